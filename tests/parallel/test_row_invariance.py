"""Under TP = 2 on the bf16 row-invariant kernels, a token's logits do not depend on how many tokens share the
forward (1..64 rows: the all-reduce of partial sums must keep the kernels' row invariance), so speculation stays
exactly plain decoding."""

from __future__ import annotations

import pytest
import torch

from specserve.config import DeploymentConfig, ModelConfig, SpeculativeConfig, build_engine
from specserve.models.kernel_forward import kernel_plan
from specserve.models.kv_cache import KVCache
from specserve.parallel.launch import load_tensor_parallel
from specserve.speculative.sampling import SamplingParams
from tests.models.reference_layer_loop import use_loop


@pytest.fixture(scope="module")
def tp2_bf16(gemma_kv1):
    target = load_tensor_parallel(gemma_kv1, "bfloat16", None, 2)
    assert target.model.kernels_usable
    yield target
    target.model.close()


def test_rows_1_to_64_give_the_same_logits_bit_for_bit(tp2_bf16):
    model = tp2_bf16.model
    tokens = torch.randint(0, model.spec.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(64)[None]

    def logits(rows: int) -> torch.Tensor:
        cache = KVCache.for_model(model, 1, 64)
        return model(tokens[:, :rows], positions[:, :rows], cache, positions[:, :rows]).logits[0]

    every = logits(64)
    for rows in range(1, 64):
        assert torch.equal(logits(rows), every[:rows]), rows


def test_cpp_layer_loop_reduces_as_the_python_loop(tp2_bf16, monkeypatch):
    """Rank 0's C++ layer loop, which calls the all-reduce between its kernels, gives the reference loop's bits."""
    model = tp2_bf16.model
    assert kernel_plan(model.local).reduce is not None
    tokens = torch.randint(0, model.spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(9)[None].expand(2, -1)

    def forward(loop: str):
        use_loop(monkeypatch, loop)
        cache = KVCache.for_model(model, 2, 16)
        return model(tokens, positions, cache, positions, output_layers=(0, -1))

    cpp, python = forward("cpp"), forward("python")
    assert torch.equal(cpp.logits, python.logits)
    assert all(torch.equal(cpp.hidden_states[i], python.hidden_states[i]) for i in (0, -1))


def test_ngram_equals_plain_decoding_on_the_kernels(tp2_bf16):
    def engine(method: str):
        spec = SpeculativeConfig(method, 4, None, False, {"prompt_lookup_min": 1, "prompt_lookup_max": 3})
        return build_engine(DeploymentConfig(ModelConfig(str(tp2_bf16.path)), speculative=spec), tp2_bf16)

    plain, ngram = engine("ar"), engine("ngram")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    drafted = 0
    for prompt in ["The quick brown fox jumps over the lazy dog. The lazy", "def add(a, b):\n    return a + b\n"]:
        got = ngram.generate(prompt, params)
        assert got.token_ids == plain.generate(prompt, params).token_ids, prompt
        drafted += got.metrics.total_draft_tokens
    assert drafted > 0
