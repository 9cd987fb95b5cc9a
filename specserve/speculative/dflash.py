"""DFlash block drafters (Chen et al. 2026, arXiv 2602.06036) in the layout z-lab publishes (`z-lab/*-DFlash*`).

A block drafter proposes a whole block in one forward. The block is the pending token (the anchor) followed by
B - 1 mask tokens; the drafter's output at block position j > 0 is its guess of the token at that position. It
sees the sequence only through the target's features: the outputs of the target layers `target_layer_ids`,
concatenated and fused, z = hidden_norm(fc([h_l1, ..., h_ln])), are projected by every drafter layer's own
k_proj / v_proj into keys and values of the context ("KV injection"). The block's positions attend to all of the
context and to each other (no causal mask inside the block), so the drafter runs once per step, however long the
block, and the context's keys and values of each committed token are computed once and kept.

Layout (z-lab `dflash/model.py`, a Qwen3 decoder without embeddings or lm_head):

* `config.json`: a Qwen3 config (`hidden_size`, `num_attention_heads`, `num_key_value_heads`, `head_dim`,
  `intermediate_size`, `num_hidden_layers`, `rms_norm_eps`, `rope_theta`, `attention_bias`) and
  `dflash_config: {target_layer_ids, block_size, mask_token_id}` (optional `input_embedding_scale`).
* `model.safetensors`: `fc.weight` [h, n * h], `hidden_norm.weight`, `norm.weight`, and per layer i
  `layers.{i}.self_attn.{q,k,v,o}_proj.weight` (+ `.bias` with attention_bias), `layers.{i}.self_attn.{q,k}_norm.weight`
  (per-head RMSNorm before rope), `layers.{i}.{input,post_attention}_layernorm.weight`,
  `layers.{i}.mlp.{gate,up,down}_proj.weight`.
* the block's inputs are the target's embedding rows of [anchor, mask, ..., mask] times `input_embedding_scale`,
  and its logits the target's lm_head over norm(outputs). A `draft_vocab.json` beside the weights (specserve's own
  heads) scores drafts over those rows of the target's lm_head only.

The DFlash-2 additions (dynamic convolutions, a candidate selector) and sliding-window drafter layers are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.transformer import MLP, ArchSpec, Attention, RMSNorm, rotate
from specserve.speculative.eagle import Linear, default_aux_layer_ids, draft_layer_spec, llama_rope_tables
from specserve.speculative.weights import check_layout, read_weights, write_weights

SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"
CONFIG_FILE = "config.json"
DFLASH2_KEYS = ("conv_kernel_size", "selector_rank")  # DFlash-2's extra parts, not supported


@dataclass
class DFlashConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    target_layer_ids: list[int]  # the target layers whose outputs are fused (0-based)
    block_size: int  # anchor + masks: at most block_size - 1 tokens drafted per forward
    mask_token_id: int
    input_embedding_scale: float = 1.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    hidden_act: str = "silu"
    vocab_size: int | None = None  # the target's, as the checkpoint records it
    extra: dict = field(default_factory=dict)  # other config.json keys, written back unchanged

    def arch_spec(self) -> ArchSpec:
        """The drafter's layers in the terms of the target's module types: a Qwen3 decoder's."""
        return draft_layer_spec(self, "qwen3", self.vocab_size or 0, attention_bias=self.attention_bias,
                                output_bias=self.attention_bias, qk_norm=True)

    def to_json(self) -> dict:
        return {**self.extra, "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                "hidden_size": self.hidden_size, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
                "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
                "max_position_embeddings": self.max_position_embeddings, "attention_bias": self.attention_bias,
                "hidden_act": self.hidden_act, "vocab_size": self.vocab_size, "block_size": self.block_size,
                "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "block_size": self.block_size,
                                  "mask_token_id": self.mask_token_id,
                                  "input_embedding_scale": self.input_embedding_scale}}

    @classmethod
    def from_json(cls, data: dict) -> "DFlashConfig":
        known = {"architectures", "model_type", "hidden_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "num_hidden_layers", "rms_norm_eps", "rope_theta", "rope_scaling",
                 "max_position_embeddings", "attention_bias", "hidden_act", "vocab_size", "block_size",
                 "dflash_config"}
        draft = dict(data.get("dflash_config") or {})
        unsupported = [key for key in DFLASH2_KEYS if key in draft or key in data]
        if unsupported or "sliding_attention" in (data.get("layer_types") or []):
            raise ValueError("a DFlash-2 drafter (dynamic convolutions, candidate selector) or one with "
                             "sliding-window layers: only DFlash's full-attention drafter is supported")

        def value(name, default=None):
            return draft.get(name, data.get(name, default))

        try:
            heads = int(data["num_attention_heads"])
            hidden = int(data["hidden_size"])
            layer_ids = value("target_layer_ids")
            if not layer_ids:
                raise KeyError("dflash_config.target_layer_ids")
            return cls(hidden_size=hidden, num_heads=heads,
                       num_kv_heads=int(data.get("num_key_value_heads") or heads),
                       head_dim=int(data.get("head_dim") or hidden // heads),
                       intermediate_size=int(data["intermediate_size"]), num_layers=int(data["num_hidden_layers"]),
                       target_layer_ids=[int(i) for i in layer_ids], block_size=int(value("block_size", 16)),
                       mask_token_id=int(value("mask_token_id")),
                       input_embedding_scale=float(value("input_embedding_scale", 1.0)),
                       rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(data.get("rope_theta", 1_000_000.0)), rope_scaling=data.get("rope_scaling"),
                       max_position_embeddings=int(data.get("max_position_embeddings", 32768)),
                       attention_bias=bool(data.get("attention_bias", False)),
                       hidden_act=data.get("hidden_act", "silu"), vocab_size=data.get("vocab_size"),
                       extra={k: v for k, v in data.items() if k not in known})
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"config.json lacks or mistypes {exc} for a DFlash drafter") from None


