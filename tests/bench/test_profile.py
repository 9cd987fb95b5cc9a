"""`specserve convert-dataset`, `specserve profile` and `specserve profile compare`: genai-perf's metric definitions
on known timestamps, end-to-end runs against a real server on a loopback port (tiny random models), the exports,
the comparison, and clear errors for bad input (exit != 0, no traceback)."""

from __future__ import annotations

import csv
import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specserve.bench.convert import convert_dataset
from specserve.bench.profile import (
    Clock,
    ProfileConfig,
    RequestRecord,
    Style,
    aggregate,
    request_metrics,
    run_requests,
    statistics,
)
from specserve.cli import app
from tests.server.conftest import SlowEngine  # fails prompts with "boom" mid-stream

runner = CliRunner()
PROMPTS = ["def add(a, b):\n    return", "Once upon a time there was", "for i in range(10):\n    print(",
           "The quick brown fox jumps over"]
GENAI_STAT_KEYS = {"unit", "avg", "p1", "p5", "p10", "p25", "p50", "p75", "p90", "p95", "p99", "min", "max", "std"}


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_clean_failure(result, code: int, *words: str) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, (AssertionError, TypeError,
                                                                                    KeyError, AttributeError))
    for word in words:
        assert word in result.output, result.output


# ------------------------------------------------------------------------------------------------------------------
# metric definitions on synthetic records


def chars(text: str) -> int:
    return len(text)


def test_request_metrics_from_known_timestamps():
    # start 1000 ns; responses at 1500, 2000, 3000 ns with one "token" (character) each
    m = request_metrics(1000, [1500, 2000, 3000], ["a", "b", "c"], 7, chars)
    assert m["request_latency"] == 2000  # last response - start
    assert m["time_to_first_token"] == 500
    assert m["time_to_second_token"] == 500
    assert m["output_sequence_length"] == 3 and m["input_sequence_length"] == 7
    assert m["inter_token_latency"] == 750  # (2000 - 500) / (3 - 1)
    assert m["output_token_throughput_per_user"] == pytest.approx(1 / 750e-9)


def test_empty_responses_are_dropped_before_timing():
    # the OpenAI role chunk (""), a content chunk of 2 tokens, an empty finish chunk and [DONE]
    m = request_metrics(0, [100, 400, 900, 950], ["", "ab", "", ""], 1, chars)
    assert m["time_to_first_token"] == 400 and m["request_latency"] == 400
    assert "time_to_second_token" not in m and "inter_token_latency" not in m  # one response with text
    assert request_metrics(0, [10, 20], ["", ""], 1, chars) is None  # no text at all: skipped, as genai-perf


def test_non_streaming_single_response():
    m = request_metrics(1_000_000, [9_000_000], ["hello"], 3, chars)
    assert m["request_latency"] == 8_000_000 == m["time_to_first_token"]
    assert m["output_sequence_length"] == 5 and "inter_token_latency" not in m


def test_aggregate_matches_genai_perf():
    # 4 requests starting at 0, 1s, 2s, 3s (ns), each 1 s long; OSL as in the vLLM tutorial's sample output
    per_request = [{"request_latency": 1e9, "time_to_first_token": 1e9, "output_sequence_length": osl,
                    "input_sequence_length": 100} for osl in (324, 325, 325, 326)]
    stats = aggregate(per_request, 4, first_start=0, last_response=4_000_000_000)
    assert stats["request_latency"]["avg"] == pytest.approx(1000.0)  # ms
    assert stats["output_sequence_length"]["p99"] == pytest.approx(325.97)  # the tutorial's p99 for these
    assert stats["output_sequence_length"]["p90"] == pytest.approx(325.7)
    assert stats["output_sequence_length"]["p75"] == pytest.approx(325.25)
    assert stats["output_token_throughput"] == {"unit": "tokens/sec", "avg": pytest.approx(1300 / 4)}
    assert stats["request_throughput"] == {"unit": "requests/sec", "avg": pytest.approx(1.0)}
    assert stats["request_count"] == {"unit": "count", "avg": 4.0}
    assert set(stats["request_latency"]) == GENAI_STAT_KEYS
    assert "inter_token_latency" not in stats  # non-streaming: no ITL


