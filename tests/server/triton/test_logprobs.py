"""Log-probabilities on the Triton routes, in each backend's outputs: vLLM's `logprobs` (JSON per token) and
`cumulative_logprob`, the LLM API's `cumulative_logprob`, the TRT-LLM ensemble's `cum_log_probs` and
`output_log_probs` ([batch, beam, tokens] over KServe infer and gRPC). The numbers are those the OpenAI route
reports for the same tokens (tested there against a direct forward), through speculating models."""

from __future__ import annotations

import json

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as triton_http

from tests.server.grpc.conftest import inputs
from tests.server.triton.test_http import PROMPT, gen, sse_events

MAX_TOKENS = 10


def openai_logprobs(server, top: int = 2) -> tuple[list[float], list[dict]]:
    """The plain model's greedy token log-probabilities and top ones from /v1/completions."""
    r = server.http.post("/v1/completions", json={"model": "plain", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                  "temperature": 0, "logprobs": top})
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    return logprobs["token_logprobs"], logprobs["top_logprobs"]


def vllm_body(**extra) -> dict:
    params = {"max_tokens": MAX_TOKENS, "temperature": 0, **extra.pop("sampling", {})}
    return {"text_input": PROMPT, "sampling_parameters": json.dumps(params), "exclude_input_in_output": True,
            **extra}


def test_vllm_logprobs_and_cumulative_equal_the_openai_routes(server):
    want, want_top = openai_logprobs(server)
    r = gen(server, "eagle_model", vllm_body(sampling={"logprobs": 2}, return_logprobs=True,
                                             return_cumulative_logprob=True, return_num_output_tokens=True))
    assert r.status_code == 200, r.text
    out = r.json()
    tokens = json.loads(out["logprobs"])
    assert len(tokens) == out["num_output_tokens"] == len(want)
    tokenizer = server.repository.models["eagle_model"].engine.tokenizer
    sampled = []
    for entry, top in zip(tokens, want_top):
        assert 1 <= len(entry) <= 3 and all(set(item) == {"logprob", "rank", "decoded_token"}
                                            for item in entry.values())
        best = [(int(token), item) for token, item in entry.items() if item["rank"] == 1]
        assert len(best) == 1  # greedy: the sampled token is the most likely one
        sampled.append(best[0])
        assert all(item["decoded_token"] == tokenizer.decode([int(token)]) for token, item in entry.items())
        # the legacy layout keeps one entry per text: each of its numbers is one of the top tokens'
        assert all(any(abs(item["logprob"] - logprob) < 1e-4 for item in entry.values()) for logprob in top.values())
    assert tokenizer.decode([token for token, _ in sampled]) == out["text_output"]
    assert [item["logprob"] for _, item in sampled] == pytest.approx(want, abs=1e-4)
    assert out["cumulative_logprob"] == pytest.approx(sum(want), abs=1e-3)


def test_vllm_streamed_logprobs_follow_each_response(server):
    r = gen(server, "eagle_model", vllm_body(stream=True, sampling={"logprobs": 0}, return_logprobs=True,
                                             return_cumulative_logprob=True, return_num_output_tokens=True),
            "generate_stream")
    assert r.status_code == 200, r.text
    events = sse_events(r)
    running = 0.0
    for event in events:
        tokens = json.loads(event["logprobs"])
        assert len(tokens) == event["num_output_tokens"]
        running += sum(item["logprob"] for entry in tokens for item in entry.values())
        assert event["cumulative_logprob"] == pytest.approx(running, abs=1e-3)
    assert sum(event["num_output_tokens"] for event in events) == MAX_TOKENS
    assert events[-1]["cumulative_logprob"] == pytest.approx(sum(openai_logprobs(server)[0]), abs=1e-3)


def test_logprobs_are_null_unless_the_sampling_parameters_ask(server):
    r = gen(server, "eagle_model", vllm_body(return_logprobs=True))
    assert r.status_code == 200, r.text
    assert r.json()["logprobs"] == "null"
    plain = gen(server, "eagle_model", vllm_body())
    assert "logprobs" not in plain.json() and "cumulative_logprob" not in plain.json()


def test_llmapi_cumulative_logprob_is_text(server):
    r = gen(server, "tensorrt_llm", {"text_input": PROMPT, "sampling_param_max_tokens": MAX_TOKENS,
                                     "return_cumulative_logprob": True})
    assert r.status_code == 200, r.text
    assert float(r.json()["cumulative_logprob"]) == pytest.approx(sum(openai_logprobs(server)[0]), abs=1e-3)


def test_ensemble_log_probs_over_generate_infer_and_grpc(server):
    want = openai_logprobs(server)[0]
    body = {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "return_log_probs": True}
    out = gen(server, "ensemble", body).json()
    assert out["output_log_probs"] == pytest.approx(want, abs=1e-4)
    assert out["cum_log_probs"] == pytest.approx(sum(want), abs=1e-3)
    http = triton_http.InferenceServerClient(url=server.host_port, connection_timeout=30, network_timeout=60)
    try:
        result = http.infer("ensemble", [_http_input(name, value) for name, value in body.items()])
    finally:
        http.close()
    assert result.as_numpy("output_log_probs").shape == (1, 1, MAX_TOKENS)
    assert result.as_numpy("output_log_probs").reshape(-1).tolist() == pytest.approx(want, abs=1e-4)
    with grpcclient.InferenceServerClient(server.grpc_address) as client:
        response = client.infer("ensemble", inputs(**body))
    assert response.as_numpy("output_log_probs").shape == (1, 1, MAX_TOKENS)
    assert float(response.as_numpy("cum_log_probs").reshape(-1)[0]) == pytest.approx(sum(want), abs=1e-3)


def _http_input(name: str, value) -> triton_http.InferInput:
    import numpy as np

    datatype = "BYTES" if isinstance(value, str) else "BOOL" if isinstance(value, bool) else "INT32"
    array = np.array([[value]], dtype=object if datatype == "BYTES" else bool if datatype == "BOOL" else np.int32)
    item = triton_http.InferInput(name, [1, 1], datatype)
    item.set_data_from_numpy(array)
    return item


@pytest.mark.parametrize("body,fragment", [
    (vllm_body(sampling={"logprobs": 21}, return_logprobs=True), "logprobs"),
    (vllm_body(sampling={"logprobs": -1}, return_logprobs=True), "logprobs"),
    (vllm_body(sampling={"prompt_logprobs": 1}), "prompt_logprobs"),
    (vllm_body(return_context_logits=True), "return_context_logits"),
])
def test_bad_logprob_requests_are_400s(server, body, fragment):
    r = gen(server, "eagle_model", body)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]
