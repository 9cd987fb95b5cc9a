"""Building the CPU kernels never waits forever on a lock a killed build left behind (runs without AVX-512 too)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import torch.utils.cpp_extension as cpp_extension

from specserve.models import cpu_kernels


def fake_loader(monkeypatch, seen: list[str], check=lambda directory: None):
    def fake_load(name, sources, build_directory, **kwargs):
        check(build_directory)
        seen.append(build_directory)
        return "extension"

    monkeypatch.setattr(cpp_extension, "load", fake_load)


def test_a_stale_torch_build_lock_is_cleared(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path))
    abi = f"py{sys.version_info.major}{sys.version_info.minor}_torch{cpu_kernels.torch.__version__.replace('+', '_')}"
    seen: list[str] = []
    fake_loader(monkeypatch, seen)
    cpu_kernels._build()
    build_dir = Path(seen[0])
    assert build_dir.parent == tmp_path / abi and build_dir.name.startswith(cpu_kernels.NAME + "-")
    (build_dir / "lock").write_text("")  # what a build killed mid-way leaves; torch's load() would wait on it
    fake_loader(monkeypatch, seen, check=lambda directory: Path(directory, "lock").exists() and pytest.fail("lock"))
    assert cpu_kernels._build() == "extension"


def test_each_source_version_builds_in_its_own_folder(tmp_path, monkeypatch):
    """Two checkouts with different kernels (or an upgrade) never rebuild over each other's."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    seen: list[str] = []
    fake_loader(monkeypatch, seen)
    source = tmp_path / "kernel.cpp"
    for text in ("int a;", "int b;", "int a;"):
        source.write_text(text)
        cpu_kernels._compile("k", source, [])
    assert seen[0] == seen[2] != seen[1] and all(s.startswith(str(tmp_path)) for s in seen)


def test_env_var_disables_both_kernels_on_any_cpu(monkeypatch):
    import importlib.util

    monkeypatch.setenv("SPECSERVE_NO_KERNELS", "1")
    spec = importlib.util.spec_from_file_location("fresh_cpu_kernels", cpu_kernels.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert not fresh.available() and not fresh.f32_linear_available()
    assert "SPECSERVE_NO_KERNELS" in fresh.unavailable_reason and "SPECSERVE_NO_KERNELS" in fresh.f32_unavailable_reason
