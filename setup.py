"""Builds specserve._C, the CPU kernels, at install (`pip install .` or `pip install -e .`).

One extension from specserve/csrc: quant_linear.cpp, module.cpp and a variant_*.cpp per instruction set (scalar,
AVX2, AVX-512, AMX; csrc/kernels.h). Everything is compiled for the architecture's baseline, each variant with its
own target, so the .so runs on any CPU of the architecture and picks its path at run time. No FP contraction: the
vector paths round exactly as the scalar ones.
"""

from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

CSRC = Path("specserve") / "csrc"

setup(
    ext_modules=[
        CppExtension(
            "specserve._C",
            sorted(str(path) for path in CSRC.glob("*.cpp")),
            extra_compile_args=["-O3", "-g0", "-fopenmp", "-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
            depends=sorted(str(path) for path in [*CSRC.glob("*.h"), *CSRC.glob("*.inc")]),
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
