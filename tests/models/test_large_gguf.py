"""A GGUF too large to dequantize in memory (an 8B model) converts with its norms and biases only and runs on its
own blocks; its outputs are those of the same file converted in full. A tiny file stands in, with the memory
limit set to nothing."""

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
    path.touch()  # a new mtime: a new conversion
    monkeypatch.setattr(loader, "DENSE_RAM_SHARE", 0.0)
    packed = loader.load_model(str(path))
    assert (packed.path / loader.PACKED_ONLY).exists()
    assert torch.equal(logits(packed), expected)
    with pytest.raises(loader.ModelLoadError, match="too large to dequantize"):
        loader.load_model(str(path), quantization="none")
