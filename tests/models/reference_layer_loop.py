"""The reference the C++ layer loop (cpu_kernels' LayerStack) is held to, bit for bit: the same kernels called one
by one from Python, layer after layer, from the KernelPlan the model gathered (kernel_forward.py)."""

from __future__ import annotations

import torch

from specserve.models import cpu_kernels
from specserve.models.kernel_forward import KernelLayer, KernelPlan, linear_weights
from specserve.models.quant import packed_matmul


def linear(layer, out_fp32: bool = False):
    """x -> layer(x) on the kernel LayerStack uses for it: the packed one for a quantized layer, else bf16."""
    args, weight, bias = linear_weights(layer)
    if args is not None:
        return lambda x: packed_matmul(x, args, bias, out_fp32)
    return lambda x: cpu_kernels.small_linear(x, weight, bias, out_fp32)


def layer_forward(layer: KernelLayer, x, normed, cos, sin, cache, slots, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer output, next norm of it) for the residual stream x [B, T, H] and normed = its input norm."""
    norm, eps, gemma = layer.norm, layer.eps, layer.gemma
    bsz, seq, _ = x.shape
    qkv = [linear(part)(normed) for part in layer.qkv_linears]
    q, k, v = qkv[0].split(layer.qkv_sizes, dim=-1) if len(qkv) == 1 else qkv
    keys, values = cache.keys[layer.index], cache.values[layer.index]
    q = cpu_kernels.rope_store(q, k, v, norm["q"], norm["k"], eps, gemma, cos, sin, keys, values, slots)
    span = mask.shape[-1]
    attn = cpu_kernels.decode_attention(q, keys[:, :, :span], values[:, :, :span], mask, layer.scale)
    attn = linear(layer.o_linear, layer.reduce_attention is not None)(attn.transpose(1, 2).reshape(bsz, seq, -1))
    if layer.reduce_attention is not None:
        attn = layer.reduce_attention(attn).to(x.dtype)
    if gemma:  # sandwich norms: the sublayer's output is normed before the residual add
        x, normed = cpu_kernels.residual_norm(x, attn, norm["post_attention"], norm["pre_feedforward"], eps, gemma)
    else:
        x, normed = cpu_kernels.residual_norm(x, attn, None, norm["post_attention"], eps, gemma)
    # a fused gate/up output [.., 2 I] goes to the activation kernel as it is
    gate_up = [linear(part)(normed) for part in layer.gate_up_linears]
    activated = cpu_kernels.gated_activation(gate_up[0], gate_up[1] if len(gate_up) > 1 else None, layer.gelu)
    mlp = linear(layer.down_linear, layer.reduce_mlp is not None)(activated)
    if layer.reduce_mlp is not None:
        mlp = layer.reduce_mlp(mlp).to(x.dtype)
    return cpu_kernels.residual_norm(x, mlp, norm["post_feedforward"], norm["next"], eps, gemma)


def plan_forward(plan: KernelPlan, x, normed, rope, masks, cache, slots, output_layers):
    """KernelPlan._run's result, from the Python loop."""
    hidden: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(plan.layers):
        cos, sin = rope[layer.layer_type]
        x, normed = layer_forward(layer, x, normed, cos, sin, cache, slots, masks[layer.layer_type])
        if i in output_layers:
            hidden[i] = x
    return normed, hidden


STACK_RUN = KernelPlan._run


def use_loop(monkeypatch, loop: str) -> None:
    """Models run their layers on `loop` from now on: "cpp" (LayerStack, as they do) or "python" (this reference)."""
    monkeypatch.setattr(KernelPlan, "_run", {"cpp": STACK_RUN, "python": plan_forward}[loop])
