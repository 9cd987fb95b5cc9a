"""The row-invariant CPU kernels: accuracy against float references and bit-exact invariance to batch shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.models import cpu_kernels as ck
from tests.conftest import runnable_kernel_variants


@pytest.fixture(autouse=True, params=runnable_kernel_variants())
def variant(request, monkeypatch):
    """Every test here runs on each kernel variant this CPU runs (scalar, avx2, avx512, amx)."""
    monkeypatch.setenv(ck.ENV, request.param)
    torch.manual_seed(0)
    return request.param


def bf16(*shape):
    return torch.randn(*shape).bfloat16()


# --------------------------------------------------------------------------------------------- small_linear


@pytest.mark.parametrize("k, n", [(640, 256), (1024, 1000), (2048, 2048), (100, 1000), (640, 2048), (33, 256)])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
def test_small_linear_matches_float_reference(k, n, bias_dtype):
    x, w = bf16(5, k), bf16(n, k)
    bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    y32 = ck.small_linear(x, w, bias, out_fp32=True)
    y16 = ck.small_linear(x, w, bias)
    assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16 and y16.shape == (5, n)
    torch.testing.assert_close(y32, ref, rtol=1e-5, atol=1e-3)
    assert torch.equal(y16, y32.bfloat16())  # bf16 output = round to nearest even of the fp32 result


def test_small_linear_keeps_leading_dims():
    x, w = bf16(2, 3, 64), bf16(48, 64)
    y = ck.small_linear(x, w)
    assert y.shape == (2, 3, 48)
    assert torch.equal(y[1, 2], ck.small_linear(x[1, 2], w))


@pytest.mark.parametrize("k, n", [(640, 1000), (99, 70)])
def test_small_linear_rows_are_independent_of_the_batch(k, n):
    x, w = bf16(40, k), bf16(n, k)
    full = ck.small_linear(x, w)
    for m in range(1, 34):
        assert torch.equal(ck.small_linear(x[:m], w), full[:m]), m
    for i in range(40):
        assert torch.equal(ck.small_linear(x[i:i + 1], w)[0], full[i]), i
    other = bf16(40, k)
    other[7] = x[7]
    assert torch.equal(ck.small_linear(other, w)[7], full[7])


def test_head_linears_run_many_rows_on_the_kernel_a_row_at_a_time():
    """A head's Linear over more rows than one kernel call takes (a catch-up after skipped steps): each row is
    what the kernel gives it alone, never PyTorch's bf16 GEMM."""
    from specserve.speculative.eagle import Linear

    layer = Linear(96, 80, bias=False).bfloat16()
    x = bf16(2, 75, 96)  # 150 rows: three calls
    with torch.inference_mode():
        y = layer(x)
    assert y.shape == (2, 75, 80)
    for b, t in ((0, 0), (0, 63), (0, 64), (1, 74)):
        assert torch.equal(y[b, t], ck.small_linear(x[b, t], layer.weight.detach())), (b, t)


# ----------------------------------------------------------------------------------------- decode_attention


def reference_attention(q, k, v, mask, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1) @ v).nan_to_num(0.0)  # rows with no visible key: zeros


def causal_mask(b, t, s):
    """Query i of t new tokens sits at position s - t + i and sees keys up to there."""
    return torch.ones(t, s, dtype=torch.bool).tril(s - t)[None, None].expand(b, 1, t, s)


def cache_views(b, hkv, s, d, capacity=320):
    """Keys/values as the model passes them: [:, :, :s] slices of a larger cache."""
    kc, vc = bf16(b, hkv, capacity, d), bf16(b, hkv, capacity, d)
    return kc[:, :, :s], vc[:, :, :s]


@pytest.mark.parametrize("h, hkv, d", [(4, 1, 256), (8, 2, 64), (6, 2, 80)])
@pytest.mark.parametrize("s", [1, 17, 300])
def test_decode_attention_matches_float_reference(h, hkv, d, s):
    b, t = 2, min(s, 5)
    q = bf16(b, t, h, d).transpose(1, 2)  # [B, H, T, D] view, as the model makes it
    k, v = cache_views(b, hkv, s, d)
    mask = causal_mask(b, t, s) & (torch.rand(b, 1, t, s) > 0.3)
    mask[0, 0, 0] = False  # a row that sees nothing
    scale = d ** -0.5
    out = ck.decode_attention(q, k, v, mask, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (b, h, t, d)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, mask, scale), rtol=8e-3, atol=8e-3)
    assert not out[0, :, 0].any()