def test_statistics_are_numpy_linear():
    s = statistics([1, 2, 3, 4, 10], "ms")
    assert s["p50"] == 3 and s["min"] == 1 and s["max"] == 10 and s["avg"] == 4
    assert s["p25"] == 2 and s["p75"] == 4 and s["p99"] == pytest.approx(9.76)
    assert s["std"] == pytest.approx(3.1622776601683795)


# ------------------------------------------------------------------------------------------------------------------
# the converter


def test_convert_dataset_semantics(tmp_path):
    source = tmp_path / "question.jsonl"
    source.write_text(
        json.dumps({"question_id": 0, "category": "code", "turns": ["first \u00e9", "second"], "reference": ["x"]})
        + "\n\n" + json.dumps({"question_id": 1, "no_turns": True}) + "\n"
        + json.dumps({"question_id": 2, "turns": ["third\n"]}) + "\n")
    out = tmp_path / "converted.jsonl"
    result = invoke("convert-dataset", "--input_file", source, "--output_file", out)
    assert result.exit_code == 0, result.output
    assert "3 prompts" in result.output
    # one {"text": turn} line per turn, in order, other fields dropped, json.dumps defaults (ASCII escapes)
    assert out.read_text() == '{"text": "first \\u00e9"}\n{"text": "second"}\n{"text": "third\\n"}\n'
    assert invoke("convert-dataset", "-i", source, "-o", tmp_path / "b.jsonl").exit_code == 0
    assert (tmp_path / "b.jsonl").read_text() == out.read_text()


def test_convert_the_humaneval_file(tmp_path):
    data = Path(__file__).resolve().parents[3] / "shared" / "data" / "humaneval_question.jsonl"
    if not data.exists():
        pytest.skip("shared/data is not beside the checkout")
    count = convert_dataset(data, tmp_path / "converted.jsonl")
    lines = (tmp_path / "converted.jsonl").read_text().splitlines()
    assert count == len(lines) == 80
    first = json.loads(data.read_text().splitlines()[0])
    assert json.loads(lines[0]) == {"text": first["turns"][0]}


@pytest.mark.parametrize("content, words", [("", ["empty"]), ("not json\n", ["not valid JSON"]),
                                            ('{"a": 1}\n', ["no turns"])])
def test_convert_bad_input(tmp_path, content, words):
    source = tmp_path / "q.jsonl"
    source.write_text(content)
    assert_clean_failure(invoke("convert-dataset", "--input_file", source, "--output_file", tmp_path / "o.jsonl"),
                         2, *words)
    assert_clean_failure(invoke("convert-dataset", "--input_file", tmp_path / "missing.jsonl", "--output_file",
                                tmp_path / "o.jsonl"), 2, "does not exist")


# ------------------------------------------------------------------------------------------------------------------
# a real server


def _put(root: Path, path: str, text: str) -> None:
    file = root / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    from specserve.config import build_engine
    from specserve.server.app import SpecServer
    from specserve.server.repository import ModelRepository

    target, other = checkpoint("llama"), checkpoint("llama", 1)
    root = tmp_path_factory.mktemp("profile_repo")
    llmapi = "triton_config:\n  max_batch_size: 0\n  decoupled: True\n"
    # fixed drafts: the adaptive choice may stop drafting on a random model once its requests' drafts failed
    # (the pooled acceptance), and the tests read the draft counters
    _put(root, "tensorrt_llm/1/model.yaml", f"model: {target}\ndtype: float32\nspeculative_config:\n"
                                            f"  decoding_type: NGram\n  max_draft_len: 4\n"
                                            f"  adaptive_draft_len: false\n{llmapi}")
    _put(root, "base/1/model.yaml", f"model: {target}\ndtype: float32\n{llmapi}")
    _put(root, "other/1/model.yaml", f"model: {other}\ndtype: float32\n{llmapi}")
    _put(root, "plain/1/model.yaml", f"model: {target}\ndtype: float32\ntriton_config:\n  max_batch_size: 0\n"
                                     "  decoupled: False\n")
    _put(root, "vllm_model/config.pbtxt", 'backend: "vllm"\n')
    _put(root, "vllm_model/1/model.json", json.dumps({
        "model": target, "dtype": "float32",
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}}))
    repository = ModelRepository.from_directory(
        root, engine_factory=lambda config, loaded: SlowEngine(build_engine(config, loaded), delay=0.0))
    assert not repository.load_all()
    running = SpecServer(repository, host="127.0.0.1", http_port=0, metrics_port=0).start()
    running.host_port = running.url.removeprefix("http://")
    yield running
    running.stop()


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in PROMPTS))
    return path


