"""Continuous batching: requests that share forwards get exactly what each gets alone."""

from __future__ import annotations

import numpy as np
import pytest

from specserve.engine.batch import BatchEngine
from specserve.engine.engine import Engine
from specserve.engine.execute import execute
from specserve.engine.scheduler import StepKind
from specserve.models.step_costs import StepCosts
from specserve.speculative.base import DraftKind, Proposal, Proposer, SpecMethod
from specserve.speculative.draft_model import DraftModelMethod
from specserve.speculative.ngram import NGramMethod, NGramProposer
from specserve.speculative.policy.acceptance import Acceptance, AcceptanceByEvidence, expected_tokens
from specserve.speculative.policy.draft_length import ShadowDraft
from specserve.speculative.sampling import SamplingParams
from specserve.speculative.tree import Chain

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


def test_a_step_is_scheduled_as_data_executed_by_the_engine_and_applied(loaded):
    """The scheduler plans each forward as data (its kind, rows, cache and draft plan) without running the model;
    the engine runs it; the scheduler applies its output. Driven by hand, the same tokens as each request alone."""
    engine = Engine(loaded("llama"), NGramMethod(1, 3), 4)
    requests = [(prompt, SamplingParams(max_tokens=12, ignore_eos=True)) for prompt in PROMPTS[:3]]
    batch = BatchEngine(engine, max_batch_size=2)
    seqs = [batch.add(prompt, params) for prompt, params in requests]
    kinds, results = [], {}
    while batch.has_work():
        step = batch.schedule()
        kinds.append(step.kind)
        if step.kind is StepKind.PREFILL:  # a new request's row, alone
            assert step.cache.batch == 1 and step.seqs[0].metrics.target_forwards == 0
        else:
            assert step.seqs == batch.rows and step.plan.draft_len <= 4
        output = execute(engine, step)
        assert len(output.events) == len(step.seqs)
        for seq, event in batch.update(step, output):
            if event.result is not None:
                results[seqs.index(seq)] = event.result.token_ids
    assert kinds[:2] == [StepKind.PREFILL] * 2 and kinds[2] is StepKind.DECODE and StepKind.CHUNK not in kinds
    assert results == {i: engine.generate(prompt, params).token_ids for i, (prompt, params) in enumerate(requests)}


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
    batch.policy.costs.seconds = [1.0 * s for s in batch.policy.costs.sizes]  # cost proportional to tokens: drafting never pays
    seqs = [batch.add(p, SamplingParams(max_tokens=4)) for p in PROMPTS[:3]]
    assert batch.policy.draft_length.choose(seqs) == 0
    batch.policy.costs.seconds = [1.0 for _ in batch.policy.costs.sizes]  # flat cost: draft as much as allowed
    assert batch.policy.draft_length.choose(seqs) == 4


