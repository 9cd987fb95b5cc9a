"""A KV cache: one buffer per layer [rows, kv_heads, capacity, head_dim], committed lengths per row.

Rolling back rejected draft tokens is setting a length; keeping an accepted tree path is copying its few slots
into place (`compact`). Committed slots always hold consecutive positions (slot == position), which lets the
attention masks be derived from lengths alone.

A single request knows its size and gets it up front (`for_model`). A server's batch does not: preallocating
every row at the full context costs gigabytes while idle, so its cache (`growable`) starts empty and `fit`
grows rows and slots in blocks as requests arrive and lengthen, and gives memory back as they leave.
"""

from __future__ import annotations

import copy
import ctypes

import torch

from specserve.models import cpu_kernels

BLOCK = 256  # slots are allocated in multiples of this
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only


def give_back_freed_memory() -> None:
    """Freed tensors smaller than glibc's (self-raising) mmap threshold stay in the heap, so RSS would not drop
    when the cache shrinks: hand the free heap back to the OS."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def round_up(n: int, block: int = BLOCK) -> int:
    return -(-n // block) * block


class KVCache:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, max_batch: int | None = None, max_capacity: int | None = None):
        self.num_layers, self.num_kv_heads, self.head_dim, self.dtype = num_layers, num_kv_heads, head_dim, dtype
        self.max_batch = max(batch, max_batch or 0)
        self.max_capacity = max(capacity, max_capacity or 0)
        self._allocate(batch, capacity)

    def _allocate(self, rows: int, capacity: int) -> None:
        shape = (rows, self.num_kv_heads, capacity, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        self.capacity = capacity
        self.lengths = torch.zeros(rows, dtype=torch.long)

    @classmethod
    def for_model(cls, model, batch: int, capacity: int) -> "KVCache":
        if hasattr(model, "new_kv_cache"):  # a tensor-parallel target: a cache kept alike on every rank
            return model.new_kv_cache(batch, capacity)
        spec = model.spec
        return cls(spec.num_layers, batch, spec.num_kv_heads, capacity, spec.head_dim, model.dtype)

    @classmethod
    def growable(cls, model, max_batch: int, max_capacity: int) -> "KVCache":
        """An empty cache that `fit` grows up to max_batch rows of max_capacity slots."""
        if hasattr(model, "new_kv_cache"):
            return model.new_kv_cache(0, 0, max_batch, max_capacity)
        spec = model.spec
        return cls(spec.num_layers, 0, spec.num_kv_heads, 0, spec.head_dim, model.dtype, max_batch, max_capacity)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def fit(self, rows: int, slots: int) -> None:
        """Make room for `rows` rows of `slots` slots; rows below `rows` keep their contents. Grows by at least a
        quarter (rows: double) so a lengthening request is not copied every block; shrinks only when less than
        half is needed (everything when rows is 0), so a request that comes and goes does not copy either."""
        slots = min(round_up(slots), self.max_capacity) if rows else 0
        new_rows, new_slots = self.batch, self.capacity
        if rows > new_rows:
            new_rows = min(self.max_batch, max(rows, 2 * new_rows))
        elif 2 * rows < new_rows:
            new_rows = rows
        if slots > new_slots:
            new_slots = min(self.max_capacity, max(slots, round_up(new_slots + new_slots // 4)))
        elif 2 * slots < new_slots:
            new_slots = slots
        if (new_rows, new_slots) == (self.batch, self.capacity):
            return
        shrinking = new_rows * new_slots < self.batch * self.capacity
        self._reallocate(new_rows, new_slots)
        if shrinking:
            give_back_freed_memory()

    def _reallocate(self, rows: int, capacity: int) -> None:
        """New buffers, holding the old ones' committed slots of rows that remain."""
        buffers, lengths = self.keys + self.values, self.lengths
        self._allocate(rows, capacity)
        r = min(rows, len(lengths))
        s = min(capacity, int(lengths[:r].max())) if r else 0  # slots past every length hold nothing needed
        for old, new in zip(buffers, self.keys + self.values):
            new[:r, :, :s] = old[:r, :, :s]
        self.lengths[:r] = lengths[:r]

    def move_row(self, src: int, dst: int) -> None:
        """Copy row src's committed keys/values and length into row dst (to keep a batch's rows dense)."""
        self.copy_row_from(self, src, dst)

    def copy_row_from(self, other: "KVCache", src: int, dst: int) -> None:
        """Copy row src of another cache (its committed keys/values and length) into row dst of this one."""
        length = int(other.lengths[src])
        for mine, theirs in zip(self.keys + self.values, other.keys + other.values):
            mine[dst, :, :length] = theirs[src, :, :length]
        self.lengths[dst] = length

    def view(self, start: int, count: int) -> "KVCache":
        """Rows [start, start + count) as a cache of their own, sharing storage (and lengths) with this one."""
        part = copy.copy(self)
        part.keys = [k[start:start + count] for k in self.keys]
        part.values = [v[start:start + count] for v in self.values]
        part.lengths = self.lengths[start:start + count]
        part.max_batch, part.max_capacity = count, self.capacity  # a view cannot grow
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
        """Boolean masks [B, 1, T, S] (True = attend) for full and sliding-window layers: the CPU kernel's one
        pass where it is built (instead of ~12 PyTorch ops), else `masks_by_torch`."""
        span = int(slots.max()) + 1
        if span > self.capacity:
            raise ValueError(f"KV cache overflow: need {span} slots, capacity is {self.capacity}")
        if slots.device.type != "cpu" or not cpu_kernels.available():
            return self.masks_by_torch(positions, slots, tree_mask, sliding_window, span)
        full, sliding = cpu_kernels.attention_masks(self.lengths, positions, slots, tree_mask, sliding_window or 0,
                                                    span)
        return {"full_attention": full, "sliding_attention": sliding}

    def masks_by_torch(self, positions: torch.Tensor, slots: torch.Tensor, tree_mask: torch.Tensor | None,
                       sliding_window: int | None, span: int) -> dict[str, torch.Tensor]:
        """attention_masks in PyTorch ops: where the kernels are not built, and the kernel's reference."""
        bsz, seq = slots.shape
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
