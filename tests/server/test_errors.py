"""Bad input: Triton's status codes and {"error": "..."} bodies (OpenAI's error object on /v1); the server stays
up and serves the next request."""

from __future__ import annotations

import json

import pytest

GOOD = {"text_input": "def add(a, b):", "sampling_param_max_tokens": 4}
LONG_PROMPT = "the quick brown fox " * 400  # far beyond the tiny models' 512-token context

BAD_GENERATE = [
    ("malformed json", b'{"text_input": "hi", ', 400, "failed to parse the request JSON"),
    ("invalid utf-8", b'{"text_input": "caf\xe9 \xff"}', 400, "UTF-8"),
    ("not an object", b'["text_input", "hi"]', 400, "JSON object"),
    ("missing text_input", {"sampling_param_max_tokens": 4}, 400, "text_input"),
    ("empty body", b"", 400, "text_input"),
    ("text_input not a string", {"text_input": 5}, 400, "text_input"),
    ("batched text_input", {"text_input": ["a", "b"]}, 400, "text_input"),
    ("max_tokens not a number", {"text_input": "hi", "sampling_param_max_tokens": "abc"}, 400, "max_tokens"),
    ("max_tokens a list", {"text_input": "hi", "sampling_param_max_tokens": [1, 2]}, 400, "max_tokens"),
    ("max_tokens an object", {"text_input": "hi", "sampling_param_max_tokens": {"a": 1}}, 400, "max_tokens"),
    ("max_tokens a bool", {"text_input": "hi", "sampling_param_max_tokens": True}, 400, "max_tokens"),
    ("negative max_tokens", {"text_input": "hi", "sampling_param_max_tokens": -5}, 400, "max_tokens"),
    ("zero max_tokens", {"text_input": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("huge max_tokens", {"text_input": "hi", "sampling_param_max_tokens": 10**9}, 400, "max_tokens"),
    ("negative temperature", {"text_input": "hi", "sampling_param_temperature": -0.5}, 400, "temperature"),
    ("temperature not a number", {"text_input": "hi", "parameters": {"temperature": "hot"}}, 400, "temperature"),
    ("top_p zero", {"text_input": "hi", "sampling_param_top_p": 0}, 400, "top_p"),
    ("top_p above one", {"text_input": "hi", "top_p": 1.5}, 400, "top_p"),
    ("negative seed", {"text_input": "hi", "sampling_param_seed": -1}, 400, "seed"),
    ("streaming not a bool", {"text_input": "hi", "streaming": "maybe"}, 400, "streaming"),
    ("parameters not an object", {"text_input": "hi", "parameters": [1]}, 400, "parameters"),
    ("prompt over the context", {"text_input": LONG_PROMPT, "sampling_param_max_tokens": 4}, 400, "context"),
    ("unknown input", {"text_input": "hi", "sampling_param_max_token": 4}, 400, "sampling_param_max_token"),
    ("bad_words", {"text_input": "hi", "bad_words": ["foo"]}, 400, "bad_words"),
    ("beam search", {"text_input": "hi", "beam_width": 2}, 400, "beam_width"),
    ("logits", {"text_input": "hi", "return_generation_logits": True}, 400, "return_generation_logits"),
    ("vllm sampling_parameters not json", {"text_input": "hi", "sampling_parameters": "{"}, 400,
     "sampling_parameters"),
]


@pytest.mark.parametrize("case,body,status,fragment", BAD_GENERATE, ids=[c[0] for c in BAD_GENERATE])
@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_bad_generate_request(server, case, body, status, fragment, endpoint):
    data = body if isinstance(body, bytes) else json.dumps(body)
    r = server.http.post(f"/v2/models/tensorrt_llm/{endpoint}", content=data)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()
    assert set(error) == {"error"} and isinstance(error["error"], str)
    assert fragment.lower() in error["error"].lower(), error
    ok = server.http.post("/v2/models/tensorrt_llm/generate", content=json.dumps(GOOD))  # still serving
    assert ok.status_code == 200 and ok.json()["text_output"].startswith("def add(a, b):")


def test_unknown_model_and_version(server):
    r = server.http.post("/v2/models/nope/generate", content=json.dumps(GOOD))
    assert r.status_code == 404 and r.json() == {"error": "Request for unknown model: 'nope' is not found"}
    r = server.http.post("/v2/models/tensorrt_llm/versions/7/generate", content=json.dumps(GOOD))
    assert r.status_code == 404 and "version 7" in r.json()["error"]
    assert server.http.get("/v2/models/nope").status_code == 404
    assert server.http.get("/v2/models/nope/config").status_code == 404
    r = server.http.post("/v2/models/tensorrt_llm/versions/latest/generate", content=json.dumps(GOOD))
    assert r.status_code == 404 and r.json() == {"error": "Not Found"}
    r = server.http.get("/v2/nothing/here")
    assert r.status_code == 404 and r.json() == {"error": "Not Found"}


def test_wrong_method(server):
    for method, path in [("GET", "/v2/models/tensorrt_llm/generate"), ("GET", "/v2/models/tensorrt_llm/infer"),
                         ("POST", "/v2/health/live"), ("DELETE", "/v2/models/tensorrt_llm"),
                         ("GET", "/v2/repository/index")]:
        r = server.http.request(method, path)
        assert r.status_code == 405, (method, path)
        assert r.json() == {"error": "Method Not Allowed"}


def test_content_encoding(server):
    r = server.http.post("/v2/models/tensorrt_llm/generate", content=json.dumps(GOOD),
                         headers={"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "Content-Encoding" in r.json()["error"]


def test_bad_infer_requests(server):
    url = "/v2/models/plain/infer"
    assert server.http.post(url, content=b"{").status_code == 400
    assert server.http.post(url, content=json.dumps({"inputs": "x"})).status_code == 400
    r = server.http.post(url, content=json.dumps({"inputs": [{"name": "text_input", "datatype": "BYTES",
                                                                "shape": [1], "data": ["hi"]},
                                                               {"name": "foo", "datatype": "INT32", "shape": [1],
                                                                "data": [1]}]}))
    assert r.status_code == 400 and "'foo'" in r.json()["error"]
    r = server.http.post(url, content=b'{"inputs":[{"name":"text_input","datatype":"BYTES","shape":[1],'
                                      b'"parameters":{"binary_data_size":100}}]}',
                         headers={"Inference-Header-Content-Length": "94"})
    assert r.status_code == 400
    text_input = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}
    max_tokens = {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [2]}
    for parameters in ({"binary_data_output": "maybe"}, {"binary_data_output": [1, 2]}):
        r = server.http.post(url, json={"inputs": [text_input, max_tokens], "parameters": parameters})
        assert r.status_code == 400 and "binary_data_output" in r.json()["error"]
    outputs = [{"name": "text_output", "parameters": {"binary_data": "maybe"}}]
    r = server.http.post(url, json={"inputs": [text_input, max_tokens], "outputs": outputs})
    assert r.status_code == 400 and "binary_data" in r.json()["error"]


BAD_OPENAI = [
    ("n above the cap", {"prompt": "hi", "n": 17}, 400, "n"),
    ("logprobs above the cap", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("max_tokens 0 without scoring", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("negative temperature", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("top_p above one", {"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("prompt missing", {"max_tokens": 3}, 400, "prompt"),
    ("prompt over the context", {"prompt": LONG_PROMPT, "max_tokens": 3}, 400, "context"),
    ("unknown model", {"model": "gpt-4", "prompt": "hi"}, 404, "gpt-4"),
    ("stream_options without stream", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream"),
    ("max_tokens a string", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
]


@pytest.mark.parametrize("case,body,status,fragment", BAD_OPENAI, ids=[c[0] for c in BAD_OPENAI])
def test_bad_openai_request(server, case, body, status, fragment):
    body = {"model": "tensorrt_llm", **body}
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert fragment.lower() in error["message"].lower()


def test_bad_openai_bodies(server):
    r = server.http.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = server.http.post("/v1/chat/completions", content=b'{"messages": "\xff"}')
    assert r.status_code == 400
    r = server.http.post("/v1/chat/completions", json={"model": "tensorrt_llm", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = server.http.post("/v1/chat/completions", json={"model": "tensorrt_llm", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400
    r = server.http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    r = server.http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