def test_requests_with_nothing_to_draft_do_not_make_the_batch_draft(loaded):
    """Where drafting is free, a request's latest shadow draft is what it could draft now: a batch in which no
    request has one does not pad its rows for drafts that will not come, even when verifying is free."""
    batch = BatchEngine(Engine(loaded("llama"), NGramMethod(1, 3), 4), max_batch_size=4)
    seqs = [batch.add(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in PROMPTS[:3]]
    while not all(seq in batch.policy.draft_length.shadows for seq in seqs):  # prefilled and decoded once: shadows scored
        batch.step()
    batch.policy.costs.seconds = [1.0 for _ in batch.policy.costs.sizes]
    for seq in seqs:
        batch.policy.draft_length.shadows[seq] = [ShadowDraft(len(seq.context), Chain(seq.pending[0], [1, 2, 3, 4]))]
    assert batch.policy.draft_length.choose(seqs) == 4
    for seq in seqs:
        batch.policy.draft_length.shadows[seq] = []  # the proposer found nothing where the requests stand
    assert batch.policy.draft_length.choose(seqs) == 0


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


# ---- the adaptive draft length keeps drafting where drafts pay ---------------------------------------------------

def on_sizes(points: dict[int, float]) -> list[float]:
    """A step-cost table over StepCosts.SIZES, linear between the given sizes."""
    sizes = sorted(points)
    return [float(np.interp(size, sizes, [points[s] for s in sizes])) for size in StepCosts.SIZES]


# a small model on a CPU: a few more tokens cost little
CPU_LIKE_COSTS = on_sizes({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5, 16: 2.2, 32: 3.8, 64: 7.0})


class ScriptedMethod(SpecMethod):
    """Drafts the reference continuation (so drafts are accepted), but wrong ones for the first `wrong` calls:
    a request whose text turns repetitive only after a while."""

    name = "scripted"

    def __init__(self, reference: list[int], wrong: int, vocab: int):
        self.reference, self.wrong, self.vocab = reference, wrong, vocab

    def new_proposer(self, params, generator, capacity):
        method, calls = self, []

        class Scripted(Proposer):
            def propose(self, tokens, max_len):
                calls.append(1)
                following = method.reference[len(tokens): len(tokens) + max_len]
                if len(calls) <= method.wrong:
                    following = [(t + 1) % method.vocab for t in following]
                return Proposal.chain(tokens[-1], following)

        return Scripted()


def test_adaptive_draft_len_recovers_after_rejected_drafts(loaded):
    """A run of rejected drafts must not stop speculation for good: the old running mean fell to ~0 after them,
    chose draft length 0, and with no more drafts never learnt that drafts now pay."""
    target = loaded("llama")
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    plain = Engine(target).generate(PROMPTS[0], params)
    reference = target.tokenizer(PROMPTS[0]).input_ids + plain.token_ids
    runs = {}
    for adaptive in (False, True):
        batch = BatchEngine(Engine(target, ScriptedMethod(reference, 12, target.model.spec.vocab_size), 4), max_batch_size=4,
                            adaptive_draft=adaptive)
        if adaptive:
            batch.policy.costs.seconds = list(CPU_LIKE_COSTS)
        runs[adaptive] = run_batched(batch, [(PROMPTS[0], params)])[0]
    for result in runs.values():
        assert result.token_ids == plain.token_ids
    fixed, adaptive = runs[False].metrics, runs[True].metrics
    assert adaptive.total_accepted_draft_tokens >= 0.7 * fixed.total_accepted_draft_tokens
    assert adaptive.target_forwards <= 1.3 * fixed.target_forwards


# drafting looks unprofitable at the prior acceptance (0.7 / 0.8), profitable at the real one (1.0)
COSTS_AT_THE_EDGE = on_sizes({1: 1.0, 2: 1.8, 4: 2.8, 8: 5.6, 16: 11.2, 32: 22.4, 64: 44.8})


@pytest.mark.parametrize("free,probes", [(True, False), (False, True), (False, False)])
def test_free_drafts_are_scored_even_when_the_batch_drafts_nothing(loaded, free, probes, monkeypatch):
    """Where drafting costs no forward, drafts the batch did not verify are scored against what the request
    emits, so a choice of "no drafts" made on the prior is revised at once. Where a draft costs a forward, the
    choice drafts one probe step after PROBE_AFTER undrafted ones and is revised from it. Learnt from verified
    drafts alone with no probes (the control), the estimate stays at its prior and the request decodes one token
    per forward."""
    from specserve.speculative.policy.draft_length import ModelChainLengths

    monkeypatch.setattr(ModelChainLengths, "PROBE_AFTER", ModelChainLengths.PROBE_AFTER if probes else 10**9)
    target = loaded("llama")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = Engine(target).generate(PROMPTS[0], params)
    method = ScriptedMethod(target.tokenizer(PROMPTS[0]).input_ids + plain.token_ids, 0, target.model.spec.vocab_size)
    method.draft_kind = DraftKind.LOOKUP if free else DraftKind.MODEL_CHAIN
    batch = BatchEngine(Engine(target, method, 4), max_batch_size=4)
    batch.policy.costs.seconds = list(COSTS_AT_THE_EDGE)
    result = run_batched(batch, [(PROMPTS[0], params)])[0]
    assert result.token_ids == plain.token_ids
    if free:
        assert result.metrics.target_forwards < 20, result.metrics.target_forwards
    elif probes:  # the first PROBE_AFTER steps decode alone, then the probe's verdict opens drafting
        assert ModelChainLengths.PROBE_AFTER < result.metrics.target_forwards < 30, result.metrics.target_forwards
    else:
        assert result.metrics.target_forwards == 40


def test_acceptance_estimate_returns_to_its_prior():
    estimate = Acceptance()
    assert estimate.first.value == pytest.approx(Acceptance.PRIOR_FIRST)
    for _ in range(5):
        estimate.update(4, 0)
    low = estimate.first.value
    assert low < 0.2
    for _ in range(30):  # steps without drafts: the evidence fades
        estimate.update(0, 0)
    assert estimate.first.value > 0.5


def test_acceptance_tells_first_tokens_from_later_ones():
    """Drafts right at their first token and then right throughout (prompt lookup's way) make long drafts pay,
    where one per-token rate would call them a coin toss."""
    estimate = Acceptance()
    for _ in range(20):
        estimate.update(4, 0)
        estimate.update(4, 4)
    assert estimate.first.value == pytest.approx(0.5, abs=0.1)
    assert estimate.further.value > 0.95
    assert estimate.expected_tokens(4) > 2.8 > expected_tokens(0.5, 4)
    assert expected_tokens(0.5, 4, further=1.0) == 3.0 and expected_tokens(0.7, 0, 0.9) == 1.0


def test_acceptance_is_kept_apart_per_evidence_and_new_requests_start_from_the_pool():
    pool = AcceptanceByEvidence.pooled()
    first = AcceptanceByEvidence(pool)
    for _ in range(10):
        first.update(4, 4, evidence=3)  # long matches: always right
        first.update(4, 0, evidence=1)  # one-token matches: always wrong
    assert first[3].expected_tokens(4) > 4.0 and first[1].expected_tokens(4) < 1.5
    later = AcceptanceByEvidence(pool)  # the next request: no evidence of its own yet
    assert later[3].first.value > 0.9 > Acceptance.PRIOR_FIRST
    assert later[1].first.value < 0.2
    assert AcceptanceByEvidence()[1].first.value == pytest.approx(Acceptance.PRIOR_FIRST)  # no pool: the prior


def test_ngram_drafts_carry_the_matched_n():
    proposer = NGramProposer(1, 3)
    assert proposer.propose([5, 6, 7, 8, 5, 6, 7], 2).evidence == 3  # 5 6 7 recurs
    assert proposer.propose([1, 2, 9, 3, 4, 9], 2).evidence == 1  # only 9 recurs
    empty = proposer.propose([1, 2, 3], 2)
    assert empty.tokens == [] and empty.evidence == 0


def test_draft_length_follows_the_evidence_of_the_draft_at_hand(loaded):
    """The same requests draft fully where their drafts rest on evidence that has been right, and not at all
    where it has been wrong."""
    batch = BatchEngine(Engine(loaded("llama"), NGramMethod(1, 3), 4), max_batch_size=4)
    seqs = [batch.add(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in PROMPTS[:2]]
    while not all(seq in batch.policy.draft_length.shadows for seq in seqs):
        batch.step()
    batch.policy.costs.seconds = list(CPU_LIKE_COSTS)
    for seq in seqs:
        for _ in range(10):
            batch.policy.draft_length.acceptance[seq].update(4, 4, evidence="sure")
            batch.policy.draft_length.acceptance[seq].update(4, 0, evidence="unsure")
    for evidence, want in (("sure", 4), ("unsure", 0)):
        for seq in seqs:
            chain = Chain(seq.pending[0], [1, 2, 3, 4])
            batch.policy.draft_length.shadows[seq] = [ShadowDraft(len(seq.context), chain, evidence)]
        assert batch.policy.draft_length.choose(seqs) == want, evidence


@pytest.mark.parametrize("method", ["ngram", "draft_target"])
def test_offline_engine_with_adaptive_draft_length_equals_plain(loaded, method):
    """Engine.generate with adaptive_draft_len runs each request through a one-row batch engine: greedy outputs
    equal plain decoding's, request after request, and a stream left early frees its row."""
    target = loaded("qwen3")
    spec = {"ngram": NGramMethod(1, 3),
            "draft_target": DraftModelMethod(loaded("qwen3", 1).model, target.model.spec.vocab_size)}[method]
    plain, adaptive = Engine(target), Engine(target, spec, 4, adaptive_draft_len=True)
    for prompt in PROMPTS[:4]:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        assert adaptive.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids, prompt
    stream = adaptive.stream(PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True))
    next(stream)
    assert adaptive._solo_batch.active == 1
    stream.close()
    assert adaptive._solo_batch.active == 0 and not adaptive._solo_batch.has_work()
    assert adaptive._solo_batch.policy.draft_length.pooled.by_evidence  # learnt from the requests so far
    adaptive.forget_requests()
    assert not adaptive._solo_batch.policy.draft_length.pooled.by_evidence


# ---- the KV cache grows with use ------------------------------------------------------------------------------------


def test_cache_grows_with_a_request_and_is_released_when_it_ends(loaded):
    engine = Engine(loaded("llama"), NGramMethod(1, 3), 4)
    batch = BatchEngine(engine, max_batch_size=8)
    assert batch.cache.nbytes == 0  # idle: nothing held
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    seq = batch.add(PROMPTS[0], params)
    capacities = []
    while batch.has_work():
        batch.step()
        capacities.append(batch.cache.capacity)
        assert batch.cache.batch <= 1
    assert capacities[0] == 256 and 256 < max(capacities) <= engine.max_model_len + engine.draft_slots
    assert capacities == sorted(capacities[:-1]) + [0]  # grew, then was released at the end
    assert batch.cache.nbytes == 0
    assert seq.stops.output == engine.generate(PROMPTS[0], params).token_ids


def test_cancel_releases_the_cache(loaded):
    batch = BatchEngine(Engine(loaded("llama")), max_batch_size=4)
    seqs = [batch.add(p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in PROMPTS[:3]]
    for _ in range(5):
        batch.step()
    assert batch.active == 3 and batch.cache.batch >= 3
    held = batch.cache.nbytes
    batch.cancel(seqs[0])
    batch.cancel(seqs[1])
    assert batch.active == 1 and batch.cache.nbytes < held
    batch.cancel(seqs[2])
    assert batch.cache.nbytes == 0 and not batch.has_work()


def test_a_request_near_the_full_context(loaded):
    target = loaded("llama")
    engine = Engine(target, NGramMethod(1, 3), 4)
    prompt_len = len(target.tokenizer(PROMPTS[1]).input_ids)
    params = SamplingParams(max_tokens=engine.max_model_len - prompt_len, ignore_eos=True)
    want = engine.generate(PROMPTS[1], params).token_ids
    short = SamplingParams(max_tokens=20, ignore_eos=True)
    results = run_batched(BatchEngine(engine, max_batch_size=3),
                          [(PROMPTS[0], short), (PROMPTS[1], params), (PROMPTS[2], short)])
    assert len(results[1].token_ids) == params.max_tokens and results[1].token_ids == want
    assert results[0].token_ids == engine.generate(PROMPTS[0], short).token_ids
