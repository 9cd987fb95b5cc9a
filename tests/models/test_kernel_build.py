"""Building the CPU kernels never waits forever on a lock a killed build left behind (runs without AVX-512 too)."""

from __future__ import annotations

import sys

import torch.utils.cpp_extension as cpp_extension

from specserve.models import cpu_kernels


def test_a_stale_torch_build_lock_is_cleared(tmp_path, monkeypatch):
    abi = f"py{sys.version_info.major}{sys.version_info.minor}_torch{cpu_kernels.torch.__version__.replace('+', '_')}"
    build_dir = tmp_path / abi / cpu_kernels.NAME
    build_dir.mkdir(parents=True)
    (build_dir / "lock").write_text("")  # what a build killed mid-way leaves; torch's load() would wait on it
    seen = {}

    def fake_load(name, sources, build_directory, **kwargs):
        seen["lock_left"] = (build_dir / "lock").exists()
        seen["build_directory"] = build_directory
        return "extension"

    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert cpu_kernels._build() == "extension"
    assert seen == {"lock_left": False, "build_directory": str(build_dir)}


def test_env_var_disables_both_kernels_on_any_cpu(monkeypatch):
    import importlib.util

    monkeypatch.setenv("SPECSERVE_NO_KERNELS", "1")
    spec = importlib.util.spec_from_file_location("fresh_cpu_kernels", cpu_kernels.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert not fresh.available() and not fresh.f32_linear_available()
    assert "SPECSERVE_NO_KERNELS" in fresh.unavailable_reason and "SPECSERVE_NO_KERNELS" in fresh.f32_unavailable_reason
