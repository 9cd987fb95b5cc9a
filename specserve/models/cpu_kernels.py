"""Row-invariant bf16 CPU kernels (linear and masked attention), compiled on first use.

Speculative decoding is only lossless if a token's logits don't depend on how many tokens share the forward
(T=1 decoding vs T=K+1 verification) or on the KV length; PyTorch's CPU bf16 linear and SDPA don't promise
that. The kernels in `specserve/csrc/cpu_kernels.cpp` compute every output element with one fixed sequence of
fp32 operations, on AVX-512, on AVX2 + FMA (the same arithmetic in 8-lane halves) or in scalar code.
`available()` never raises: when the build fails or SPECSERVE_NO_KERNELS=1 is set, it returns False and
`unavailable_reason` says why.

`f32_linear` (`specserve/csrc/f32_linear.cpp`, AVX2 + FMA) is the same idea for the linears of fp32 models (an
explicit `dtype: float32`): row-invariant, and it reads each weight once for all rows of a step.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import threading
from pathlib import Path

import torch

NAME = "specserve_cpu_kernels"
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_kernels.cpp"
F32_NAME = "specserve_f32_linear"
F32_SOURCE = SOURCE.with_name("f32_linear.cpp")

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


def _build_root() -> Path:
    """torch's extension folder (TORCH_EXTENSIONS_DIR when set, as torch's own loader does)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def _compile(name: str, source: Path, flags: list[str]):
    from torch.utils.cpp_extension import load

    # The .so is tied to the Python and torch it was built against, and to its source: a folder per source
    # version, so two checkouts (or an upgrade) never rebuild over each other's kernels.
    abi = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.replace('+', '_')}"
    # and to the environment: its torch headers' paths are in the build command, and a changed command rebuilds
    headers = sorted(source.parent.glob("*.h"))  # fp_mode.h
    digest = hashlib.sha256(source.read_bytes() + b"".join(h.read_bytes() for h in headers)
                            + " ".join([*flags, sys.prefix]).encode()).hexdigest()[:12]
    build_dir = _build_root() / abi / f"{name}-{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    built = build_dir / f"{name}.so"
    # torch's own build lock is a plain file that a killed build leaves behind, after which every later load
    # waits on it forever. An flock dies with its process: hold one while building and clear a stale torch lock.
    with open(build_dir / "specserve.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        if not built.exists():
            print(f"specserve: compiling {name} (once) ...", file=sys.stderr, flush=True)
        _use_packaged_ninja()
        return load(name=name, sources=[str(_source_copy(build_dir, source, headers))],
                    build_directory=str(build_dir), extra_cflags=["-O3", *flags, "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)


def _use_packaged_ninja() -> None:
    """Put the `ninja` package's binary first on PATH for torch's build: a system ninja of another version found
    first by one process (a venv's python run without activating it) reads the other's build log as a changed
    command and rebuilds, so processes alternating between the two rebuild the kernels every time."""
    import ninja

    if not os.environ.get("PATH", "").startswith(ninja.BIN_DIR + os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _source_copy(build_dir: Path, source: Path, headers: list[Path]) -> Path:
    """The source (and headers) copied into the build folder: ninja rebuilds when a source's path changes, so two
    checkouts of the same source sharing one folder would otherwise rebuild the .so over each other forever."""
    copies = build_dir / "src"
    copies.mkdir(exist_ok=True)
    for path in [source, *headers]:
        target = copies / path.name
        if not target.exists() or target.read_bytes() != path.read_bytes():
            target.write_bytes(path.read_bytes())
    return copies / source.name


QUANT_NAME = "specserve_quant_linear"
QUANT_SOURCE = SOURCE.with_name("quant_linear.cpp")


def load_quant():
    """The low-bit linear kernel (`quant_linear.cpp`). It picks AVX-512 VNNI, AVX2 or scalar code at run time, so
    it is built for the baseline ISA and needs only a C++ compiler; raises QuantizationError when it can't build."""
    from specserve.models.quant import QuantizationError

    try:
        # no -march=native: each path carries its own target attribute; no FP contraction, so the scalar path
        # rounds exactly as the vector ones
        return _compile(QUANT_NAME, QUANT_SOURCE, ["-ffp-contract=off"])
    except Exception as exc:
        raise QuantizationError(f"the quantized-weight kernel could not be built ({exc}); "
                                "use quantization: none") from exc


def _build():
    return _compile(NAME, SOURCE, ["-march=native"])


def _load():
    """The compiled extension, or None with `unavailable_reason` set; builds at most once per process."""
    global _ext, _tried, unavailable_reason
    with _lock:
        if not _tried:
            _tried = True
            _ext, unavailable_reason = _try_build(_build, ())
        return _ext


def _try_build(build, cpu_flags: tuple[str, ...]):
    """(extension, None) or (None, why not); never raises: a missing compiler or CPU feature means fall back."""
    if os.environ.get("SPECSERVE_NO_KERNELS") == "1":
        return None, "disabled by SPECSERVE_NO_KERNELS=1"
    missing = [flag for flag in cpu_flags if flag not in _cpu_flags()]
    if missing:
        return None, f"{', '.join(missing)} not listed in /proc/cpuinfo"
    try:
        return build(), None
    except Exception as exc:  # a missing compiler, a failed build: fall back, never crash the server
        return None, f"building the CPU kernels failed: {exc}"


_f32 = None
_f32_tried = False
f32_unavailable_reason: str | None = None


def _load_f32():
    global _f32, _f32_tried, f32_unavailable_reason
    if _f32_tried:  # asked on every linear of a forward: no lock once decided
        return _f32
    with _lock:
        if not _f32_tried:
            _f32, f32_unavailable_reason = _try_build(
                lambda: _compile(F32_NAME, F32_SOURCE, ["-mavx2", "-mfma"]), ("avx2", "fma"))
            _f32_tried = True
        return _f32


def f32_linear_available() -> bool:
    return _load_f32() is not None


def f32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias for fp32 x [..., K] and weight [N, K] (AVX2 + FMA); row m depends only on x[m]."""
    ext = _load_f32()
    if ext is None:
        raise RuntimeError(f"specserve fp32 kernel unavailable: {f32_unavailable_reason}")
    y = ext.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


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


# The glue of a decoder layer (see the C++ for the exact rounding order of each).

def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor | None,
               k_norm: torch.Tensor | None, eps: float, gemma: bool, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q, k, v [B, T, heads * D] (views of one fused projection are fine): per head the optional q/k RMSNorm, then
    rope with cos, sin [B, T, D]; k, v go into the layer's caches [rows, Hkv, C, D] at `slots` [B, T]. Returns the
    rotated q [B, H, T, D]."""
    return _require().rope_store(q, k, v, q_norm, k_norm, float(eps), bool(gemma), cos, sin, k_cache, v_cache,
                                 slots)


def gated_activation(gate: torch.Tensor, up: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    """act(gate) * up in bf16 (tanh-approximated gelu or silu); with up None, gate is one fused [..., 2 I]."""
    return _require().gated_activation(gate, up, bool(gelu))


def residual_norm(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor | None, next_norm: torch.Tensor,
                  eps: float, gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, next_norm(s)) with s = x + post(y) (Gemma's sandwich norm) or x + y when post is None; bf16."""
    total, normed = _require().residual_norm(x, y, post, next_norm, float(eps), bool(gemma))
    return total, normed


# The decoder layers in one call (kernel_forward.py builds them; see the C++ for what each field is).

def bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None):
    """A LayerStack linear computing small_linear(x, weight, bias)."""
    return _require().bf16_linear(weight, bias)


def packed_linear(args: tuple[list, ...], bias: torch.Tensor | None):
    """A LayerStack linear computing quant.packed_matmul(x, args, bias) (args: quant.kernel_args)."""
    return _require().packed_linear(*args, bias)


def stack_layer(**fields):
    """One decoder layer of a LayerStack: its linears, norm weights and settings."""
    return _require().StackLayer(**fields)


def layer_stack(layers: list, quant_linear_capsule=None):
    """The layers as one C++ call per forward; packed linears need quant.quant_linear_capsule()."""
    return _require().LayerStack(layers, quant_linear_capsule)


def attention_masks(lengths: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    tree_mask: torch.Tensor | None, window: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KVCache.attention_masks' (full, sliding-window) boolean masks [B, 1, T, span] in one pass (window 0: none,
    and the two are one tensor)."""
    return tuple(_require().attention_masks(lengths, positions, slots, tree_mask, window, span))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) for fp32 logits (the first maximum, or the first NaN), in one vectorized pass:
    PyTorch's reduction costs ~3% of a decoding step over a 262k vocabulary. PyTorch's own where the kernels are
    unavailable."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.numel() == 0 or not available():
        return logits.argmax(-1)
    return _require().argmax(logits)
