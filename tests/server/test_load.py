"""A bounded load test on loopback: a fixed number of requests from 16 clients, within a time limit; no errors,
no lost requests, every greedy answer equal to the same request alone, and memory flat after warm-up."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

PROMPTS = ["def add(a, b):", "Once upon a time", "The quick brown fox", "for i in range(10):",
           "def fibonacci(n):", "The lazy dog", "print(i * i)", "there was a little girl"]
CLIENTS, WAVES, TIME_LIMIT_S = 16, 3, 120


def rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


def ask(url: str, i: int) -> str:
    with httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/v2/models/tensorrt_llm/generate", json={
            "text_input": PROMPTS[i % len(PROMPTS)], "sampling_param_max_tokens": 8 + i % 9,
            "sampling_param_exclude_input_from_output": True})
        assert r.status_code == 200, r.text
        return r.json()["text_output"]


def test_bounded_load(server):
    runner = server.repository.models["tensorrt_llm"].deployment.runner
    failed_before = runner.stats()["failed"]  # the server is shared: earlier tests' refused requests count there
    alone = {i: ask(server.url, i) for i in range(CLIENTS)}
    start = time.monotonic()
    memory = []
    with ThreadPoolExecutor(CLIENTS) as pool:
        for _ in range(WAVES):
            answers = list(pool.map(lambda i: ask(server.url, i), range(CLIENTS)))
            assert answers == [alone[i] for i in range(CLIENTS)]  # nothing lost, nothing mixed up
            memory.append(rss_mb())
            assert time.monotonic() - start < TIME_LIMIT_S
    assert memory[-1] - memory[0] < 64, memory  # the first wave allocated what the batch needs; no growth after
    assert runner.stats()["failed"] == failed_before
