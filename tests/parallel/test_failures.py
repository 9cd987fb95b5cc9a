"""What goes wrong across ranks ends in a clear error, never a hang, and leaves nothing running: a size that does
not divide the model, a rank that cannot connect or never joins, ranks of different builds, and a rank killed while
serving (the model goes not ready: health and model readiness say so, requests get 503)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

import httpx
import pytest
from typer.testing import CliRunner

from specserve.checks import ConfigError
from specserve.cli import app
from specserve.engine.engine import Engine
from specserve.models.transformer import ArchSpec
from specserve.parallel.group import Rendezvous, TensorParallelError, free_port
from specserve.parallel.launch import load_tensor_parallel
from specserve.parallel.shard import check_shardable
from specserve.parallel.worker import run_worker, spawned_worker
from specserve.speculative.sampling import SamplingParams


# ---- worker entries the tests start in place of the real one (spawned: module-level functions) ----------------

def other_build_worker(rendezvous, rank, threads):
    """A rank whose torch differs from rank 0's."""
    import specserve.parallel.worker as worker

    real = worker.build_info
    worker.build_info = lambda: {**real(), "torch": "0.0.0-other"}
    spawned_worker(rendezvous, rank, threads)


def crashing_worker(rendezvous, rank, threads):
    sys.exit(3)


def silent_worker(rendezvous, rank, threads):
    time.sleep(120)  # never joins; stopped by rank 0


def nothing_left_running() -> bool:
    return not multiprocessing.active_children()


# ---- sizes -------------------------------------------------------------------------------------------------------

def spec(**changes) -> ArchSpec:
    base = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, vocab_size=384, rms_norm_eps=1e-6, tie_word_embeddings=False)
    return ArchSpec(**{**base, **changes})


@pytest.mark.parametrize("changes,world,quantized,needle", [
    ({}, 3, False, "does not divide the model's 4 attention heads"),
    ({"num_heads": 6, "num_kv_heads": 4}, 3, False, "4 KV heads"),
    ({"intermediate_size": 130}, 4, False, "MLP width 130"),
    ({"intermediate_size": 96}, 2, True, "quantization block"),
    ({"head_dim": 8}, 2, True, "quantization block"),
])
def test_sizes_that_cannot_be_sharded_are_named(changes, world, quantized, needle):
    with pytest.raises(ConfigError, match=needle):
        check_shardable(spec(**changes), world, quantized)


def test_replicated_kv_heads_and_dense_blocks_are_fine():
    check_shardable(spec(num_kv_heads=1), 4, False)  # 4 ranks, one KV head: replicated
    check_shardable(spec(intermediate_size=96), 2, False)  # a dense split needs no block boundary


def test_a_size_that_does_not_divide_the_heads_fails_before_any_rank_starts(checkpoint):
    result = CliRunner().invoke(app, ["generate", "hi", "--model", checkpoint("llama"), "--dtype", "float32",
                                      "--tensor-parallel-size", "3"])
    assert result.exit_code == 2
    assert "tensor_parallel_size 3 does not divide the model's 4 attention heads" in result.output
    assert nothing_left_running()


# ---- joining -----------------------------------------------------------------------------------------------------

def test_a_rank_that_cannot_reach_rank_0_exits_non_zero(monkeypatch, capsys):
    monkeypatch.setenv("SPECSERVE_TP_CONNECT_TIMEOUT", "1")
    start = time.monotonic()
    assert run_worker(Rendezvous("127.0.0.1", free_port(), 2), 1) == 1
    assert time.monotonic() - start < 30
    assert "rank 1 cannot reach rank 0 at 127.0.0.1:" in capsys.readouterr().err


def test_a_rank_that_dies_before_joining_is_named(gemma_kv1):
    with pytest.raises(TensorParallelError, match="rank 1 .* exited with code 3 while starting"):
        load_tensor_parallel(gemma_kv1, "float32", None, 2, worker=crashing_worker)
    assert nothing_left_running()


def test_a_rank_that_never_joins_times_out(gemma_kv1, monkeypatch):
    monkeypatch.setenv("SPECSERVE_TP_CONNECT_TIMEOUT", "3")
    with pytest.raises(TensorParallelError, match="rank 1 of 2 did not join rank 0 at 127.0.0.1:.* within 3 s"):
        load_tensor_parallel(gemma_kv1, "float32", None, 2, worker=silent_worker)
    assert nothing_left_running()


def test_ranks_of_different_builds_refuse_to_serve(gemma_kv1):
    with pytest.raises(TensorParallelError, match="different builds.*rank 1 runs .*torch 0.0.0-other"):
        load_tensor_parallel(gemma_kv1, "float32", None, 2, worker=other_build_worker)
    assert nothing_left_running()


# ---- a rank killed while serving ---------------------------------------------------------------------------------

def test_a_killed_rank_makes_the_model_not_ready(gemma_kv1, tmp_path):
    from specserve.server.app import SpecServer, build_repository

    (tmp_path / "model.yaml").write_text(f"model: {gemma_kv1}\ndtype: float32\ntensor_parallel_size: 2\n"
                                         "speculative_config:\n  decoding_type: NGram\n  max_draft_len: 3\n")
    repository = build_repository(model=str(tmp_path / "model.yaml"))
    assert not repository.load_all()
    server = SpecServer(repository, http_port=0, metrics_port=None).start(timeout=120)
    try:
        http = httpx.Client(base_url=server.url, timeout=30)
        body = {"text_input": "Once upon a time", "max_tokens": 8}
        assert http.post("/v2/models/tensorrt_llm/generate", json=body).status_code == 200
        served = repository.get("tensorrt_llm")
        model = served.engine.model

        # a request in flight when the rank dies ends with the error at its next step
        stream = Engine(served.engine.target).stream("Once upon a time", SamplingParams(max_tokens=40,
                                                                                        ignore_eos=True))
        next(stream)
        os.kill(model.processes[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1 .* exited with code -9"):
            for _ in stream:
                pass
        assert time.monotonic() - start < 10

        assert http.get("/v2/health/ready").status_code == 400
        assert http.get("/v2/models/tensorrt_llm/ready").status_code == 400
        assert http.get("/health").status_code == 503
        refused = http.post("/v2/models/tensorrt_llm/generate", json=body)
        assert refused.status_code == 503 and "tensor-parallel model failed: rank 1" in refused.json()["error"]
        completion = http.post("/v1/completions", json={"model": "tensorrt_llm", "prompt": "Hi", "max_tokens": 4})
        assert completion.status_code == 503 and "restart the server" in completion.json()["error"]["message"]
        index = {m["name"]: m for m in http.post("/v2/repository/index", json={}).json()}
        assert index["tensorrt_llm"]["state"] == "UNAVAILABLE"
        assert http.get("/v2/health/live").status_code == 200  # the front end itself lives on
    finally:
        server.stop()
    assert nothing_left_running()


def test_a_rank_killed_while_idle_is_noticed_without_a_request(gemma_kv1):
    target = load_tensor_parallel(gemma_kv1, "float32", None, 2)
    model = target.model
    try:
        os.kill(model.processes[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while model.failure is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert model.failure is not None and "rank 1" in model.failure  # the heartbeat found it
        with pytest.raises(TensorParallelError):
            Engine(target).generate("Once upon a time", SamplingParams(max_tokens=4))
    finally:
        model.close()
    assert nothing_left_running()
