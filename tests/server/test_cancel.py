"""Client disconnects stop the request at the next step (streaming and not); a full queue answers 503 / 429 and
the server keeps serving."""

from __future__ import annotations

import json
import socket
import threading

import httpx

from .conftest import wait_for

BODY = {"text_input": "Once upon a time", "sampling_param_max_tokens": 400, "sampling_param_temperature": 0,
        "streaming": True}


def raw_post(server, path: str, body: dict) -> socket.socket:
    """Send a POST on a raw socket (so the test decides when the connection drops)."""
    host, port = server.host_port.split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_disconnect_mid_stream_stops_the_request(slow_server):
    runner, engine = slow_server.runner, slow_server.engine
    with httpx.Client(base_url=slow_server.url, timeout=30) as client:
        with client.stream("POST", "/v2/models/slow/generate_stream",
                           json={**BODY, "ignore_eos": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["text_output"]
        # leaving the block closes the connection mid-stream
    assert wait_for(lambda: runner.stats()["cancelled"] == 1 and runner.stats()["running"] == 0)
    steps = engine.steps
    assert steps < 100  # 400 asked; stopped after the disconnect
    assert wait_for(lambda: 'reason="CANCELED"' in slow_server.metrics_text())
    text = slow_server.metrics_text()
    assert 'nv_inference_request_failure{model="slow",reason="CANCELED",version="1"} 1' in text
    ok = slow_server.http.post("/v2/models/slow/generate", json={"text_input": "hi", "sampling_param_max_tokens": 2})
    assert ok.status_code == 200


def test_disconnect_non_streaming_and_openai_stream(slow_server):
    runner = slow_server.runner
    sock = raw_post(slow_server, "/v2/models/slow/generate",
                    {"text_input": "Once upon a time", "sampling_param_max_tokens": 400, "ignore_eos": True})
    assert wait_for(lambda: runner.stats()["running"] == 1)
    sock.close()
    assert wait_for(lambda: runner.stats()["cancelled"] == 1 and runner.stats()["running"] == 0)
    sock = raw_post(slow_server, "/v1/chat/completions", {"model": "slow", "max_tokens": 400, "stream": True,
                                                          "ignore_eos": True,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    assert wait_for(lambda: runner.stats()["cancelled"] == 2 and runner.stats()["running"] == 0)
    assert slow_server.engine.steps < 200


def test_disconnect_while_queued(slow_server):
    runner = slow_server.runner
    first = raw_post(slow_server, "/v2/models/slow/generate",
                     {"text_input": "Once upon a time", "sampling_param_max_tokens": 60, "ignore_eos": True})
    assert wait_for(lambda: runner.stats()["running"] == 1)
    queued = raw_post(slow_server, "/v2/models/slow/generate",
                      {"text_input": "queued", "sampling_param_max_tokens": 60, "ignore_eos": True})
    assert wait_for(lambda: runner.stats()["queued"] == 1)
    queued.close()
    assert wait_for(lambda: runner.stats()["queued"] == 0 and runner.stats()["cancelled"] == 1)
    first.close()
    assert wait_for(lambda: runner.stats()["running"] == 0)


def test_queue_full(slow_server):
    runner = slow_server.runner
    body = {"text_input": "Once upon a time", "sampling_param_max_tokens": 16, "ignore_eos": True}
    results = {}

    def post(i):
        with httpx.Client(base_url=slow_server.url, timeout=60) as client:
            results[i] = client.post("/v2/models/slow/generate", json=body)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(3)]  # 1 running + 2 queued (the limit)
    for i, t in enumerate(threads):
        t.start()
        assert wait_for(lambda: runner.pending == i + 1)
    assert wait_for(lambda: runner.stats()["queued"] == 2)
    r = slow_server.http.post("/v2/models/slow/generate", json=body)
    assert r.status_code == 503 and r.json() == {"error": "Exceeds maximum queue size"}
    r = slow_server.http.post("/v1/completions", json={"model": "slow", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["code"] == 429
    for t in threads:
        t.join(60)
    assert [results[i].status_code for i in range(3)] == [200, 200, 200]
    assert 'nv_inference_request_failure{model="slow",reason="REJECTED",version="1"} 2' in slow_server.metrics_text()
    assert slow_server.http.get("/v2/health/ready").status_code == 200


def test_engine_failure_mid_stream(slow_server):
    """A request the engine fails: 500 before the first response, `data: {"error": ...}` after it (Triton) or an
    error chunk then [DONE] (OpenAI); the worker and the server go on."""
    boom = {"text_input": "boom boom boom", "sampling_param_max_tokens": 20, "ignore_eos": True}
    r = slow_server.http.post("/v2/models/slow/generate_stream", json={**boom, "streaming": True})
    assert r.status_code == 200
    blocks = [b for b in r.text.split("\n\n") if b]
    assert len(blocks) >= 2 and all(b.startswith("data: ") for b in blocks)
    assert json.loads(blocks[-1][6:]) == {"error": "Error generating request: boom: the engine failed"}
    assert "text_output" in json.loads(blocks[0][6:])
    r = slow_server.http.post("/v2/models/slow/generate", json=boom)
    assert r.status_code == 500 and r.json() == {"error": "Error generating request: boom: the engine failed"}
    r = slow_server.http.post("/v1/completions", json={"model": "slow", "prompt": "boom boom", "max_tokens": 20,
                                                       "ignore_eos": True, "stream": True})
    blocks = [b for b in r.text.split("\n\n") if b]
    assert blocks[-1] == "data: [DONE]" and "error" in json.loads(blocks[-2][6:])
    assert slow_server.runner.stats()["failed"] == 3
    ok = slow_server.http.post("/v2/models/slow/generate", json={"text_input": "hi", "sampling_param_max_tokens": 2})
    assert ok.status_code == 200
    assert 'nv_inference_request_failure{model="slow",reason="BACKEND",version="1"} 3' in slow_server.metrics_text()


def test_stop_request_cancels_by_id(slow_server):
    """TRT-LLM LLM-API style cancellation: {"id": X, "stop": true} stops the in-flight request with id X."""
    runner = slow_server.runner
    results = {}

    def post():
        with httpx.Client(base_url=slow_server.url, timeout=60) as client:
            results["r"] = client.post("/v2/models/slow/generate", json={
                "id": "job-7", "text_input": "Once upon a time", "sampling_param_max_tokens": 300,
                "ignore_eos": True})

    thread = threading.Thread(target=post)
    thread.start()
    assert wait_for(lambda: runner.stats()["running"] == 1)
    r = slow_server.http.post("/v2/models/slow/generate", json={"id": "job-7", "stop": True})
    assert r.status_code == 400 and r.json() == {"error": "Request cancelled by client"}
    thread.join(30)
    assert results["r"].status_code == 400 and results["r"].json() == {"error": "Request cancelled by client"}
    assert runner.stats()["cancelled"] == 1 and slow_server.engine.steps < 150
