"""The row-invariant forward of bf16 models (decoding, chain and tree verification, drafting): its glue kernels
round as the PyTorch ops they replace, a token's logits are bit-identical for 1..64 rows in any batch, the whole
forward tracks PyTorch's, and greedy speculation equals plain decoding on it, for every supported family. The C++
layer loop (the default) computes exactly what the Python reference loop computes, for bf16 and packed weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.engine.engine import Engine
from specserve.models import cpu_kernels as ck
from specserve.models import quant
from specserve.models.kv_cache import KVCache
from specserve.models.loader import build_model, load_model
from specserve.models.transformer import RMSNorm, rotate_half
from specserve.speculative.draft_model import DraftModelMethod
from specserve.speculative.ngram import NGramMethod
from specserve.speculative.sampling import SamplingParams
from tests.models.reference_layer_loop import use_loop
from tests.models.test_quant import isa_paths, random_gguf

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def norm_weights(dim: int, gemma: bool) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, gemma)
    with torch.no_grad():
        norm.weight.normal_()
    return norm


@pytest.mark.parametrize("gemma, qk_norm", [(True, True), (False, True), (False, False)])
def test_rope_store_equals_the_pytorch_ops(gemma, qk_norm):
    b, t, h, hkv, d, capacity = 2, 5, 4, 2, 32, 16
    qkv = (torch.randn(b, t, (h + 2 * hkv) * d) * 2).bfloat16()
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)  # strided views, as the fused projection gives
    angles = torch.randn(b, t, d)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    slots = torch.tensor([[3, 4, 5, 9, 7], [0, 1, 2, 3, 4]])
    q_norm, k_norm = norm_weights(d, gemma), norm_weights(d, gemma)
    keys, values = torch.zeros(b, hkv, capacity, d).bfloat16(), torch.zeros(b, hkv, capacity, d).bfloat16()
    got = ck.rope_store(q, k, v, q_norm.kernel_weight() if qk_norm else None,
                        k_norm.kernel_weight() if qk_norm else None, 1e-6, gemma, cos, sin, keys, values, slots)

    def heads(x, n):
        x = x.reshape(b, t, n, d)
        return x.transpose(1, 2)

    want_q, want_k = heads(q, h), heads(k, hkv)
    if qk_norm:
        want_q = ck.rms_norm(want_q.transpose(1, 2).contiguous(), q_norm.kernel_weight(), 1e-6, gemma).transpose(1, 2)
        want_k = ck.rms_norm(want_k.transpose(1, 2).contiguous(), k_norm.kernel_weight(), 1e-6, gemma).transpose(1, 2)
    c, s = cos[:, None], sin[:, None]
    want_q = want_q * c + rotate_half(want_q) * s
    want_k = want_k * c + rotate_half(want_k) * s
    assert torch.equal(got, want_q)
    rows = torch.arange(b)[:, None].expand_as(slots)
    assert torch.equal(keys[rows, :, slots], want_k.transpose(1, 2))
    assert torch.equal(values[rows, :, slots], heads(v, hkv).transpose(1, 2))
    untouched = torch.ones(b, capacity, dtype=torch.bool)
    untouched[rows, slots] = False
    assert keys.transpose(1, 2)[untouched].eq(0).all()


def test_rope_store_refuses_a_slot_past_the_cache():
    q, kv = torch.zeros(1, 1, 32).bfloat16(), torch.zeros(1, 1, 32).bfloat16()
    cache = torch.zeros(1, 1, 4, 32).bfloat16()
    with pytest.raises(RuntimeError, match="slot out of range"):
        ck.rope_store(q, kv, kv, None, None, 1e-6, False, q, q, cache, cache.clone(), torch.tensor([[4]]))


@pytest.mark.parametrize("gemma", [False, True])
def test_residual_norm_equals_the_pytorch_ops(gemma):
    x, y = (torch.randn(3, 4, 64) * 3).bfloat16(), torch.randn(3, 4, 64).bfloat16()
    post, nxt = norm_weights(64, gemma), norm_weights(64, gemma)
    total, normed = ck.residual_norm(x, y, post.kernel_weight() if gemma else None, nxt.kernel_weight(), 1e-6, gemma)
    with torch.no_grad():  # as the model's forward runs them (with a gradient, RMSNorm takes PyTorch's ops)
        want = x + (post(y) if gemma else y)
        assert torch.equal(total, want)
        assert torch.equal(normed, nxt(want))


@pytest.mark.parametrize("gelu", [False, True])
def test_gated_activation_tracks_pytorch_and_is_row_invariant(gelu):
    gate_up = (torch.randn(9, 2 * 80) * 3).bfloat16()  # 80: a 16-lane tail
    gate, up = gate_up.chunk(2, dim=-1)
    got = ck.gated_activation(gate_up, None, gelu)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    want = act * up
    # the activation is our own vectorized exp: at most one bf16 step off PyTorch's before the product
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    assert torch.equal(ck.gated_activation(gate.contiguous(), up.contiguous(), gelu), got)
    for i in range(9):
        assert torch.equal(ck.gated_activation(gate_up[i:i + 1], None, gelu)[0], got[i])


@pytest.mark.parametrize("gemma", [False, True])
def test_norm_and_residual_add_round_as_pytorch_bit_for_bit(gemma):
    """Rows of +-0.5, 1 and 2 have a sum of squares that is exact in any order, so RMSNorm's scale is one correctly
    rounded 1 / sqrt; each normed value is then PyTorch's fp32 products rounded to bf16, bit for bit (Gemma:
    bf16(x r w); llama: bf16(w bf16(x r))). The residual add of random bits is PyTorch's fp32 sum rounded."""
    gen = torch.Generator().manual_seed(2)
    D, eps = 645, 1e-6
    halves = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0])
    x, y = (halves[torch.randint(0, 6, (7, D), generator=gen)].bfloat16() for _ in range(2))
    weight = norm_weights(D, gemma).kernel_weight()
    total, normed = ck.residual_norm(x, y, None, weight, eps, gemma)
    s = x.float() + y.float()  # exact
    scale = 1.0 / torch.sqrt((s * s).sum(-1, keepdim=True) / D + eps)
    want = (s * scale * weight) if gemma else (weight * (s * scale).bfloat16().float())
    assert torch.equal(total, s.bfloat16())
    assert torch.equal(normed.view(torch.int16), want.bfloat16().view(torch.int16))
    bits = lambda: torch.randint(-2 ** 15, 2 ** 15, (7, D), generator=gen, dtype=torch.int16).view(torch.bfloat16)
    x, y = bits(), bits()
    total = ck.residual_norm(x, y, None, weight, eps, gemma)[0]
    want = (x.float() + y.float()).bfloat16()
    nan = want.isnan()
    tiny = lambda t: (t != 0) & (t.abs() < torch.finfo(torch.float32).tiny)  # flushed by the kernels (fp_mode.h)
    kept = ~nan & ~tiny(x.double()) & ~tiny(y.double()) & ~tiny(x.double() + y.double())
    assert torch.equal(total.isnan(), nan)
    assert torch.equal(total.view(torch.int16)[kept], want.view(torch.int16)[kept])


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("width", [1032, 1037])  # 8-lane blocks only; a tail after 16- and 8-lane blocks
def test_gated_activation_rounds_its_product_as_pytorch_bit_for_bit(gelu, width):
    """act(gate) is rounded to bf16, then its product with up: with `up` of random bits (every exponent, ties,
    infinities, NaN) the output is PyTorch's fp32 product of the two, rounded to bf16, bit for bit. Where `up` or
    the product is denormal the kernels flush to zero (fp_mode.h)."""
    gen = torch.Generator().manual_seed(width)
    gate = (torch.randn(16, width, generator=gen) * 4).bfloat16()
    up = torch.randint(-2 ** 15, 2 ** 15, (16, width), generator=gen, dtype=torch.int16).view(torch.bfloat16)
    act = ck.gated_activation(gate, torch.ones_like(up), gelu)  # x 1 is exact: bf16(act(gate))
    want = (act.float() * up.float()).bfloat16()
    got = ck.gated_activation(gate, up, gelu)
    nan = got.isnan()
    assert torch.equal(nan, want.isnan()) and nan.any()
    assert (got.view(torch.int16)[nan] == 0x7FC0).all()  # c10::BFloat16's NaN, as a scalar conversion gives
    tiny = lambda t: (t != 0) & (t.abs() < torch.finfo(torch.float32).tiny)
    flushed = tiny(up.double()) | tiny(act.double() * up.double())
    assert (got[flushed] == 0).all() and flushed.any()
    kept = ~nan & ~flushed
    assert torch.equal(got.view(torch.int16)[kept], want.view(torch.int16)[kept])


