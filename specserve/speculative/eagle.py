"""EAGLE draft heads (Li et al. 2024, 2025) in the checkpoint layouts their authors publish.

Both read the target's features and draft tokens autoregressively; the input at draft position t is the pair
(feature of token t, embedding of token t + 1), so the head's output at t predicts token t + 2.

EAGLE-1 / EAGLE-2 (`yuhuili/EAGLE-*`; SafeAILab/EAGLE `eagle/model/cnets1.py`, vLLM `llama_eagle.py`):

* `config.json`: a Llama config (`hidden_size`, `num_attention_heads`, `num_key_value_heads`, `intermediate_size`,
  `num_hidden_layers` (usually 1), `rms_norm_eps`, `rope_theta`, `vocab_size`; optional `bias` for fc).
* `pytorch_model.bin` (or `model.safetensors`): `fc.weight` [h, 2h] (+ `fc.bias` when trained with bias),
  `layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
  `layers.{i}.post_attention_layernorm.weight`, and `layers.{i}.input_layernorm.weight` for i >= 1 only (layer 0
  has no input norm); optional `embed_tokens.weight` (else the target's table is used).
* feature: the target's final normed hidden state; x = fc([embed(token), feature]) -> decoder layers -> the next
  feature, whose tokens come from the target's own lm_head (no norm in between).

EAGLE-3 (`yuhuili/EAGLE3-*`; SafeAILab/EAGLE `eagle/model/cnets.py`, vLLM `llama_eagle3.py`):

* `config.json`: as above plus `draft_vocab_size` (and optionally `target_hidden_size`,
  `eagle_config.eagle_aux_hidden_state_layer_ids`).
* weights: `fc.weight` [h, 3 * target_h] (no bias), one decoder layer `midlayer.*` whose q/k/v projections read
  2h inputs, `midlayer.input_layernorm.weight` (on the embedding), `midlayer.hidden_norm.weight` (on the
  feature), `midlayer.post_attention_layernorm.weight`, `norm.weight`, `lm_head.weight` [draft_vocab, h], and the
  draft-vocabulary maps `d2t` [draft_vocab] int64 (target id = i + d2t[i]) and `t2d` [vocab] bool.
* feature: the residual stream entering target layers (2, L // 2, L - 3) (low, mid, high), concatenated and
  fused by fc; the layer's pre-norm output is fed back as the next step's feature (training-time test), and
  lm_head(norm(output)) gives draft-vocabulary logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from specserve.models import cpu_kernels
from specserve.models.kv_cache import KVCache
from specserve.models.transformer import MLP, ArchSpec, Attention, RMSNorm, RopeTables
from specserve.speculative.weights import check_layout, read_weights, write_weights

TORCH_FILE = "pytorch_model.bin"
SAFETENSORS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


@dataclass
class EagleConfig:
    kind: str  # "eagle" (EAGLE-1/2 layout) or "eagle3"
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    num_layers: int = 1
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    fc_bias: bool = False  # EAGLE-1 only
    draft_vocab_size: int | None = None  # EAGLE-3 only; None = vocab_size
    target_hidden_size: int | None = None  # EAGLE-3 only; None = hidden_size
    aux_layer_ids: list[int] | None = None  # EAGLE-3: target layers whose input is fused; None = default
    extra: dict = field(default_factory=dict)  # other config.json keys, written back unchanged

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_heads
        if self.kind == "eagle3":
            self.draft_vocab_size = self.draft_vocab_size or self.vocab_size
            self.target_hidden_size = self.target_hidden_size or self.hidden_size

    def arch_spec(self) -> ArchSpec:
        """The head's layers in the terms of the target's module types: a Llama decoder's."""
        return draft_layer_spec(self, "llama", self.vocab_size)

    def to_json(self) -> dict:
        data = {**self.extra, "model_type": "llama", "hidden_size": self.hidden_size,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "vocab_size": self.vocab_size,
                "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position_embeddings,
                "hidden_act": self.hidden_act, "tie_word_embeddings": False}
        if self.kind == "eagle3":
            data["architectures"] = ["LlamaForCausalLMEagle3"]
            data["draft_vocab_size"] = self.draft_vocab_size
            data["target_hidden_size"] = self.target_hidden_size
            if self.aux_layer_ids is not None:
                data["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        else:
            data["architectures"] = ["LlamaForCausalLM"]
            data["bias"] = self.fc_bias
        return data

    @classmethod
    def from_json(cls, data: dict, kind: str) -> "EagleConfig":
        known = {"hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                 "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
                 "max_position_embeddings", "hidden_act", "bias", "draft_vocab_size", "target_hidden_size",
                 "eagle_config", "model_type", "architectures", "tie_word_embeddings"}
        try:
            eagle_config = data.get("eagle_config") or {}
            return cls(kind=kind, hidden_size=int(data["hidden_size"]),
                       num_heads=int(data["num_attention_heads"]),
                       num_kv_heads=int(data.get("num_key_value_heads") or data["num_attention_heads"]),
                       intermediate_size=int(data["intermediate_size"]), vocab_size=int(data["vocab_size"]),
                       num_layers=int(data.get("num_hidden_layers", 1)), head_dim=data.get("head_dim"),
                       rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(data.get("rope_theta", 10000.0)), rope_scaling=data.get("rope_scaling"),
                       max_position_embeddings=int(data.get("max_position_embeddings", 4096)),
                       hidden_act=data.get("hidden_act", "silu"), fc_bias=bool(data.get("bias", False)),
                       draft_vocab_size=data.get("draft_vocab_size"),
                       target_hidden_size=data.get("target_hidden_size"),
                       aux_layer_ids=eagle_config.get("eagle_aux_hidden_state_layer_ids"),
                       extra={k: v for k, v in data.items() if k not in known})
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"config.json lacks or mistypes {exc} for an EAGLE head") from None


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high target layers (vLLM's default (2, L // 2, L - 3)), kept inside 1..L-1 so that
    tiny targets have them too."""
    last = max(num_target_layers - 1, 1)
    return [min(max(i, 1), last) for i in (2, num_target_layers // 2, num_target_layers - 3)]


class Linear(nn.Linear):
    """nn.Linear that runs bf16 inference on the CPU kernels (PyTorch's small bf16 GEMMs were most of a drafting
    level), 64 rows per call: a head catching up on the tokens of the steps its draft gate skipped runs ~100 rows,
    which PyTorch's bf16 GEMM is slow at on a CPU without native bf16. Training and other dtypes take the usual
    path."""

    ROWS_PER_CALL = 64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16 and x.device.type == "cpu"
                and not torch.is_grad_enabled() and cpu_kernels.available()):
            rows = x.reshape(-1, x.shape[-1])
            if rows.shape[0] <= self.ROWS_PER_CALL:
                return cpu_kernels.small_linear(x, self.weight, self.bias)
            parts = [cpu_kernels.small_linear(part, self.weight, self.bias)
                     for part in rows.split(self.ROWS_PER_CALL)]
            return torch.cat(parts).view(*x.shape[:-1], self.weight.shape[0])
        return super().forward(x)


class HeadAttention(Attention):
    """The target's attention type (transformer.Attention: its forward over a KV cache drafts) with the head's
    bf16 kernel linears; `over_steps` is training-time test's attention pattern."""

    def __init__(self, spec: ArchSpec, layer_idx: int, input_size: int):
        super().__init__(spec, layer_idx, input_size, linear=Linear)

    def over_steps(self, x, cos, sin, past: list) -> torch.Tensor:
        """Training-time test: x [B, T, in] at one step, cos/sin [T, hd]; position t attends to the first step's
        positions <= t (causal) and to its own position in each later step, whose keys and values `past` holds
        (this step's are appended)."""
        b, t, _ = x.shape
        q, k, v = self.heads(x, cos[None], sin[None])
        groups = self.spec.num_heads // self.spec.num_kv_heads
        past.append((k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)))
        scale = self.spec.attn_scale
        k0, v0 = past[0]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        scores += [(q * ki).sum(-1, keepdim=True) * scale for ki, _ in past[1:]]
        probs = torch.softmax(torch.cat(scores, -1).float(), -1).to(q.dtype)
        out = probs[..., :t] @ v0
        for i, (_, vi) in enumerate(past[1:]):
            out = out + probs[..., t + i: t + i + 1] * vi
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class HeadLayer(nn.Module):
    """A Llama decoder layer of the target's module types; `fused=True` is EAGLE-3's midlayer (norms on embedding
    and feature, 2h attention input); `input_norm=False` is EAGLE-1's first layer."""

    def __init__(self, config: EagleConfig, layer_idx: int = 0, fused: bool = False, input_norm: bool = True):
        super().__init__()
        spec, h = config.arch_spec(), config.hidden_size
        self.fused = fused
        self.self_attn = HeadAttention(spec, layer_idx, 2 * h if fused else h)
        self.mlp = MLP(spec, linear=Linear)
        if input_norm or fused:
            self.input_layernorm = RMSNorm(h, config.rms_norm_eps, gemma=False)
        if fused:
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps, gemma=False)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, gemma=False)

    def forward(self, x, embeds, cos, sin, cache: KVCache, slots, mask) -> torch.Tensor:
        """x, embeds [B, T, h], cos/sin [B or 1, T, hd], slots [B, T], mask [B or 1, 1, T, S]."""
        x = x + self.self_attn(self.attention_input(x, embeds), cos, sin, cache, slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def over_steps(self, x, embeds, cos, sin, past: list) -> torch.Tensor:
        """The layer over [B, T] positions at one training-time-test step (HeadAttention.over_steps)."""
        x = x + self.self_attn.over_steps(self.attention_input(x, embeds), cos, sin, past)
        return x + self.mlp(self.post_attention_layernorm(x))

    def attention_input(self, x, embeds) -> torch.Tensor:
        if self.fused:
            return torch.cat([self.input_layernorm(embeds), self.hidden_norm(x)], dim=-1)
        return self.input_layernorm(x) if hasattr(self, "input_layernorm") else x


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head; `state_dict()` is the published layout (plus `embed_tokens.weight` only
    when the head carries its own table)."""

    def __init__(self, config: EagleConfig, own_embeddings: bool = False):
        super().__init__()
        self.config = config
        h = config.hidden_size
        if own_embeddings:
            self.embed_tokens = nn.Embedding(config.vocab_size, h)
        if config.kind == "eagle3":
            self.fc = Linear(3 * config.target_hidden_size, h, bias=False)
            self.midlayer = HeadLayer(config, fused=True)
            self.norm = RMSNorm(h, config.rms_norm_eps, gemma=False)
            self.lm_head = Linear(h, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool)
                                 if config.draft_vocab_size == config.vocab_size
                                 else torch.zeros(config.vocab_size, dtype=torch.bool))
        elif config.kind == "eagle":
            self.fc = Linear(2 * h, h, bias=config.fc_bias)
            self.layers = nn.ModuleList(HeadLayer(config, i, input_norm=i > 0) for i in range(config.num_layers))
        else:
            raise ValueError(f"unknown EAGLE head kind {config.kind!r}")
        self._rotary = None

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def decoder_layers(self) -> list[HeadLayer]:
        return [self.midlayer] if self.kind == "eagle3" else list(self.layers)

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """EAGLE-3: the draft vocabulary as sorted target ids; writes d2t (offsets) and t2d (membership)."""
        target_ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values
        if target_ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"need {self.config.draft_vocab_size} ids, got {target_ids.numel()}")
        self.d2t.copy_(target_ids - torch.arange(target_ids.numel()))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab] target token id of each draft-vocabulary entry."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (cos, sin) [T, head_dim] at `positions`: a Llama layer's, from the target's rope tables."""
        if self._rotary is None:
            self._rotary = llama_rope_tables(self.config)
        return self._rotary.lookup(positions.long(), "full_attention")

    def new_cache(self, capacity: int) -> KVCache:
        """Keys and values of the head's decoder layers for one sequence: a one-row KV cache."""
        cfg = self.config
        return KVCache(len(self.decoder_layers), 1, cfg.num_kv_heads, capacity, cfg.head_dim, self.fc.weight.dtype)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, slots: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """features [T, F] (target features, or the head's own previous outputs [T, h]), embeds [T, h] of the
        next tokens, positions [T], written at `slots` [T] of `cache` (new_cache) and attending as `mask` [T, S]
        allows over its first S slots -> the head's outputs [T, h] (pre-norm). Without a cache, causal over T."""
        dtype = self.fc.weight.dtype
        features, embeds = features.to(dtype), embeds.to(dtype)
        if cache is None:
            cache, slots = self.new_cache(len(positions)), torch.arange(len(positions))
        if mask is None:
            mask = torch.ones(len(positions), len(positions), dtype=torch.bool).tril()
        cos, sin = self.rotary(positions)
        if self.kind == "eagle3":
            x = self.fc(features) if features.shape[-1] != self.config.hidden_size else features
        else:
            x = self.fc(torch.cat([embeds, features], dim=-1))
        x, embeds, cos, sin = x[None], embeds[None], cos.to(dtype)[None], sin.to(dtype)[None]
        for layer in self.decoder_layers:
            x = layer(x, embeds, cos, sin, cache, slots[None], mask[None, None])
        return x[0]

    def lm_inputs(self, outputs: torch.Tensor) -> torch.Tensor:
        """What the draft logits read at the head's outputs: EAGLE-3's final norm of them, EAGLE-1's as they are."""
        return self.norm(outputs) if self.kind == "eagle3" else outputs

    def draft_logits(self, lm_inputs: torch.Tensor, target_lm_head) -> torch.Tensor:
        """Logits [T, V'] of `lm_inputs(outputs)`: EAGLE-3 over its draft vocabulary, EAGLE-1 over the target's
        (through the target's lm_head, a callable)."""
        if self.kind == "eagle3":
            return self.lm_head(lm_inputs).float()
        return target_lm_head(lm_inputs).float()


def save_eagle(head: EagleHead, path, safetensors: bool = False) -> Path:
    """Write `head` as its authors publish it: config.json + pytorch_model.bin (or model.safetensors)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_weights(head, path, SAFETENSORS_FILE if safetensors else TORCH_FILE)
    (path / CONFIG_FILE).write_text(json.dumps(head.config.to_json(), indent=2))
    return path


def read_state(path: Path) -> dict[str, torch.Tensor]:
    return read_weights(path, SAFETENSORS_FILE, TORCH_FILE)


def detect_kind(state: dict) -> str:
    if any(k.startswith("midlayer.") for k in state):
        return "eagle3"
    if any(k.startswith("layers.") for k in state):
        return "eagle"
    raise ValueError("neither an EAGLE-3 head (midlayer.*) nor an EAGLE-1 head (layers.*)")


def load_eagle(path, kind: str, target_spec, dtype: torch.dtype = torch.float32) -> EagleHead:
    """Load an EAGLE (`kind` "eagle") or EAGLE-3 (`kind` "eagle3") head directory for a target with the given
    ArchSpec; ValueError naming both sides when the head belongs to another model or layout."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"EAGLE head directory {path} does not exist")
    if not (path / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE}")
    state = {k.removeprefix("model."): v for k, v in read_state(path).items()}
    found = detect_kind(state)
    if found != kind:
        names = {"eagle": "an EAGLE-1/2 head (decoding_type Eagle)", "eagle3": "an EAGLE-3 head (decoding_type Eagle3)"}
        raise ValueError(f"{path} is {names[found]}, not {names[kind]}")
    config = EagleConfig.from_json(json.loads((path / CONFIG_FILE).read_text()), kind)
    check_against_target(config, state, target_spec, path)
    head = EagleHead(config, own_embeddings="embed_tokens.weight" in state)
    check_layout(path, f"{kind} layout of a {config.num_layers}-layer head", head.state_dict(), state)
    head.load_state_dict(state)
    if kind == "eagle3":
        ids = head.draft_to_target()
        if ids.min() < 0 or ids.max() >= config.vocab_size:
            raise ValueError(f"{path}: d2t maps draft tokens outside the target vocabulary of {config.vocab_size}")
    return head.to(dtype).eval()


def check_against_target(config: EagleConfig, state: dict, target_spec, path: Path) -> None:
    target_h, target_v = target_spec.hidden_size, target_spec.vocab_size
    if config.vocab_size != target_v:
        raise ValueError(f"EAGLE head {path} was trained for a vocabulary of {config.vocab_size} tokens, the target "
                         f"model has {target_v}: it belongs to another model (or tokenizer)")
    fc = state.get("fc.weight")
    if fc is None:
        raise ValueError(f"{path}: missing fc.weight")
    if config.kind == "eagle3":
        if fc.shape[1] != 3 * target_h:
            raise ValueError(f"EAGLE-3 head {path} fuses features of size {fc.shape[1]} (3 x {fc.shape[1] // 3}), "
                             f"the target model's hidden size is {target_h}: it belongs to another model")
        for layer in config.aux_layer_ids or []:
            if not 1 <= int(layer) <= target_spec.num_layers:
                raise ValueError(f"EAGLE-3 head {path} reads the input of target layer {layer}; the target model "
                                 f"has layers 0..{target_spec.num_layers - 1} (1..{target_spec.num_layers} usable)")
    else:
        if config.hidden_size != target_h or fc.shape[1] != 2 * target_h:
            raise ValueError(f"EAGLE head {path} has hidden size {config.hidden_size} (fc input {fc.shape[1]}), the "
                             f"target model has {target_h}: it belongs to another model")


def new_eagle_head(target_spec, kind: str, draft_vocab_ids: torch.Tensor | None = None, seed: int = 0,
                   aux_layer_ids: list[int] | None = None, std: float = 0.02) -> EagleHead:
    """A randomly initialized one-layer head sized for a target (ArchSpec): the start of training, and the
    random heads of the layout tests. EAGLE-3: `draft_vocab_ids` (target ids) set the draft vocabulary."""
    draft_vocab = None if draft_vocab_ids is None else int(torch.as_tensor(draft_vocab_ids).numel())
    config = EagleConfig(kind=kind, hidden_size=target_spec.hidden_size, num_heads=target_spec.num_heads,
                         num_kv_heads=target_spec.num_kv_heads, head_dim=target_spec.head_dim,
                         intermediate_size=target_spec.intermediate_size, vocab_size=target_spec.vocab_size,
                         rms_norm_eps=target_spec.rms_norm_eps, draft_vocab_size=draft_vocab,
                         aux_layer_ids=aux_layer_ids)
    generator = torch.Generator().manual_seed(seed)
    head = EagleHead(config)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                continue
            param.copy_(torch.randn(param.shape, generator=generator) * std if param.dim() > 1
                        else torch.zeros_like(param))
    if kind == "eagle3" and draft_vocab_ids is not None:
        head.set_draft_vocab(draft_vocab_ids)
    return head


def draft_layer_spec(config, model_type: str, vocab_size: int, **family) -> ArchSpec:
    """The ArchSpec of a draft's full-attention decoder layers (EAGLE heads, DFlash drafters) from its config's
    shape fields; `family`: the rest (q/k norms, biases)."""
    return ArchSpec(model_type=model_type, hidden_size=config.hidden_size,
                    intermediate_size=config.intermediate_size, num_layers=config.num_layers,
                    num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                    vocab_size=vocab_size, rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=False,
                    attn_scale=config.head_dim ** -0.5, layer_types=["full_attention"] * config.num_layers,
                    hidden_act=config.hidden_act, **family)


def llama_rope_tables(config) -> RopeTables:
    """fp32 rope tables of a Llama-style draft layer (EAGLE heads, DFlash drafters) from its config's rope fields."""
    from transformers import LlamaConfig

    hf = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_heads, head_dim=config.head_dim,
                     rope_theta=config.rope_theta, rope_scaling=config.rope_scaling,
                     max_position_embeddings=config.max_position_embeddings)
    return RopeTables(hf, torch.float32)
