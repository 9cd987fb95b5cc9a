"""A GGUF runs from its own file: the cache holds its config, tokenizer and norms, never its linears dequantized,
and its outputs are those of the file dequantized in memory. One too large to dequantize (an 8B model) still runs
on its blocks and refuses quantization none. `specserve convert` writes the dequantized weights as an HF
checkpoint that loads to the same outputs. Tiny files stand in, with the memory limit set to nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from specserve.models import loader

HELPER = Path(__file__).resolve().parents[2] / "benchmarks" / "random_gguf.py"


@pytest.fixture(scope="module")
def random_gguf():
    spec = importlib.util.spec_from_file_location("random_gguf", HELPER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def cached_tensor_names(directory: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as reader:
        return set(reader.keys())


@pytest.mark.parametrize("arch, bias", [("llama", False), ("qwen2", True)])
def test_a_gguf_too_large_to_dequantize_runs_packed(tmp_path, monkeypatch, random_gguf, arch, bias):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    shape = random_gguf.Shape(arch, 256, 2, 4, 2, 512, 600, tied=arch == "qwen2", rope_theta=10000.0,
                              qkv_bias=bias, context=256)
    path = tmp_path / f"tiny-{arch}.gguf"
    random_gguf.write(f"tiny {arch}", "Q4_K_M", path, shape=shape)
    full = loader.load_model(str(path))
    ids = torch.tensor([[5, 77, 300, 41, 9]])
    positions = torch.arange(5)[None]

    def logits(model):
        from specserve.models.kv_cache import KVCache

        cache = KVCache.for_model(model.model, 1, 8)
        return model.model(ids, positions, cache, positions).logits

    expected = logits(full)
    names = cached_tensor_names(full.path)
    assert not any(name.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight"))
                   for name in names), "a packed linear was also cached dense"
    path.touch()  # a new mtime: a new conversion
    monkeypatch.setattr(loader, "DENSE_RAM_SHARE", 0.0)
    packed = loader.load_model(str(path))
    assert packed.path != full.path and cached_tensor_names(packed.path) == names
    assert torch.equal(logits(packed), expected)
    with pytest.raises(loader.ModelLoadError, match="too large to dequantize"):
        loader.load_model(str(path), quantization="none")


def test_a_gguf_header_is_read_once_per_load_and_equals_ggufs_own_reader(tmp_path, monkeypatch, random_gguf):
    import numpy as np
    from gguf import GGUFReader

    from specserve.models import gguf_file

    shape = random_gguf.Shape("llama", 256, 2, 4, 2, 512, 600, tied=False, rope_theta=10000.0, context=256)
    path = tmp_path / "tiny.gguf"
    random_gguf.write("tiny", "Q4_K_M", path, shape=shape)
    fast, reference = gguf_file.FastGGUFReader(path), GGUFReader(path)
    for key, field in reference.fields.items():
        other = fast.fields[key]
        assert other.types == field.types and other.data == field.data
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(other.parts, field.parts)), key
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in fast.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist()) for t in reference.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors, reference.tensors))

    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    made, parsed = [], []
    monkeypatch.setattr(gguf_file, "FastGGUFReader", lambda *args: made.append(args) or GGUFReader(*args))
    parse = hf_gguf.load_gguf_checkpoint
    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", lambda *a, **k: parsed.append(a) or parse(*a, **k))
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    loader.load_model(str(path))  # config, tokenizer, norms, packing, chat template: one read, one parse
    assert len(made) == 1 and len(parsed) == 1
    import gguf

    assert gguf.GGUFReader is GGUFReader  # what the block patched is back


def test_convert_writes_a_checkpoint_with_the_ggufs_outputs(tmp_path, monkeypatch, random_gguf):
    from specserve.models.kv_cache import KVCache

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    shape = random_gguf.Shape("qwen2", 256, 2, 4, 2, 512, 600, tied=True, rope_theta=10000.0, qkv_bias=True,
                              context=256)
    path = tmp_path / "tiny-qwen2.gguf"
    random_gguf.write("tiny qwen2", "Q8_0", path, shape=shape)
    out = loader.export_hf_checkpoint(str(path), tmp_path / "hf")
    ids, positions = torch.tensor([[5, 77, 300, 41, 9]]), torch.arange(5)[None]
    results = []
    for model in (loader.load_model(str(path), quantization="none"), loader.load_model(str(out))):
        cache = KVCache.for_model(model.model, 1, 8)
        results.append(model.model(ids, positions, cache, positions).logits)
    assert torch.equal(*results)


def test_a_gguf_changed_in_place_leaves_one_converted_directory(tmp_path, monkeypatch, random_gguf):
    """The conversion of a file's earlier version (another mtime), and one of its name without a recorded source (an
    earlier specserve's layout), are removed when it is converted again; the conversion of another file of the same
    name, elsewhere, and a directory of another name are not (the controls)."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    shape = random_gguf.Shape("llama", 256, 2, 4, 2, 512, 600, tied=False, rope_theta=10000.0, context=256)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    path, namesake = tmp_path / "a" / "tiny.gguf", tmp_path / "b" / "tiny.gguf"
    for file in (path, namesake):
        random_gguf.write("tiny", "Q4_K_M", file, shape=shape)
    first, other = loader.load_model(str(path)).path, loader.load_model(str(namesake)).path
    older_layout = first.parent / "tiny-0123456789abcdef"  # what an earlier specserve wrote: no source recorded
    older_layout.mkdir()
    (older_layout / "model.safetensors").write_bytes(b"fp32 weights")
    unrelated = first.parent / "tiny-llama-0123456789abcdef"  # another file's name, with the same start
    unrelated.mkdir()
    import os

    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # the file changed in place
    second = loader.load_model(str(path)).path
    assert second != first and second.exists() and not first.exists() and not older_layout.exists()
    assert sorted(d.name for d in second.parent.iterdir()) == sorted([second.name, other.name, unrelated.name])
