"""Medusa heads (Cai et al. 2024) in the published checkpoint layout of FasterDecoding/Medusa.

Layout (FasterDecoding/Medusa `medusa/model/medusa_model.py`, the `FasterDecoding/medusa-*` checkpoints):

* `config.json`: `medusa_num_heads`, `medusa_num_layers` (default 1), `base_model_name_or_path`; specserve also
  writes `hidden_size` and `vocab_size` (the published configs may lack them; the weights' shapes decide).
* `medusa_lm_head.safetensors` (Medusa-1 training script, newer checkpoints) or `medusa_lm_head.pt`
  (`torch.load`, older checkpoints): the state dict of `medusa_head`, an `nn.ModuleList` of
  `nn.Sequential(*[ResBlock(hidden)] * medusa_num_layers, nn.Linear(hidden, vocab, bias=False))`, so the keys are
      `{i}.{j}.linear.weight` [hidden, hidden], `{i}.{j}.linear.bias` [hidden]   (ResBlock j < medusa_num_layers)
      `{i}.{medusa_num_layers}.weight` [vocab, hidden]                          (head i's lm_head)
  with ResBlock(x) = x + SiLU(linear(x)). (The published module repeats one ResBlock object
  `medusa_num_layers` times, so its layers share weights and its state dict repeats them; loading them into
  separate blocks, as here, computes the same function.)

specserve's draft vocabulary (`draft_vocab.json`, sorted target token ids) makes the heads score those tokens only.
With it, a checkpoint may hold only those rows of each lm_head (`{i}.{medusa_num_layers}.weight` [draft vocab,
hidden], row r scoring token `token_ids[r]`; config.json keeps the target's `vocab_size`): the compact form that
`specserve train medusa --vocab-rows-only` writes, a few MB where the full-vocabulary lm_heads of a 262k-token
model take 1 GB. Other Medusa tools read only the full form.

Head i reads the target's final normed hidden state at the last accepted position and predicts the token
i + 2 positions ahead: the target's own lm_head gives the next token (the tree's root), head 0 the token after
it (tree depth 1), head i depth i + 1 (`medusa_draft.MedusaMethod.scored_tree` fills a tree so).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from specserve.speculative.weights import (DRAFT_VOCAB_FILE, check_layout, read_draft_vocab, read_weights,
                                           write_draft_vocab, write_weights)

SAFETENSORS_FILE = "medusa_lm_head.safetensors"
TORCH_FILE = "medusa_lm_head.pt"
CONFIG_FILE = "config.json"


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """`num_heads` heads of `num_layers` ResBlocks and an lm_head; `heads.state_dict()` is the published layout."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 base_model_name_or_path: str = ""):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.target_vocab_size = vocab_size  # the compact form's lm_heads have fewer rows (`compact`)
        self.num_heads, self.num_layers = num_heads, num_layers
        self.base_model_name_or_path = base_model_name_or_path
        self.vocab_subset: torch.Tensor | None = None
        self._subset_weights: list[torch.Tensor] | None = None
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)],
                          nn.Linear(hidden_size, vocab_size, bias=False))
            for _ in range(num_heads)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [num_heads, ..., V] (float32); with a draft vocabulary, [..., V'] over it."""
        return torch.stack([self.head_logits(hidden, i) for i in range(self.num_heads)])

    def head_logits(self, hidden: torch.Tensor, index: int) -> torch.Tensor:
        """Head `index`'s fp32 logits [..., V'] at hidden [..., H]."""
        hidden = hidden.to(self.heads[0][-1].weight.dtype)
        return torch.nn.functional.linear(self.heads[index][:-1](hidden), self.lm_weights[index]).float()

    @property
    def lm_weights(self) -> list[torch.Tensor]:
        """Each head's lm_head weight over the rows it scores (the draft vocabulary's, where it has one)."""
        return self._subset_weights or [head[-1].weight for head in self.heads]

    @classmethod
    def compact(cls, hidden_size: int, target_vocab_size: int, token_ids: torch.Tensor, num_heads: int,
                num_layers: int = 1, base_model_name_or_path: str = "") -> "MedusaHeads":
        """Heads whose lm_heads hold only the rows of `token_ids` (sorted target ids): row r scores token_ids[r]."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        if not bool((token_ids[1:] > token_ids[:-1]).all()):
            raise ValueError("a compact Medusa checkpoint's draft vocabulary must be sorted and without repeats")
        heads = cls(hidden_size, len(token_ids), num_heads, num_layers, base_model_name_or_path)
        heads.vocab_subset = token_ids
        heads.target_vocab_size = target_vocab_size
        heads._subset_weights = [head[-1].weight.detach() for head in heads.heads]
        return heads

    @property
    def rows_only(self) -> bool:
        """Whether the lm_heads hold only the draft vocabulary's rows (the compact form)."""
        return self.vocab_subset is not None and self.heads[0][-1].weight.shape[0] == len(self.vocab_subset)

    def _apply(self, fn, *args, **kwargs):  # .to(dtype) etc.: the compact form's lm_heads are its subset weights
        module = super()._apply(fn, *args, **kwargs)
        if self.rows_only:
            self._subset_weights = [head[-1].weight.detach() for head in self.heads]
        return module

    def restrict_vocab(self, token_ids: torch.Tensor | None) -> None:
        """specserve's draft vocabulary: the heads score these tokens only (their lm_heads are most of their
        cost on a large vocabulary); candidates stay guesses, so verification remains exact."""
        self.vocab_subset = None if token_ids is None else torch.as_tensor(token_ids).sort().values
        self._subset_weights = None if token_ids is None else \
            [head[-1].weight.detach()[self.vocab_subset].contiguous() for head in self.heads]


def save_medusa(heads: MedusaHeads, path, safetensors: bool = True, vocab_rows_only: bool = False) -> Path:
    """Write `heads` as a Medusa checkpoint directory (config.json + medusa_lm_head.safetensors or .pt); with
    `vocab_rows_only` and a draft vocabulary, in the compact form (only its rows of each lm_head)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if vocab_rows_only and heads.vocab_subset is not None and not heads.rows_only:
        state = dict(heads.heads.state_dict())
        for i, weight in enumerate(heads._subset_weights):
            state[f"{i}.{heads.num_layers}.weight"] = weight
        write_weights(state, path, SAFETENSORS_FILE if safetensors else TORCH_FILE)
    else:
        write_weights(heads.heads, path, SAFETENSORS_FILE if safetensors else TORCH_FILE)
    if heads.vocab_subset is not None:
        write_draft_vocab(path, heads.vocab_subset)
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
              "base_model_name_or_path": heads.base_model_name_or_path,
              "hidden_size": heads.hidden_size, "vocab_size": heads.target_vocab_size}
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return path


def load_medusa(path, target_hidden_size: int, target_vocab: int,
                dtype: torch.dtype = torch.float32) -> MedusaHeads:
    """Load a Medusa checkpoint directory for a target of the given hidden size and vocabulary; ValueError
    (naming both sizes) when the heads were trained for another model, or when keys are missing / unknown."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"Medusa checkpoint directory {path} does not exist")
    config = json.loads((path / CONFIG_FILE).read_text()) if (path / CONFIG_FILE).exists() else {}
    state = read_weights(path, SAFETENSORS_FILE, TORCH_FILE)
    state = {re.sub(r"^medusa_head\.", "", k): v for k, v in state.items()}  # whole-model saves prefix the keys
    head_ids = sorted({int(k.split(".")[0]) for k in state if k.split(".")[0].isdigit()})
    if not head_ids:
        raise ValueError(f"{path}: no Medusa head weights (keys '{{i}}.{{j}}.linear.weight', '{{i}}.{{L}}.weight')")
    num_heads = int(config.get("medusa_num_heads", len(head_ids)))
    num_layers = int(config.get("medusa_num_layers", 1))
    lm_key = f"0.{num_layers}.weight"
    if lm_key not in state:
        raise ValueError(f"{path}: missing {lm_key!r} (head 0's lm_head for medusa_num_layers={num_layers})")
    rows, hidden = state[lm_key].shape
    if hidden != target_hidden_size:
        raise ValueError(f"Medusa heads in {path} have hidden size {hidden}, the target model has "
                         f"{target_hidden_size}: they were trained for another model")
    vocab = int(config.get("vocab_size", rows))
    if vocab != target_vocab:
        raise ValueError(f"Medusa heads in {path} predict a vocabulary of {vocab} tokens, the target model has "
                         f"{target_vocab}: they were trained for another model (or tokenizer)")
    if "hidden_size" in config and int(config["hidden_size"]) != hidden:
        raise ValueError(f"{path}: config.json says hidden_size={config['hidden_size']}, the weights disagree")
    draft_vocab = read_draft_vocab(path, vocab)
    name = config.get("base_model_name_or_path", "")
    if rows == vocab:
        heads = MedusaHeads(hidden, vocab, num_heads, num_layers, name)
    elif draft_vocab is not None and rows == len(draft_vocab):
        heads = MedusaHeads.compact(hidden, vocab, draft_vocab, num_heads, num_layers, name)
    else:
        raise ValueError(f"{path}: the lm_heads have {rows} rows, neither the vocabulary of {vocab} tokens nor a "
                         f"draft vocabulary of as many tokens ({DRAFT_VOCAB_FILE})")
    expected = heads.heads.state_dict()

    def extra_head(key: str) -> bool:  # heads beyond medusa_num_heads are ignored, as Medusa does
        prefix = key.split(".")[0]
        return prefix.isdigit() and int(prefix) >= num_heads

    check_layout(path, f"Medusa layout for {num_heads} heads x {num_layers} layers", expected, state, extra_head)
    heads.heads.load_state_dict({k: state[k] for k in expected})
    heads = heads.to(dtype).eval()
    if not heads.rows_only:
        heads.restrict_vocab(draft_vocab)
    return heads
