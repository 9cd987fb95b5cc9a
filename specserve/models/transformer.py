"""A lean decoder-only transformer (gpt-fast style) for the Llama, Qwen2/3, Mistral and Gemma3 families.

Parameter names follow Hugging Face's checkpoints so a state dict loads as is. The forward takes new tokens at
given positions, writes their keys/values into a static KV cache at given cache slots, and attends under an
optional tree mask, so the same call serves prefill, plain decoding, chain verification and tree verification.

Tensor parallelism (specserve/parallel) runs this same model on every rank with its shard of the weights: the
attention's and MLP's `reduce` hooks sum the ranks' partial o_proj / down_proj outputs, and the lm_head is the
rank's vocabulary slice (`lm_head_shard`) whose logits `gather_vocab` joins on rank 0.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models import cpu_kernels
from specserve.models.kernel_forward import MAX_KERNEL_TOKENS, kernel_plan
from specserve.models.kv_cache import KVCache
from specserve.models.quant import (BLOCK, FusedQuantLinear, PackedWeight, QuantEmbedding, QuantLinear, quantize_dense,
                                    screen_argmax)
from specserve.models.screen_choice import ScreenChoice

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
GREEDY_SCREEN = "SPECSERVE_GREEDY_SCREEN"  # "0": greedy forwards compute the full logits
# fp32 weights at least this big go through the AVX2 kernel when a forward has few rows (there it beats PyTorch's
# GEMM at every size of a real model's layers and lm_head); tiny test models keep PyTorch's GEMM, which the tests
# compare with transformers bit for bit.
F32_KERNEL_MIN_WEIGHTS = 1 << 18
F32_KERNEL_MAX_LAYER_ROWS = 16  # past this PyTorch's GEMM catches up on the layers' small weights


def f32_kernel_fits(weight: torch.Tensor, x: torch.Tensor, max_rows: int) -> bool:
    return (weight.dtype == torch.float32 and x.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.numel() >= F32_KERNEL_MIN_WEIGHTS and x.numel() // x.shape[-1] <= max_rows
            and not torch.is_grad_enabled() and cpu_kernels.f32_linear_available())


def fuse_linears(layers: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linears over the same input; the layers' parameters become views of it,
    so memory is not doubled and the unfused path computes exactly what it did."""
    weight = torch.cat([layer.weight.detach() for layer in layers])
    bias = torch.cat([layer.bias.detach() for layer in layers]) if layers[0].bias is not None else None
    start = 0
    for layer in layers:
        rows = layer.weight.shape[0]
        layer.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return weight, bias


def linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """A linear of the PyTorch path (the row-invariant one is in kernel_forward.py)."""
    if not isinstance(layer, QuantLinear) and f32_kernel_fits(layer.weight, x, F32_KERNEL_MAX_LAYER_ROWS):
        return cpu_kernels.f32_linear(x, layer.weight, layer.bias)
    return layer(x)


