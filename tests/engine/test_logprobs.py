"""Log-probabilities of output and prompt tokens: those of a direct forward of the model, and the same with and
without speculation (row-invariant logits, each row's distribution computed alone)."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.engine.sequence import PREFILL_CHUNK
from specserve.models.kv_cache import KVCache
from specserve.models.loader import load_model
from specserve.speculative.ngram import NGramMethod
from specserve.speculative.sampling import SamplingParams, probabilities
from tests.engine.test_batching import ScriptedMethod

PROMPT = "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n\ndef"


@pytest.fixture(scope="module")
def target(checkpoint):
    """A bf16 model on the row-invariant kernels: a token's logits do not depend on the rows beside it."""
    loaded = load_model(checkpoint("llama"), dtype=torch.bfloat16)
    assert loaded.model.kernels_usable
    return loaded


def direct_logits(model, ids: list[int]) -> torch.Tensor:
    """The model's logits [len(ids), V] at every position: plain forwards of PREFILL_CHUNK tokens."""
    cache, out = KVCache.for_model(model, 1, len(ids)), []
    for start in range(0, len(ids), PREFILL_CHUNK):
        chunk = ids[start:start + PREFILL_CHUNK]
        positions = torch.arange(start, start + len(chunk))[None]
        out.append(model(torch.tensor([chunk]), positions, cache, positions).logits[0])
        cache.lengths[0] = start + len(chunk)
    return torch.cat(out)


def reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1) if params.greedy else torch.log(probabilities(logits, params))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_output_logprobs_are_the_models_with_and_without_speculation(target, temperature):
    params = SamplingParams(max_tokens=24, temperature=temperature, top_p=0.9, seed=3, ignore_eos=True, logprobs=5)
    prompt_ids = target.tokenizer(PROMPT).input_ids
    runs = {"ar": Engine(target).generate(PROMPT, params)}
    # drafts of the plain output (greedy: all accepted, so logits come from draft rows)
    drafts = ScriptedMethod(prompt_ids + runs["ar"].token_ids, 0, target.model.spec.vocab_size)
    runs["drafted"] = Engine(target, drafts, 4).generate(PROMPT, params)
    for name, result in runs.items():
        assert [entry.token for entry in result.logprobs] == result.token_ids, name
        want = reference(direct_logits(target.model, prompt_ids + result.token_ids)[len(prompt_ids) - 1: -1], params)
        got = torch.tensor([entry.logprob for entry in result.logprobs])
        assert torch.allclose(got, want.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0], atol=1e-4), name
        for entry, row in zip(result.logprobs, want):
            assert len(entry.top) == 5
            assert [token for token, _ in entry.top] == row.topk(5).indices.tolist() or \
                torch.allclose(torch.tensor([lp for _, lp in entry.top]), row.topk(5).values, atol=1e-4)
    if temperature == 0.0:  # same tokens: the very same numbers, drafted or not
        ar, drafted = runs["ar"], runs["drafted"]
        assert drafted.token_ids == ar.token_ids and drafted.metrics.total_accepted_draft_tokens > 10
        assert [(e.logprob, e.top) for e in drafted.logprobs] == [(e.logprob, e.top) for e in ar.logprobs]


@pytest.mark.parametrize("repeat", [1, 4])  # one prefill forward; several chunks (PREFILL_CHUNK tokens each)
def test_prompt_logprobs_score_every_prompt_token(target, repeat):
    prompt_ids = target.tokenizer(PROMPT * repeat).input_ids
    assert (len(prompt_ids) > 2 * PREFILL_CHUNK) == (repeat > 1)
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    result = Engine(target, NGramMethod(1, 3), 4).generate(prompt_ids, params)
    assert result.token_ids == [] and result.finish_reason == "length"
    scored = result.prompt_logprobs
    assert len(scored) == len(prompt_ids) and scored[0] is None
    want = torch.log_softmax(direct_logits(target.model, prompt_ids)[:-1].float(), -1)
    got = torch.tensor([entry.logprob for entry in scored[1:]])
    assert [entry.token for entry in scored[1:]] == prompt_ids[1:]
    assert torch.allclose(got, want.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0], atol=1e-4)


def test_logprob_requests_are_checked():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21).validate()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).validate()
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0).validate()
    SamplingParams(max_tokens=0, prompt_logprobs=0).validate()
