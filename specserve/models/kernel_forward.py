"""The row-invariant forward of the decoder layers: every forward of at most MAX_KERNEL_TOKENS tokens per row
(decoding, chain and tree verification, drafting, prefill chunks) on the bf16 CPU kernels. A longer causal forward
runs in chunks of MAX_KERNEL_TOKENS, each seeing the ones before it through the cache, as the engine's chunked
prefill does.

Per layer, nine calls: the q/k/v projection (one quantized call even when a GGUF mixes formats), `rope_store`
(q/k norms, rope, the cache writes), attention, the o projection, `residual_norm` (the residual add and the norm
after it), gate/up, `gated_activation`, down, `residual_norm` again (its norm is the next layer's input norm or the
final one). Each kernel rounds as the PyTorch ops it replaces, so the layer computes what the PyTorch layer of
transformer.py computes on the same kernels for the linears and attention.

What the calls need is gathered once per model (`KernelPlan`): nn.Module attribute lookups and per-call checks
cost more than the glue kernels themselves. cpu_kernels.inc's `LayerStack` runs every layer in one C++ call (the
Python between a step's ~160 kernel calls would be a visible share of a small model's step); the tests hold it, bit
for bit, to a reference that calls the same kernels one by one from Python (tests/models/reference_layer_loop.py).

Under tensor parallelism (specserve/parallel) a layer's o and down projections give this rank's partial sums in
fp32; the attention's and MLP's `reduce` hook (the group's all-reduce) adds the ranks' partials before the one
rounding to bf16, so the sum is rounded once, as the unsharded layer rounds its dot products. The C++ loop calls
the same hook between its kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.models import cpu_kernels
from specserve.models.quant import FusedQuantLinear, QuantLinear

MAX_KERNEL_TOKENS = 64  # the most tokens a row of one kernel forward holds (the kernels' row invariance is tested to it)


def linear_weights(layer) -> tuple[tuple | None, torch.Tensor | None, torch.Tensor | None]:
    """(packed kernel args, bf16 weight, bias) of a linear, exactly one of the first two set. `layer` is a
    (Fused)QuantLinear, an nn.Linear, or a fused bf16 weight (a tensor, or a (weight, bias) pair)."""
    if isinstance(layer, (QuantLinear, FusedQuantLinear)):
        return layer.args, None, layer.bias
    if isinstance(layer, nn.Module):
        return None, layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
    weight, bias = layer if isinstance(layer, tuple) else (layer, None)
    return None, weight, bias


def stack_linear(layer, out_fp32: bool = False):
    """A linear as LayerStack takes it: the packed kernel for a quantized layer, else the bf16 one; fp32 results
    with out_fp32."""
    args, weight, bias = linear_weights(layer)
    if args is not None:
        return cpu_kernels.packed_linear(args, bias, out_fp32)
    return cpu_kernels.bf16_linear(weight, bias, out_fp32)


class KernelLayer:
    """What one decoder layer's row-invariant forward needs, looked up once: its linears, norm weights and settings."""

    def __init__(self, layer, next_norm):
        attn, mlp, spec = layer.self_attn, layer.mlp, layer.self_attn.spec
        self.index, self.layer_type = attn.layer_idx, layer.layer_type
        self.eps, self.gemma, self.scale, self.gelu = spec.rms_norm_eps, spec.gemma, spec.attn_scale, mlp.gelu
        # the linears: one fused weight for several parts when there is one, else the parts
        fused_qkv, fused_gate_up = attn.qkv_quant or attn.qkv, mlp.gate_up_quant or mlp.gate_up
        self.qkv_linears = [fused_qkv] if fused_qkv is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
        self.qkv_sizes = [part.out_features for part in (attn.q_proj, attn.k_proj, attn.v_proj)]
        self.gate_up_linears = [fused_gate_up] if fused_gate_up is not None else [mlp.gate_proj, mlp.up_proj]
        self.o_linear, self.down_linear = attn.o_proj, mlp.down_proj
        # tensor parallel: the ranks' fp32 partial sums of o and down, added across ranks (then rounded once)
        self.reduce_attention, self.reduce_mlp = attn.reduce, mlp.reduce
        norms = {"q": getattr(attn, "q_norm", None), "k": getattr(attn, "k_norm", None), "next": next_norm,
                 "post_attention": layer.post_attention_layernorm,
                 "pre_feedforward": getattr(layer, "pre_feedforward_layernorm", None),
                 "post_feedforward": getattr(layer, "post_feedforward_layernorm", None)}
        self.norm = {name: None if norm is None else norm.kernel_weight() for name, norm in norms.items()}
        self.norm_versions = [(norm.weight, norm.weight._version) for norm in norms.values() if norm is not None]

    def current(self) -> bool:
        """False once a norm weight changed in place (its kernel weight is derived from it)."""
        return all(weight._version == version for weight, version in self.norm_versions)

    def stack_layer(self, kind: int):
        """This layer for cpu_kernels' LayerStack; `kind` indexes the forward's per-layer-type rope and masks."""
        norm = self.norm
        return cpu_kernels.stack_layer(
            qkv=[stack_linear(linear) for linear in self.qkv_linears], qkv_sizes=self.qkv_sizes,
            o=stack_linear(self.o_linear, out_fp32=self.reduce_attention is not None),
            gate_up=[stack_linear(linear) for linear in self.gate_up_linears],
            down=stack_linear(self.down_linear, out_fp32=self.reduce_mlp is not None),
            q_norm=norm["q"], k_norm=norm["k"],
            post_attention=norm["post_attention"], pre_feedforward=norm["pre_feedforward"],
            post_feedforward=norm["post_feedforward"], next_norm=norm["next"], eps=self.eps, scale=self.scale,
            gemma=self.gemma, gelu=self.gelu, cache_index=self.index, kind=kind)