def profile(server, prompts_file, tmp_path, name: str, *extra, model: str = "tensorrt_llm", count: int = 4):
    export = tmp_path / "out" / f"{name}.json"
    result = invoke("profile", "-m", model, "--input-file", prompts_file, "--url", server.host_port,
                    "--request-count", count, "--warmup-request-count", 1, "--output-tokens-mean", 8,
                    "--output-tokens-mean-deterministic", "--profile-export-file", export, *extra)
    return result, export


def count_tokens(text: str) -> int:
    """genai-perf's count: the tokenizer without special tokens (the tiny models' shared tokenizer)."""
    from tests.conftest import build_tokenizer

    return len(_TOKENIZER.setdefault("t", build_tokenizer()).encode(text, add_special_tokens=False))


_TOKENIZER: dict = {}


def read_export(export: Path) -> dict:
    return json.loads(export.read_text())


def check_genai_perf_files(export: Path, streaming: bool) -> dict:
    summary = json.loads(export.with_name(export.stem + "_genai_perf.json").read_text())
    for key in ("request_latency", "output_sequence_length", "input_sequence_length"):
        assert set(summary[key]) == GENAI_STAT_KEYS
    for key, unit in (("request_throughput", "requests/sec"), ("output_token_throughput", "tokens/sec"),
                      ("request_count", "count")):
        assert summary[key]["unit"] == unit and "avg" in summary[key]
    assert summary["input_config"]["model"]
    with open(export.with_name(export.stem + "_genai_perf.csv")) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["Metric", "avg", "min", "max", "p99", "p95", "p90", "p75", "p50", "p25", "p10", "p5", "p1"]
    labels = [r[0] for r in rows if r]
    assert "Request Latency (ms)" in labels and "Output Token Throughput (tokens/sec)" in labels
    assert ("Time To First Token (ms)" in labels) == streaming and ("Inter Token Latency (ms)" in labels) == streaming
    assert ["Metric", "Value"] in rows and ["Request Count (count)", "4.00"] in rows
    return summary


@pytest.mark.parametrize("streaming", [False, True])
def test_profile_triton_tensorrtllm(server, prompts_file, tmp_path, streaming):
    flags = ["--streaming"] if streaming else []
    result, export = profile(server, prompts_file, tmp_path, "trt", "--service-kind", "triton", "--backend",
                             "tensorrtllm", *flags)
    assert result.exit_code == 0, result.output
    assert "Request Latency (ms)" in result.output and "Output Token Throughput (tokens/sec)" in result.output
    assert ("Time To First Token (ms)" in result.output) == streaming
    assert "acceptance rate" in result.output  # the server's perf metrics
    doc = read_export(export)
    requests = doc["experiments"][0]["requests"]
    assert doc["experiments"][0]["experiment"] == {"mode": "concurrency", "value": 1}
    assert len(requests) == 4 and doc["specserve"]["complete"] and doc["specserve"]["failed"] == 0
    for i, r in enumerate(requests):
        assert r["response_timestamps"][-1] > r["timestamp"] > 0
        assert r["request_inputs"]["text_input"] == PROMPTS[i]
        assert r["request_inputs"]["sampling_param_max_tokens"] == 8 and r["request_inputs"]["min_length"] == 8
        s = r["specserve"]
        # 8 tokens generated; OSL is the client-side count of the text (the served model's tokenizer)
        assert s["output_tokens"] == count_tokens(s["output_text"]) > 0
        assert s["input_tokens"] == count_tokens(PROMPTS[i])
        assert s["output_text"] and s["perf_metrics"]["total_draft_tokens"] >= 0
        if streaming:
            assert len(r["response_timestamps"]) > 1
    summary = check_genai_perf_files(export, streaming)
    assert summary["output_sequence_length"]["avg"] == pytest.approx(
        sum(r["specserve"]["output_tokens"] for r in requests) / 4)
    assert ("inter_token_latency" in summary) == streaming
    assert doc["specserve"]["server_perf_metrics"]["requests_with_perf_metrics"] == 4


