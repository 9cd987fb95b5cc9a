"""Continuous batching: requests that share forwards get exactly what each gets alone."""

from __future__ import annotations

import pytest

from specserve.engine.batch import BatchEngine, expected_tokens
from specserve.engine.engine import Engine
from specserve.spec.proposers import DraftModelMethod, NGramMethod
from specserve.spec.sampling import SamplingParams

PROMPTS = ["def fibonacci(n):", "Once upon a time", "The quick brown fox", "for i in range(10):",
           "def add(a, b):", "The lazy dog sleeps", "print(i * i)", "Once upon a time there was"]


def run_batched(batch: BatchEngine, requests) -> dict:
    """Submit requests (prompt, params) in waves while decoding, as a server would; returns results by index."""
    results, pending = {}, list(enumerate(requests))
    owners = {}
    steps = 0
    while pending or batch.has_work():
        if pending and steps % 3 == 0:  # new requests join between steps
            index, (prompt, params) = pending.pop(0)
            owners[id(batch.add(prompt, params))] = index
        for seq, event in batch.step():
            if event.result is not None:
                results[owners[id(seq)]] = event.result
        steps += 1
        assert steps < 10_000
    return results


@pytest.mark.parametrize("method", ["ar", "ngram", "draft_target"])
def test_sixteen_concurrent_greedy_requests_equal_each_alone(loaded, method):
    target = loaded("qwen3")
    spec = {"ar": None, "ngram": NGramMethod(1, 3),
            "draft_target": DraftModelMethod(loaded("qwen3", 1).model, target.model.spec.vocab_size)}[method]
    engine = Engine(target, spec, 4 if spec else 0)
    requests = [(PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=8 + 3 * i)) for i in range(16)]
    alone = [engine.generate(prompt, params) for prompt, params in requests]
    batched = run_batched(BatchEngine(engine, max_batch_size=6), requests)
    for i, want in enumerate(alone):
        assert batched[i].token_ids == want.token_ids, i
        assert batched[i].text == want.text


def test_cancel_frees_the_row(loaded):
    batch = BatchEngine(Engine(loaded("llama")), max_batch_size=2)
    first = batch.add(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    batch.add(PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True))
    batch.step()
    batch.step()
    assert batch.active == 2
    batch.cancel(first)
    assert batch.active == 1
    third = batch.add(PROMPTS[2], SamplingParams(max_tokens=3))
    batch.step()
    assert third in batch.rows


def test_draft_length_shrinks_when_verification_gets_expensive(loaded):
    target = loaded("llama")
    batch = BatchEngine(Engine(target, NGramMethod(1, 3), 4), max_batch_size=4)
    batch.costs.seconds = [1.0 * s for s in batch.costs.sizes]  # cost proportional to tokens: drafting never pays
    seqs = [batch.add(p, SamplingParams(max_tokens=4)) for p in PROMPTS[:3]]
    assert batch.choose_draft_len(seqs) == 0
    batch.costs.seconds = [1.0 for _ in batch.costs.sizes]  # flat cost: draft as much as allowed
    assert batch.choose_draft_len(seqs) == 4


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
