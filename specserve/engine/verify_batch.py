"""The layout of one verify forward: every request's uncached tokens, its root and its draft tree in one batch.

Row b of the batch is request b: the tokens its KV cache lacks (the prefill, or nothing), then the root (its
pending token), then the draft tree's nodes below the root, in node order, at consecutive cache slots from the
row's cache length. A chain's nodes sit at consecutive positions; a tree's at the root's position plus their depth,
seeing only their ancestors. The target's logits are read at the root and at every draft node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.models.kv_cache import KVCache


@dataclass
class VerifyBatch:
    tokens: torch.Tensor  # [B, T] long: per row the fed tokens, right-padded with 0 (T: the longest row)
    positions: torch.Tensor  # [B, T] long: rope positions (tree nodes: the root's position + their depth)
    slots: torch.Tensor  # [B, T] long: the cache slots the fed tokens' keys and values go to
    tree_mask: torch.Tensor | None  # [B, T, T] bool: causal, each tree's own mask over its nodes; None: chains only
    logits_rows: torch.Tensor  # [B, R] long: per row, the columns whose logits are verified (R: the most drafted + 1)
    fed: list[int]  # [B]: tokens fed per row (T minus the padding)
    verified: list[int]  # [B]: logits rows to verify per row (its draft + the root)
    scored: list[int]  # [B]: logits rows before those, at prompt tokens a request scores (they come first)
    starts: list[int]  # [B]: the row's cache length before the forward (slot of its first fed token)

    @classmethod
    def build(cls, cache: KVCache, feeds: list[list[int]], trees: list, scored: list[int] | None = None
              ) -> VerifyBatch:
        """`feeds[b]`: row b's tokens (uncached, root, draft); `trees[b]`: its DraftTree (None: an idle row);
        `scored[b]`: uncached tokens right before the root that also need logits (default none)."""
        starts = [int(cache.lengths[row]) for row in range(len(feeds))]
        verified = [len(tree) if tree is not None else 1 for tree in trees]
        scored = scored or [0] * len(feeds)
        wanted = [s + v for s, v in zip(scored, verified)]
        width, rows_out = max(map(len, feeds)), max(wanted)
        tokens = torch.tensor([feed + [0] * (width - len(feed)) for feed in feeds])
        slots = torch.tensor(starts)[:, None] + torch.arange(width)[None]
        positions, tree_mask = slots.clone(), None
        for row, tree in enumerate(trees):
            if tree is None or tree.is_chain:
                continue
            root = len(feeds[row]) - len(tree)
            positions[row, root: root + len(tree)] = tree.positions(slots[row, root])
            if tree_mask is None:
                tree_mask = torch.ones(width, width, dtype=torch.bool).tril().repeat(len(feeds), 1, 1)
            tree_mask[row, root: root + len(tree), root: root + len(tree)] = tree.mask
        logits_rows = torch.tensor([[max(len(f) - n + i, 0) for i in range(rows_out)]
                                    for f, n in zip(feeds, wanted)]).clamp(max=width - 1)
        return cls(tokens, positions, slots, tree_mask, logits_rows, [len(f) for f in feeds], verified, scored,
                   starts)

    @property
    def wanted(self) -> list[int]:
        """[B]: the leading entries of each row's logits_rows that are read (the rest pad it to R)."""
        return [s + v for s, v in zip(self.scored, self.verified)]

    def root(self, row: int) -> int:
        """The root's column in `row`."""
        return self.fed[row] - self.verified[row]
