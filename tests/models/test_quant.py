"""Quantized weights: GGUF block decoding, the packed kernel on every ISA path this CPU runs, and losslessness."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file, save_file

from specserve.engine.engine import Engine
from specserve.models import cpu_kernels, huge_pages, quant
from specserve.models.gguf_convert import llama_row_order
from specserve.models.huge_pages import huge_pages_available, read_safetensors
from specserve.models.loader import ModelLoadError, load_model
from specserve.speculative.draft_model import DraftModelMethod
from specserve.speculative.ngram import NGramMethod
from specserve.speculative.sampling import SamplingParams
from tests.conftest import runnable_kernel_variants

# fp16 fields (byte offsets) of each block: random bytes elsewhere are valid codes
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}
FORMATS = [*quant.GGUF_TYPES, "int8", "int4"]


def isa_paths() -> list[str]:
    """The kernels variants this CPU runs whose quantized paths differ (amx runs avx512's), slowest first: each is
    chosen with SPECSERVE_KERNELS, and its packed linears run its own path."""
    return [name for name in runnable_kernel_variants() if name != "amx"]


def random_gguf(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of a GGUF type (uint8 [rows, bytes per row]) with sane fp16 scales."""
    _, _, _, block_bytes, per_block = quant._FORMATS[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // per_block, block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[kind]:
        scale = (rng.random((rows, cols // per_block)) * 0.02 + 1e-3).astype(np.float16)
        blocks[..., offset:offset + 2] = scale[..., None].view(np.uint8).reshape(rows, cols // per_block, 2)
    return blocks.reshape(rows, -1)


def packed_weight(kind: str, rows: int = 80, cols: int = 512, seed: int = 0):
    """(packed weight, its exact dense values) of a GGUF type, or of int8 / int4 quantization."""
    if kind in quant.GGUF_TYPES:
        raw = random_gguf(kind, rows, cols, seed)
        dense = quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols)
        return quant.PackedWeight.from_codes(quant.decode_gguf(kind, raw, (rows, cols))), torch.from_numpy(dense)
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    packed = quant.PackedWeight.from_codes(quant.quantize_dense(weight, kind))
    return packed, packed.dequantize()


@pytest.mark.parametrize("kind", quant.GGUF_TYPES)
def test_gguf_blocks_decode_to_gguf_py_values(kind):
    """Every type exactly: its f16 scales as they are, and a K-quant's d * sc (and dmin * m) formed from its
    super-block's fp16 d and integer sc, which the packed layout keeps as they are (1 byte a block, not 2)."""
    raw = random_gguf(kind, 35, 512, seed=1)  # 35 rows: a partial last tile
    expected = quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(35, 512)
    packed = quant.PackedWeight.from_codes(quant.decode_gguf(kind, raw, (35, 512)))
    assert np.array_equal(packed.dequantize().numpy(), expected)
    assert packed.super_blocks == kind.endswith("_K")
    if packed.super_blocks:  # the GGUF's bytes per weight, bar Q4_K / Q5_K's 6-bit sc and m held in bytes
        bytes_per_weight = packed.nbytes / (48 * 512)  # 3 tiles of 16 outputs
        assert bytes_per_weight == {"Q4_K": 18.5, "Q5_K": 22.5, "Q6_K": 26.25}[kind] / 32


@pytest.mark.parametrize("magnitude", [2.0 ** -40, 1e-7, 3e-3, 1.0, 7e4, 2.0 ** 60])
def test_scales_of_any_magnitude_keep_their_precision(magnitude, monkeypatch):
    """Scales are stored as fp16 in a power-of-two unit of the weight's own: the same codes with every scale
    multiplied by a power of two give outputs multiplied by exactly that, on every path, at magnitudes far outside
    fp16's range; fused parts of different units compute what they compute alone."""
    codes = quant.decode_gguf("Q4_0", random_gguf("Q4_0", 32, 256), (32, 256))
    base = quant.PackedWeight.from_codes(codes)
    power = 2.0 ** round(np.log2(magnitude) + 6)  # the scales are ~2^-6: this puts them near `magnitude`
    scaled = quant.PackedWeight.from_codes(quant.Codes(codes.q, codes.scales * np.float32(power), None, codes.bits,
                                                       codes.group, codes.zero, codes.kind))
    assert scaled.unit == base.unit * power
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    for isa in isa_paths():
        monkeypatch.setenv(cpu_kernels.ENV, isa)
        want = base.matmul(x, out_fp32=True).double() * power
        if np.isfinite(want.numpy()).all():
            assert torch.equal(scaled.matmul(x, out_fp32=True).double(), want), isa
    assert torch.equal(scaled.dequantize().double(), base.dequantize().double() * power)
    alone = [base.matmul(x, out_fp32=True), scaled.matmul(x, out_fp32=True)]
    if abs(np.log2(power)) < 12:  # re-expressed in the larger unit, the smaller part's scales stay fp16 normals
        fused = quant.PackedWeight.concat([base, scaled])
        assert torch.equal(fused.matmul(x, out_fp32=True), torch.cat(alone, -1))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_dense_quantization_error_is_bounded(kind):
    weight = torch.randn(64, 256)
    weight[3] = 0.5  # a constant block: zero range must not divide by zero
    got = quant.PackedWeight.from_codes(quant.quantize_dense(weight, kind)).dequantize()
    blocks = weight.reshape(64, 8, 32)
    step = blocks.abs().amax(-1) / 127 if kind == "int8" else (blocks.amax(-1) - blocks.amin(-1)) / 15
    # half a step of the stored scale, which fp16 keeps within 2^-11 of `step`
    assert (got - weight).abs().reshape(64, 8, 32).amax(-1).le(step * 0.5 * (1 + 2 ** -10) + 1e-5).all()
    if kind == "int4":  # its offset holds the constant; int8's scale 0.5 / 127 has no exact fp16 value
        assert torch.equal(got[3], weight[3])


@pytest.mark.parametrize("kind", FORMATS)
def test_kernel_paths_agree_are_row_invariant_and_accurate(kind, monkeypatch):
    packed, dense = packed_weight(kind)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(3))
    reference = x.double() @ dense.double().T
    outputs = {}
    for isa in isa_paths():
        monkeypatch.setenv(cpu_kernels.ENV, isa)
        full = packed.matmul(x, out_fp32=True)
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 64):  # every tile height, each row the same bits
            for start in range(0, 64, rows):
                assert torch.equal(packed.matmul(x[start:start + rows], out_fp32=True), full[start:start + rows])
        outputs[isa] = full
    for isa, out in outputs.items():
        assert torch.equal(out, outputs["scalar"]), isa  # exact integer sums, the same fp32 tail
    error = (outputs["scalar"].double() - reference).norm() / reference.norm()
    assert error < 0.02  # the int8 activation rounding, as llama.cpp's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])  # one activation scale per block of 32, or per super-block
def test_every_path_quantizes_hard_activations_alike(dtype, kind, monkeypatch):
    """The vector paths quantize activations with their own instructions: halfway cases (round to even), zero and
    tiny blocks, mixed magnitudes and a NaN must come out as the scalar path's std::nearbyint makes them."""
    packed, _ = packed_weight(kind, rows=32, cols=256)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(5)) * 3
    x[0, :32] = torch.arange(32) - 15.5  # amax 15.5: halfway codes ... 126.5 / 15.5 * k ...
    x[0, 32:64] = torch.tensor([127.0] + [k + 0.5 for k in range(-15, 16)])  # amax 127: scale 1, exact halves
    x[1, :32] = 0.0  # a zero block: scale 0
    x[1, 32:64] = 1e-39  # denormal in fp32 (flushed), tiny in bf16
    x[2, :32] *= 1e30
    x[3, 21] = float("nan")  # skipped by the block's max, as std::max skips it
    x = x.to(dtype)
    outputs = {}
    for isa in isa_paths():
        monkeypatch.setenv(cpu_kernels.ENV, isa)
        outputs[isa] = packed.matmul(x, out_fp32=True)
    for isa, out in outputs.items():
        torch.testing.assert_close(out, outputs["scalar"], rtol=0, atol=0, equal_nan=True, msg=isa)


def test_kernel_bias_and_dtypes():
    packed, dense = packed_weight("Q4_K", rows=48, cols=256)
    bias = torch.randn(48)
    x = torch.randn(3, 256)
    y32 = packed.matmul(x, bias, out_fp32=True)
    assert torch.equal(y32, packed.matmul(x, out_fp32=True) + bias)
    y16 = packed.matmul(x.to(torch.bfloat16), bias)
    assert y16.dtype == torch.bfloat16 and y16.shape == (3, 48)
    reference = x.to(torch.bfloat16).float() @ dense.T + bias
    assert (y16.float() - reference).norm() / reference.norm() < 0.02


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_bf16_outputs_round_as_torch_does_on_every_path(rows, monkeypatch):
    """The vector paths store whole tiles of bf16 outputs with their own rounding: ties (to even), values that
    round up to infinity, infinities, NaN and denormals must come out as torch rounds the fp32 outputs, in the
    tiles' outputs (40 = two whole tiles and a partial one) and their biases (a zero row outputs the bias)."""
    packed, _ = packed_weight("Q4_0", rows=40, cols=256)
    ties = [0x3F808000, 0x3F818000, 0xBF818000, 0x7F7F8000, 0x7F7FFFFF, 0x00008000, 0x00018000, 0x80007FFF]
    special = [float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.4e38, -3.4e38, 1.0]
    bias = torch.randn(40, generator=torch.Generator().manual_seed(9))
    bias[:8] = torch.tensor(ties, dtype=torch.int64).to(torch.int32).view(torch.float32)
    bias[16:24] = torch.tensor(special)
    bias[32:40] = torch.tensor(special[::-1])
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
    x[0] = 0.0
    for isa in isa_paths():
        monkeypatch.setenv(cpu_kernels.ENV, isa)
        for b in (bias, None):
            want, got = packed.matmul(x, b, out_fp32=True).to(torch.bfloat16), packed.matmul(x, b)
            assert torch.equal(got.isnan(), want.isnan()), isa  # torch's NaN bits differ by path: not compared
            assert torch.equal(got.view(torch.int16)[~got.isnan()], want.view(torch.int16)[~want.isnan()]), isa


def test_fused_weights_compute_what_the_parts_do():
    parts = [packed_weight(kind, rows=rows, cols=256, seed=i)[0]
             for i, (kind, rows) in enumerate([("Q5_0", 64), ("Q5_0", 32), ("Q5_0", 32)])]
    x = torch.randn(4, 256)
    separate = torch.cat([p.matmul(x, out_fp32=True) for p in parts], -1)
    fused = quant.PackedWeight.concat(parts)
    assert torch.equal(fused.matmul(x, out_fp32=True), separate)
    assert torch.equal(torch.cat([p.matmul(x, out_fp32=True) for p in parts], -1), separate)
    assert parts[1].qs.untyped_storage().data_ptr() == fused.qs.untyped_storage().data_ptr()  # views, not copies
    assert quant.PackedWeight.concat([parts[0], packed_weight("Q8_0", rows=32, cols=256)[0]]) is None


def test_a_fused_linear_of_mixed_formats_is_one_call_computing_the_parts():
    """A GGUF's q/k/v may mix formats (Q5_0 q, k and a Q8_0 v): like formats share a weight, the rest ride along;
    a part of 40 outputs (not whole tiles) and biases included."""
    layers = [quant.QuantLinear(packed_weight(kind, rows=rows, cols=256, seed=i)[0], torch.randn(rows))
              for i, (kind, rows) in enumerate([("Q5_0", 64), ("Q5_0", 32), ("Q8_0", 40), ("Q4_K", 32)])]
    fused = quant.FusedQuantLinear(layers)
    assert [w.kind for w in fused.weights] == ["Q5_0", "Q8_0", "Q4_K"]
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(fused(x), torch.cat([layer(x) for layer in layers], -1))


@pytest.mark.parametrize("isa", isa_paths())
def test_outputs_do_not_depend_on_the_threads_that_compute_them(isa, monkeypatch):
    """Long calls share their tiles out as threads come free (quant_linear.cpp's split_items), so the tiles each
    thread computes change from call to call: the outputs may not. A fused call of three formats long enough to be
    shared out (runs cross from one weight to the next), a weight of one tile (fewer tiles than threads), and the
    greedy screen of an lm_head-like weight of over 1024 tiles."""
    monkeypatch.setenv(cpu_kernels.ENV, isa)
    parts = [quant.QuantLinear(packed_weight(kind, rows=rows, cols=64, seed=i)[0])
             for i, (kind, rows) in enumerate([("Q5_0", 10000), ("Q8_0", 7000), ("Q4_0", 72)])]
    fused = quant.FusedQuantLinear(parts)
    single, _ = packed_weight("Q6_K", rows=16, cols=256)
    lm_head, dense = packed_weight("Q8_0", rows=16500, cols=64)
    x64, x256 = (torch.randn(9, cols, generator=torch.Generator().manual_seed(5)).bfloat16() for cols in (64, 256))
    near = dense[torch.arange(0, 16500, 1700)].bfloat16() * 4

    def outputs():
        return [fused(x64), single.matmul(x256, out_fp32=True),
                quant.screen_argmax(near, lm_head, lm_head.greedy_screen())]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = outputs()
        torch.set_num_threads(max(threads, 2))
        for _ in range(3):
            for got, want in zip(outputs(), alone):
                assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], torch.cat([part(x64) for part in parts], -1))
    assert torch.equal(alone[2], lm_head.matmul(near, out_fp32=True).argmax(-1))


