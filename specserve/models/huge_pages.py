"""A safetensors file's tensors read into memory backed by 2 MB pages where the system allows it (Linux
transparent huge pages).

The quantized tiles stream every weight once per forward. Mapped from their file in 4 KB pages, each 4 KB of the
stream costs a TLB miss and ends the hardware prefetcher's run; in one anonymous private mapping advised
MADV_HUGEPAGE (honoured under the kernel's `madvise` and `always` settings, the defaults of most distributions) a
page walk covers 2 MB. What it bought is in docs/design-notes.md ("Kept settings"). Where the advice is not honoured
(`never`, no free huge pages), the mapping holds ordinary pages: the same values, read the same way.

The file is read straight into the mapping, not memory-mapped and copied: safetensors has no call that reads into
a given buffer, and a mapped copy would hold the file's pages and the new ones at once (twice the weights' size at
load). The format is safetensors' own (an 8-byte little-endian header size, a JSON header of each tensor's dtype,
shape and byte range, then the data).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

_ALIGN = 4096  # each tensor starts on a page of its own: the views' data pointers stay aligned for any dtype
_CHUNK = 64 << 20  # bytes a read takes
_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
           "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
           "F64": torch.float64}


def huge_pages_available() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def huge_page_buffer(size: int) -> torch.Tensor:
    """`size` uninitialised bytes (uint8) in a new private anonymous mapping advised MADV_HUGEPAGE, which the tensor
    and its views hold for as long as they live; ordinary memory where huge_pages_available() is false."""
    if not huge_pages_available():
        return torch.empty(size, dtype=torch.uint8)
    arena = mmap.mmap(-1, max(_ALIGN, size), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(arena, dtype=torch.uint8)[:size]


def read_safetensors(path: Path) -> dict[str, torch.Tensor] | None:
    """The file's tensors as views of one new mapping advised MADV_HUGEPAGE; None where this system has no such
    advice or the file holds a dtype this reader does not know (read it with safetensors then)."""
    if not huge_pages_available() or not hasattr(os, "preadv"):
        return None
    with open(path, "rb") as file:
        (header_size,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(header_size))
        header.pop("__metadata__", None)
        if any(entry["dtype"] not in _DTYPES for entry in header.values()):
            return None
        places, offset = {}, 0  # name -> (offset in the mapping, offset in the file, bytes)
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            places[name] = (offset, 8 + header_size + begin, end - begin)
            offset += _aligned(end - begin)
        memory = huge_page_buffer(offset)
        _read_in_parallel(file.fileno(), memoryview(memory.numpy()), list(places.values()), path)
    return {name: memory[at:at + size].view(_DTYPES[header[name]["dtype"]]).view(header[name]["shape"])
            for name, (at, _, size) in places.items()}


def _read_in_parallel(fd: int, buffer: memoryview, places: list[tuple[int, int, int]], path: Path) -> None:
    """The file's byte ranges into the buffer, in chunks of _CHUNK spread over the machine's threads: the first
    touch of each fresh 2 MB page is the load's cost (on a VM, the hypervisor's too), and threads pay it side by
    side (docs/design-notes.md)."""
    chunks = [(at + start, source + start, min(_CHUNK, size - start))
              for at, source, size in places for start in range(0, size, _CHUNK)]
    threads = max(1, min(torch.get_num_threads(), len(chunks)))

    def read(first: int) -> None:
        for at, source, size in chunks[first::threads]:
            if os.preadv(fd, [buffer[at:at + size]], source) != size:
                raise OSError(f"{path} is cut short")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, range(threads)))
    buffer.release()
