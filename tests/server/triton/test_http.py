"""Triton HTTP: tritonclient health / metadata / repository / infer, and the generate extension in the three
request styles (TRT-LLM LLM API, vLLM backend, legacy ensemble) with their response fields and echo rules."""

from __future__ import annotations

import json
import socket

import pytest
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

import numpy as np

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def gen(server, model: str, body, endpoint: str = "generate"):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return server.http.post(f"/v2/models/{model}/{endpoint}", content=data)


def sse_events(response) -> list[dict]:
    text = response.text
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        events.append(json.loads(block[len("data: "):]))
    return events


def plain_text(server, prompt: str = PROMPT, max_tokens: int = 24) -> str:
    """Plain decoding (the 'plain' model, method ar), prompt excluded."""
    r = gen(server, "plain", {"text_input": prompt, "sampling_param_max_tokens": max_tokens,
                              "sampling_param_exclude_input_from_output": True})
    assert r.status_code == 200, r.text
    return r.json()["text_output"]


# ---- tritonclient ----------------------------------------------------------------------------------------------

@pytest.fixture()
def client(server):
    c = triton_http.InferenceServerClient(url=server.host_port, connection_timeout=30, network_timeout=60)
    yield c
    c.close()


def test_health_and_metadata_with_tritonclient(client):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert "model_repository" in meta["extensions"] and meta["version"]
    assert client.is_model_ready("tensorrt_llm") and client.is_model_ready("tensorrt_llm", "1")
    assert not client.is_model_ready("nope")
    model = client.get_model_metadata("tensorrt_llm")
    assert model["name"] == "tensorrt_llm" and model["versions"] == ["1"] and model["platform"] == "python"
    inputs = {i["name"]: i for i in model["inputs"]}
    assert inputs["text_input"] == {"name": "text_input", "datatype": "BYTES", "shape": [-1]}
    assert {"sampling_param_max_tokens", "sampling_param_return_perf_metrics", "streaming"} <= set(inputs)
    ensemble = client.get_model_metadata("ensemble")
    assert ensemble["platform"] == "ensemble"
    assert {i["name"]: i["shape"] for i in ensemble["inputs"]}["max_tokens"] == [-1, 1]  # max_batch_size 4
    assert client.get_model_metadata("eagle_model")["platform"] == "vllm"


def test_model_config(client):
    config = client.get_model_config("tensorrt_llm")
    assert config["name"] == "tensorrt_llm" and config["backend"] == "python"
    assert config["model_transaction_policy"] == {"decoupled": True}
    assert config["parameters"]["speculative_method"]["string_value"] == "ngram"
    assert {i["name"]: i["optional"] for i in config["input"]}["text_input"] is False
    vllm = client.get_model_config("eagle_model")
    assert vllm["max_batch_size"] == 0 and vllm["model_transaction_policy"]["decoupled"] is True
    assert vllm["parameters"]["max_draft_len"]["string_value"] == "3"
    draft = client.get_model_config("draft_model")
    assert draft["parameters"]["speculative_method"]["string_value"] == "draft_target"
    assert client.get_model_config("plain")["parameters"]["speculative_method"]["string_value"] == "ar"


def test_repository_index_load_unload(client, server):
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["tensorrt_llm"] == {"name": "tensorrt_llm", "version": "1", "state": "READY"}
    assert index["preprocessing"] == {"name": "preprocessing"}  # never loaded: no model file
    client.unload_model("plain")
    assert not client.is_model_ready("plain")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["plain"]["state"] == "UNAVAILABLE" and index["plain"]["reason"] == "unloaded"
    r = gen(server, "plain", {"text_input": "hi", "sampling_param_max_tokens": 2})
    assert r.status_code == 404 and "unknown model" in r.json()["error"]
    ready = server.http.post("/v2/repository/index", json={"ready": True}).json()
    assert "plain" not in {m["name"] for m in ready}
    client.load_model("plain")
    assert client.is_model_ready("plain")
    assert gen(server, "plain", {"text_input": "hi", "sampling_param_max_tokens": 2}).status_code == 200
    with pytest.raises(InferenceServerException):
        client.load_model("no_such_model")
    with pytest.raises(InferenceServerException):
        client.load_model("preprocessing")
    r = server.http.post("/v2/repository/other/index")
    assert r.status_code == 501 and "repository_name" in r.json()["error"]


