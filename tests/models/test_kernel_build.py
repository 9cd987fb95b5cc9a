"""The kernels are built at install and required: one extension, its variants chosen by the CPU or by
SPECSERVE_KERNELS, and a clear error (never a silent fallback) when they cannot load."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess

import pytest

from specserve.models import cpu_kernels, quant
from specserve.models.quant import QuantizationError
from tests.conftest import runnable_kernel_variants


@pytest.fixture
def fresh_choice(monkeypatch):
    """The module's per-mode choice forgotten, and restored after the test."""
    monkeypatch.setattr(cpu_kernels, "_loaded", {})


def test_the_extension_has_every_variant_and_the_cpu_runs_the_scalar_one():
    ext = cpu_kernels.extension()
    assert ext.VARIANTS[0] == "scalar" and ext.cpu_runs("scalar")
    assert set(ext.VARIANTS) <= {"scalar", "avx2", "avx512", "amx"}
    assert not ext.cpu_runs("no-such-variant")
    for name in ext.VARIANTS:
        assert callable(getattr(ext, name).small_linear) and callable(getattr(ext, name).LayerStack)


def test_auto_takes_the_fastest_variant_this_cpu_runs(monkeypatch, fresh_choice):
    monkeypatch.setenv(cpu_kernels.ENV, "auto")
    assert cpu_kernels._load() is getattr(cpu_kernels.extension(), runnable_kernel_variants()[-1])


def test_a_variant_this_cpu_cannot_run_is_refused_by_name(monkeypatch, fresh_choice):
    ext = cpu_kernels.extension()
    missing = [name for name in ext.VARIANTS if not ext.cpu_runs(name)]
    if not missing:
        pytest.skip("this CPU runs every compiled variant")
    monkeypatch.setenv(cpu_kernels.ENV, missing[-1])
    with pytest.raises(cpu_kernels.KernelsUnavailable, match=f"cannot run the {missing[-1]} kernels"):
        cpu_kernels.available()


def test_an_unknown_mode_is_an_error_naming_the_choices(monkeypatch, fresh_choice):
    monkeypatch.setenv(cpu_kernels.ENV, "avx1024")
    with pytest.raises(cpu_kernels.KernelsUnavailable, match="auto, off, scalar"):
        cpu_kernels.available()


def test_off_turns_every_kernel_off(monkeypatch, fresh_choice):
    monkeypatch.setenv(cpu_kernels.ENV, "off")
    assert not cpu_kernels.available() and not cpu_kernels.f32_linear_available()
    with pytest.raises(cpu_kernels.KernelsUnavailable, match="turned off"):
        cpu_kernels.variant() or cpu_kernels._require()


def test_a_missing_extension_is_an_error_not_a_fallback(monkeypatch, fresh_choice):
    """A broken build (here: the import fails) stops the start with the cause; nothing falls back to a lossy path."""
    import importlib

    real = importlib.import_module

    def broken(name, *args):
        if name == "specserve._C":
            raise ImportError("undefined symbol: _ZN9specserve12quant_linear")
        return real(name, *args)

    monkeypatch.setattr(cpu_kernels.importlib, "import_module", broken)
    monkeypatch.setenv(cpu_kernels.ENV, "auto")
    with pytest.raises(cpu_kernels.KernelsUnavailable, match="undefined symbol.*pip install"):
        cpu_kernels.available()
    with pytest.raises(QuantizationError, match="cannot be loaded"):
        quant.quant_path()


def test_the_model_loader_stops_on_missing_kernels(monkeypatch, fresh_choice, checkpoint):
    from specserve.models.loader import load_model

    def missing():
        raise cpu_kernels.KernelsUnavailable("specserve's compiled kernels (specserve._C) cannot be loaded: test")

    monkeypatch.setattr(cpu_kernels, "extension", missing)
    with pytest.raises(cpu_kernels.KernelsUnavailable, match="cannot be loaded"):
        load_model(checkpoint("llama"))


def tile_functions(disassembly: str) -> dict[str, str]:
    """The quantized linear's vector functions that read a packed weight block by block (the tiles, but not those
    that read a tile decoded once into a buffer; the decoding itself), by demangled name -> their machine code,
    from `objdump -d -C` of the extension."""
    tiles = {}
    for function in disassembly.split("\n\n"):
        header = re.match(r"[0-9a-f]+ <(.*)>:", function.strip())
        name = header and re.search(r"(?:tile_rows|decode_tile)_avx(?:512|2)<[^>]*>", header.group(1))
        reads_buffer = name and name.group(0).startswith("tile_rows") and name.group(0).endswith("true>")  # DECODED
        if name and not reads_buffer:
            tiles[name.group(0)] = function
    return tiles


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the vector tiles are x86 code")
def test_every_vector_tile_prefetches_the_weight_it_streams():
    """GCC 12, given Python's own CFLAGS (-fwrapv, which setuptools adds), compiled _mm_prefetch out of every tile
    of the formats with offsets or bit planes (Q4_K, Q5_K, Q6_K, Q5_0, Q4_1), on both vector paths: the models
    users run streamed their weights unprefetched, a fifth slower at one row, a quarter at eight. The installed
    extension's machine code must hold a prefetch in each tile that reads a packed weight."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    disassembly = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", cpu_kernels.extension().__file__],
                                 capture_output=True, text=True, check=True).stdout
    tiles = tile_functions(disassembly)
    formats = {re.search(r"<(\d+, \d+, (?:true|false))", name).group(1) for name in tiles if "tile_rows" in name}
    assert {"4, 1, false", "4, 1, true", "5, 1, false", "5, 1, true", "6, 2, false", "8, 1, false"} <= formats
    assert {"decode_tile_avx512", "decode_tile_avx2"} <= {name.split("<")[0] for name in tiles}
    unprefetched = sorted(name for name, code in tiles.items() if "prefetcht" not in code)
    assert not unprefetched, f"{len(unprefetched)} of {len(tiles)} tiles issue no prefetch: {unprefetched[:4]}"
