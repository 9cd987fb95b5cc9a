"""All of a server's tensor work runs on one thread (see specserve/server/compute.py for why)."""

from __future__ import annotations

import threading

import pytest

from specserve.server.compute import COMPUTE, ComputeThread


def test_compute_thread_runs_calls_in_order_and_reraises():
    compute = ComputeThread("test-compute")
    seen = []
    assert compute.run(lambda x: seen.append(threading.get_ident()) or x * 2, 21) == 42
    assert compute.run(lambda: compute.run(lambda: "nested runs inline")) == "nested runs inline"
    with pytest.raises(ValueError, match="boom"):
        compute.run(lambda: (_ for _ in ()).throw(ValueError("boom")))
    assert seen == [compute.ident] and compute.ident != threading.get_ident()


def test_engine_steps_and_loading_run_on_the_compute_thread(monkeypatch, loaded):
    import asyncio

    from specserve.engine.batch import BatchEngine
    from specserve.engine.engine import Engine
    from specserve.server.runner import Runner
    from specserve.speculative.sampling import SamplingParams

    threads = set()
    step = BatchEngine.step

    def recording_step(self):
        threads.add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(BatchEngine, "step", recording_step)
    runner = Runner(Engine(loaded("llama")), name="compute-test")

    async def ask():
        handle = await runner.submit("def fibonacci(n):", SamplingParams(max_tokens=8))
        return [event async for event in handle][-1].result

    try:
        assert asyncio.run(ask()).metrics.output_tokens == 8
    finally:
        runner.close()
    assert threads == {COMPUTE.ident}


def test_a_guided_request_compiles_its_grammar_once_off_the_compute_thread(monkeypatch, loaded):
    import asyncio

    from specserve.engine.engine import Engine
    from specserve.server.runner import Runner
    from specserve.speculative.grammar import GrammarVocabulary, Guide
    from specserve.speculative.sampling import SamplingParams

    compiles = []
    compile_ = GrammarVocabulary.compile

    def recording_compile(self, guide):
        compiles.append(threading.get_ident())
        return compile_(self, guide)

    monkeypatch.setattr(GrammarVocabulary, "compile", recording_compile)
    runner = Runner(Engine(loaded("llama")), name="grammar-test")

    async def ask():
        params = SamplingParams(max_tokens=6, guide=Guide("regex", "(yes|no)[a-d]{1,4}"))
        handle = await runner.submit("def fibonacci(n):", params)
        return [event async for event in handle][-1].result

    try:
        result = asyncio.run(ask())
    finally:
        runner.close()
    assert result.text[:2] in ("ye", "no")
    assert len(compiles) == 1 and compiles[0] != COMPUTE.ident
