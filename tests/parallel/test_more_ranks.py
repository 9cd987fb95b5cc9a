"""Four ranks (the KV head replicated on all of them) sum their partials by an all-gather in rank order, so rows
1..64 stay bit-identical and speculation stays plain decoding; and the embedded default (GGUF blocks, split on
their packed tiles and blocks) under TP = 2 speculates exactly."""

from __future__ import annotations

import pytest
import torch

from specserve.config import DeploymentConfig, ModelConfig, SpeculativeConfig, build_engine
from specserve.engine.engine import Engine
from specserve.models.kv_cache import KVCache
from specserve.parallel.launch import load_tensor_parallel
from specserve.speculative.sampling import SamplingParams

NGRAM = {"prompt_lookup_min": 1, "prompt_lookup_max": 3}


def ngram_equals_plain(target, prompts: list[str], max_tokens: int) -> None:
    spec = SpeculativeConfig("ngram", 4, None, False, NGRAM)
    ngram = build_engine(DeploymentConfig(ModelConfig(str(target.path)), speculative=spec), target)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    drafted = 0
    for prompt in prompts:
        got = ngram.generate(prompt, params)
        assert got.token_ids == Engine(target).generate(prompt, params).token_ids, prompt
        drafted += got.metrics.total_draft_tokens
    assert drafted > 0


def test_four_ranks_stay_row_invariant_and_exact(gemma_kv1):
    target = load_tensor_parallel(gemma_kv1, "bfloat16", None, 4)
    model = target.model
    try:
        assert model.local.spec.num_kv_heads == 1 and model.local.spec.num_heads == 1
        tokens = torch.randint(0, model.spec.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(64)[None]

        def logits(rows: int) -> torch.Tensor:
            cache = KVCache.for_model(model, 1, 64)
            return model(tokens[:, :rows], positions[:, :rows], cache, positions[:, :rows]).logits[0]

        every = logits(64)
        for rows in (1, 2, 3, 5, 8, 13, 21, 34, 63):
            assert torch.equal(logits(rows), every[:rows]), rows
        ngram_equals_plain(target, ["The quick brown fox jumps over the lazy dog. The lazy"], 24)
    finally:
        model.close()
    assert all(process.exitcode == 0 for process in model.processes)


@pytest.mark.slow
def test_the_embedded_default_speculates_exactly_under_tp2():
    target = load_tensor_parallel("gemma-3-270m", None, None, 2)
    try:
        assert target.model.quantization == "gguf"
        ngram_equals_plain(target, ["What is ML? ML is machine learning. What is ML?"], 24)
    finally:
        target.model.close()
