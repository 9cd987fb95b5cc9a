"""A GGUF file's header read once per load, shared by specserve's loader and transformers' GGUF functions.

gguf's GGUFReader builds a numpy view per metadata element; on the np.memmap it opens, each view goes through the
memmap subclass's bookkeeping, and the default model's 262k-token vocabulary took 19 s to read on a 2-core Zen 3.
A first start read it five times: transformers' config, tensors and tokenizer, specserve's packer and chat
template. `FastGGUFReader` slices a plain ndarray over the same mapping instead and parses each array field in one
pass (the same fields and tensors, 1.4 s), and inside `shared_readers()` every reader of a file, transformers'
included, is one instance, transformers' metadata parse of it (load_gguf_checkpoint without tensors) runs once, and
so does gguf's tensor name map.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import lru_cache, partial
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType

_local = threading.local()  # .readers: this thread's shared readers by resolved path (None: not sharing)


class FastGGUFReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map: the same fields, parts and tensors (the tensors'
    data still read from the file on first touch)."""

    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value) -> None:  # GGUFReader.__init__ assigns its np.memmap here
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    def _get(self, offset: int, dtype, count: int = 1, override_order=None):
        dtype = np.dtype(dtype)
        values = self._data[offset:offset + dtype.itemsize * int(count)].view(dtype)
        order = self.byte_order if override_order is None else override_order
        return values if order == "I" else values.view(dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        """GGUFReader's parts of a field, an array of strings or numbers (a vocabulary's tokens, scores and types)
        made in one pass over it instead of one recursive call per element (the default model's header, 262k
        tokens: 4 s -> 1.4 s)."""
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item_type, count, offs = GGUFValueType(raw_itype[0]), int(length[0]), orig_offs + 12
        parts: list[np.ndarray] = [raw_itype, length]
        if item_type == GGUFValueType.STRING:
            lengths = np.dtype(np.uint64).newbyteorder("<" if self.byte_order == "I" else ">")
            for _ in range(count):
                size = self._get(offs, np.uint64)
                text_size = int(self._data[offs:offs + 8].view(lengths)[0])
                parts += (size, self._data[offs + 8:offs + 8 + text_size])
                offs += 8 + text_size
            return offs - orig_offs, parts, list(range(3, 2 * count + 2, 2)), [GGUFValueType.ARRAY, item_type]
        scalar = self.gguf_scalar_to_np.get(item_type)
        if scalar is None:  # arrays of arrays: the general path
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, scalar, count)
        parts += list(values.reshape(count, 1))
        return 12 + values.nbytes, parts, list(range(2, count + 2)), [GGUFValueType.ARRAY, item_type]


def read(path: Path | str, mode: str = "r") -> GGUFReader:
    """The reader of `path`: inside shared_readers(), one per file for the whole block; else a new one."""
    key = str(Path(path).resolve())
    shared = getattr(_local, "readers", None)
    if shared is None or mode != "r":
        return FastGGUFReader(key, mode)
    if key not in shared:
        shared[key] = FastGGUFReader(key)
    return shared[key]


@contextmanager
def shared_readers(transformers: bool = False) -> Iterator[None]:
    """Until the outermost block ends, every reader of a GGUF file on this thread is one instance per file, made
    when first asked for. With `transformers`, transformers' GGUF loaders (config, tokenizer, tensors) read through
    them too from then on; only blocks that call those loaders ask, since importing them costs ~1.3 s."""
    outer = getattr(_local, "readers", None) is None
    if outer:
        _local.readers, _local.metadata, _local.undo = {}, {}, ExitStack()
    try:
        if transformers:
            _share_with_transformers(_local.undo)
        yield
    finally:
        if outer:
            _local.undo.close()
            _local.readers = _local.metadata = _local.undo = None


def _share_with_transformers(undo: ExitStack) -> None:
    """Point transformers' GGUF loaders at the shared readers until `undo` closes (once per outermost block)."""
    if getattr(_local, "transformers_shared", False):
        return
    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    load_checkpoint, name_map = hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map
    # transformers imports these from their modules each time it reads a file or maps its names
    gguf.GGUFReader = read
    hf_gguf.load_gguf_checkpoint = partial(_metadata_once, load_checkpoint)
    gguf.get_tensor_name_map = lru_cache(maxsize=8)(name_map)  # asked again for every submodule, built each time
    _local.transformers_shared = True

    def restore() -> None:
        gguf.GGUFReader, gguf.get_tensor_name_map = GGUFReader, name_map
        hf_gguf.load_gguf_checkpoint = load_checkpoint
        _local.transformers_shared = False

    undo.callback(restore)


def _metadata_once(load_checkpoint, path, return_tensors: bool = False, model_to_load=None):
    """transformers' load_gguf_checkpoint, its metadata-only answer (config, tokenizer: every vocabulary entry
    parsed into Python, ~4 s for 262k tokens) computed once per file in a shared_readers() block."""
    shared = getattr(_local, "metadata", None)  # None on another thread than the block's
    if return_tensors or shared is None:
        return load_checkpoint(path, return_tensors=return_tensors, model_to_load=model_to_load)
    key = str(Path(path).resolve())
    if key not in shared:
        shared[key] = load_checkpoint(path, return_tensors=False)
    # a copy of each part (config, tokenizer, ...): a caller may pop a key of its own
    return {part: dict(value) if isinstance(value, dict) else value for part, value in shared[key].items()}
