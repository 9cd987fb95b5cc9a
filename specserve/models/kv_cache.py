"""A static KV cache: one preallocated buffer per layer, rows of a batch, committed lengths per row.

Rolling back rejected draft tokens is setting a length; keeping an accepted tree path is copying its few slots
into place (`compact`). Committed slots always hold consecutive positions (slot == position), which lets the
attention masks be derived from lengths alone.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype):
        shape = (batch, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.capacity = capacity
        self.lengths = torch.zeros(batch, dtype=torch.long)

    @classmethod
    def for_model(cls, model, batch: int, capacity: int) -> "KVCache":
        spec = model.spec
        return cls(spec.num_layers, batch, spec.num_kv_heads, capacity, spec.head_dim, model.dtype)

    def view(self, start: int, count: int) -> "KVCache":
        """Rows [start, start + count) as a cache of their own, sharing storage (and lengths) with this one."""
        part = KVCache.__new__(KVCache)
        part.keys = [k[start:start + count] for k in self.keys]
        part.values = [v[start:start + count] for v in self.values]
        part.capacity = self.capacity
        part.lengths = self.lengths[start:start + count]
        return part

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: int):
        """Store k, v [B, Hkv, T, hd] at `slots` [B, T]; return this layer's keys/values over slots [0, span)."""
        kc, vc = self.keys[layer], self.values[layer]
        if slots.shape[0] == 1 and kc.shape[0] == 1:
            start = int(slots[0, 0])
            end = start + slots.shape[1]
            if int(slots[0, -1]) == end - 1:  # contiguous: plain slice copy
                kc[:, :, start:end] = k
                vc[:, :, start:end] = v
                return kc[:, :, :span], vc[:, :, :span]
        rows = torch.arange(slots.shape[0])[:, None].expand_as(slots)
        kc[rows, :, slots] = k.transpose(1, 2)
        vc[rows, :, slots] = v.transpose(1, 2)
        return kc[:, :, :span], vc[:, :, :span]

    def attention_masks(self, positions: torch.Tensor, slots: torch.Tensor, tree_mask: torch.Tensor | None,
                        sliding_window: int | None) -> dict[str, torch.Tensor]:
        """Boolean masks [B, 1, T, S] (True = attend) for full and sliding-window layers."""
        bsz, seq = slots.shape
        span = int(slots.max()) + 1
        if span > self.capacity:
            raise ValueError(f"KV cache overflow: need {span} slots, capacity is {self.capacity}")
        key_slots = torch.arange(span)
        committed = key_slots[None, None, :] < self.lengths[:, None, None]  # [B, 1, S]
        key_pos = key_slots[None, :].expand(bsz, span).clone()
        key_pos.scatter_(1, slots, positions)
        if tree_mask is None:
            tree_mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None].expand(bsz, seq, seq)
        new_visible = torch.zeros(bsz, seq, span, dtype=torch.bool)
        new_visible.scatter_(2, slots[:, None, :].expand(bsz, seq, seq), tree_mask)
        full = committed | new_visible  # [B, T, S]
        masks = {"full_attention": full[:, None]}
        if sliding_window:
            near = (positions[:, :, None] - key_pos[:, None, :]) < sliding_window
            masks["sliding_attention"] = (full & near)[:, None]
        else:
            masks["sliding_attention"] = masks["full_attention"]
        return masks

    def compact(self, row: int, src_slots: torch.Tensor, dst_start: int) -> None:
        """Copy the slots of an accepted tree path to consecutive slots from dst_start (all layers)."""
        dst = torch.arange(dst_start, dst_start + src_slots.numel())
        if torch.equal(src_slots, dst):
            return
        for kc, vc in zip(self.keys, self.values):
            kc[row, :, dst] = kc[row, :, src_slots]
            vc[row, :, dst] = vc[row, :, src_slots]

    def reset_row(self, row: int) -> None:
        self.lengths[row] = 0