def test_packed_weights_cache_round_trip(tmp_path):
    weights = {"a.weight": packed_weight("Q6_K")[0], "b.weight": packed_weight("Q4_1")[0]}
    quant.save_packed(weights, tmp_path / "w.st")
    back = quant.load_packed(tmp_path / "w.st")
    x = torch.randn(2, 512)
    for name, w in weights.items():
        assert torch.equal(back[name].matmul(x, out_fp32=True), w.matmul(x, out_fp32=True))


@pytest.mark.skipif(not huge_pages_available(), reason="no MADV_HUGEPAGE on this system")
def test_safetensors_read_into_huge_pages_equal_the_librarys_reading(tmp_path, monkeypatch):
    tensors = {"codes": torch.randint(0, 255, (3, 5, 7), dtype=torch.uint8), "scales": torch.randn(33).half(),
               "empty": torch.empty(0, 4), "states": torch.randn(6, 4).bfloat16(), "index": torch.arange(5),
               "scalar": torch.tensor(2.5), "large": torch.randn(3000)}
    save_file(tensors, str(tmp_path / "w.st"), metadata={"version": "1"})
    expected = load_file(str(tmp_path / "w.st"))
    for chunk in (64 << 20, 1000):  # 1,000 bytes: "large" comes in 12 reads, spread over the threads
        monkeypatch.setattr(huge_pages, "_CHUNK", chunk)
        read = read_safetensors(tmp_path / "w.st")
        assert sorted(read) == sorted(expected)
        for name, tensor in expected.items():
            assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape
            assert torch.equal(read[name], tensor) and read[name].data_ptr() % 4096 == 0
        spans = sorted((t.data_ptr(), t.numel() * t.element_size()) for t in read.values() if t.numel())
        # one mapping, each tensor on pages of its own, right after the one before
        assert all(b[0] - a[0] == -(-a[1] // 4096) * 4096 for a, b in zip(spans, spans[1:]))
    # the controls: a dtype this reader does not know leaves the file to safetensors; a cut file is an error
    save_file({"eight": torch.zeros(4).to(torch.float8_e4m3fn)}, str(tmp_path / "f8.st"))
    assert read_safetensors(tmp_path / "f8.st") is None
    whole = (tmp_path / "w.st").read_bytes()
    (tmp_path / "cut.st").write_bytes(whole[:-8])
    with pytest.raises(OSError, match="cut short"):
        read_safetensors(tmp_path / "cut.st")


def test_fused_parts_are_cached_once_and_map_back_as_views_of_one_weight(tmp_path):
    """q/k/v fused before the cache is written (Q4_K, Q4_K, Q6_K: the first two fuse, the third rides alone) are
    stored once and come back as views of the fused weight, which FusedQuantLinear then uses without a copy."""
    x = torch.randn(3, 512)
    parts = {f"{n}.weight": packed_weight(kind, rows=64, seed=i)[0]
             for i, (n, kind) in enumerate([("q", "Q4_K"), ("k", "Q4_K"), ("v", "Q6_K")])}
    expected = {name: w.matmul(x, out_fp32=True) for name, w in parts.items()}
    quant.PackedWeight.fuse_runs(list(parts.values()))
    quant.save_packed(parts, tmp_path / "w.st")
    back = quant.load_packed(tmp_path / "w.st")
    q, k, v = back.values()
    assert q.fused_into is not None and q.fused_into[0] is k.fused_into[0] and v.fused_into is None
    whole = q.fused_into[0].qs  # every loaded tensor shares the one huge-page mapping: test the fused weight's bytes
    start, end = whole.data_ptr(), whole.data_ptr() + whole.numel() * whole.element_size()
    assert all(start <= part.qs.data_ptr() < end for part in (q, k)) and not start <= v.qs.data_ptr() < end
    for name, w in back.items():
        assert torch.equal(w.matmul(x, out_fp32=True), expected[name])
    fused = quant.FusedQuantLinear([quant.QuantLinear(w, None) for w in back.values()])
    assert fused.weights[0] is q.fused_into[0] and len(fused.weights) == 2
    assert torch.equal(fused(x.bfloat16()), torch.cat([w.matmul(x.bfloat16()) for w in parts.values()], -1))
    # the control: parts fused in another order are a new weight, not the stored one
    stored = q.fused_into[0]
    assert quant.PackedWeight.concat([k, q]) is not stored


def test_llama_row_order_undoes_llama_cpp_permutation():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(32 * 3).reshape(32, 3)
    expected = LlamaTensorProcessor()._reverse_permute_weights(rows, 4, 4)
    assert np.array_equal(rows[llama_row_order(32, 4)], expected)


def test_bad_quantization_requests_get_clear_errors(checkpoint):
    with pytest.raises(ModelLoadError, match="int8 or int4"):
        load_model(checkpoint("llama"), dtype=torch.float32, quantization="int3")
    with pytest.raises(ModelLoadError, match="needs a GGUF model"):
        load_model(checkpoint("llama"), dtype=torch.float32, quantization="gguf")
    with pytest.raises(ModelLoadError, match="CPU only"):
        load_model(checkpoint("llama"), dtype=torch.float32, quantization="int8", device="cuda")
    with pytest.raises(quant.QuantizationError, match="supported: Q4_0"):
        quant.decode_gguf("Q2_K", np.zeros((1, 84), np.uint8), (1, 256))
    with pytest.raises(quant.QuantizationError, match="divisible by 32"):
        quant.quantize_dense(torch.randn(4, 40), "int8")


@pytest.fixture(scope="module")
def quantized(checkpoint):
    made = {}

    def get(family: str, kind: str):
        if (family, kind) not in made:
            made[family, kind] = load_model(checkpoint(family), dtype=torch.float32, quantization=kind)
        return made[family, kind]

    return get


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_speculation_equals_plain(family, kind, quantized, loaded):
    target = quantized(family, kind)
    assert target.model.quantization == kind
    plain = Engine(target)
    dense_draft = loaded(family, seed=1).model
    params = SamplingParams(max_tokens=32)
    for prompt in ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The lazy"]:
        expected = plain.generate(prompt, params).token_ids
        for method, draft_len in [(NGramMethod(1, 3), 4), (DraftModelMethod(dense_draft, 384), 3),
                                  (DraftModelMethod(target.model, 384), 6)]:  # a self-draft accepts all
            assert Engine(target, method, draft_len).generate(prompt, params).token_ids == expected


def test_quantized_model_stays_close_to_dense(quantized, loaded):
    """int8 logits track the dense model's; int4 ones are coarser but still correlated (a garbage check)."""
    dense = loaded("llama").model
    tokens = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46]])
    pos = torch.arange(8)[None]

    def logits(model):
        from specserve.models.kv_cache import KVCache
        return model(tokens, pos, KVCache.for_model(model, 1, 16), pos).logits

    want = logits(dense)
    for kind, bound in (("int8", 0.05), ("int4", 0.35)):
        got = logits(quantized("llama", kind).model)
        assert ((got - want).norm() / want.norm()) < bound, kind