@pytest.mark.parametrize("h, hkv, d", [(4, 1, 256), (8, 2, 64)])
def test_decode_attention_row_is_independent_of_t_and_s(h, hkv, d):
    b, t, committed = 2, 8, 41
    s = committed + t
    q = bf16(b, h, t, d)
    k, v = cache_views(b, hkv, s + 20, d)
    mask = causal_mask(b, t, s)
    verify = ck.decode_attention(q, k[:, :, :s], v[:, :, :s], mask, 0.125)  # T = 8
    for i in range(t):
        visible = committed + i + 1
        alone = ck.decode_attention(q[:, :, i:i + 1], k[:, :, :visible], v[:, :, :visible],
                                    torch.ones(b, 1, 1, visible, dtype=torch.bool), 0.125)  # T = 1
        assert torch.equal(alone[:, :, 0], verify[:, :, i]), i
        longer = torch.zeros(b, 1, 1, s + 20, dtype=torch.bool)
        longer[..., :visible] = True  # same keys visible, more masked ones after them
        padded = ck.decode_attention(q[:, :, i:i + 1], k, v, longer, 0.125)
        assert torch.equal(padded[:, :, 0], verify[:, :, i]), i


def test_results_do_not_depend_on_thread_count():
    x, w = bf16(9, 640), bf16(1000, 640)
    # 8 rows: the threads split the rows; one row of a long context: they split its keys, then its head dims
    q, (k, v) = bf16(1, 4, 8, 256), cache_views(1, 1, 300, 256)
    mask = causal_mask(1, 8, 300)
    q_one, (k_long, v_long) = bf16(1, 4, 1, 256), cache_views(1, 1, 1100, 256, capacity=1100)
    mask_long = causal_mask(1, 1, 1100) & (torch.rand(1, 1, 1, 1100) > 0.3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = (ck.small_linear(x, w), ck.decode_attention(q, k, v, mask, 0.0625),
                  ck.decode_attention(q_one, k_long, v_long, mask_long, 0.0625))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(single[0], ck.small_linear(x, w))
    assert torch.equal(single[1], ck.decode_attention(q, k, v, mask, 0.0625))
    assert torch.equal(single[2], ck.decode_attention(q_one, k_long, v_long, mask_long, 0.0625))


def test_decode_attention_rejects_head_dims_off_16():
    q, k = bf16(1, 2, 1, 40), bf16(1, 1, 3, 40)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ck.decode_attention(q, k, k, torch.ones(1, 1, 1, 3, dtype=torch.bool), 1.0)


def test_the_variant_asked_for_is_the_one_that_runs(variant):
    assert ck.available()
    want = {"scalar": "scalar", "avx2": "avx2_fma", "avx512": "avx512f", "amx": "avx512f"}[variant]
    assert ck.variant().endswith(f"decode_attention: {want}")


@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_matches_the_model_norm_and_is_row_invariant(gemma):
    from specserve.models.transformer import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(640, 1e-6, gemma)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(12, 640) * 3).bfloat16()
    got = ck.rms_norm(x, norm.kernel_weight(), norm.eps, gemma)
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)
    want = (h * (1 + norm.weight)).bfloat16() if gemma else norm.weight.bfloat16() * h.bfloat16()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    for i in range(12):
        assert torch.equal(ck.rms_norm(x[i:i + 1], norm.kernel_weight(), norm.eps, gemma)[0], got[i])


@pytest.fixture()
def scalar_build():
    """The scalar variant of the kernels, next to the one under test."""
    return ck.extension().scalar


@pytest.mark.parametrize("d", [640, 256, 40, 17])
def test_norm_glue_is_bit_identical_on_the_scalar_path(scalar_build, d):
    """rms_norm, residual_norm and rope_store's q/k norms and rope: the vector paths (AVX2, also in AVX-512
    builds) sum and round as the scalar path does, tails included."""
    x, y = (torch.randn(6, d) * 3).bfloat16(), torch.randn(6, d).bfloat16()
    w, post = torch.randn(d), torch.randn(d)
    for gemma in (True, False):
        assert torch.equal(ck.rms_norm(x, w, 1e-6, gemma), scalar_build.rms_norm(x, w, 1e-6, gemma))
        for p in (post, None):
            got = ck.residual_norm(x, y, p, w, 1e-6, gemma)
            want = scalar_build.residual_norm(x, y, p, w, 1e-6, gemma)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    if d % 2:
        return
    b, t, h = 2, 3, 2
    q, k, v = torch.randn(b, t, h * d).bfloat16(), torch.randn(b, t, d).bfloat16(), torch.randn(b, t, d).bfloat16()
    angles = torch.randn(b, t, d)
    slots = torch.tensor([[0, 1, 2], [3, 4, 5]])
    outs = []
    for build in (ck._load(), scalar_build):
        keys, values = torch.zeros(b, 1, 8, d).bfloat16(), torch.zeros(b, 1, 8, d).bfloat16()
        rotated = build.rope_store(q, k, v, w, post, 1e-6, True, angles.cos().bfloat16(), angles.sin().bfloat16(),
                                   keys, values, slots)
        outs.append((rotated, keys, values))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("k, n", [(640, 70), (1920, 33), (100, 9), (33, 5)])
