"""A real server (uvicorn in a background thread, 127.0.0.1, free ports) over a model repository of tiny models."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from specserve.server.app import SpecServer
from specserve.server.repository import ModelRepository
from tests.server.stream_batch import StreamBatch

TIMEOUT = httpx.Timeout(60.0, connect=5.0)


def write_repository(root: Path, target: str, draft: str) -> Path:
    """tensorrt_llm (LLM-API model.yaml), eagle_model (vLLM model.json, current form), draft_model (vLLM flat
    form), ensemble (legacy, model.yaml + platform ensemble), plain (no speculation, not decoupled) and
    preprocessing (a legacy helper without a model file: listed, never loaded)."""
    def put(path: str, text: str) -> None:
        file = root / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)

    put("tensorrt_llm/config.pbtxt", 'name: "tensorrt_llm"\nbackend: "python"\n')
    put("tensorrt_llm/1/model.yaml",
        f"model: {target}\nbackend: pytorch\ndtype: float32\ntensor_parallel_size: 1\npipeline_parallel_size: 1\n"
        "speculative_config:\n  decoding_type: NGram\n  max_draft_len: 4\n  adaptive_draft_len: false\n"
        "triton_config:\n  max_batch_size: 0\n  decoupled: True\n")
    put("eagle_model/config.pbtxt", 'backend: "vllm"\ninstance_group [{ count: 1, kind: KIND_MODEL }]\n')
    put("eagle_model/1/model.json", json.dumps({
        "model": target, "dtype": "float32", "gpu_memory_utilization": 0.1, "enforce_eager": True,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}}))
    put("draft_model/config.pbtxt", 'backend: "vllm"\n')
    put("draft_model/1/model.json", json.dumps({
        "model": target, "dtype": "float32", "speculative_model": draft, "num_speculative_tokens": 3,
        "tensor_parallel_size": 1, "disable_log_requests": True}))
    put("ensemble/config.pbtxt", 'name: "ensemble"\nplatform: "ensemble"\nmax_batch_size: 4\n')
    put("ensemble/1/model.yaml", f"model: {target}\ndtype: float32\nspeculative_config:\n  decoding_type: NGram\n"
                                 "  max_draft_len: 3\ntriton_config:\n  max_batch_size: 4\n  decoupled: True\n")
    put("plain/1/model.yaml", f"model: {target}\ndtype: float32\ntriton_config:\n  max_batch_size: 0\n"
                              "  decoupled: False\n")
    put("preprocessing/config.pbtxt", 'name: "preprocessing"\nbackend: "python"\n')
    (root / "preprocessing" / "1").mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def repo_dir(tmp_path_factory, checkpoint) -> Path:
    return write_repository(tmp_path_factory.mktemp("model_repository"), checkpoint("llama"),
                            checkpoint("llama", 1))


class Running:
    """A started SpecServer and clients for it."""

    def __init__(self, server: SpecServer):
        self.server = server
        self.url = server.url
        self.metrics_url = server.metrics_url
        self.host_port = self.url.removeprefix("http://")
        self.grpc_address = server.grpc_address  # host:port of the KServe gRPC server
        self.http = httpx.Client(base_url=self.url, timeout=TIMEOUT)

    @property
    def repository(self) -> ModelRepository:
        return self.server.repository

    def metrics_text(self) -> str:
        return httpx.get(self.metrics_url, timeout=TIMEOUT).text

    def close(self) -> None:
        self.http.close()
        self.server.stop()


def start_server(repository: ModelRepository, **options) -> Running:
    errors = repository.load_all()
    assert not errors, errors
    options.setdefault("grpc_port", 0)  # gRPC on a free port beside HTTP, as `specserve serve` runs it
    # warming five tiny models takes ~25 s on a busy 2-core machine: start()'s default 30 s was too tight
    server = SpecServer(repository, host="127.0.0.1", http_port=0, metrics_port=0, **options)
    return Running(server.start(timeout=180))


@pytest.fixture(scope="session")
def server(repo_dir) -> Running:
    """Explicit model-control mode: the repository tests load and unload models."""
    running = start_server(ModelRepository.from_directory(repo_dir), model_control_mode="explicit")
    yield running
    running.close()


class SlowEngine:
    """An engine whose every step takes `delay` seconds (cancellation and queue tests); counts its steps."""

    def __init__(self, engine, delay: float = 0.05):
        self.engine = engine
        self.delay = delay
        self.steps = 0
        self.closed = 0
        self.lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def open_batch(self, max_active: int, adaptive_draft: bool = True) -> StreamBatch:
        return StreamBatch(self)  # steps this engine's own stream, one request at a time

    def stream(self, prompt, params):
        """A prompt containing "boom" fails after two events (mid-stream errors)."""
        boom = "boom" in self.engine.tokenizer.decode(prompt)
        generator = self.engine.stream(prompt, params)
        try:
            for i, event in enumerate(generator):
                if boom and i == 2:
                    raise RuntimeError("boom: the engine failed")
                time.sleep(self.delay)
                with self.lock:
                    self.steps += 1
                yield event
        finally:
            with self.lock:
                self.closed += 1
            generator.close()


@pytest.fixture()
def slow_server(tmp_path, checkpoint):
    """A fresh server over one slow model ('slow', decoupled, queue of 2) with its SlowEngine at .engine."""
    from specserve.config import build_engine

    engines = []

    def factory(config, target):
        engine = SlowEngine(build_engine(config, target))
        engines.append(engine)
        return engine

    root = tmp_path / "repo"
    (root / "slow" / "1").mkdir(parents=True)
    (root / "slow" / "config.pbtxt").write_text(
        'backend: "python"\ndynamic_batching { default_queue_policy { max_queue_size: 2 } }\n')
    (root / "slow" / "1" / "model.yaml").write_text(
        f"model: {checkpoint('llama')}\ndtype: float32\nspeculative_config:\n  decoding_type: NGram\n"
        "  max_draft_len: 2\ntriton_config:\n  max_batch_size: 0\n  decoupled: True\n")
    running = start_server(ModelRepository.from_directory(root, engine_factory=factory))
    running.engine = engines[0]
    running.runner = running.repository.models["slow"].runner
    yield running
    running.close()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
