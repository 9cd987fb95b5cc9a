"""Statistical losslessness of speculative sampling, and a deliberately broken verifier that must fail it.

Bound: for N samples over V outcomes, P(||p_hat - p||_1 > eps) <= 2^V exp(-N eps^2 / 2), so with probability
1 - delta the total variation is below sqrt(2 (V ln 2 + ln(1/delta)) / N) / 2.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

import specserve.speculative.verify as verify_module
from specserve.engine.batch import BatchEngine
from specserve.engine.engine import Engine
from specserve.models.kv_cache import KVCache
from specserve.speculative.draft_model import DraftModelMethod
from specserve.speculative.sampling import SamplingParams, probabilities, sample
from specserve.speculative.tree import Chain
from specserve.speculative.verify import verify

DELTA = 1e-4


def tv_bound(outcomes: int, samples: int) -> float:
    return math.sqrt(2 * (outcomes * math.log(2) + math.log(1 / DELTA)) / samples) / 2


def total_variation(counts: Counter, expected: dict, samples: int) -> float:
    keys = set(counts) | set(expected)
    return 0.5 * sum(abs(counts.get(k, 0) / samples - expected.get(k, 0.0)) for k in keys)


def follows(counts: Counter, expected: dict) -> bool:
    """Whether sampled outcome counts are within the bound of the distribution `expected`."""
    n = sum(counts.values())
    return total_variation(counts, expected, n) < tv_bound(len(expected), n)


def broken_residual(p, q):
    return p  # resamples from p instead of norm(max(0, p - q)): biased towards the draft


def break_the_verifier(monkeypatch) -> None:
    """The control: after a rejection, resample from p itself, for sampled drafts (q) and deterministic ones."""
    monkeypatch.setattr(verify_module, "residual_distribution", broken_residual)
    monkeypatch.setattr(verify_module, "without_token", lambda p, token: p)


def chain_statistics(deterministic: bool, samples: int = 20000):
    """Verify drafts of a K=3 chain with prefix-independent target rows p_i and draft rows q_i (V=6)."""
    gen = torch.Generator().manual_seed(0)
    vocab, k = 6, 3
    p_logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
    q_logits = torch.randn(k, vocab, generator=gen) * 1.5
    params = SamplingParams(temperature=1.0)
    p, q = probabilities(p_logits, params), probabilities(q_logits, params)
    first, second = Counter(), Counter()
    for _ in range(samples):
        draft = [int(t) for t in sample(q, gen)]
        if deterministic:  # an n-gram-like fixed draft: the likeliest tokens, so some get accepted
            draft = p[:k].argmax(-1).tolist()
        verdict = verify(Chain(0, draft), p_logits, params, gen, None if deterministic else q)
        first[verdict.tokens[0]] += 1
        if verdict.accepted >= 1:
            second[verdict.tokens[1]] += 1
    return p, first, second


@pytest.mark.parametrize("deterministic", [False, True])
def test_chain_verifier_keeps_target_distribution(deterministic):
    p, first, second = chain_statistics(deterministic)
    n_first, n_second = sum(first.values()), sum(second.values())
    assert n_second > 1000
    assert total_variation(first, dict(enumerate(p[0].tolist())), n_first) < tv_bound(6, n_first)
    assert total_variation(second, dict(enumerate(p[1].tolist())), n_second) < tv_bound(6, n_second)


def test_broken_verifier_fails_the_same_test(monkeypatch):
    break_the_verifier(monkeypatch)
    p, first, _ = chain_statistics(False)
    n = sum(first.values())
    assert total_variation(first, dict(enumerate(p[0].tolist())), n) > tv_bound(6, n)


def exact_joint(target, prompt_ids: list[int], params: SamplingParams, length: int) -> dict:
    """P(first `length` generated tokens) under the target alone, by enumerating its top-k support."""
    def dist(ids):
        cache = KVCache.for_model(target.model, 1, len(ids) + 1)
        pos = torch.arange(len(ids))[None]
        return probabilities(target.model(torch.tensor([ids]), pos, cache, pos).logits[0, -1:], params)[0]

    joint = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, prob in joint.items():
            d = dist(prompt_ids + list(prefix))
            for token in d.nonzero().flatten().tolist():
                grown[prefix + (token,)] = prob * float(d[token])
        joint = grown
    return joint


def perturbed_copy(model, scale: float):
    """A draft that agrees with the target often but not always, so rejections and resampling both happen."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale * param.std())
    return draft


def seeded_outputs(engine: Engine, prompt_ids: list[int], params: SamplingParams, samples: int,
                   width: int = 16) -> Counter:
    """Counts of the generated token tuples of `samples` requests seeded 0..samples-1, `width` at a time through
    one batch: each request draws from its own seeded generator, so a request samples as it would alone (1.8x
    faster than one after the other on the tiny test models)."""
    batch = BatchEngine(engine, width, adaptive_draft=False)
    requests = [batch.add(prompt_ids, replace(params, seed=seed)) for seed in range(samples)]
    outputs = {}
    while batch.has_work():
        for seq, event in batch.step():
            if isinstance(event, Exception):
                raise event
            if event.result is not None:
                outputs[id(seq)] = tuple(event.result.token_ids)
    return Counter(outputs[id(seq)] for seq in requests)


def sample_three_tokens(engine: Engine, samples: int = 2500):
    """Counts of the first three generated tokens over `samples` seeds, and their exact target probabilities."""
    prompt_ids = engine.encode("Once upon a time")
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    return seeded_outputs(engine, prompt_ids, params, samples), exact_joint(engine.target, prompt_ids, params, 3)


def engine_statistics(loaded):
    target = loaded("llama")
    draft = perturbed_copy(target.model, 0.5)
    return sample_three_tokens(Engine(target, DraftModelMethod(draft, target.model.spec.vocab_size), 3))


def test_engine_sampling_keeps_target_distribution(loaded):
    counts, expected = engine_statistics(loaded)
    assert follows(counts, expected)


def test_engine_with_broken_verifier_fails(loaded, monkeypatch):
    break_the_verifier(monkeypatch)
    counts, expected = engine_statistics(loaded)
    assert not follows(counts, expected)


def test_engine_sampling_keeps_a_quantized_target_distribution(checkpoint, loaded):
    """The same test with an int4 target (the packed kernel) and a dense perturbed draft."""
    from specserve.models.loader import load_model

    target = load_model(checkpoint("llama"), dtype=torch.float32, quantization="int4")
    draft = perturbed_copy(loaded("llama").model, 0.5)
    counts, expected = sample_three_tokens(Engine(target, DraftModelMethod(draft, target.model.spec.vocab_size), 3))
    assert follows(counts, expected)