def fused_or_parts(fused: FusedQuantLinear | None, parts: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """[y] from the quantized fused weight of several linears over x when there is one, else [y_i] per part."""
    return [fused(x)] if fused is not None else [linear(x, part) for part in parts]


@dataclass
class ArchSpec:
    """What differs between the supported families, read once from the HF config."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v biases
    output_bias: bool = False  # o_proj's (Qwen3-style drafters with attention_bias; the targets here have none)
    qk_norm: bool = False
    gemma: bool = False  # (1 + w) norms, sandwich norms, scaled embeddings, gelu
    attn_scale: float = 1.0
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    final_logit_softcapping: float | None = None
    hidden_act: str = "silu"

    @classmethod
    def from_hf_config(cls, config) -> "ArchSpec":
        model_type = config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        gemma = model_type == "gemma3_text"
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        scale = (config.query_pre_attn_scalar ** -0.5) if gemma else head_dim ** -0.5
        return cls(
            model_type=model_type,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            gemma=gemma,
            attn_scale=scale,
            layer_types=layer_types,
            sliding_window=getattr(config, "sliding_window", None),
            final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
            hidden_act=getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu"),
        )


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, with Llama's or Gemma's rounding order (they differ; HF keeps both)."""

    def __init__(self, dim: int, eps: float, gemma: bool):
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self._kernel_weight: tuple[int, torch.Tensor] | None = None  # (weight version, fp32 scale)

    def kernel_weight(self) -> torch.Tensor:
        """The fp32 scale the kernel applies (Gemma: 1 + w), recomputed only if the weight changed."""
        version = self.weight._version
        if self._kernel_weight is None or self._kernel_weight[0] != version:
            scale = (1.0 + self.weight.float()) if self.gemma else self.weight.float()
            self._kernel_weight = (version, scale.contiguous())
        return self._kernel_weight[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the kernel rounds as the ops below do, but has no gradient (an EAGLE head trains with this module)
        kernel = x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled()
        if kernel and cpu_kernels.available():
            return cpu_kernels.rms_norm(x, self.kernel_weight(), self.eps, self.gemma)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (h * (1.0 + self.weight.float())).type_as(x)
        return self.weight * h.to(x.dtype)


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma's final logit soft-capping, cap * tanh(logits / cap); the logits as they are without a cap."""
    return torch.tanh(logits / cap) * cap if cap else logits


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding x * cos + rotate_half(x) * sin, in x's dtype whatever the tables' (training passes
    fp32 ones to bf16 heads)."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")  # their frequencies depend on the longest position


class RopeTables:
    """cos/sin tables per layer type, cached per position and grown on demand. The frequencies are those of
    transformers' rotary modules: the families' default 1 / theta^(2i/d), or its rope-scaling functions
    (ROPE_INIT_FUNCTIONS; "dynamic" and "longrope" evaluated at the table's length, as its dynamic_rope_update
    does). Computed here rather than by the family's module, whose import costs ~2.5 s of every start."""

    def __init__(self, hf_config, dtype: torch.dtype):
        self.config = hf_config
        self.per_layer_type = hf_config.model_type == "gemma3_text"
        self.dtype = dtype
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.size = 0

    def frequencies(self, layer_type: str | None, size: int) -> tuple[torch.Tensor, float]:
        """(inverse frequencies [head_dim / 2], attention scaling) of a layer type for positions below `size`."""
        config = self.config
        params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        seq_len = size if rope_type in SEQUENCE_DEPENDENT_ROPE else None
        return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), seq_len=seq_len, layer_type=layer_type)

    def _build(self, size: int) -> None:
        positions = torch.arange(size, device="cpu", dtype=torch.float)
        for layer_type in ("full_attention", "sliding_attention"):
            inv_freq, scaling = self.frequencies(layer_type if self.per_layer_type else None, size)
            freqs = positions[:, None] * inv_freq.to(device="cpu", dtype=torch.float)
            angles = torch.cat((freqs, freqs), dim=-1)
            self.tables[layer_type] = ((angles.cos() * scaling).to(self.dtype), (angles.sin() * scaling).to(self.dtype))
        self.size = size

    def lookup(self, positions: torch.Tensor, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(positions.max()) + 1
        if needed > self.size:
            self._build(max(needed, 2 * self.size, 256))
        cos, sin = self.tables[layer_type]
        return cos[positions], sin[positions]


class Attention(nn.Module):
    """A family's attention: q/k/v projections of `input_size` inputs (the hidden size; EAGLE-3's midlayer takes
    twice it), the q/k norms where the family has them, the rotation, and o_proj back to the hidden size; `linear`
    is the projections' module type (the draft heads' run bf16 on the kernels)."""

    def __init__(self, spec: ArchSpec, layer_idx: int, input_size: int | None = None,
                 linear: type[nn.Linear] = nn.Linear):
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        h, hd = spec.hidden_size, spec.head_dim
        inputs = input_size or h
        self.q_proj = linear(inputs, spec.num_heads * hd, bias=spec.attention_bias)
        self.k_proj = linear(inputs, spec.num_kv_heads * hd, bias=spec.attention_bias)
        self.v_proj = linear(inputs, spec.num_kv_heads * hd, bias=spec.attention_bias)
        self.o_proj = linear(spec.num_heads * hd, h, bias=spec.output_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, spec.rms_norm_eps, spec.gemma)
            self.k_norm = RMSNorm(hd, spec.rms_norm_eps, spec.gemma)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fused weights for the kernels
        self.qkv_quant: FusedQuantLinear | None = None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sums o_proj's partials

    def project(self, x: torch.Tensor):
        projections = [self.q_proj, self.k_proj, self.v_proj]
        outputs = fused_or_parts(self.qkv_quant, projections, x)
        if len(outputs) == 1:
            return outputs[0].split([p.out_features for p in projections], dim=-1)
        return outputs

    def heads(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, in], cos/sin [B or 1, T, hd] -> normed, rotated queries [B, heads, T, hd], keys and values
        [B, kv_heads, T, hd]."""
        spec = self.spec
        bsz, seq, _ = x.shape
        q, k, v = self.project(x)
        q = q.reshape(bsz, seq, spec.num_heads, spec.head_dim)
        k = k.reshape(bsz, seq, spec.num_kv_heads, spec.head_dim)
        v = v.reshape(bsz, seq, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def forward(self, x, cos, sin, cache: KVCache, slots, mask) -> torch.Tensor:
        """Attention with PyTorch's ops (fp32 models, GPUs, CPUs without the row-invariant kernels, draft heads):
        x [B, T, in] at cache `slots` [B, T], mask [B or 1, 1, T, S] over the first S slots."""
        spec = self.spec
        bsz, seq, _ = x.shape
        q, k, v = self.heads(x, cos, sin)
        keys, values = cache.write(self.layer_idx, slots, k, v, mask.shape[-1])
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=spec.attn_scale,
                                             enable_gqa=spec.num_kv_heads != spec.num_heads)
        out = out.transpose(1, 2).reshape(bsz, seq, spec.num_heads * spec.head_dim)
        out = linear(out, self.o_proj)
        return out if self.reduce is None else self.reduce(out)


class MLP(nn.Module):
    def __init__(self, spec: ArchSpec, linear: type[nn.Linear] = nn.Linear):
        super().__init__()
        self.gate_proj = linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None  # fused weight for the kernels
        self.gate_up_quant: FusedQuantLinear | None = None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sums down_proj's partials
        self.gelu = spec.hidden_act in ("gelu_pytorch_tanh", "gelu_tanh")
        if self.gelu:
            self.act = lambda t: F.gelu(t, approximate="tanh")
        elif spec.hidden_act == "silu":
            self.act = F.silu
        else:
            raise ValueError(f"unsupported activation {spec.hidden_act!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = fused_or_parts(self.gate_up_quant, [self.gate_proj, self.up_proj], x)
        gate, up = outputs[0].chunk(2, dim=-1) if len(outputs) == 1 else outputs
        out = linear(self.act(gate) * up, self.down_proj)
        return out if self.reduce is None else self.reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec, layer_idx: int):
        super().__init__()
        self.gemma = spec.gemma
        self.layer_type = spec.layer_types[layer_idx]
        self.self_attn = Attention(spec, layer_idx)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.gemma)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.gemma)
        if spec.gemma:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, True)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, True)

    def forward(self, x, cos, sin, cache, slots, mask):
        """The layer with PyTorch's ops (fp32 models, GPUs, CPUs without the row-invariant kernels)."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cache, slots, mask)
        if self.gemma:
            x = x + self.post_attention_layernorm(attn)
            mlp = self.mlp(self.pre_feedforward_layernorm(x))
            return x + self.post_feedforward_layernorm(mlp)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True)
