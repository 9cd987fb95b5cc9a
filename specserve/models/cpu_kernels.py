"""Row-invariant CPU kernels: the compiled extension specserve._C, built at install, one variant chosen per CPU.

Speculative decoding is only lossless if a token's logits don't depend on how many tokens share the forward
(T=1 decoding vs T=K+1 verification) or on the KV length; PyTorch's CPU bf16 linear and SDPA don't promise
that. The kernels in `specserve/csrc` compute every output element with one fixed sequence of fp32 operations.
The bf16 layer kernels (cpu_kernels.inc) are compiled once per instruction-set variant, side by side in one
extension: `scalar`, `avx2` (AVX2 + FMA), `avx512` (AVX-512 VNNI + BF16) and `amx`; the fastest this CPU runs is
used unless SPECSERVE_KERNELS (or `specserve --kernels`) names another. Each variant also holds the packed low-bit
linear (quant_linear.cpp) on its own path (scalar, AVX2, AVX-512 VNNI for both `avx512` and `amx`): the one choice
of variant picks every kernel's instructions, by the one probe of the CPU (module.cpp's `cpu_runs`).

The kernels are required: when they cannot load, `available()` raises KernelsUnavailable naming the cause. Only
SPECSERVE_KERNELS=off turns them off (PyTorch's own ops: slower, and not row-invariant, so speculation is then no
longer exactly lossless).

`f32_linear` (f32_linear.inc, AVX2 + FMA variants) is the same idea for the linears of fp32 models (an explicit
`dtype: float32`): row-invariant, and it reads each weight once for all rows of a step.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Callable

import torch

MODES = ("auto", "off", "scalar", "avx2", "avx512", "amx")
ENV = "SPECSERVE_KERNELS"


class KernelsUnavailable(RuntimeError):
    """The compiled kernels cannot load or cannot run the requested variant: a message that names the cause."""


_lock = threading.Lock()
_loaded: dict[str, object] = {}  # mode -> the variant submodule (or None for off)


def parse_mode(value: str, given_as: str = ENV) -> str:
    """`value` as a kernels mode (auto, off or a variant's name); KernelsUnavailable naming `given_as` if it is none."""
    mode = value.strip().lower() or "auto"
    if mode not in MODES:
        raise KernelsUnavailable(f"{given_as} {value!r} is not one of {', '.join(MODES)}")
    return mode


def mode() -> str:
    """SPECSERVE_KERNELS: auto (the fastest variant this CPU runs), off, or a variant's name."""
    return parse_mode(os.environ.get(ENV, "auto"))


def extension():
    """specserve._C, or KernelsUnavailable saying why it cannot be imported (not built, built for another torch)."""
    try:
        return importlib.import_module("specserve._C")
    except ImportError as exc:
        raise KernelsUnavailable(
            f"specserve's compiled kernels (specserve._C) cannot be loaded: {exc}. They are built by "
            "`pip install` from the repository (a C++ compiler and torch==2.13.0); reinstall, or run with "
            f"{ENV}=off (`specserve --kernels off`: slower, and speculation no longer exactly lossless)") from exc


def choose_variant(ext, wanted: str) -> str:
    """The variant for mode `wanted`: the fastest this CPU runs for auto, else the named one if the CPU runs it."""
    runnable = [name for name in ext.VARIANTS if ext.cpu_runs(name)]
    if wanted == "auto":
        return runnable[-1]
    if wanted not in ext.VARIANTS:
        raise KernelsUnavailable(f"the {wanted} kernels are not compiled into this build (it has "
                                 f"{', '.join(ext.VARIANTS)})")
    if wanted not in runnable:
        raise KernelsUnavailable(f"this CPU cannot run the {wanted} kernels (it runs {', '.join(runnable)})")
    return wanted


def _load(wanted: str | None = None):
    """The submodule of specserve._C for mode `wanted` (SPECSERVE_KERNELS by default), or None when the kernels are
    off; raises when it can't."""
    wanted = wanted or mode()
    if wanted in _loaded:  # asked on every kernel call: no lock once decided
        return _loaded[wanted]
    with _lock:
        if wanted not in _loaded:
            ext = None if wanted == "off" else extension()
            _loaded[wanted] = None if ext is None else getattr(ext, choose_variant(ext, wanted))
        return _loaded[wanted]


def quant_module():
    """The variant whose quant_linear, screen_argmax and probes compute packed weights: the chosen one, or with the
    kernels off the fastest this CPU runs (packed weights have no PyTorch path); KernelsUnavailable when it cannot
    load."""
    return _load() or _load("auto")


def available() -> bool:
    """True when the kernels run, False when the user turned them off; raises KernelsUnavailable otherwise."""
    return _load() is not None


def _load_f32():
    ext = _load()
    return getattr(ext, "f32_linear", None) if ext is not None else None


def f32_linear_available() -> bool:
    """Whether the fp32 linear runs here (the AVX2 and later variants; not the scalar one, nor with kernels off)."""
    return _load_f32() is not None


def f32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias for fp32 x [..., K] and weight [N, K] (AVX2 + FMA); row m depends only on x[m]."""
    linear = _load_f32()
    if linear is None:
        raise KernelsUnavailable(f"the fp32 linear runs in the avx2 and later variants, not with {ENV}={mode()}")
    y = linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def variant() -> str | None:
    """Which instructions each kernel runs on (they fix its arithmetic), e.g. for logs; None when turned off."""
    ext = _load()
    return None if ext is None else ext.variant()


def _require():
    ext = _load()
    if ext is None:
        raise KernelsUnavailable(f"the CPU kernels are turned off ({ENV}=off)")
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

def bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None, out_fp32: bool = False):
    """A LayerStack linear computing small_linear(x, weight, bias, out_fp32)."""
    return _require().bf16_linear(weight, bias, out_fp32)


def packed_linear(args: tuple[list, ...], bias: torch.Tensor | None, out_fp32: bool = False):
    """A LayerStack linear computing quant.packed_matmul(x, args, bias, out_fp32) (args: quant.kernel_args)."""
    return _require().packed_linear(*args, bias, out_fp32)


def stack_layer(**fields):
    """One decoder layer of a LayerStack: its linears, norm weights and settings."""
    return _require().StackLayer(**fields)


def layer_stack(layers: list, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """The layers as one C++ call per forward (packed linears call quant_linear directly). `reduce`: a
    tensor-parallel rank's all-reduce of its fp32 partial sums of o and down (built with out_fp32), called twice a
    layer."""
    return _require().LayerStack(layers, reduce)


def attention_masks(lengths: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    tree_mask: torch.Tensor | None, window: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KVCache.attention_masks' (full, sliding-window) boolean masks [B, 1, T, span] in one pass (window 0: none,
    and the two are one tensor)."""
    return tuple(_require().attention_masks(lengths, positions, slots, tree_mask, window, span))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) for fp32 logits (the first maximum, or the first NaN), in one vectorized pass:
    PyTorch's reduction is a visible share of a decoding step over a 262k vocabulary. PyTorch's own when the
    kernels are off."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.numel() == 0 or not available():
        return logits.argmax(-1)
    return _require().argmax(logits)
