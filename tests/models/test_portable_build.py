"""The kernels build from source off x86: the sources of specserve._C that hold code there (the module, the
scalar variant, the quantized linear's scalar path) compile for aarch64, checked with a cross compiler where one
is installed (Debian: g++-aarch64-linux-gnu)."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension

CSRC = Path(__file__).resolve().parents[2] / "specserve" / "csrc"
CROSS = shutil.which("aarch64-linux-gnu-g++")


@pytest.mark.skipif(CROSS is None, reason="no aarch64 cross compiler here (apt install g++-aarch64-linux-gnu)")
@pytest.mark.parametrize("source", ["module.cpp", "quant_linear.cpp", "variant_scalar.cpp"])
def test_the_sources_with_code_off_x86_compile_for_aarch64(source):
    includes = [f"-I{path}" for path in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    command = [CROSS, "-std=c++20", "-fsyntax-only", "-fopenmp", "-Wall", "-Werror=unused-variable",
               "-DTORCH_EXTENSION_NAME=_C", *includes, str(CSRC / source)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