class BlockAttention(Attention):
    """The target's attention type (a Qwen3 layer's: q/k norms) with the drafter's kernel linears, attending from
    the block's positions over the injected context and the whole block."""

    def __init__(self, config: DFlashConfig):
        super().__init__(config.arch_spec(), 0, linear=Linear)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, T, h], cos/sin [b or 1, 1, T, hd] -> rotated keys and values [b, kv_heads, T, hd] (the
        context's)."""
        b, t, _ = x.shape
        kv, hd = self.spec.num_kv_heads, self.spec.head_dim
        k = self.k_norm(self.k_proj(x).view(b, t, kv, hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, kv, hd).transpose(1, 2)
        return rotate(k, cos, sin), v

    def forward(self, x, cos, sin, context, mask) -> torch.Tensor:
        """x [b, Q, h] (normed block inputs), cos/sin [b or 1, Q, hd]; `context`: the context's (keys, values)
        [b, kv, S, hd], or a ContextCache's `Slots`, after whose S cached tokens the block's own keys and values
        are written (the next injection overwrites them); mask [b, Q, S + Q] (True: visible) or None (all)."""
        b, t, _ = x.shape
        q, k, v = self.heads(x, cos, sin)
        if isinstance(context, Slots):
            end = context.length + t
            context.keys[:, :, context.length: end], context.values[:, :, context.length: end] = k, v
            k, v = context.keys[:, :, :end], context.values[:, :, :end]
        else:
            k, v = torch.cat([context[0], k], 2), torch.cat([context[1], v], 2)
        # the query heads sharing a key head attend as one taller query: no copies of the keys and values
        spec = self.spec
        groups = spec.num_heads // spec.num_kv_heads
        q = q.reshape(b, spec.num_kv_heads, groups * t, spec.head_dim)
        mask = None if mask is None else mask.repeat(1, groups, 1)[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.attn_scale)
        out = out.view(b, spec.num_heads, t, spec.head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class BlockLayer(nn.Module):
    """A Qwen3 decoder layer of the target's module types over the block."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = BlockAttention(config)
        self.mlp = MLP(config.arch_spec(), linear=Linear)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, gemma=False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, gemma=False)

    def forward(self, x, cos, sin, context, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The drafter; `state_dict()` is z-lab's layout. Inference and training run the same two calls: `context`
    (target features -> each layer's keys and values) and `block` (the block's embeddings -> normed outputs)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps, gemma=False)
        self.layers = nn.ModuleList(BlockLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps, gemma=False)
        self._rotary = None

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [..., head_dim] at `positions`, in the weights' dtype."""
        if self._rotary is None:
            self._rotary = llama_rope_tables(self.config)
        cos, sin = self._rotary.lookup(positions.long().cpu(), "full_attention")
        weight = self.norm.weight  # a linear may be packed for the kernels (dflash_draft.py): the norms are not
        return cos.to(weight.device, weight.dtype), sin.to(weight.device, weight.dtype)

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features [b, T, n * h] of the target at `positions` [b, T] -> per layer (keys, values) [b, kv, T, hd]."""
        z = self.hidden_norm(self.fc(features.to(self.norm.weight.dtype)))
        cos, sin = self.rotary(positions)
        return [layer.self_attn.keys_values(z, cos[:, None], sin[:, None]) for layer in self.layers]

    def block(self, embeds: torch.Tensor, positions: torch.Tensor, context: list, mask=None) -> torch.Tensor:
        """embeds [b, Q, h] of the block's tokens at `positions` [b, Q], over `context` (per layer (keys,
        values), or `Slots`), visible as `mask` [b, Q, S + Q] allows (None: all) -> normed outputs [b, Q, h]."""
        x = embeds.to(self.norm.weight.dtype)
        cos, sin = self.rotary(positions)
        for layer, layer_context in zip(self.layers, context):
            x = layer(x, cos, sin, layer_context, mask)
        return self.norm(x)


class Slots(NamedTuple):
    """One layer's cache storage [1, kv_heads, capacity, head_dim]: `length` tokens cached, free slots after."""
    keys: torch.Tensor
    values: torch.Tensor
    length: int


class ContextCache:
    """The drafter's keys and values of one sequence's committed tokens: [kv_heads, capacity, head_dim] per layer,
    with a block's room beyond the capacity for the block's own keys and values."""

    def __init__(self, drafter: DFlashDrafter, capacity: int):
        cfg = drafter.config
        dtype = drafter.norm.weight.dtype
        shape = (1, cfg.num_kv_heads, capacity + cfg.block_size, cfg.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in drafter.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.length = 0

    def append(self, context: list) -> None:
        """Write the next tokens' (keys, values) per layer, as `DFlashDrafter.context` gives them."""
        n = context[0][0].shape[2]
        for layer, (k, v) in enumerate(context):
            self.keys[layer][:, :, self.length: self.length + n] = k
            self.values[layer][:, :, self.length: self.length + n] = v
        self.length += n

    def view(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in zip(self.keys, self.values)]

    def slots(self) -> list[Slots]:
        """Per layer the storage and the cached length, for a block to attend without copying the context."""
        return [Slots(k, v, self.length) for k, v in zip(self.keys, self.values)]


def save_dflash(drafter: DFlashDrafter, path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_weights(drafter, path, SAFETENSORS_FILE)
    (path / CONFIG_FILE).write_text(json.dumps(drafter.config.to_json(), indent=2))
    return path


def is_dflash_dir(directory) -> bool:
    """Whether the directory holds a DFlash drafter (its config names dflash_config)."""
    path = Path(directory) / CONFIG_FILE
    try:
        return "dflash_config" in json.loads(path.read_text())
    except (OSError, ValueError):
        return False


def load_dflash(path, target_spec, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """A DFlash drafter directory for a target with the given ArchSpec; ValueError naming both sides when it was
    made for another model."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE}: not a DFlash drafter directory")
    config = DFlashConfig.from_json(json.loads((path / CONFIG_FILE).read_text()))
    check_against_target(config, target_spec, path)
    state = {k.removeprefix("model."): v for k, v in read_weights(path, SAFETENSORS_FILE, TORCH_FILE).items()}
    drafter = DFlashDrafter(config)
    check_layout(path, f"DFlash layout of a {config.num_layers}-layer drafter", drafter.state_dict(), state)
    drafter.load_state_dict(state)
    return drafter.to(dtype).eval()


def check_against_target(config: DFlashConfig, target_spec, path: Path) -> None:
    if config.hidden_size != target_spec.hidden_size:
        raise ValueError(f"DFlash drafter {path} has hidden size {config.hidden_size}, the target model has "
                         f"{target_spec.hidden_size}: it belongs to another model")
    if config.vocab_size is not None and int(config.vocab_size) != target_spec.vocab_size:
        raise ValueError(f"DFlash drafter {path} was made for a vocabulary of {config.vocab_size} tokens, the "
                         f"target model has {target_spec.vocab_size}: it belongs to another model")
    bad = [i for i in config.target_layer_ids if not 0 <= i < target_spec.num_layers]
    if bad:
        raise ValueError(f"DFlash drafter {path} reads target layers {bad}; the target model has layers "
                         f"0..{target_spec.num_layers - 1}")
    if not 0 <= config.mask_token_id < target_spec.vocab_size:
        raise ValueError(f"DFlash drafter {path}: mask_token_id {config.mask_token_id} is outside the target's "
                         f"vocabulary of {target_spec.vocab_size}")
    if config.block_size < 2:
        raise ValueError(f"DFlash drafter {path}: block_size {config.block_size} drafts nothing (need >= 2)")


def new_dflash(target_spec, num_layers: int, block_size: int, mask_token_id: int, embedding_scale: float,
               target_layer_ids: list[int] | None = None, seed: int = 0, std: float = 0.02) -> DFlashDrafter:
    """A randomly initialized drafter of the target's layer shapes: the start of training, and the random
    drafters of the tests. By default it reads the layers whose outputs EAGLE-3 fuses (the inputs of its low /
    mid / high layers), so one set of distilled features trains both."""
    config = DFlashConfig(hidden_size=target_spec.hidden_size, num_heads=target_spec.num_heads,
                          num_kv_heads=target_spec.num_kv_heads, head_dim=target_spec.head_dim,
                          intermediate_size=target_spec.intermediate_size, num_layers=num_layers,
                          target_layer_ids=target_layer_ids or default_target_layers(target_spec.num_layers),
                          block_size=block_size, mask_token_id=mask_token_id, input_embedding_scale=embedding_scale,
                          rms_norm_eps=target_spec.rms_norm_eps, vocab_size=target_spec.vocab_size)
    drafter = DFlashDrafter(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * std if param.dim() > 1
                            else torch.zeros_like(param))
    return drafter


def default_target_layers(num_target_layers: int) -> list[int]:
    return [i - 1 for i in default_aux_layer_ids(num_target_layers)]
