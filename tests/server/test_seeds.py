"""The curl lines of the tutorials (/work/shared/seeds), verbatim but for host and port, against a repository with
the tutorials' model names: tensorrt_llm (LLM API), eagle_model (vLLM backend), ensemble (legacy)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess

import httpx
import pytest

SEED_CURLS = [
    """curl -X POST localhost:8000/v2/models/tensorrt_llm/generate \\
  -d '{"text_input": "What is ML?", "sampling_param_max_tokens": 50}'""",
    """curl -X POST localhost:8000/v2/models/tensorrt_llm/generate \\
  -d '{"text_input": "What is ML?", "sampling_param_max_tokens": 50, "sampling_param_return_perf_metrics": true}' | jq""",  # noqa: E501
    """curl -X POST localhost:8000/v2/models/eagle_model/generate -d '{"text_input": "What is Triton Inference Server?", "parameters": {"stream": false, "temperature": 0}}' | jq""",  # noqa: E501
    """curl -X POST localhost:8000/v2/models/ensemble/generate -d '{"text_input": "What is ML?", "max_tokens": 50, "bad_words": "", "stop_words": "", "pad_id": 2, "end_id": 2}'""",  # noqa: E501
]
PERF_KEYS = {"acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "arrival_time_ns",
             "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns"}


def replay(line: str, host_port: str) -> dict:
    """Run a tutorial curl line against host_port (curl if installed, else the same request with httpx)."""
    line = line.replace("\\\n", " ").replace("localhost:8000", host_port)
    line = line.split(" | ")[0]  # `| jq` only pretty-prints
    argv = shlex.split(line)
    if shutil.which("curl"):
        out = subprocess.run(argv[:1] + ["-sS", "--max-time", "120"] + argv[1:], capture_output=True, text=True,
                             timeout=150, check=True)
        return json.loads(out.stdout)
    url = next(a for a in argv if "/v2/" in a)
    data = argv[argv.index("-d") + 1]
    return httpx.post("http://" + url, content=data, timeout=120).json()


def check(line: str, body: dict) -> None:
    if "ensemble" in line:
        assert set(body) == {"model_name", "model_version", "sequence_end", "sequence_id", "sequence_start",
                             "text_output"}
        assert body["model_name"] == "ensemble" and body["text_output"].startswith("What is ML?")
    elif "eagle_model" in line:
        assert set(body) == {"model_name", "model_version", "text_output"}
        assert body["text_output"].startswith("What is Triton Inference Server?")
    elif "return_perf_metrics" in line:
        assert set(body) >= {"model_name", "model_version", "text_output"} | PERF_KEYS
        assert all(isinstance(body[k], str) for k in PERF_KEYS)
    else:
        assert set(body) == {"model_name", "model_version", "text_output"}
        assert body["model_name"] == "tensorrt_llm" and body["model_version"] == "1"
        assert body["text_output"].startswith("What is ML?")


@pytest.mark.parametrize("line", SEED_CURLS, ids=["llmapi", "llmapi-perf", "vllm", "ensemble"])
def test_seed_curl(server, line):
    check(line, replay(line, server.host_port))