def test_small_linear_is_bit_identical_on_the_scalar_path(scalar_build, variant, k, n):
    """The vector tiles (AVX2's blocked pairs, AVX512-BF16's VDPBF16PS) add the same products in the same order
    as the scalar model, for every row count a tile edge can leave and K off the 32-element step."""
    if variant == "amx":  # its rows stay independent of the batch (the test above), which is what decoding needs
        pytest.skip("TDPBF16PS adds a tile row's 16 pairs in an order of its own that no scalar order reproduces")
    x, w = bf16(9, k), bf16(n, k)
    for m in range(1, 10):
        assert torch.equal(ck.small_linear(x[:m], w, out_fp32=True),
                           scalar_build.small_linear(x[:m].contiguous(), w, None, True)), m


def test_argmax_is_torch_argmax_with_ties_nans_and_infinities():
    for shape in [(1, 262144), (5, 1000), (3, 17), (2, 1), (2, 3, 40)]:
        x = torch.randn(*shape)
        assert torch.equal(ck.argmax(x), x.argmax(-1)), shape
    x = torch.randn(5, 100)
    x[0, 10] = x[0, 90] = x[0, 20] = 1e9  # ties: the first index
    x[1, 70] = x[1, 50] = float("nan")  # a NaN wins, the first one
    x[2] = float("-inf")
    x[3, 99] = float("inf")  # in the tail lanes
    x[4] = 0.0
    assert torch.equal(ck.argmax(x), x.argmax(-1))
    assert ck.argmax(x).tolist() == [10, 50, 0, 99, 0]


def test_argmax_over_its_four_chains_and_tail():
    """The kernel keeps four chains of 16 lanes (64 values a pass) and a tail: the first index of the maximum,
    wherever its ties sit among chains, lanes and the tail."""
    generator = torch.Generator().manual_seed(0)
    for n in (1, 15, 16, 63, 64, 65, 127, 128, 200, 262144 + 7):
        x = torch.randn(8, n, generator=generator)
        for row, picks in enumerate([(n - 1,), (0, n - 1), (n // 2, n // 3), (n // 4, n // 2, n - 1)]):
            x[row, list(picks)] = 1e9  # ties in other chains, lanes or the tail
        x[4] = float("-inf")
        x[5, n // 2:] = float("nan")
        x[6] = 0.0
        x[7] = -0.0
        x[7, n - 1] = 0.0  # equal to -0.0: the first index still
        assert torch.equal(ck.argmax(x), x.argmax(-1)), n


@pytest.mark.parametrize("caller_flushes", [False, True])
def test_every_thread_computes_with_denormals_flushed(caller_flushes):
    """Kernels compute in one floating-point mode on every thread, whatever the calling thread's: a denormal input
    reads as zero (the model's loading thread flushes denormals; OpenMP workers may not), so a row cannot round
    one way alone and another in a batch that splits it onto another thread."""
    # bf16 bits 0x000b: exponent 0, mantissa 11, ~1e-39 (built from bits: a flushing thread would make it 0)
    x = torch.full((200, 64), 0x000B, dtype=torch.int16).view(torch.bfloat16)
    torch.set_flush_denormal(caller_flushes)
    try:
        for rows in (1, 3, 200):  # x * rsqrt(mean(x^2) + eps) would be ~1e-36, a normal number, were x read as is
            assert torch.count_nonzero(ck.rms_norm(x[:rows], torch.ones(64), 1e-6, False)) == 0
    finally:
        torch.set_flush_denormal(True)  # as a loaded model leaves it


def test_auto_dtype_is_bf16_wherever_the_row_invariant_kernels_run():
    """fp32 runs PyTorch's attention, whose rows change with the forward's shape: speculation would not be exact."""
    from specserve.models.loader import default_dtype

    assert default_dtype("cpu") == torch.bfloat16