def test_packed_linears_of_a_biased_family_load_their_biases(checkpoint):
    """A GGUF's packed q/k/v of a Qwen2 model (which has q/k/v biases) get the checkpoint's biases."""
    from pathlib import Path

    from specserve.models.loader import _read_state_dict, build_model, load_hf_config

    directory = Path(checkpoint("qwen2"))
    config, state = load_hf_config(directory), _read_state_dict(directory)
    names = [n for n in state if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]
    packed = {n: quant.PackedWeight.from_codes(quant.quantize_dense(state[n], "int8")) for n in names}
    model = build_model(config, dict(state), torch.float32, packed=packed)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, quant.QuantLinear)
    assert torch.equal(q_proj.bias.float(), state["model.layers.0.self_attn.q_proj.bias"])
    dense = build_model(config, dict(state), torch.float32)
    tokens, pos = torch.tensor([[1, 40, 41, 42]]), torch.arange(4)[None]
    from specserve.models.kv_cache import KVCache
    got, want = (m(tokens, pos, KVCache.for_model(m, 1, 8), pos).logits for m in (model, dense))
    assert (got - want).norm() / want.norm() < 0.05


@pytest.mark.parametrize("bits, group, zero, offsets", [(4, 32, 8, False), (4, 32, 0, True), (5, 32, 16, False),
                                                        (5, 32, 0, True), (6, 16, 32, False), (8, 32, 128, False)])