class KernelPlan:
    """A model's KernelLayers and, made on first use, the LayerStack that runs them in one C++ call."""

    def __init__(self, model):
        layers = model.model.layers
        norms = [layer.input_layernorm for layer in layers[1:]] + [model.model.norm]
        self.layers = [KernelLayer(layer, next_norm) for layer, next_norm in zip(layers, norms)]
        self.layer_types = list(dict.fromkeys(layer.layer_type for layer in self.layers))
        reduces = {hook for layer in self.layers for hook in (layer.reduce_attention, layer.reduce_mlp)}
        if len(reduces) != 1:
            raise ValueError("the layers of a model are all sharded with one all-reduce, or none is")
        self.reduce = reduces.pop()
        self._stack = None

    def current(self) -> bool:
        return all(layer.current() for layer in self.layers)

    @property
    def stack(self):
        if self._stack is None:
            kinds = {layer_type: kind for kind, layer_type in enumerate(self.layer_types)}
            layers = [layer.stack_layer(kinds[layer.layer_type]) for layer in self.layers]
            self._stack = cpu_kernels.layer_stack(layers, self.reduce)
        return self._stack

    def run(self, x, normed, rope, masks, cache, slots, output_layers) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(the final norm of the last layer's output, {i: layer i's output for i in output_layers}) for the
        residual stream x [B, T, H], normed = the first layer's input norm of it; `rope` and `masks` map each
        layer type to its (cos, sin) [B, T, D] and mask [B, 1, T, S]. Over MAX_KERNEL_TOKENS tokens a row, in
        chunks: each chunk's rows of the masks, cut to the slots they can see (the chunks before it and the cache)."""
        width = x.shape[1]
        if width <= MAX_KERNEL_TOKENS:
            return self._run(x, normed, rope, masks, cache, slots, output_layers)
        parts = []
        for start in range(0, width, MAX_KERNEL_TOKENS):
            rows = slice(start, start + MAX_KERNEL_TOKENS)
            span = max(int(slots[:, :rows.stop].max()) + 1, int(cache.lengths.max()))
            parts.append(self._run(
                x[:, rows].contiguous(), normed[:, rows].contiguous(),
                {kind: (cos[:, rows].contiguous(), sin[:, rows].contiguous()) for kind, (cos, sin) in rope.items()},
                {kind: mask[:, :, rows, :span].contiguous() for kind, mask in masks.items()}, cache,
                slots[:, rows].contiguous(), output_layers))
        return torch.cat([normed for normed, _ in parts], 1), {
            i: torch.cat([hidden[i] for _, hidden in parts], 1) for i in parts[0][1]}

    def _run(self, x, normed, rope, masks, cache, slots, output_layers):
        keep = sorted({i for i in output_layers if 0 <= i < len(self.layers)})
        types = self.layer_types
        normed, kept = self.stack.forward(x, normed, [rope[t][0] for t in types], [rope[t][1] for t in types],
                                          [masks[t] for t in types], cache.keys, cache.values, slots, keep)
        return normed, dict(zip(keep, kept))


def kernel_plan(model) -> KernelPlan:
    """The model's KernelPlan, built on first use and again when a norm weight changed (see `current`)."""
    plan = model.__dict__.get("_kernel_layers")
    if plan is None or not plan.current():
        plan = KernelPlan(model)
        model.__dict__["_kernel_layers"] = plan
    return plan