@pytest.mark.parametrize("endpoint_type, streaming", [("completions", False), ("completions", True),
                                                      ("chat", True)])
def test_profile_openai(server, prompts_file, tmp_path, endpoint_type, streaming):
    flags = ["--streaming"] if streaming else []
    result, export = profile(server, prompts_file, tmp_path, "oai", "--service-kind", "openai", "--endpoint-type",
                             endpoint_type, *flags)
    assert result.exit_code == 0, result.output
    doc = read_export(export)
    assert doc["service_kind"] == "openai"
    for r in doc["experiments"][0]["requests"]:
        payload = json.loads(r["request_inputs"]["payload"])
        assert payload["max_tokens"] == 8 and payload["temperature"] == 0 and payload.get("stream", False) == streaming
        assert r["specserve"]["output_tokens"] == count_tokens(r["specserve"]["output_text"]) > 0
        assert all("response" in o for o in r["response_outputs"])
    check_genai_perf_files(export, streaming)
    # acceptance from the server's vllm:spec_decode_* counters (the OpenAI responses carry none)
    assert doc["specserve"]["server_spec_decode_metrics"]["num_drafts"] > 0


def test_triton_and_openai_and_vllm_agree(server, prompts_file, tmp_path):
    """Greedy: every endpoint and request style gives the same outputs for the same prompts."""
    outputs = {}
    for name, flags in {"trt": ["--backend", "tensorrtllm"],
                        "trt_stream": ["--backend", "tensorrtllm", "--streaming"],
                        "vllm": ["--backend", "vllm", "--streaming", "-m", "vllm_model"],
                        "oai": ["--endpoint-type", "completions", "--streaming"]}.items():
        model = "vllm_model" if name == "vllm" else "tensorrt_llm"
        flags = [f for f in flags if f not in ("-m", "vllm_model")]
        result, export = profile(server, prompts_file, tmp_path, name, *flags, model=model, count=2)
        assert result.exit_code == 0, result.output
        outputs[name] = [r["specserve"]["output_text"] for r in read_export(export)["experiments"][0]["requests"]]
    assert len({tuple(v) for v in outputs.values()}) == 1, outputs


