"""8 concurrent requests (mixed endpoints and models sharing one set of weights) all succeed, each with exactly the
output it has alone (greedy)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

PROMPTS = ["def add(a, b):", "Once upon a time", "The quick brown fox", "for i in range(10):",
           "def fibonacci(n):", "The lazy dog", "print(i * i)", "there was a little girl"]


def run_one(url: str, i: int, prompt: str) -> str:
    with httpx.Client(base_url=url, timeout=120) as client:
        kind = i % 4
        if kind == 0:
            r = client.post("/v2/models/tensorrt_llm/generate", json={
                "text_input": prompt, "sampling_param_max_tokens": 20,
                "sampling_param_exclude_input_from_output": True})
            assert r.status_code == 200, r.text
            return r.json()["text_output"]
        if kind == 1:
            r = client.post("/v2/models/eagle_model/generate_stream", json={
                "text_input": prompt, "stream": True, "exclude_input_in_output": True,
                "parameters": {"temperature": 0, "max_tokens": 20}})
            assert r.status_code == 200, r.text
            return "".join(json.loads(b[6:])["text_output"] for b in r.text.split("\n\n") if b)
        if kind == 2:
            r = client.post("/v1/completions", json={"model": "draft_model", "prompt": prompt, "max_tokens": 20,
                                                     "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        r = client.post("/v2/models/plain/generate", json={"text_input": prompt, "sampling_param_max_tokens": 20,
                                                            "sampling_param_exclude_input_from_output": True})
        assert r.status_code == 200, r.text
        return r.json()["text_output"]


def test_eight_concurrent_requests_equal_solo(server):
    solo = [run_one(server.url, i, p) for i, p in enumerate(PROMPTS)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda args: run_one(server.url, *args), enumerate(PROMPTS)))
    assert together == solo
    # every path is lossless: each equals plain decoding of its prompt
    assert solo == [run_one(server.url, 3, p) for p in PROMPTS]
