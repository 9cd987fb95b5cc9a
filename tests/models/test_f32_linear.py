"""The AVX2 fp32 linear kernel: accurate, bit-exact whatever the other rows, and lossless inside the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.engine.engine import Engine
from specserve.models import cpu_kernels as ck
from specserve.models import transformer
from specserve.speculative.ngram import NGramMethod
from specserve.speculative.sampling import SamplingParams

if not ck.f32_linear_available():
    pytest.skip("the fp32 linear is in the AVX2 and later variants; this CPU runs none", allow_module_level=True)


@pytest.mark.parametrize("k, n", [(640, 1000), (64, 384), (37, 11), (8, 3), (5, 2)])
def test_matches_a_float64_reference_and_each_row_alone(k, n):
    gen = torch.Generator().manual_seed(k * n)
    x, w, bias = torch.randn(9, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    for b in (None, bias):
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        for rows in (1, 2, 4, 5, 8, 9):
            y = ck.f32_linear(x[:rows], w, b)
            assert y.dtype == torch.float32 and y.shape == (rows, n)
            torch.testing.assert_close(y.double(), ref[:rows], rtol=1e-5, atol=1e-4)
            alone = torch.cat([ck.f32_linear(x[i: i + 1], w, b) for i in range(rows)])
            assert torch.equal(y, alone)  # row m never depends on the other rows


def test_batched_leading_dims_are_kept():
    x, w = torch.randn(2, 3, 16), torch.randn(7, 16)
    assert torch.equal(ck.f32_linear(x, w), ck.f32_linear(x.reshape(6, 16), w).view(2, 3, 7))


def test_engine_with_the_kernel_head_is_lossless(loaded, monkeypatch):
    monkeypatch.setattr(transformer, "F32_KERNEL_MIN_WEIGHTS", 0)  # the tiny model's linears take the kernel
    target = loaded("gemma3")
    calls = []
    real = ck.f32_linear
    monkeypatch.setattr(ck, "f32_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    params = SamplingParams(max_tokens=32)
    for prompt in ("def fibonacci(n):", "Once upon a time"):
        want = Engine(target).generate(prompt, params)
        got = Engine(target, NGramMethod(1, 3), 4).generate(prompt, params)
        assert got.token_ids == want.token_ids and got.metrics.total_draft_tokens > 0
    assert calls