def test_extreme_codes_and_activations_sum_exactly_on_every_path(bits, group, zero, offsets, monkeypatch):
    """The vector paths add u8 x s8 products in saturating int16 lanes (AVX2's maddubs) before widening: codes at
    0 and at their maximum against activation blocks of all +-127 must still give the exact integer sums."""
    n, k, top = 32, 256, 2 ** bits - 1
    q = np.zeros((n, k), dtype=np.uint8)
    q[0::4], q[1::4] = top, 0
    q[2::4] = np.tile([0, top], k // 2)
    q[3::4] = np.random.default_rng(0).integers(0, top + 1, k)
    scales = np.ones((n, k // group), dtype=np.float32)
    codes = quant.Codes(q, scales, np.zeros_like(scales) if offsets else None, bits, group, zero, f"test{bits}")
    packed = quant.PackedWeight.from_codes(codes)
    x = torch.full((4, k), 127.0)
    x[1] = -127.0
    x[2, 0::2] = -127.0
    x[3] = torch.arange(k) % 255 - 127.0  # every code from -127 to 127,
    x[3, ::32] = 127.0  # with 127 in each block, so its scale dx is 1 and its codes are x
    x = x.repeat(3, 1)  # 12 rows, more than one pass takes: the 5- and 6-bit tiles are decoded once, then read
    exact = x.double() @ (torch.from_numpy(q.astype(np.float64)) - zero).T  # dx = 1: the integer sums themselves
    for isa in isa_paths():
        monkeypatch.setenv(cpu_kernels.ENV, isa)
        assert torch.equal(packed.matmul(x, out_fp32=True).double(), exact), isa
