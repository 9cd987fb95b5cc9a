"""A failure inside a batch step ends only the request it belongs to; its batch mates finish correctly."""

from __future__ import annotations

import pytest

from specserve.engine.batch import BatchEngine
from specserve.engine.engine import Engine
from specserve.speculative.ngram import NGramMethod
from specserve.speculative.sampling import SamplingParams

from tests.engine.test_batching import PROMPTS

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def run(batch: BatchEngine, seqs, poison=lambda step: None) -> tuple[dict, dict]:
    """Step until done; `poison(step)` may break something before a step. Returns (results, errors) by seq."""
    results, errors, step = {}, {}, 0
    while batch.has_work():
        poison(step)
        for seq, event in batch.step():
            if isinstance(event, Exception):
                errors[seq] = event
            elif event.result is not None:
                results[seq] = event.result.token_ids
        step += 1
        assert step < 1_000
    return results, errors


@pytest.fixture()
def engine(loaded):
    return Engine(loaded("llama"), NGramMethod(1, 3), 3)


def test_a_failure_in_one_rows_verification_ends_that_request_alone(engine):
    batch = BatchEngine(engine, max_batch_size=4)
    seqs = [batch.add(prompt, PARAMS) for prompt in PROMPTS[:4]]
    victim = seqs[2]

    def poison(step: int) -> None:
        if step == 6:  # all four decode together by now
            def broken(*args, **kwargs):
                raise RuntimeError("probability tensor contains either inf, nan or element < 0")
            victim.commit = broken

    results, errors = run(batch, seqs, poison)
    assert list(errors) == [victim] and "probability tensor" in str(errors[victim])
    for prompt, seq in zip(PROMPTS, seqs):
        if seq is not victim:
            assert results[seq] == engine.generate(prompt, PARAMS).token_ids


def test_a_batched_forward_that_fails_is_rerun_row_by_row(engine):
    """The target fails on any forward holding one request's rows past its prompt + 4 tokens (the others stop
    before that position): only that request fails; the others' rows, rerun alone, give what they give alone."""
    model = engine.model
    long_prompt = " ".join(PROMPTS[:4])
    limit = len(engine.tokenizer(long_prompt).input_ids) + 4
    assert max(len(engine.tokenizer(p).input_ids) for p in PROMPTS[:2]) + PARAMS.max_tokens + 4 < limit
    calls = {"batched_failures": 0}

    def failing_model(tokens, positions, *args, **kwargs):
        if (positions >= limit).any():
            calls["batched_failures"] += tokens.shape[0] > 1
            raise RuntimeError("the target failed")
        return model(tokens, positions, *args, **kwargs)

    batch = BatchEngine(engine, max_batch_size=4)
    seqs = [batch.add(prompt, PARAMS) for prompt in [PROMPTS[0], PROMPTS[1], long_prompt]]
    engine.model = failing_model
    try:
        results, errors = run(batch, seqs)
    finally:
        engine.model = model
    assert list(errors) == [seqs[2]] and calls["batched_failures"] >= 1
    for prompt, seq in zip(PROMPTS, seqs[:2]):
        assert results[seq] == engine.generate(prompt, PARAMS).token_ids


def test_a_failing_prefill_ends_that_request_alone(engine, monkeypatch):
    batch = BatchEngine(engine, max_batch_size=4)
    first = batch.add(PROMPTS[0], PARAMS)
    batch.step()
    second = batch.add(PROMPTS[1], PARAMS)
    real_forward = engine.forward

    def forward(cache, seqs):
        if second in seqs and not second.prefilled:
            raise RuntimeError("prefill failed")
        return real_forward(cache, seqs)

    monkeypatch.setattr(engine, "forward", forward)
    results, errors = run(batch, [first, second])
    assert list(errors) == [second] and results[first] == engine.generate(PROMPTS[0], PARAMS).token_ids