def test_request_rate_and_default_artifact_dir(server, prompts_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("profile", "-m", "tensorrt_llm", "--input-file", prompts_file, "--url", server.host_port,
                    "--request-rate", 50, "--request-distribution", "poisson", "--request-count", 3,
                    "--output-tokens-mean", 4, "--warmup-request-count", 0, "--tokenizer",
                    server.repository.models["base"].source.config.model.source)
    assert result.exit_code == 0, result.output
    export = tmp_path / "artifacts" / "tensorrt_llm-triton-tensorrtllm-request_rate50" / "profile_export.json"
    doc = read_export(export)
    assert doc["experiments"][0]["experiment"] == {"mode": "request_rate", "value": 50.0}
    assert len(doc["experiments"][0]["requests"]) == 3
    assert export.with_name("profile_export_genai_perf.json").exists()


# ------------------------------------------------------------------------------------------------------------------
# compare


def test_compare_base_and_speculative(server, prompts_file, tmp_path):
    base = profile(server, prompts_file, tmp_path, "base", model="base")
    spec = profile(server, prompts_file, tmp_path, "spec", model="tensorrt_llm")
    assert base[0].exit_code == 0 and spec[0].exit_code == 0, base[0].output + spec[0].output
    png, out = tmp_path / "cmp.png", tmp_path / "cmp.json"
    result = invoke("profile", "compare", base[1], spec[1], "--plot", png, "--json", out, "--strict")
    assert result.exit_code == 0, result.output
    assert "outputs: identical, 4/4 requests" in result.output
    assert "speedup" in result.output and "Request Latency (ms)" in result.output
    assert "Time To First Token" not in result.output  # not streamed: TTFT would just repeat the latency
    report = json.loads(out.read_text())
    assert report["outputs"]["all_identical"] and report["outputs"]["different"] == []
    assert {m["metric"] for m in report["metrics"]} >= {"request_latency", "output_token_throughput",
                                                       "request_throughput"}
    assert all(m["speedup"] > 0 for m in report["metrics"])
    assert report["acceptance"]["spec"]["total_draft_tokens"] > 0
    assert report["acceptance"]["base"]["total_draft_tokens"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the genai-perf summary file leads to the same run
    summary = base[1].with_name("base_genai_perf.json")
    assert invoke("profile", "compare", summary, spec[1]).exit_code == 0


def test_compare_flags_a_different_output(server, prompts_file, tmp_path):
    base = profile(server, prompts_file, tmp_path, "base", model="base")
    other = profile(server, prompts_file, tmp_path, "other", model="other")  # another model: other outputs
    assert base[0].exit_code == 0 and other[0].exit_code == 0
    result = invoke("profile", "compare", base[1], other[1])
    assert result.exit_code == 0, result.output
    assert "outputs: DIFFERENT" in result.output and "first difference" in result.output
    assert invoke("profile", "compare", base[1], other[1], "--strict").exit_code == 1
    # one edited output in an otherwise identical run is caught too
    doc = read_export(base[1])
    doc["experiments"][0]["requests"][2]["specserve"]["output_text"] += "!"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    result = invoke("profile", "compare", base[1], edited, "--json", tmp_path / "c.json")
    assert "1 of 4 requests differ (indexes [2])" in result.output
    assert json.loads((tmp_path / "c.json").read_text())["outputs"]["different"] == [2]


def test_compare_refuses_different_inputs(server, prompts_file, tmp_path):
    a = profile(server, prompts_file, tmp_path, "a", count=2)
    b = profile(server, prompts_file, tmp_path, "b", "--extra-inputs", "seed:5", count=2)
    c = profile(server, prompts_file, tmp_path, "c", count=3)
    assert a[0].exit_code == b[0].exit_code == c[0].exit_code == 0
    assert_clean_failure(invoke("profile", "compare", a[1], b[1]), 2, "did not send the same inputs")
    assert_clean_failure(invoke("profile", "compare", a[1], c[1]), 2, "2 requests vs 3")
    bogus = tmp_path / "bogus.json"
    bogus.write_text("{}")
    assert_clean_failure(invoke("profile", "compare", a[1], bogus), 2, "not a profile export")
    assert_clean_failure(invoke("profile", "compare", a[1], tmp_path / "nope.json"), 2, "does not exist")


# ------------------------------------------------------------------------------------------------------------------
# bad input


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server(prompts_file, tmp_path):
    result = invoke("profile", "-m", "tensorrt_llm", "--input-file", prompts_file, "--url",
                    f"127.0.0.1:{free_port()}", "--profile-export-file", tmp_path / "x.json")
    assert_clean_failure(result, 2, "cannot connect", "specserve serve")
    assert not (tmp_path / "x.json").exists()


def test_wrong_model_name(server, prompts_file, tmp_path):
    result, _ = profile(server, prompts_file, tmp_path, "x", model="no_such_model")
    assert_clean_failure(result, 2, "no_such_model", "not served", "tensorrt_llm")
    result, _ = profile(server, prompts_file, tmp_path, "x", "--endpoint-type", "chat", model="no_such_model")
    assert_clean_failure(result, 2, "not served", "tensorrt_llm")


@pytest.mark.parametrize("content, words", [
    ("", ["empty"]), ("{not json\n", ["not valid JSON", ":1"]), ('{"text": "a"}\n{"prompt": "b"}\n', [":2", "text"]),
    ('{"question_id": 0, "turns": ["x"]}\n', ["convert-dataset"])])
def test_bad_input_file(server, tmp_path, content, words):
    path = tmp_path / "in.jsonl"
    path.write_text(content)
    result, _ = profile(server, path, tmp_path, "x")
    assert_clean_failure(result, 2, *words)
    result, _ = profile(server, tmp_path / "missing.jsonl", tmp_path, "x")
    assert_clean_failure(result, 2, "does not exist")


def test_streaming_a_model_that_is_not_decoupled(server, prompts_file, tmp_path):
    result, _ = profile(server, prompts_file, tmp_path, "x", "--streaming", model="plain")
    assert_clean_failure(result, 2, "not decoupled")


def test_bad_flags(server, prompts_file, tmp_path):
    assert_clean_failure(profile(server, prompts_file, tmp_path, "x", "--concurrency", 2, "--request-rate", 1)[0],
                         2, "mutually exclusive")
    assert_clean_failure(profile(server, prompts_file, tmp_path, "x", "--service-kind", "grpc")[0], 2,
                         "--service-kind")
    assert_clean_failure(profile(server, prompts_file, tmp_path, "x", "--tokenizer", tmp_path / "nope")[0], 2,
                         "cannot load tokenizer")
    assert_clean_failure(invoke("profile", "--input-file", prompts_file), 2, "-m/--model")


@pytest.mark.parametrize("streaming", [False, True])
def test_server_error_mid_run(server, tmp_path, streaming):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in [PROMPTS[0], "boom " + PROMPTS[1], PROMPTS[2]]))
    flags = ["--streaming"] if streaming else []
    result, export = profile(server, path, tmp_path, "partial", *flags, count=3)
    assert_clean_failure(result, 1, "1 of 3 requests failed", "indexes 1", "boom", "partial")
    doc = read_export(export)
    meta = doc["specserve"]
    assert meta["complete"] is False and meta["failed"] == 1 and meta["succeeded"] == 2
    assert [f["index"] for f in meta["failed_requests"]] == [1] and "boom" in meta["failed_requests"][0]["error"]
    requests = doc["experiments"][0]["requests"]
    assert requests[1]["specserve"]["error"] and not requests[0]["specserve"]["error"]
    summary = json.loads(export.with_name("partial_genai_perf.json").read_text())
    assert summary["request_count"]["avg"] == 2  # the statistics cover the requests that succeeded


def test_server_gone_mid_run_stops_sending(tmp_path):
    """Once the server is unreachable, the remaining requests are not sent and say why."""
    import asyncio

    import httpx

    style = Style(path="/v2/models/m/generate", kind="triton", endpoint_type="kserve", backend="tensorrtllm",
                  streaming=False, names={"max_tokens": "max_tokens"})
    records = [RequestRecord(i, i, "h", "p", {"text_input": "p"}) for i in range(3)]
    config = ProfileConfig(model="m", input_file=Path("x"))

    async def go():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{free_port()}") as client:
            await run_requests(client, style, records, config, Clock(), concurrency=1)

    asyncio.run(go())
    assert "cannot connect" in records[0].error
    assert all(r.error.startswith("not sent") for r in records[1:])


def test_help_lists_the_genai_perf_flags():
    result = runner.invoke(app, ["profile", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in ("--service-kind", "--backend", "--endpoint-type", "--input-file", "--tokenizer", "--url",
                 "--concurrency", "--request-rate", "--request-count", "--num-prompts", "--profile-export-file",
                 "--streaming", "--output-tokens-mean", "--output-tokens-stddev",
                 "--output-tokens-mean-deterministic", "--warmup-request-count", "compare"):
        assert flag in result.output, flag