class GreedyChoices:
    """What a greedy-only forward returns in place of logits: each row's argmax (torch.argmax's answer over the
    logits it stands for), int64 with the logits' shape less the vocabulary. Indexing it indexes the rows."""

    ids: torch.Tensor

    def __getitem__(self, index) -> "GreedyChoices":
        return GreedyChoices(self.ids[index])

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class ForwardOutput:
    # [B, T, V] float32; with logits_offsets: [N, V], the rows asked for, row after row; GreedyChoices of the
    # same rows when the forward was asked for greedy choices only
    logits: torch.Tensor | GreedyChoices
    hidden_states: dict[int, torch.Tensor]  # layer index -> [B, T, H]; -1 is the final-normed state
    logits_offsets: list[int] | None = None  # [B]: where row b's logits start in the flat form

    def row_logits(self, row: int, start: int, end: int) -> torch.Tensor:
        """Row `row`'s logits at its logits_rows entries [start, end): [end - start, V]."""
        if self.logits_offsets is None:
            return self.logits[row, start:end]
        base = self.logits_offsets[row]
        return self.logits[base + start: base + end]


class Model(nn.Module):
    """The inner `model.*` of an HF causal LM; wrapped by CausalLM so names match `model.` / `lm_head.`."""

    def __init__(self, spec: ArchSpec):
        super().__init__()
        # a given weight skips the random init, whose normal_ on the meta device imports torch._dynamo (~2.5 s)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size,
                                         _weight=torch.empty(spec.vocab_size, spec.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.gemma)