@pytest.fixture(scope="module")
def bf16_model(checkpoint):
    made = {}

    def get(family: str, seed: int = 0):
        if (family, seed) not in made:
            made[family, seed] = load_model(checkpoint(family, seed), dtype=torch.bfloat16)
        return made[family, seed]

    return get


def chain_logits(model, tokens: torch.Tensor, prefix: int, split: list[int]) -> torch.Tensor:
    """Logits of tokens[:, prefix:] [B, T, V], forwarded in chunks of `split` tokens after a prefix."""
    cache = KVCache.for_model(model, tokens.shape[0], tokens.shape[1])
    positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
    model(tokens[:, :prefix], positions[:, :prefix], cache, positions[:, :prefix])
    cache.lengths[:] = prefix
    out, start = [], prefix
    for size in split:
        span = slice(start, start + size)
        out.append(model(tokens[:, span], positions[:, span], cache, positions[:, span]).logits)
        start += size
        cache.lengths[:] = start
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_are_bit_identical_for_1_to_64_rows(family, bf16_model):
    model = bf16_model(family).model
    assert model.kernels_usable
    tokens = torch.randint(3, 384, (2, 80))
    one_by_one = chain_logits(model, tokens, 16, [1] * 64)
    for split in ([64], [2, 3, 59], [33, 31], [8] * 8):
        assert torch.equal(chain_logits(model, tokens, 16, split), one_by_one), split
    assert torch.equal(chain_logits(model, tokens[1:], 16, [64]), one_by_one[1:])  # alone = in a batch


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_of_the_wanted_rows_alone_equal_the_padded_ones(family, bf16_model):
    """logits_counts skips the lm_head for rows padded to the longest draft: the rows it keeps are the padded
    form's, bit for bit (a broken offset or row order would hand a request another's logits)."""
    model = bf16_model(family).model
    tokens = torch.randint(3, 384, (3, 6))
    positions = torch.arange(6)[None].expand(3, 6)
    logits_rows = torch.tensor([[5, 5, 5, 5], [2, 3, 4, 5], [4, 5, 5, 5]])
    run = lambda **kw: model(tokens, positions, KVCache.for_model(model, 3, 6), positions, logits_rows=logits_rows,
                             **kw)
    padded, ragged = run(), run(logits_counts=[1, 4, 2])
    assert ragged.logits.shape[0] == 7 and ragged.logits_offsets == [0, 1, 5]
    for row, count in enumerate([1, 4, 2]):
        assert torch.equal(ragged.row_logits(row, 0, count), padded.logits[row, :count])
        assert torch.equal(padded.row_logits(row, 0, count), padded.logits[row, :count])


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_forward_tracks_pytorch_ops(family, bf16_model, monkeypatch):
    """The same tokens through the kernels and through PyTorch's ops (the layers of models the kernels do not run)."""
    model = bf16_model(family).model
    tokens = torch.randint(3, 384, (1, 65))
    kernels = chain_logits(model, tokens, 1, [64])
    positions = torch.arange(65)[None]
    monkeypatch.setattr(model, "_kernels_usable", False)
    pytorch = model(tokens, positions, KVCache.for_model(model, 1, 65), positions).logits[:, 1:]
    assert ((kernels - pytorch).norm() / pytorch.norm()) < 0.02
    assert (kernels.argmax(-1) == pytorch.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding-window layers too
def test_a_long_forward_runs_the_kernels_in_chunks(family, bf16_model):
    """A causal forward over 64 tokens a row (a prefill in one call, training's features) is the chunked prefill:
    the same logits and hidden states, bit for bit, as forwards of 64 tokens, after a committed prefix and in a
    batch."""
    model = bf16_model(family).model
    tokens = torch.randint(3, 384, (2, 170))
    positions = torch.arange(170)[None].expand(2, -1)

    def forwards(sizes: list[int]):
        cache, start, outputs = KVCache.for_model(model, 2, 170), 0, []
        for size in sizes:
            rows = slice(start, start + size)
            outputs.append(model(tokens[:, rows], positions[:, rows], cache, positions[:, rows], output_layers=(0, -1)))
            start = cache.lengths[:] = rows.stop
        return outputs[1:]  # after the prefix

    whole, = forwards([20, 150])
    chunks = forwards([20, 64, 64, 22])
    assert torch.equal(whole.logits, torch.cat([c.logits for c in chunks], 1))
    for layer in (0, -1):
        assert torch.equal(whole.hidden_states[layer], torch.cat([c.hidden_states[layer] for c in chunks], 1))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_speculation_equals_plain(family, bf16_model):
    target = bf16_model(family)
    plain = Engine(target)
    params = SamplingParams(max_tokens=32)
    vocab = target.model.spec.vocab_size
    for prompt in ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The lazy"]:
        expected = plain.generate(prompt, params).token_ids
        for method, draft_len in [(NGramMethod(1, 3), 4), (DraftModelMethod(bf16_model(family, 1).model, vocab), 3),
                                  (DraftModelMethod(target.model, vocab), 8)]:
            assert Engine(target, method, draft_len).generate(prompt, params).token_ids == expected, method


# ---------------------------------------------------------------- the C++ layer loop against the Python one

def run_chain(model, tokens: torch.Tensor, split: list[int], output_layers: tuple[int, ...]) -> list[torch.Tensor]:
    """Logits, the requested hidden states and the whole KV cache after forwarding tokens in chunks of `split`."""
    cache = KVCache.for_model(model, tokens.shape[0], tokens.shape[1])
    positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
    results, start = [], 0
    for size in split:
        span = slice(start, start + size)
        out = model(tokens[:, span], positions[:, span], cache, positions[:, span], output_layers=output_layers)
        results += [out.logits, *(out.hidden_states[i] for i in output_layers)]
        start += size
        cache.lengths[:] = start
    return results + cache.keys + cache.values


def assert_loops_agree(model, monkeypatch, splits=([16, 1, 2, 3, 5, 8, 13, 32], [1, 15, 64])):
    """Both layer loops give the same bits: logits, hidden states (first, last and final-normed) and KV cache."""
    assert model.kernels_usable
    tokens = torch.randint(3, 384, (2, 80))
    output_layers = (0, model.spec.num_layers - 1, -1)
    for split in splits:
        runs = {}
        for loop in ("python", "cpp"):
            use_loop(monkeypatch, loop)
            runs[loop] = run_chain(model, tokens, split, output_layers)
        assert all(torch.equal(a, b) for a, b in zip(runs["python"], runs["cpp"], strict=True)), split


@pytest.mark.parametrize("family", FAMILIES)
def test_cpp_layer_loop_equals_python_loop_bf16(family, bf16_model, monkeypatch):
    assert_loops_agree(bf16_model(family).model, monkeypatch)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cpp_layer_loop_equals_python_loop_quantized(family, kind, checkpoint, monkeypatch):
    model = load_model(checkpoint(family), dtype=torch.bfloat16, quantization=kind).model
    assert model.quantization == kind
    assert_loops_agree(model, monkeypatch, splits=([16, 1, 7, 56],))


# Two layers of GGUF types: every supported format, mixed within fused q/k/v (as Q4_K_M's Q6_K v) and gate/up.
GGUF_LAYER_FORMATS = [
    {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_K", "gate_proj": "Q4_0", "up_proj": "Q5_1",
     "down_proj": "Q8_0"},
    {"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q8_0", "o_proj": "Q4_1", "gate_proj": "Q6_K", "up_proj": "Q6_K",
     "down_proj": "Q4_K"},
]
WIDE = dict(vocab_size=384, hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=512, initializer_range=0.05, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)


def gguf_model(family: str, projections: tuple[str, ...]):
    """A bf16 model of 256-wide layers (K-quants need 256 inputs) whose `projections` hold random GGUF blocks."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen2Config

    if family == "gemma3":
        config = Gemma3TextConfig(**WIDE, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=64,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    else:  # Qwen2: Llama's layout with q/k/v biases, which the packed kernel adds
        config = Qwen2Config(**WIDE, num_hidden_layers=2, tie_word_embeddings=False)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    packed = {}
    for name, weight in state.items():
        parts = name.split(".")
        if len(parts) > 4 and parts[1] == "layers" and parts[-2] in projections and parts[-1] == "weight":
            kind = GGUF_LAYER_FORMATS[int(parts[2]) % 2][parts[-2]]
            raw = random_gguf(kind, *weight.shape, seed=len(packed))
            packed[name] = quant.PackedWeight.from_codes(quant.decode_gguf(kind, raw, tuple(weight.shape)))
    return build_model(config, state, torch.bfloat16, packed=packed)


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_cpp_layer_loop_equals_python_loop_gguf_every_isa(family, monkeypatch):
    logits = {}
    for isa in isa_paths():
        monkeypatch.setenv(ck.ENV, isa)
        torch.manual_seed(0)  # the same model on every path; its LayerStack is the variant's, made at first use
        model = gguf_model(family, tuple(GGUF_LAYER_FORMATS[0]))
        assert model.model.layers[0].self_attn.qkv_quant is not None  # fused, of mixed formats
        assert_loops_agree(model, monkeypatch, splits=([16, 1, 7, 56],))
        logits[isa] = run_chain(model, torch.arange(3, 40)[None], [16, 5, 16], (-1,))
    for isa, outputs in logits.items():  # every path computes the same bits
        assert all(torch.equal(a, b) for a, b in zip(outputs, logits["scalar"], strict=True)), isa


def test_cpp_layer_loop_equals_python_loop_packed_and_bf16_unfused(monkeypatch):
    """Packed q/k/v with bf16 gate/up: nothing is fused, each part is its own kernel call."""
    model = gguf_model("qwen2", ("q_proj", "k_proj", "v_proj"))
    mlp = model.model.layers[0].mlp
    assert model.model.layers[0].self_attn.qkv_quant is None and mlp.gate_up is None and mlp.gate_up_quant is None
    assert_loops_agree(model, monkeypatch, splits=([16, 1, 7, 56],))
