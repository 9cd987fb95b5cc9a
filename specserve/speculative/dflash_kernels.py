"""A DFlash drafter's block forward on the CPU kernels: its decoder layers in one LayerStack call.

The block [pending token, mask, ...] is a decoder forward over a cache: each drafter layer's keys and values of the
committed tokens sit in the request's `ContextCache` (injected from the target's features), the block's own are
written into the free slots after them, and every block position sees all of them. That is the target's layer on
the kernels (`cpu_kernels.LayerStack`: fused q/k/v and gate/up projections, Qwen3's per-head q/k norms, rope, the
write into the cache at `slots`, attention under a mask, norms), with an all-visible mask over the cached tokens
and the block. In PyTorch the same forward is ~60 small ops per layer, most of a propose's time.

The layer maps onto the stack as follows (dflash.py has the layout): the residual stream starts at the block's
embeddings, the first normed input is layer 0's `input_layernorm` of them, layer i's next norm is layer i + 1's
`input_layernorm` and the last one's the drafter's `norm`, so the call returns the normed outputs the draft lm_head
reads. The block's keys and values are left in the slots past the cached length, which the next injection
overwrites. Drafts are proposals: the kernels' rounding changes what is proposed, never the verified output.
"""

from __future__ import annotations

import torch

from specserve.models import cpu_kernels
from specserve.models.kernel_forward import stack_linear
from specserve.speculative.dflash import ContextCache, DFlashDrafter
from specserve.speculative.eagle_kernels import fused


def usable(drafter: DFlashDrafter) -> bool:
    """bf16 weights on a CPU that runs the kernels, and a head dimension the attention kernel takes."""
    weight = drafter.norm.weight
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and drafter.config.head_dim % 16 == 0
            and cpu_kernels.available())


class KernelBlock:
    """`DFlashDrafter.block` over a ContextCache for inference, on the kernels; the drafter's linears as they are
    (packed by `dflash_draft.pack_linears`, or bf16)."""

    def __init__(self, drafter: DFlashDrafter):
        cfg = drafter.config
        self.eps = cfg.rms_norm_eps
        self.first_norm = norm_weight(drafter.layers[0].input_layernorm)
        next_norms = [layer.input_layernorm for layer in drafter.layers[1:]] + [drafter.norm]
        self.stack = cpu_kernels.layer_stack([self._stack_layer(layer, i, norm_weight(norm), cfg)
                                              for i, (layer, norm) in enumerate(zip(drafter.layers, next_norms))])

    @staticmethod
    def _stack_layer(layer, index: int, next_norm: torch.Tensor, cfg):
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        return cpu_kernels.stack_layer(
            qkv=[stack_linear(p) for p in fused(list(projections))], qkv_sizes=[p.out_features for p in projections],
            o=stack_linear(attn.o_proj), gate_up=[stack_linear(p) for p in fused([mlp.gate_proj, mlp.up_proj])],
            down=stack_linear(mlp.down_proj), q_norm=norm_weight(attn.q_norm), k_norm=norm_weight(attn.k_norm),
            post_attention=norm_weight(layer.post_attention_layernorm), pre_feedforward=None, post_feedforward=None,
            next_norm=next_norm, eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5, gemma=False,
            gelu=mlp.gelu, cache_index=index, kind=0)

    def __call__(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 cache: ContextCache) -> torch.Tensor:
        """embeds [Q, h] of the block's tokens, cos/sin [Q, hd] at their positions (after the cache's tokens) ->
        the normed outputs [Q, h]."""
        x = embeds.to(torch.bfloat16).contiguous()
        first = cpu_kernels.rms_norm(x, self.first_norm, self.eps, False)
        count, cached = x.shape[0], cache.length
        slots = torch.arange(cached, cached + count)[None]
        visible = torch.ones(1, 1, count, cached + count, dtype=torch.bool)
        normed, _ = self.stack.forward(x[None], first[None], [cos[None].contiguous()], [sin[None].contiguous()],
                                       [visible], cache.keys, cache.values, slots, [])
        return normed[0]


def norm_weight(norm) -> torch.Tensor:
    return norm.weight.float().contiguous()
