"""`specserve serve`: the flags, clear errors (exit 2) for bad repositories, and real processes: a model
repository of tiny models, and (slow) no arguments at all = the embedded default under the tutorials' names."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from typer.testing import CliRunner

from specserve.cli import app

from .test_seeds import SEED_CURLS, check, replay

ROOT = Path(__file__).resolve().parents[2]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_serve_help_lists_the_contract_flags():
    result = invoke("serve", "--help")
    assert result.exit_code == 0
    for flag in ("--model-repository", "--model", "--http-port", "--metrics-port", "--host", "--grpc-port",
                 "--allow-grpc"):
        assert flag in result.output


class RecordedServer:
    """Stands in for SpecServer: records what `serve` asked for, serves nothing."""

    made: list[dict] = []

    def __init__(self, repository, **options):
        self.repository, self.http_port, self.metrics_port = repository, options["http_port"], options["metrics_port"]
        RecordedServer.made.append(options)

    def run(self) -> None:
        self.repository.close()


@pytest.mark.parametrize("flags, grpc_port", [((), 8001), (("--grpc-port", "9101"), 9101),
                                               (("--allow-grpc", "false"), None), (("--allow-grpc", "True"), 8001)])
def test_serve_opens_grpc_on_8001_unless_told(monkeypatch, checkpoint, flags, grpc_port):
    """As Triton: gRPC on 8001 by default, another port with --grpc-port, none with --allow-grpc false."""
    monkeypatch.setattr("specserve.server.app.SpecServer", RecordedServer)
    RecordedServer.made.clear()
    result = invoke("serve", "--model", checkpoint("llama"), *flags)
    assert result.exit_code == 0, result.output
    assert RecordedServer.made[0]["grpc_port"] == grpc_port
    assert ("GRPCInferenceService" in result.output) == (grpc_port is not None)


def test_serve_refuses_a_bad_allow_grpc():
    result = invoke("serve", "--allow-grpc", "maybe")
    assert result.exit_code == 2 and "--allow-grpc must be true or false" in result.output


def test_serve_errors_are_clear(tmp_path, checkpoint):
    result = invoke("serve", "--model-repository", tmp_path / "missing")
    assert result.exit_code == 2 and "not a directory" in result.output
    result = invoke("serve", "--model-repository", tmp_path, "--model", "x")
    assert result.exit_code == 2 and "either" in result.output
    (tmp_path / "bad" / "1").mkdir(parents=True)
    (tmp_path / "bad" / "1" / "model.json").write_text(json.dumps({"model": checkpoint("llama"),
                                                                    "gpu_memory_fraction": 0.5}))
    result = invoke("serve", "--model-repository", tmp_path)
    assert result.exit_code == 2 and "gpu_memory_fraction" in result.output
    (tmp_path / "bad" / "1" / "model.json").unlink()
    (tmp_path / "bad" / "1" / "model.yaml").write_text(
        f"model: {checkpoint('llama')}\nspeculative_config:\n  decoding_type: Eagle3\n  max_draft_len: 3\n")
    result = invoke("serve", "--model-repository", tmp_path)
    assert result.exit_code == 2 and "eagle3 needs speculative_model" in result.output
    result = invoke("serve", "--model", tmp_path / "nothing-here")
    assert result.exit_code == 2 and "not found" in result.output


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    def __init__(self, *args: str, timeout: float):
        self.http_port, self.metrics_port, self.grpc_port = free_port(), free_port(), free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        # A file, not a pipe: nobody reads the server's output while it runs, and a full pipe would block it.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli", "serve", *args, "--http-port", str(self.http_port),
             "--metrics-port", str(self.metrics_port), "--grpc-port", str(self.grpc_port), "--host", "127.0.0.1",
             "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: {self.output()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise AssertionError(f"server did not become ready in {timeout} s: {self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    @property
    def host_port(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def test_serve_model_repository_process(repo_dir):
    server = Process("--model-repository", str(repo_dir), timeout=90)
    try:
        for line in SEED_CURLS:
            check(line, replay(line, server.host_port))
        with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:  # KServe gRPC beside
            assert client.is_server_ready() and client.is_model_ready("tensorrt_llm")
            prompt = grpcclient.InferInput("text_input", [1], "BYTES")
            prompt.set_data_from_numpy(np.array(["Once upon"], dtype=object))
            assert client.infer("tensorrt_llm", [prompt]).as_numpy("text_output")[0].startswith(b"Once upon")
        metrics = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
        assert 'nv_inference_request_success{model="tensorrt_llm",version="1"} 3' in metrics
    finally:
        code = server.stop()
    assert code == 0


@pytest.mark.slow
def test_serve_without_arguments_serves_the_default_model():
    """A newcomer's first commands: `specserve serve`, then the tutorials' curl lines, then OpenAI chat."""
    server = Process(timeout=600)
    try:
        for line in SEED_CURLS:
            check(line, replay(line, server.host_port))
        base = f"http://{server.host_port}"
        models = [m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]]
        assert models[0] == "gemma-3-270m" and "tensorrt_llm" in models
        chat = httpx.post(base + "/v1/chat/completions", timeout=120, json={
            "model": "gemma-3-270m", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}).json()
        answer = chat["choices"][0]
        assert "Paris" in answer["message"]["content"] and answer["finish_reason"] == "stop"
        assert "Question:" not in answer["message"]["content"]
        config = httpx.get(base + "/v2/models/tensorrt_llm/config", timeout=10).json()
        assert config["parameters"]["speculative_method"]["string_value"] == "ngram"
        greedy = {"text_input": "The capital of France is", "max_tokens": 8, "exclude_input_in_output": True}
        expected = httpx.post(base + "/v2/models/tensorrt_llm/generate", json=greedy, timeout=120).json()
        with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:  # the same over gRPC
            inputs = []
            for name, value in greedy.items():
                datatype = {str: "BYTES", int: "INT32", bool: "BOOL"}[type(value)]
                inputs.append(grpcclient.InferInput(name, [1], datatype))
                inputs[-1].set_data_from_numpy(np.array([value], dtype={"BYTES": object, "INT32": np.int32,
                                                                         "BOOL": bool}[datatype]))
            output = client.infer("tensorrt_llm", inputs).as_numpy("text_output")[0].decode()
        assert output == expected["text_output"] and "France" in output
    finally:
        code = server.stop()
    assert code == 0
