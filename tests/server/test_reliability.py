"""Control routes locked by default, an optional API key, request limits, and "ready" only once warm."""

from __future__ import annotations

import threading

import httpx
import pytest

from specserve.server.app import SpecServer
from specserve.server.repository import ModelRepository
from specserve.server.request import RequestLimits

from tests.server.conftest import TIMEOUT, SlowEngine, start_server, wait_for, write_repository


@pytest.fixture(scope="module")
def locked(tmp_path_factory, checkpoint):
    """A server in the default model-control mode with an API key and small limits."""
    root = write_repository(tmp_path_factory.mktemp("locked"), checkpoint("llama"), checkpoint("llama", 1))
    running = start_server(ModelRepository.from_directory(root), api_key="s3cret",
                           limits=RequestLimits(max_body_bytes=4096, max_messages=3))
    running.http.headers["Authorization"] = "Bearer s3cret"
    yield running
    running.close()


@pytest.mark.parametrize("action", ["load", "unload"])
def test_load_and_unload_are_refused_outside_explicit_mode(locked, action):
    response = locked.http.post(f"/v2/repository/models/plain/{action}")
    assert response.status_code == 503
    assert response.json() == {"error": "explicit model load / unload is not allowed if polling is enabled"}
    assert locked.http.get("/v2/models/plain/ready").status_code == 200


@pytest.mark.parametrize("path", ["/v2/models/plain/generate", "/v1/completions", "/v2/repository/index",
                                  "/v2/models/plain"])
def test_the_api_key_is_required(locked, path):
    method = "GET" if path == "/v2/models/plain" else "POST"
    body = {"model": "plain", "prompt": "Once"} if path.startswith("/v1") else {"text_input": "Once"}
    body = {**body, "max_tokens": 2} if "generate" in path or path.startswith("/v1") else {}
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        response = httpx.request(method, locked.url + path, json=body, headers=headers, timeout=TIMEOUT)
        assert response.status_code == 401
        error = response.json()["error"]
        assert "API key" in (error["message"] if path.startswith("/v1") else error)
    assert locked.http.request(method, path, json=body).status_code == 200


@pytest.mark.parametrize("path", ["/v2/health/live", "/v2/health/ready", "/health", "/metrics"])
def test_health_and_metrics_need_no_key(locked, path):
    assert httpx.get(locked.url + path, timeout=TIMEOUT).status_code == 200


def test_a_body_over_the_limit_is_refused_before_it_is_read(locked):
    big = {"model": "plain", "prompt": "x " * 4000, "max_tokens": 2}
    response = locked.http.post("/v1/completions", json=big)
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]
    response = locked.http.post("/v2/models/plain/generate", json={"text_input": "x " * 4000, "max_tokens": 2})
    assert response.status_code == 413 and "limit" in response.json()["error"]


def test_too_many_chat_messages(locked):
    messages = [{"role": "user", "content": "hi"}] * 4
    response = locked.http.post("/v1/chat/completions", json={"model": "plain", "messages": messages})
    assert response.status_code == 400 and "at most 3" in response.json()["error"]["message"]


class GatedEngine(SlowEngine):
    """Every request waits for `gate` before its first token (holds the warm-up back)."""

    def __init__(self, engine):
        super().__init__(engine, delay=0.0)
        self.gate = threading.Event()

    def stream(self, prompt, params):
        self.gate.wait(30)
        yield from super().stream(prompt, params)


def test_ready_only_after_the_warm_up(tmp_path, checkpoint):
    from specserve.config import build_engine

    engines = []

    def factory(config, target):
        engines.append(GatedEngine(build_engine(config, target)))
        return engines[-1]

    root = tmp_path / "repo"
    (root / "gated" / "1").mkdir(parents=True)
    (root / "gated" / "1" / "model.yaml").write_text(f"model: {checkpoint('llama')}\ndtype: float32\n")
    repository = ModelRepository.from_directory(root, engine_factory=factory)
    assert not repository.load_all()
    server = SpecServer(repository, host="127.0.0.1", http_port=0, metrics_port=None)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        live = f"{server.url}/v2/health/live"
        assert _eventually(lambda: httpx.get(live, timeout=TIMEOUT).status_code == 200)
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=TIMEOUT).status_code == 400
        assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 503
        engines[0].gate.set()
        assert _eventually(lambda: httpx.get(f"{server.url}/v2/health/ready", timeout=TIMEOUT).status_code == 200)
        assert engines[0].steps > 0  # the warm-up request ran before "ready"
    finally:
        engines[0].gate.set()
        server.stop()


def _eventually(predicate, timeout: float = 30.0) -> bool:
    def safe() -> bool:
        try:
            return predicate()
        except httpx.TransportError:
            return False

    return wait_for(safe, timeout)


def test_names_sharing_a_runner_are_warmed_up_once(tmp_path, checkpoint):
    """A single model is served under its own name and the tutorials' aliases, all one runner: one warm-up request,
    not one per name (each a prefill and a few steps of the model)."""
    from specserve.config import build_engine
    from specserve.server.app import build_repository

    class CountingEngine(SlowEngine):
        requests = 0

        def stream(self, prompt, params):
            self.requests += 1
            yield from super().stream(prompt, params)

    engines = []

    def factory(config, target):
        engines.append(CountingEngine(build_engine(config, target), delay=0.0))
        return engines[-1]

    yaml_path = tmp_path / "model.yaml"
    yaml_path.write_text(f"model: {checkpoint('llama')}\ndtype: float32\n")
    repository = build_repository(model=str(yaml_path), engine_factory=factory)
    assert not repository.load_all()
    assert len(repository.ready_models()) > 1 and len(engines) == 1  # the names share one engine
    server = SpecServer(repository, host="127.0.0.1", http_port=0, metrics_port=None)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert _eventually(lambda: httpx.get(f"{server.url}/v2/health/ready", timeout=TIMEOUT).status_code == 200)
        assert engines[0].requests == 1
    finally:
        server.stop()

