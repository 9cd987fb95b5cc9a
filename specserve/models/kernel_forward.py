"""The row-invariant forward of the decoder layers: every forward of at most MAX_KERNEL_TOKENS tokens per row
(decoding, chain and tree verification, drafting) on the bf16 CPU kernels.

Per layer, nine calls: the q/k/v projection (one quantized call even when a GGUF mixes formats), `rope_store`
(q/k norms, rope, the cache writes), attention, the o projection, `residual_norm` (the residual add and the norm
after it), gate/up, `gated_activation`, down, `residual_norm` again (its norm is the next layer's input norm or the
final one). Each kernel rounds as the PyTorch ops it replaces, so the layer computes what the PyTorch layer of
transformer.py computes on the same kernels for the linears and attention.

What the calls need is gathered once per model (`KernelLayer`): nn.Module attribute lookups and per-call checks
cost more than the glue kernels themselves (~3.5 ms of Python in a 20 ms step of the 270M default model).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from specserve.models import cpu_kernels
from specserve.models.quant import FusedQuantLinear, QuantLinear, packed_matmul

Linear = Callable[[torch.Tensor], torch.Tensor]


def row_invariant_linear(layer: nn.Module) -> Linear:
    """x -> layer(x) on a row-invariant kernel: the packed one for a quantized layer, else the bf16 one."""
    if isinstance(layer, (QuantLinear, FusedQuantLinear)):
        args, bias = layer.args, layer.bias
        return lambda x: packed_matmul(x, args, bias)
    weight, bias = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
    return lambda x: cpu_kernels.small_linear(x, weight, bias)


def projections(fused, parts: list[nn.Module], split: bool = True) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """x -> [part(x) for part in parts], in one kernel call when the parts have a fused weight (then, with split
    False, [the fused output])."""
    sizes = [part.out_features for part in parts]
    if isinstance(fused, FusedQuantLinear):
        linear = row_invariant_linear(fused)
    elif fused is not None:  # a fused bf16 weight (and bias)
        weight, bias = fused if isinstance(fused, tuple) else (fused, None)
        linear = lambda x: cpu_kernels.small_linear(x, weight, bias)  # noqa: E731
    else:
        linears = [row_invariant_linear(part) for part in parts]
        return lambda x: [linear(x) for linear in linears]
    return (lambda x: linear(x).split(sizes, dim=-1)) if split else (lambda x: [linear(x)])


class KernelLayer:
    """One decoder layer's row-invariant forward, with its linears, norm weights and settings looked up once."""

    def __init__(self, layer, next_norm):
        attn, mlp, spec = layer.self_attn, layer.mlp, layer.self_attn.spec
        self.index, self.layer_type = attn.layer_idx, layer.layer_type
        self.eps, self.gemma, self.scale, self.gelu = spec.rms_norm_eps, spec.gemma, spec.attn_scale, mlp.gelu
        self.qkv = projections(attn.qkv_quant or attn.qkv, [attn.q_proj, attn.k_proj, attn.v_proj])
        # unsplit: the activation kernel reads a fused [.., 2 I] output as it is
        self.gate_up = projections(mlp.gate_up_quant or mlp.gate_up, [mlp.gate_proj, mlp.up_proj], split=False)
        self.o, self.down = row_invariant_linear(attn.o_proj), row_invariant_linear(mlp.down_proj)
        norms = {"q": getattr(attn, "q_norm", None), "k": getattr(attn, "k_norm", None), "next": next_norm,
                 "post_attention": layer.post_attention_layernorm,
                 "pre_feedforward": getattr(layer, "pre_feedforward_layernorm", None),
                 "post_feedforward": getattr(layer, "post_feedforward_layernorm", None)}
        self.norm = {name: None if norm is None else norm.kernel_weight() for name, norm in norms.items()}
        self.norm_versions = [(norm.weight, norm.weight._version) for norm in norms.values() if norm is not None]

    def current(self) -> bool:
        """False once a norm weight changed in place (its kernel weight is derived from it)."""
        return all(weight._version == version for weight, version in self.norm_versions)

    def __call__(self, x, normed, cos, sin, cache, slots, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer output, next norm of it) for the residual stream x [B, T, H] and normed = its input norm."""
        norm, eps, gemma = self.norm, self.eps, self.gemma
        bsz, seq, _ = x.shape
        q, k, v = self.qkv(normed)
        keys, values = cache.keys[self.index], cache.values[self.index]
        q = cpu_kernels.rope_store(q, k, v, norm["q"], norm["k"], eps, gemma, cos, sin, keys, values, slots)
        span = mask.shape[-1]
        attn = cpu_kernels.decode_attention(q, keys[:, :, :span], values[:, :, :span], mask, self.scale)
        attn = self.o(attn.transpose(1, 2).reshape(bsz, seq, -1))
        if gemma:  # sandwich norms: the sublayer's output is normed before the residual add
            x, normed = cpu_kernels.residual_norm(x, attn, norm["post_attention"], norm["pre_feedforward"], eps, gemma)
        else:
            x, normed = cpu_kernels.residual_norm(x, attn, None, norm["post_attention"], eps, gemma)
        gate_up = self.gate_up(normed)
        mlp = self.down(cpu_kernels.gated_activation(gate_up[0], gate_up[1] if len(gate_up) > 1 else None,
                                                     self.gelu))
        return cpu_kernels.residual_norm(x, mlp, norm["post_feedforward"], norm["next"], eps, gemma)


def kernel_layers(model) -> list[KernelLayer]:
    """The model's KernelLayers, built on first use and again when a norm weight changed (see `current`)."""
    layers = model.model.layers
    plan = model.__dict__.get("_kernel_layers")
    if plan is None or not all(layer.current() for layer in plan):
        norms = [layer.input_layernorm for layer in layers[1:]] + [model.model.norm]
        plan = [KernelLayer(layer, next_norm) for layer, next_norm in zip(layers, norms)]
        model.__dict__["_kernel_layers"] = plan
    return plan
