"""An EAGLE head's drafting forward on the CPU kernels: the decoder layer in one C++ call, weights in int4 or int8.

Drafting runs the head a few times per step, each time over 1-8 rows, right after the target's forward has
evicted the caches. In PyTorch a head forward is ~60 small ops and nine bf16 GEMM calls, several times what reading
its weights once takes. Here the decoder layers run as the target's do (cpu_kernels'
`LayerStack`, the layer's fused q/k/v and gate/up projections, rope, attention and norms in one call), the rope
tables are precomputed, and every linear is packed in int4 (the default) or int8 blocks of 32 (quant.py): a
quarter or half of the bytes read. A step drafts right after the target's forward has evicted the head's weights
from the caches, so the bytes set the time, and int4 heads run faster than int8 ones (docs/design-notes.md, "Kept
settings"; `benchmarks/draft_length_ab.py`).

The layer maps onto LayerStack's Llama layer as follows (eagle.py has the layouts):

* EAGLE-3's midlayer: the stack's residual stream is x = fc(features) (or the head's own previous output), its
  first input "norm" is [input_layernorm(embeds), hidden_norm(x)] (2h wide, what q/k/v read), and the stack's
  final norm is the head's `norm`, so the call returns both the next feature (the layer's output) and the input
  of the draft lm_head.
* EAGLE-1: x = fc([embeds, features]); layer 0 reads x itself (it has no input norm), layer i + 1's input norm is
  layer i's next norm, and the outputs go to the target's lm_head unnormed.

Drafts are proposals, never verdicts: quantized weights change which tokens are proposed, not the output, which the
target's verification fixes (the losslessness tests run drafting on this path).
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.checks import ConfigError
from specserve.models import cpu_kernels
from specserve.models.kernel_forward import stack_linear
from specserve.models.kv_cache import KVCache
from specserve.models.quant import FusedQuantLinear, QuantizationError, QuantLinear, quantize_linear
from specserve.models.transformer import soft_cap
from specserve.speculative.eagle import EagleHead


def usable(head: EagleHead) -> bool:
    """Whether this head can draft on the kernels: bf16 weights on a CPU that runs them, and a head dimension the
    attention kernel takes (a multiple of 16)."""
    weight = head.fc.weight
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and head.config.head_dim % 16 == 0
            and cpu_kernels.available())


HEAD_QUANTIZATIONS = ("int8", "int4", "none")
DEFAULT_HEAD_QUANTIZATION = "int4"  # a head's bytes set its drafting time (module docstring)


def read_quantization(settings: dict, heads: str) -> dict:
    """{"quantization": value} from a config's `quantization` (vLLM's speculative_config key for the draft's
    weights; None means "none"), checked; {} where the config has none. `heads` names them in the error."""
    if "quantization" not in settings:
        return {}
    value = settings["quantization"] or "none"
    if value not in HEAD_QUANTIZATIONS:
        raise ConfigError(f"quantization {value!r} for {heads}: use one of {', '.join(HEAD_QUANTIZATIONS)}")
    return {"quantization": value}


def packed(linear: nn.Linear, quantization: str) -> nn.Module:
    """The linear in `quantization` ("int8" or "int4") where its shape allows, else itself (bf16)."""
    if quantization == "none":
        return linear
    try:
        return quantize_linear(linear, quantization)
    except QuantizationError:
        return linear


def fused(linears: list[nn.Module]) -> list[nn.Module]:
    """One call for several linears over the same input when all are packed, else the parts."""
    if all(isinstance(linear, QuantLinear) for linear in linears):
        return [FusedQuantLinear(linears)]
    return linears


def target_rows(target_model, ids: torch.Tensor, quantization: str) -> nn.Module:
    """The target's lm_head restricted to the rows `ids` (an EAGLE-1 head's draft vocabulary): a linear whose
    fp32 outputs are those tokens' logits, in `quantization` ("int4" / "int8" packed, or "none": the rows' own
    precision), soft-capped as the target caps its logits. The full 262k-row lm_head costs an EAGLE-1 level as much
    as ~half a target step; 8k rows cost ~1/30 of it."""
    packed_head = target_model.lm_head_packed
    rows = packed_head.rows(ids) if packed_head is not None else target_model.lm_head_weight.detach()[ids].float()
    linear = bias_free_linear(rows.to(target_model.dtype))
    return RowsHead(packed(linear, quantization), target_model.spec.final_logit_softcapping)


def bias_free_linear(weight: torch.Tensor) -> nn.Linear:
    """A frozen nn.Linear over `weight` [N, K] (what `packed` takes), for weights held outside a linear."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear


