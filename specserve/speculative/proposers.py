"""Proposers: each drafts up to `max_len` tokens that the target then verifies in one forward.

A speculative method is a `SpecMethod` (shared resources such as draft weights, built once per engine) that
makes one `Proposer` per request (per-request state such as a draft KV cache). A new method is one class of each.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specserve.models.kv_cache import KVCache
from specserve.speculative.choices import DEFAULT_CHOICES
from specserve.speculative.medusa import MedusaHeads, medusa_tree
from specserve.speculative.sampling import SamplingParams, probabilities, sample
from specserve.speculative.tree import DraftTree


@dataclass
class Proposal:
    tokens: list[int]  # the draft tokens (for a tree: its nodes below the root, in node order)
    probs: torch.Tensor | None = None  # [len(tokens), V] draft distributions; None = deterministic (one-hot)
    tree: "DraftTree | None" = None  # None: a chain


class Proposer(ABC):
    @abstractmethod
    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        """Draft up to max_len tokens (a tree: up to max_len deep) to follow `tokens` (prompt + generated)."""

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        """The target's features [n, F] of the n tokens the last forward committed, in order (for methods that
        draft from them): the method's `hidden_layers` concatenated."""


class SpecMethod(ABC):
    name: str
    needs_hidden_states = False  # whether proposers want observe_hidden() after every target forward
    hidden_layers: tuple[int, ...] = (-1,)  # the target layers whose outputs form a feature (-1: final normed)
    budgets_itself = False  # whether proposers size their drafts from measured costs (the batch then does not)
    typical: tuple[float, float] | None = None  # Medusa typical acceptance (threshold, alpha): not lossless

    def draft_slots(self, max_draft_len: int) -> int:
        """KV slots a verify step may take beyond the committed tokens (a tree: all its nodes)."""
        return max_draft_len + 1

    @abstractmethod
    def new_proposer(self, params: SamplingParams, generator: torch.Generator, capacity: int) -> Proposer:
        """A proposer for one request whose sequence will not exceed `capacity` tokens."""


def longest_ngram_continuation(tokens: list[int], max_len: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the longest suffix n-gram
    (max_n down to min_n) of `tokens`, at most max_len of them; [] if no n-gram recurs."""
    return ngram_lookup(tokens, max_len, min_n, max_n)[1]


def ngram_lookup(tokens: list[int], max_len: int, min_n: int, max_n: int) -> tuple[int, list[int]]:
    """`longest_ngram_continuation` and the n of the n-gram that matched (0 when none did)."""
    length = len(tokens)
    if max_len <= 0 or length < min_n + 1:
        return 0, []
    seq = torch.tensor(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = seq[:-1].unfold(0, n, 1)  # n-grams that end before the last token, so a continuation exists
        hits = (windows == seq[-n:]).all(dim=1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return n, tokens[start:start + max_len]
    return 0, []


class NGramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        return Proposal(longest_ngram_continuation(tokens, max_len, self.min_n, self.max_n))


class NGramMethod(SpecMethod):
    name = "ngram"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def new_proposer(self, params, generator, capacity) -> Proposer:
        return NGramProposer(self.min_n, self.max_n)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer(Proposer):
    """Drafts with a small model of the same tokenizer; its KV cache follows the committed tokens by keeping the
    longest prefix it already holds, so a rejection costs only a length change."""

    def __init__(self, draft_model, target_vocab: int, params: SamplingParams, generator: torch.Generator,
                 capacity: int):
        self.model = draft_model
        self.target_vocab = target_vocab
        self.params = params
        self.generator = generator
        self.cache = KVCache.for_model(draft_model, 1, capacity)
        self.fed: list[int] = []

    def _align_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft and target may pad their embedding tables differently; the shared tokenizer's ids agree."""
        vocab = logits.shape[-1]
        if vocab > self.target_vocab:
            return logits[..., : self.target_vocab]
        if vocab < self.target_vocab:
            pad = logits.new_full((*logits.shape[:-1], self.target_vocab - vocab), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def _feed(self, new_tokens: list[int]) -> torch.Tensor:
        start = len(self.fed)
        positions = torch.arange(start, start + len(new_tokens))[None]
        out = self.model(torch.tensor([new_tokens]), positions, self.cache, positions,
                         logits_rows=torch.tensor([[len(new_tokens) - 1]]))
        self.fed.extend(new_tokens)
        self.cache.lengths[0] = len(self.fed)
        return self._align_vocab(out.logits[0, -1])

    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        if max_len <= 0:
            return Proposal([])
        keep = common_prefix_length(self.fed, tokens[:-1])
        del self.fed[keep:]
        self.cache.lengths[0] = keep
        feed = tokens[keep:]
        drafted: list[int] = []
        dists: list[torch.Tensor] = []
        for _ in range(max_len):
            logits = self._feed(feed)
            if self.params.greedy:
                token = int(logits.argmax())
            else:
                q = probabilities(logits[None], self.params)[0]
                token = int(sample(q[None], self.generator))
                dists.append(q)
            drafted.append(token)
            feed = [token]
        return Proposal(drafted, torch.stack(dists) if dists else None)


class DraftModelMethod(SpecMethod):
    name = "draft_target"

    def __init__(self, draft_model, target_vocab: int):
        self.draft_model = draft_model
        self.target_vocab = target_vocab

    def new_proposer(self, params, generator, capacity) -> Proposer:
        return DraftModelProposer(self.draft_model, self.target_vocab, params, generator, capacity)


class MedusaProposer(Proposer):
    """A static tree (Medusa's `choices`) filled with the heads' top-k at the target's last hidden state."""

    def __init__(self, heads: MedusaHeads, choices):
        self.heads, self.choices = heads, choices
        self.hidden: torch.Tensor | None = None

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden[-1]

    def propose(self, tokens: list[int], max_len: int) -> Proposal:
        choices = [c for c in self.choices if len(c) <= max_len]
        if self.hidden is None or not choices:
            return Proposal([])
        tree = medusa_tree(self.heads, self.hidden.to(self.heads_dtype), tokens[-1], choices)
        return Proposal(tree.tokens[1:].tolist(), tree=tree)

    @property
    def heads_dtype(self) -> torch.dtype:
        return next(self.heads.parameters()).dtype


class MedusaMethod(SpecMethod):
    name = "medusa"
    needs_hidden_states = True

    def __init__(self, heads: MedusaHeads, choices=DEFAULT_CHOICES, typical: tuple[float, float] | None = None):
        self.heads = heads
        self.choices = [list(c) for c in choices]
        self.typical = typical

    def draft_slots(self, max_draft_len: int) -> int:
        return 1 + sum(len(c) <= max_draft_len for c in self.choices)

    def new_proposer(self, params, generator, capacity) -> Proposer:
        return MedusaProposer(self.heads, self.choices)