class CausalLM(nn.Module):
    # the forward's logits_counts and greedy take effect: logits in the flat form, rows' padding skipped (a
    # tensor-parallel model's ranks compute the padded form together)
    ragged_logits = True

    def __init__(self, hf_config, dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.set_flush_denormal(True)  # tiny activations as denormals slow CPU matmuls down many times
        self.hf_config = hf_config
        self.spec = ArchSpec.from_hf_config(hf_config)
        self.model = Model(self.spec)
        if not self.spec.tie_word_embeddings:
            self.lm_head = nn.Linear(self.spec.hidden_size, self.spec.vocab_size, bias=False)
        self.rope = RopeTables(hf_config, dtype)
        self.embed_scale = math.sqrt(self.spec.hidden_size) if self.spec.gemma else None
        self._kernels_usable: bool | None = None
        self.vocab_subset: torch.Tensor | None = None  # a draft's vocabulary (see restrict_vocab)
        self._subset_weight: torch.Tensor | None = None
        self._subset_packed: PackedWeight | None = None  # a packed lm_head's subset rows, packed again
        # tensor parallelism (specserve/parallel/shard.py): this rank's vocabulary slice of the lm_head, and the
        # function joining the slices' logits (the full logits on rank 0, None on the other ranks)
        self.lm_head_shard: nn.Module | None = None
        self.gather_vocab: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def restrict_vocab(self, token_ids: torch.Tensor | None) -> None:
        """As a draft model only: compute logits for these tokens alone (the rest get -inf). With a large
        vocabulary the lm_head costs more than a small draft's layers; drafts stay guesses, so verification
        remains exact (and sampling too: the draft's q is then zero outside the subset). A packed lm_head's rows
        stay packed, in int8 blocks (read as bytes: a dense copy would read twice as many)."""
        if token_ids is None:
            self.vocab_subset = self._subset_weight = self._subset_packed = None
            return
        self.vocab_subset = torch.as_tensor(token_ids, dtype=torch.long).sort().values
        packed = self.lm_head_packed
        self._subset_weight = self._subset_packed = None
        if packed is None:
            self._subset_weight = self.lm_head_weight.detach()[self.vocab_subset].contiguous()
            return
        rows = packed.rows(self.vocab_subset)  # fp32: quantized again from the exact rows
        if rows.shape[-1] % BLOCK == 0:
            self._subset_packed = PackedWeight.from_codes(quantize_dense(rows, "int8"))
        else:
            self._subset_weight = rows.to(self.dtype).contiguous()

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up for the row-invariant kernels (after the weights are loaded)."""
        self.__dict__.pop("_kernel_layers", None)  # kernel_forward's plan refers to the unfused modules
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv = attn.qkv_quant = mlp.gate_up = mlp.gate_up_quant = None  # again after sharding
            qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
            if all(isinstance(m, QuantLinear) for m in qkv + gate_up):
                attn.qkv_quant, mlp.gate_up_quant = FusedQuantLinear(qkv), FusedQuantLinear(gate_up)
            elif self.kernels_usable and not any(isinstance(m, QuantLinear) for m in qkv + gate_up):
                attn.qkv = fuse_linears(qkv)
                mlp.gate_up = fuse_linears(gate_up)[0]

    @property
    def lm_head_module(self) -> nn.Module:
        if self.lm_head_shard is not None:
            return self.lm_head_shard
        return self.model.embed_tokens if self.spec.tie_word_embeddings else self.lm_head

    @property
    def lm_head_packed(self) -> PackedWeight | None:
        """The lm_head's packed weight when it is quantized (then `lm_head_weight` does not exist densely)."""
        return getattr(self.lm_head_module, "packed", None)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.lm_head_packed is not None:
            raise TypeError("the lm_head is quantized: use lm_head_packed (or load with quantization: none)")
        return self.lm_head_module.weight

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms are kept in it, whatever the linears' storage)."""
        return self.model.norm.weight.dtype

    @property
    def quantization(self) -> str:
        """What the linears are stored as: 'none', a GGUF type mix ('gguf') or 'int8' / 'int4'."""
        kinds = {m.packed.kind for m in self.modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
        if not kinds:
            return "none"
        return kinds.pop() if kinds <= {"int8"} or kinds <= {"int4"} else "gguf"

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    @property
    def kernels_usable(self) -> bool:
        """Row-invariant kernels exist for bf16 on CPUs; other setups (fp32, GPUs) use PyTorch's kernels."""
        if self._kernels_usable is None:
            self._kernels_usable = (self.dtype == torch.bfloat16 and self.model.norm.weight.device.type == "cpu"
                                    and cpu_kernels.available())
        return self._kernels_usable

    def logits(self, hidden: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        logits = soft_cap(self._lm_head(hidden, row_invariant), self.spec.final_logit_softcapping)
        if self.gather_vocab is not None:
            return self.gather_vocab(logits)
        if self.vocab_subset is not None:
            full = logits.new_full((*logits.shape[:-1], self.spec.vocab_size), float("-inf"))
            full[..., self.vocab_subset] = logits
            logits = full
        return logits

    def _lm_head(self, hidden: torch.Tensor, row_invariant: bool) -> torch.Tensor:
        """fp32 logits over the whole vocabulary, or over a draft's subset (see restrict_vocab)."""
        packed = self.lm_head_packed
        if packed is not None and self.vocab_subset is None:
            return packed.matmul(hidden, out_fp32=True)
        if self._subset_packed is not None:
            return self._subset_packed.matmul(hidden, out_fp32=True)
        weight = self.lm_head_weight if self.vocab_subset is None else self._subset_weight
        if row_invariant:
            return cpu_kernels.small_linear(hidden, weight, out_fp32=True)
        if f32_kernel_fits(weight, hidden, MAX_KERNEL_TOKENS):
            return cpu_kernels.f32_linear(hidden, weight)
        return F.linear(hidden, weight).float()

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        output_layers: tuple[int, ...] = (),
        logits_rows: torch.Tensor | None = None,
        logits_counts: list[int] | None = None,
        greedy: bool = False,
    ) -> ForwardOutput:
        """Run new `tokens` [B, T] at rope `positions` [B, T], stored at cache `slots` [B, T].

        Every token sees the committed cache prefix of its row (slots below `cache.lengths`) and, among the new
        tokens, what `tree_mask` [B, T, T] allows (causal when None). `output_layers` asks for the residual
        stream after those layers (-1: the final normed state). `logits_rows` [B, R] picks the rows that need
        logits, since the lm_head dominates a step of a small model (R = 0: none at all). With `logits_counts`
        [B], only row b's first counts[b] entries of logits_rows get logits, in the flat form (ForwardOutput):
        rows padded to the batch's longest draft cost no lm_head work. `greedy`: only each row's argmax is needed;
        where `greedy_screen` applies, the logits come back as GreedyChoices.
        """
        masks = cache.attention_masks(positions, slots, tree_mask, self.spec.sliding_window)
        # the row-invariant kernels: any forward of <= MAX_KERNEL_TOKENS a row, and a longer causal one (a prefill,
        # training's features) chunk by chunk
        row_invariant = self.kernels_usable and (tokens.shape[1] <= MAX_KERNEL_TOKENS or tree_mask is None)
        rope = {kind: self.rope.lookup(positions, kind) for kind in masks}
        x = self.embed(tokens)
        hidden: dict[int, torch.Tensor] = {}
        if row_invariant:  # each layer's output comes with the next norm of it; the last one's is the final norm
            normed = self.model.layers[0].input_layernorm(x)
            x, hidden = kernel_plan(self).run(x, normed, rope, masks, cache, slots, output_layers)
        else:
            for i, layer in enumerate(self.model.layers):
                cos, sin = rope[layer.layer_type]
                x = layer(x, cos, sin, cache, slots, masks[layer.layer_type])
                if i in output_layers:
                    hidden[i] = x
            x = self.model.norm(x)
        if -1 in output_layers:
            hidden[-1] = x
        if logits_rows is not None and logits_rows.shape[1] == 0:  # a prefill chunk: only the cache is wanted
            return ForwardOutput(torch.empty(x.shape[0], 0, self.spec.vocab_size), hidden)
        if logits_rows is not None:
            x = torch.gather(x, 1, logits_rows[..., None].expand(-1, -1, x.shape[-1]))
            if logits_counts is not None and sum(logits_counts) < logits_rows.numel():
                width = logits_rows.shape[1]
                wanted = torch.tensor([b * width + r for b, n in enumerate(logits_counts) for r in range(n)])
                offsets = [0, *itertools.accumulate(logits_counts)][:-1]
                flat = x.reshape(-1, x.shape[-1])[wanted]
                return ForwardOutput(self._head(flat, row_invariant, greedy), hidden, offsets)
        return ForwardOutput(self._head(x, row_invariant, greedy), hidden)

    def _head(self, hidden: torch.Tensor, row_invariant: bool, greedy: bool) -> torch.Tensor | GreedyChoices:
        screen = self.greedy_screen if greedy else None
        if screen is None:
            return self.logits(hidden, row_invariant)
        rows = hidden.numel() // hidden.shape[-1]
        choice = self.screen_choice
        if choice.uses_screen(rows):
            return choice.timed(rows, True, lambda: GreedyChoices(screen_argmax(hidden, self.lm_head_packed, screen)))
        return choice.timed(rows, False, lambda: self.logits(hidden, row_invariant))

    @property
    def screen_choice(self) -> ScreenChoice:
        """Whether greedy calls read the screen or the plain lm_head, from their measured times (screen_choice.py)."""
        if "_screen_choice" not in self.__dict__:
            self.__dict__["_screen_choice"] = ScreenChoice()
        return self.__dict__["_screen_choice"]

    @property
    def greedy_screen(self) -> PackedWeight | None:
        """The lm_head's 5-bit screen (quant_linear.cpp's screen_argmax: exact argmaxes, reading ~2/3 of an 8-bit
        lm_head's bytes) where greedy choices can use it: an 8-bit packed lm_head over the whole vocabulary,
        without logit soft-capping (a rounding tanh could tie distinct logits); else None.
        SPECSERVE_GREEDY_SCREEN=0 turns it off."""
        packed = self.lm_head_packed
        if (packed is None or self.vocab_subset is not None or self.gather_vocab is not None
                or self.spec.final_logit_softcapping or os.environ.get(GREEDY_SCREEN, "1") == "0"):
            return None
        screen = self.__dict__.get("_greedy_screen")
        if screen is None or screen[0] is not packed:  # made once per lm_head weight (~0.3 s for 262k x 640)
            screen = (packed, packed.greedy_screen())
            self.__dict__["_greedy_screen"] = screen
        return screen[1]