def test_infer_with_tritonclient(client, server):
    text = triton_http.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
    max_tokens = triton_http.InferInput("sampling_param_max_tokens", [1], "INT32")
    max_tokens.set_data_from_numpy(np.array([24], dtype=np.int32))
    exclude = triton_http.InferInput("sampling_param_exclude_input_from_output", [1], "BOOL")
    exclude.set_data_from_numpy(np.array([True]))
    result = client.infer("tensorrt_llm", [text, max_tokens, exclude])  # binary outputs (the default)
    assert result.as_numpy("text_output")[0].decode() == plain_text(server)
    json_out = client.infer("plain", [text, max_tokens, exclude],
                            outputs=[triton_http.InferRequestedOutput("text_output", binary_data=False)])
    assert json_out.as_numpy("text_output")[0] == plain_text(server)
    assert json_out.get_response()["model_name"] == "plain"


# ---- generate: the three styles ----------------------------------------------------------------------------------

def test_llmapi_style_echo_and_fields(server):
    r = gen(server, "tensorrt_llm", {"text_input": PROMPT, "sampling_param_max_tokens": 24})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert list(body) == ["model_name", "model_version", "text_output"]  # alphabetical, like Triton
    assert body["model_name"] == "tensorrt_llm" and body["model_version"] == "1"
    assert body["text_output"] == PROMPT + plain_text(server)  # echo by default; n-gram is lossless
    assert r.text.startswith('{"model_name":"tensorrt_llm","model_version":"1","text_output":')


def test_llmapi_perf_metrics_are_strings(server):
    r = gen(server, "tensorrt_llm", {"text_input": PROMPT * 3, "sampling_param_max_tokens": 24,
                                     "sampling_param_return_perf_metrics": True, "return_finish_reason": True,
                                     "id": "req-1"})
    body = r.json()
    assert body["id"] == "req-1" and body["finish_reason"] in ("stop", "length")
    for key in ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "arrival_time_ns",
                "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns"):
        assert isinstance(body[key], str), key
    drafted, accepted = int(body["total_draft_tokens"]), int(body["total_accepted_draft_tokens"])
    assert drafted > 0 and 0 <= accepted <= drafted
    assert float(body["acceptance_rate"]) == pytest.approx(accepted / drafted)
    stamps = [int(body[k]) for k in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                                     "last_token_time_ns")]
    assert stamps == sorted(stamps)


def test_vllm_style(server):
    r = gen(server, "eagle_model", {"text_input": PROMPT, "parameters": {"stream": False, "temperature": 0,
                                                                         "max_tokens": 24}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"model_name", "model_version", "text_output"}
    assert body["text_output"] == PROMPT + plain_text(server)
    r = gen(server, "eagle_model", {"text_input": PROMPT, "exclude_input_in_output": True,
                                    "return_finish_reason": True, "return_num_input_tokens": True,
                                    "return_num_output_tokens": True,
                                    "sampling_parameters": json.dumps({"max_tokens": "24", "temperature": "0"})})
    body = r.json()
    assert body["text_output"] == plain_text(server)
    assert body["finish_reason"] in ("stop", "length") and body["num_input_tokens"] > 5
    assert 0 < body["num_output_tokens"] <= 24


def test_vllm_default_is_16_tokens(server):
    body = gen(server, "eagle_model", {"text_input": PROMPT, "exclude_input_in_output": True,
                                       "parameters": {"temperature": 0, "ignore_eos": True,
                                                      "return_num_output_tokens": True}}).json()
    assert body["num_output_tokens"] == 16


def test_ensemble_style(server):
    r = gen(server, "ensemble", {"text_input": PROMPT, "max_tokens": 24, "bad_words": "", "stop_words": "",
                                 "pad_id": 2, "end_id": 2})
    body = r.json()
    assert r.status_code == 200, body
    assert list(body) == ["model_name", "model_version", "sequence_end", "sequence_id", "sequence_start",
                          "text_output"]
    assert body["sequence_end"] is False and body["sequence_id"] == 0 and body["sequence_start"] is False
    assert body["text_output"] == PROMPT + plain_text(server)
    perf = gen(server, "ensemble", {"text_input": PROMPT, "max_tokens": 8, "return_perf_metrics": True}).json()
    assert isinstance(perf["total_draft_tokens"], int) and isinstance(perf["acceptance_rate"], float)
    missing = gen(server, "ensemble", {"text_input": PROMPT})
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]


def test_draft_model_is_lossless(server):
    body = gen(server, "draft_model", {"text_input": PROMPT, "exclude_input_in_output": True,
                                       "parameters": {"temperature": 0, "max_tokens": 24}}).json()
    assert body["text_output"] == plain_text(server)


