"""Draft vocabularies: the target tokens a draft scores (on a 262k vocabulary the lm_head is most of a small
draft's cost), and labels mapped into them."""

from __future__ import annotations

import torch


def pick_draft_vocab(records: list[dict], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent target tokens in the data (labels and text), ties by id; sorted ids."""
    return most_frequent(torch.cat([t for r in records for t in (r["labels"], r["tokens"])]), vocab_size, size)


def most_frequent(ids: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent of `ids` below `vocab_size`, ties (unseen ids too) by id; sorted ids."""
    counts = torch.bincount(ids[ids < vocab_size], minlength=vocab_size)
    order = torch.sort(-counts, stable=True).indices  # stable: ties keep id order
    return torch.sort(order[:min(size, vocab_size)]).values


def subset_labels(labels: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target ids -> positions in the draft vocabulary (-100, ignored by the loss, for ids outside it)."""
    index = torch.full((vocab_size,), -100, dtype=torch.long, device=labels.device)
    index[vocab_ids] = torch.arange(vocab_ids.numel(), device=labels.device)
    return index[labels]
