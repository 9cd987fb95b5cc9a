"""Megatron-style shards of a decoder for N ranks: which part of every weight rank r holds, and slicing a loaded
CausalLM into it.

Per layer, rank r holds query heads [r H / N, (r + 1) H / N) with their rows of q_proj and columns of o_proj, and
MLP columns [r I / N, (r + 1) I / N) of gate_proj / up_proj with the same rows of down_proj's input. Its o_proj and
down_proj give partial sums of the full outputs, which one all-reduce per block adds (the model's `reduce` hooks).
KV heads split as the query heads when N divides them; with fewer KV heads than ranks each rank keeps the one KV
head its query heads read (replicated, as vLLM does). Norms, rope and the embedding table are replicated; the
lm_head is split by vocabulary in slices of `vocab_shard` rows, gathered on rank 0.

Quantized weights split on their packed layout: a column split on whole tiles of 16 outputs, a row split (o_proj,
down_proj) on whole blocks of 32 inputs, each block carrying its own scales, so the shard computes exactly the same
per-block products as the whole weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from specserve.checks import ConfigError
from specserve.models.quant import BLOCK, TILE, QuantizationError, QuantLinear
from specserve.models.transformer import ArchSpec, CausalLM


@dataclass(frozen=True)
class Span:
    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `world` holds, in heads, KV heads, MLP columns and vocabulary rows."""

    rank: int
    world: int
    heads: Span
    kv_heads: Span
    mlp: Span
    vocab: Span
    vocab_shard: int  # rows per rank's vocabulary slice (the last may hold fewer)

    @classmethod
    def make(cls, spec: ArchSpec, rank: int, world: int, quantized: bool) -> "ShardPlan":
        """ConfigError naming the setting when `world` cannot shard this model."""
        check_shardable(spec, world, quantized)
        heads, mlp = spec.num_heads // world, spec.intermediate_size // world
        if spec.num_kv_heads % world == 0:
            kv = spec.num_kv_heads // world
            kv_heads = Span(rank * kv, kv)
        else:  # fewer KV heads than ranks: the one KV head this rank's query heads read
            kv_heads = Span(rank // (world // spec.num_kv_heads), 1)
        shard = vocab_shard(spec.vocab_size, world)
        return cls(rank, world, Span(rank * heads, heads), kv_heads, Span(rank * mlp, mlp),
                   Span(rank * shard, min(shard, spec.vocab_size - rank * shard)), shard)


def vocab_shard(vocab_size: int, world: int) -> int:
    """Rows of each rank's vocabulary slice: an even split rounded up to whole tiles of a packed lm_head."""
    return -(-vocab_size // world // TILE) * TILE if vocab_size >= world * TILE else -(-vocab_size // world)


def check_shardable(spec: ArchSpec, world: int, quantized: bool) -> None:
    """ConfigError unless `world` ranks can split this model: heads, KV heads and MLP columns evenly, and (for
    quantized weights) on the packed layout's tiles and blocks."""
    setting = f"tensor_parallel_size {world}"
    if world < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {world}")
    if spec.num_heads % world:
        raise ConfigError(f"{setting} does not divide the model's {spec.num_heads} attention heads")
    kv = spec.num_kv_heads
    if kv % world and world % kv:
        raise ConfigError(f"{setting} and the model's {kv} KV heads: one must divide the other (KV heads are split "
                          "when there are at least as many as ranks, else replicated)")
    if spec.intermediate_size % world:
        raise ConfigError(f"{setting} does not divide the model's MLP width {spec.intermediate_size}")
    if vocab_shard(spec.vocab_size, world) * (world - 1) >= spec.vocab_size:
        raise ConfigError(f"{setting}: the vocabulary of {spec.vocab_size} is too small to split")
    if not quantized:
        return
    heads, kv_heads = spec.num_heads // world * spec.head_dim, max(kv // world, 1) * spec.head_dim
    mlp = spec.intermediate_size // world
    if heads % BLOCK or mlp % BLOCK:
        raise ConfigError(f"{setting}: each rank's share of o_proj's inputs ({heads}) and down_proj's "
                          f"({mlp}) must be a multiple of the quantization block ({BLOCK} weights); "
                          "use another size or quantization: none")
    if heads % TILE or kv_heads % TILE or mlp % TILE:
        raise ConfigError(f"{setting}: each rank's rows of q/k/v ({heads}, {kv_heads}) and gate/up ({mlp}) "
                          f"must be whole tiles of {TILE} quantized outputs; use another size or quantization: none")


# ---- slicing one linear ------------------------------------------------------------------------------------------

def output_rows(layer: nn.Module, span: Span) -> nn.Module:
    """The linear's outputs [start, end) (a column split of its weight)."""
    bias = None if layer.bias is None else layer.bias.detach()[span.start:span.end].clone()
    if isinstance(layer, QuantLinear):
        return QuantLinear(layer.packed.output_slice(span.start, span.end), bias)
    return _dense(layer.weight.detach()[span.start:span.end].clone(), bias)


def input_columns(layer: nn.Module, span: Span) -> nn.Module:
    """The linear over inputs [start, end) alone (a row split: a partial sum of its outputs). o_proj and down_proj
    have no bias in the supported families (one would be added once, not per rank)."""
    if isinstance(layer, QuantLinear):
        try:  # a K-quant splits on its super-blocks of 256 only, which check_shardable cannot see
            return QuantLinear(layer.packed.input_slice(span.start, span.end))
        except QuantizationError as exc:
            raise ConfigError(f"tensor_parallel_size: this rank's share: {exc}; use another size or "
                              "quantization: none") from exc
    return _dense(layer.weight.detach()[:, span.start:span.end].clone(), None)


def _dense(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return linear


def head_rows(span: Span, head_dim: int) -> Span:
    return Span(span.start * head_dim, span.count * head_dim)


# ---- slicing the model -------------------------------------------------------------------------------------------

def shard_model(model: CausalLM, plan: ShardPlan, reduce: Callable[[torch.Tensor], torch.Tensor],
                gather_vocab: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """Turn a loaded model into rank `plan.rank`'s shard in place (the rest of each weight is freed). `reduce`
    sums a block's partial output over the ranks; `gather_vocab` joins the lm_head slices' logits on rank 0."""
    spec, hd = model.spec, model.spec.head_dim
    local = replace(spec, num_heads=plan.heads.count, num_kv_heads=plan.kv_heads.count,
                    intermediate_size=plan.mlp.count, layer_types=list(spec.layer_types))
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = output_rows(attn.q_proj, head_rows(plan.heads, hd))
        attn.k_proj = output_rows(attn.k_proj, head_rows(plan.kv_heads, hd))
        attn.v_proj = output_rows(attn.v_proj, head_rows(plan.kv_heads, hd))
        attn.o_proj = input_columns(attn.o_proj, head_rows(plan.heads, hd))
        mlp.gate_proj = output_rows(mlp.gate_proj, plan.mlp)
        mlp.up_proj = output_rows(mlp.up_proj, plan.mlp)
        mlp.down_proj = input_columns(mlp.down_proj, plan.mlp)
        attn.spec, attn.reduce, mlp.reduce = local, reduce, reduce
    model.spec = local
    _shard_lm_head(model, plan)
    model.gather_vocab = gather_vocab
    model.fuse_projections()  # fuses the shard's q/k/v and gate/up again, and drops the old kernel plan


def _shard_lm_head(model: CausalLM, plan: ShardPlan) -> None:
    """This rank's vocabulary rows of the lm_head. A tied lm_head is the embedding table, which every rank keeps
    whole for lookups: the slice is then a view of it, costing no memory."""
    source, tied = model.lm_head_module, model.spec.tie_word_embeddings
    start, end = plan.vocab.start, plan.vocab.end
    packed = getattr(source, "packed", None)
    if packed is not None:
        shard = QuantLinear(packed.output_slice(start, end, copy=not tied))
    else:
        weight = source.weight.detach()[start:end]
        shard = _dense(weight if tied else weight.clone(), None)
    if tied:
        model.lm_head_shard = shard
    else:
        model.lm_head = shard