def test_stop_words_and_seed(server):
    full = plain_text(server, max_tokens=24)
    stop = full[4:7]
    if stop.strip():
        body = gen(server, "tensorrt_llm", {"text_input": PROMPT, "sampling_param_max_tokens": 24,
                                            "sampling_param_stop": [stop],
                                            "sampling_param_exclude_input_from_output": True}).json()
        assert stop not in body["text_output"] and full.startswith(body["text_output"])
    sampled = [gen(server, "tensorrt_llm", {"text_input": PROMPT, "sampling_param_max_tokens": 12,
                                            "sampling_param_temperature": 0.8, "sampling_param_seed": 1234})
               .json()["text_output"] for _ in range(2)]
    assert sampled[0] == sampled[1]


# ---- generate_stream ---------------------------------------------------------------------------------------------

def test_stream_llmapi_cumulative(server):
    r = gen(server, "tensorrt_llm", {"text_input": PROMPT, "sampling_param_max_tokens": 16, "streaming": True,
                                     "sampling_param_return_perf_metrics": True}, "generate_stream")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in r.text
    events = sse_events(r)
    assert len(events) >= 2
    texts = [e["text_output"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # every response repeats the text so far
    assert texts[-1] == PROMPT + plain_text(server, max_tokens=16)
    assert "total_draft_tokens" in events[-1] and "total_draft_tokens" not in events[0]


def test_stream_deltas(server):
    for model, body in [("eagle_model", {"text_input": PROMPT, "stream": True, "exclude_input_in_output": True,
                                         "parameters": {"temperature": 0, "max_tokens": 16}}),
                        ("tensorrt_llm", {"text_input": PROMPT, "stream": True, "max_tokens": 16,
                                          "exclude_input_in_output": True}),
                        ("ensemble", {"text_input": PROMPT, "stream": True, "max_tokens": 16})]:
        events = sse_events(gen(server, model, body, "generate_stream"))
        assert len(events) >= 2, model
        assert "".join(e["text_output"] for e in events) == plain_text(server, max_tokens=16), model
        assert all(e["model_name"] == model for e in events)


def test_stream_without_flag_is_one_response(server):
    events = sse_events(gen(server, "tensorrt_llm", {"text_input": PROMPT, "sampling_param_max_tokens": 16},
                            "generate_stream"))
    assert len(events) == 1 and events[0]["text_output"] == PROMPT + plain_text(server, max_tokens=16)
    events = sse_events(gen(server, "plain", {"text_input": "hi", "sampling_param_max_tokens": 4},
                            "generate_stream"))
    assert len(events) == 1


def test_streaming_rules(server):
    r = gen(server, "plain", {"text_input": "hi", "streaming": True}, "generate_stream")
    assert r.status_code == 400 and r.json() == {"error": "Streaming is only supported in decoupled mode."}
    r = gen(server, "eagle_model", {"text_input": "hi", "stream": True, "exclude_input_in_output": False},
            "generate_stream")
    assert r.status_code == 400 and "exclude_input_in_output" in r.json()["error"]
    r = gen(server, "tensorrt_llm", {"text_input": "hi", "streaming": True})
    assert r.status_code == 400 and "generate stream" in r.json()["error"]


def test_stop_request_by_id(server):
    r = gen(server, "tensorrt_llm", {"id": "nothing-running", "stop": True})
    assert r.status_code == 400 and r.json() == {"error": "Request cancelled by client"}
    r = gen(server, "tensorrt_llm", {"stop": True})
    assert r.status_code == 400 and "request id" in r.json()["error"]


def test_version_paths(server):
    r = gen(server, "tensorrt_llm/versions/1", {"text_input": "hi", "sampling_param_max_tokens": 2})
    assert r.status_code == 200 and r.json()["model_version"] == "1"
    assert server.http.get("/v2/models/tensorrt_llm/versions/1").status_code == 200
    assert server.http.get("/v2/models/tensorrt_llm/versions/1/ready").status_code == 200
    assert server.http.get("/v2/models/tensorrt_llm/versions/2/ready").status_code == 400
    stats = server.http.get("/v2/models/tensorrt_llm/stats").json()["model_stats"][0]
    assert stats["name"] == "tensorrt_llm" and stats["inference_stats"]["success"]["count"] >= 1


def test_listening_socket_is_tcp_so_responses_are_not_delayed_by_nagle():
    from specserve.server.app import bind

    sock = bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP  # asyncio sets TCP_NODELAY on accepted sockets only then
    finally:
        sock.close()
