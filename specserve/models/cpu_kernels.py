"""Row-invariant bf16 CPU kernels (linear and masked attention), compiled on first use.

Speculative decoding is only lossless if a token's logits don't depend on how many tokens share the forward
(T=1 decoding vs T=K+1 verification) or on the KV length; PyTorch's CPU bf16 linear and SDPA don't promise
that. The kernels in `specserve/csrc/cpu_kernels.cpp` compute every output element with one fixed sequence of
fp32 operations. `available()` never raises: when the build fails, the CPU lacks AVX-512 or
SPECSERVE_NO_KERNELS=1 is set, it returns False and `unavailable_reason` says why.
"""

from __future__ import annotations

import fcntl
import os
import sys
import threading
from pathlib import Path

import torch

NAME = "specserve_cpu_kernels"
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_kernels.cpp"

unavailable_reason: str | None = None
_ext = None
_tried = False
_lock = threading.Lock()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _build():
    from torch.utils.cpp_extension import get_default_build_root, load

    # The .so is tied to the Python and torch it was built against.
    abi = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.replace('+', '_')}"
    build_dir = Path(get_default_build_root()) / abi / NAME
    build_dir.mkdir(parents=True, exist_ok=True)
    built = build_dir / f"{NAME}.so"
    # torch's own build lock is a plain file that a killed build leaves behind, after which every later load
    # waits on it forever. An flock dies with its process: hold one while building and clear a stale torch lock.
    with open(build_dir / "specserve.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        if not built.exists() or built.stat().st_mtime < SOURCE.stat().st_mtime:
            print("specserve: compiling CPU kernels (once) ...", file=sys.stderr, flush=True)
        return load(name=NAME, sources=[str(SOURCE)], build_directory=str(build_dir),
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


def _load():
    """The compiled extension, or None with `unavailable_reason` set; builds at most once per process."""
    global _ext, _tried, unavailable_reason
    with _lock:
        if not _tried:
            _tried = True
            if os.environ.get("SPECSERVE_NO_KERNELS") == "1":
                unavailable_reason = "disabled by SPECSERVE_NO_KERNELS=1"
            elif "avx512f" not in _cpu_flags():
                unavailable_reason = "AVX-512F is not listed in /proc/cpuinfo"
            else:
                try:
                    _ext = _build()
                except Exception as exc:  # a missing compiler, a failed build: fall back, never crash the server
                    unavailable_reason = f"building the CPU kernels failed: {exc}"
        return _ext


def available() -> bool:
    return _load() is not None


def variant() -> str | None:
    """Which instructions each kernel runs on (they fix its arithmetic), e.g. for logs; None if unavailable."""
    ext = _load()
    return None if ext is None else ext.variant()


def _require():
    ext = _load()
    if ext is None:
        raise RuntimeError(f"specserve CPU kernels unavailable: {unavailable_reason}")
    return ext


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out_fp32: bool = False) -> torch.Tensor:
    """x @ weight.T + bias for bf16 x [..., K] and weight [N, K]; fp32 or bf16 [..., N].

    Row m of the result depends only on x[m] (bit for bit), whatever the other rows are.
    """
    y = _require().small_linear(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), bias, out_fp32)
    return y.view(*x.shape[:-1], weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """RMSNorm over the last dim of bf16 x with an fp32 weight (Gemma: the precomputed 1 + w); each row computed
    alone in one fixed order, one call instead of the ~8 tensor ops of the PyTorch version."""
    return _require().rms_norm(x.contiguous(), weight, float(eps), bool(gemma))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(scale * q k^T over mask) v for bf16 q [B, H, T, D], k, v [B, Hkv, S, D], mask bool [B, 1, T, S].

    Query head h reads kv head h // (H // Hkv). Each (b, h, t) row depends only on its q, its visible keys and
    values, bit for bit; masked keys are never read, and a row with no visible key is zeros.
    """
    return _require().decode_attention(q, k, v, mask, float(scale))
