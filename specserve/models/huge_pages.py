"""Weights copied into memory backed by 2 MB pages where the system allows it (Linux transparent huge pages).

The quantized tiles stream every weight once per forward. Mapped from their file in 4 KB pages, each 4 KB of the
stream costs a TLB miss and ends the hardware prefetcher's run; in one anonymous private mapping advised
MADV_HUGEPAGE (honoured under the kernel's `madvise` and `always` settings, the defaults of most distributions) a
page walk covers 2 MB. What it bought is in docs/design-notes.md ("Kept settings"). Where the advice is not
available (other systems) or not honoured (`never`, no free huge pages), the copy holds ordinary pages: the same
values, read the same way.
"""

from __future__ import annotations

import mmap

import torch

_ALIGN = 4096  # each tensor starts on a page of its own: the views' data pointers stay aligned for any dtype


def huge_page_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors (values, dtypes, shapes) as contiguous views of one new mapping advised MADV_HUGEPAGE; the
    tensors given unchanged where this system has no such advice."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    private = getattr(mmap, "MAP_PRIVATE", None)
    if advice is None or private is None or not tensors:
        return tensors
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    total = sum(-(-size // _ALIGN) * _ALIGN for size in sizes.values())
    arena = mmap.mmap(-1, max(total, _ALIGN), flags=private | mmap.MAP_ANONYMOUS)
    arena.madvise(advice)
    memory = torch.frombuffer(arena, dtype=torch.uint8)  # holds the mapping for as long as a view lives
    copies, offset = {}, 0
    for name, tensor in tensors.items():
        size = sizes[name]
        view = memory[offset:offset + size].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        copies[name] = view
        offset += -(-size // _ALIGN) * _ALIGN
    return copies
