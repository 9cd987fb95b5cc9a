"""TP = 2 over gloo (a second rank spawned on this host) equals TP = 1 in float32, and speculation under TP = 2
(n-gram, EAGLE-1 drafting through the sharded lm_head, EAGLE-3) equals plain decoding at TP = 2, alone and in a
continuous batch whose rows move, grow and take long prompts prefilled in caches of their own."""

from __future__ import annotations

import pytest
import torch

from specserve.config import DeploymentConfig, ModelConfig, SpeculativeConfig, build_engine
from specserve.engine.batch import BatchEngine
from specserve.engine.engine import Engine
from specserve.models.kv_cache import KVCache
from specserve.parallel.launch import load_tensor_parallel
from specserve.parallel.model import ShardedKVCache, TensorParallelModel
from specserve.speculative.sampling import SamplingParams
from tests.speculative.test_eagle import save_random

PROMPTS = ["def fibonacci(n):", "Once upon a time", "The quick brown fox jumps over the lazy dog. The lazy"]
LONG = "The quick brown fox jumps over the lazy dog. " * 12  # > 64 tokens: prefilled in chunks


@pytest.fixture(scope="module")
def tp2(gemma_kv1):
    target = load_tensor_parallel(gemma_kv1, "float32", None, 2)
    yield target
    target.model.close()
    assert all(p.exitcode == 0 for p in target.model.processes)  # the other rank left cleanly


def engine(target, method: str = "ar", head=None, max_draft_len: int = 4, **settings) -> Engine:
    spec = SpeculativeConfig(method, max_draft_len, None if head is None else str(head), False, settings)
    return build_engine(DeploymentConfig(ModelConfig(str(target.path)), speculative=spec), target)


def test_the_target_is_sharded(tp2):
    model = tp2.model
    assert isinstance(model, TensorParallelModel) and model.tensor_parallel_size == 2
    local = model.local.spec
    assert (model.spec.num_heads, model.spec.num_kv_heads) == (4, 1)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)  # the KV head replicated
    assert model.local.lm_head_shard.weight.shape[0] == model.spec.vocab_size // 2
    assert isinstance(KVCache.for_model(model, 1, 16), ShardedKVCache)


def test_logits_equal_tp1_in_float32(tp2, gemma_kv1_fp32):
    tokens = torch.tensor([[5, 17, 99, 3, 250, 7, 61, 12]])
    positions = torch.arange(tokens.shape[1])[None]
    outputs = []
    for target in (gemma_kv1_fp32, tp2):
        cache = KVCache.for_model(target.model, 1, 32)
        outputs.append(target.model(tokens, positions, cache, positions, output_layers=(0, -1)))
    one, two = outputs
    assert two.logits.shape == one.logits.shape
    torch.testing.assert_close(two.logits, one.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(two.hidden_states[-1], one.hidden_states[-1], rtol=1e-4, atol=1e-4)
    assert torch.equal(two.logits.argmax(-1), one.logits.argmax(-1))


def test_greedy_output_equals_tp1(tp2, gemma_kv1_fp32):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in PROMPTS + [LONG]:
        want = Engine(gemma_kv1_fp32).generate(prompt, params)
        got = Engine(tp2).generate(prompt, params)
        assert got.token_ids == want.token_ids and got.text == want.text, prompt


@pytest.mark.parametrize("method,settings", [
    ("ngram", {"prompt_lookup_min": 1, "prompt_lookup_max": 3}),
    ("eagle", {"eagle_choices": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}),  # drafts through the sharded lm_head
    ("eagle3", {"top_k": 3, "max_total_draft_tokens": 10}),
])
def test_speculation_equals_plain_decoding_under_tp2(tp2, tmp_path, method, settings):
    head = None
    if method.startswith("eagle"):
        head = save_random(tp2, "eagle3" if method == "eagle3" else "eagle", tmp_path / "head")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain, speculative = engine(tp2), engine(tp2, method, head, 3, **settings)
    drafted = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt, params)
        got = speculative.generate(prompt, params)
        assert got.token_ids == want.token_ids, (method, prompt)
        drafted += got.metrics.total_draft_tokens
    assert drafted > 0


def test_continuous_batch_under_tp2_equals_alone(tp2):
    """Rows join, leave (the last row moves into the freed one), grow the cache, and a long prompt prefilled in
    its own cache is copied in: every change is replayed on the other rank."""
    speculative = engine(tp2, "ngram", None, 3, prompt_lookup_min=1, prompt_lookup_max=3)
    assert len(tp2.tokenizer(LONG).input_ids) > 64  # prefilled chunk by chunk in a cache of its own
    prompts = PROMPTS + [LONG, "Once upon a time there was"]
    lengths = [12, 30, 8, 20, 16]
    want = [engine(tp2).generate(p, SamplingParams(max_tokens=n, ignore_eos=True)).token_ids
            for p, n in zip(prompts, lengths)]
    batch = BatchEngine(speculative, max_batch_size=4, adaptive_draft=False)
    seqs = [batch.add(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
    results = {}
    while batch.has_work():
        for seq, event in batch.step():
            assert not isinstance(event, Exception), event
            if event.result is not None:
                results[seq] = event.result.token_ids
    assert [results[seq] for seq in seqs] == want