class RowsHead(nn.Module):
    """target_rows' linear and the target's soft-cap."""

    def __init__(self, linear: nn.Module, softcap: float | None):
        super().__init__()
        self.linear, self.softcap = linear, softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_cap(fp32_outputs(self.linear, x), self.softcap)


def fp32_outputs(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A draft lm_head's fp32 logits, packed (QuantLinear) or in its weights' own precision."""
    if isinstance(linear, QuantLinear):
        return linear(x, out_fp32=True)
    return linear(x.to(linear.weight.dtype)).float()


class KernelHead:
    """`EagleHead.forward` and its draft logits for inference, on the kernels (see the module docstring)."""

    def __init__(self, head: EagleHead, quantization: str = DEFAULT_HEAD_QUANTIZATION):
        cfg = head.config
        self.head, self.kind = head, head.kind
        self.eps, self.hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.fc = packed(head.fc, quantization)
        if self.kind == "eagle3":
            self.input_norm = head.midlayer.input_layernorm.weight.float().contiguous()
            self.hidden_norm = head.midlayer.hidden_norm.weight.float().contiguous()
            self.lm_head = packed(head.lm_head, quantization)
            final_norms = [head.norm.weight.float().contiguous()]
        else:  # the last layer's "next norm" is computed and unused: EAGLE-1's outputs go to the lm_head as they are
            final_norms = [layer.input_layernorm.weight.float().contiguous() for layer in head.layers[1:]]
            final_norms.append(torch.ones(self.hidden))
        layers = [self._stack_layer(layer, i, norm, quantization) for i, (layer, norm)
                  in enumerate(zip(head.decoder_layers, final_norms))]
        self.stack = cpu_kernels.layer_stack(layers)
        self._cos = self._sin = torch.empty(0, cfg.head_dim, dtype=torch.bfloat16)

    def _stack_layer(self, layer, index: int, next_norm: torch.Tensor, quantization: str):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = fused([packed(p, quantization) for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
        gate_up = fused([packed(p, quantization) for p in (mlp.gate_proj, mlp.up_proj)])
        return cpu_kernels.stack_layer(
            qkv=[stack_linear(p) for p in qkv], qkv_sizes=[p.out_features for p in (attn.q_proj, attn.k_proj,
                                                                                     attn.v_proj)],
            o=stack_linear(packed(attn.o_proj, quantization)), gate_up=[stack_linear(p) for p in gate_up],
            down=stack_linear(packed(mlp.down_proj, quantization)), q_norm=None, k_norm=None,
            post_attention=layer.post_attention_layernorm.weight.float().contiguous(), pre_feedforward=None,
            post_feedforward=None, next_norm=next_norm, eps=self.eps, scale=attn.spec.attn_scale, gemma=False,
            gelu=mlp.gelu, cache_index=index, kind=0)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 cos, sin [T, D] at `positions`, from a table grown by doubling (the head's own rotary)."""
        needed = int(positions.max()) + 1
        if needed > self._cos.shape[0]:
            size = max(needed, 2 * self._cos.shape[0], 256)
            cos, sin = self.head.rotary(torch.arange(size))
            self._cos, self._sin = cos.to(torch.bfloat16).contiguous(), sin.to(torch.bfloat16).contiguous()
        return self._cos[positions], self._sin[positions]

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                slots: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the head's outputs [T, h], the draft lm_head's inputs [T, h]) for EagleHead.forward's arguments."""
        features, embeds = features.to(torch.bfloat16), embeds.to(torch.bfloat16).contiguous()
        if self.kind == "eagle3":
            x = self.fc(features) if features.shape[-1] != self.hidden else features.contiguous()
            first = torch.cat([cpu_kernels.rms_norm(embeds, self.input_norm, self.eps, False),
                               cpu_kernels.rms_norm(x, self.hidden_norm, self.eps, False)], dim=-1)
        else:
            x = self.fc(torch.cat([embeds, features], dim=-1))
            first = x
        cos, sin = self.rope(positions)
        normed, kept = self.stack.forward(x[None], first[None], [cos[None]], [sin[None]], [mask[None, None]],
                                          cache.keys, cache.values,
                                          slots[None], [len(cache.keys) - 1])
        out = kept[0][0]
        return out, (normed[0] if self.kind == "eagle3" else out)

    def draft_logits(self, lm_inputs: torch.Tensor, target_logits) -> torch.Tensor:
        """fp32 logits [T, V'] of forward's lm_head inputs (EAGLE-1: through the target's lm_head, a callable)."""
        if self.kind != "eagle3":
            return target_logits(lm_inputs).float()
        return fp32_outputs(self.lm_head, lm_inputs)
