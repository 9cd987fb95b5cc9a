"""Low-bit weights: GGUF blocks and int8 / int4 quantization, packed for `specserve/csrc/quant_linear.cpp`.

Every supported format is one affine code per weight (the layouts of ggml's `ggml-common.h`):

    w[n, k] = s[n, b] * (q[n, k] - z) - o[n, b]        q unsigned (4, 5, 6 or 8 bits), b = k // G

| format | bits | G  | z   | s, o                         | bytes / 32 weights (GGUF -> packed) |
|--------|------|----|-----|------------------------------|-------------------------------------|
| Q4_0   | 4    | 32 | 8   | d                            | 18 -> 18 |
| Q4_1   | 4    | 32 | 0   | d, -m                        | 20 -> 20 |
| Q5_0   | 5    | 32 | 16  | d                            | 22 -> 22 |
| Q5_1   | 5    | 32 | 0   | d, -m                        | 24 -> 24 |
| Q8_0   | 8    | 32 | 128 | d (q stored as q + 128)      | 34 -> 34 |
| Q4_K   | 4    | 32 | 0   | d * sc, dmin * m             | 18 -> 18.5 |
| Q5_K   | 5    | 32 | 0   | d * sc, dmin * m             | 22 -> 22.5 |
| Q6_K   | 6    | 16 | 32  | d * sc                       | 26.25 -> 26.25 |
| int8   | 8    | 32 | 128 | max abs / 127 (symmetric)    | from fp weights |
| int4   | 4    | 32 | 0   | (max - min) / 15, -min       | from fp weights |

Scales and offsets are packed as fp16 per block, in a power-of-two `unit` of the weight's own (`half_unit`): a
GGUF's f16 scales exactly. The K-quants keep their super-block layout instead: per 256 inputs and output the fp16
d (and dmin), per block the integer sc (and m), whose products the kernel forms exactly in fp32. The kernel
quantizes each activation row to int8 per block of 32 (as llama.cpp does) and sums q * p in integers, so a row's
result does not depend on the other rows.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from specserve.files import write_atomically
from specserve.models import cpu_kernels

TILE = 16  # outputs per kernel tile
BLOCK = 32  # inputs per packed block
SUPER_BLOCK = 256  # a K-quant's inputs per d (and dmin)
GGUF_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
QUANTIZATIONS = ("none", "gguf", "int8", "int4")  # the `quantization` setting's values


class QuantizationError(ValueError):
    """A weight or CPU the quantized path cannot take; the message names what is supported."""


@dataclass
class Codes:
    """One weight as affine codes: q uint8 [N, K], scales / offsets float32 [N, K // group]. A K-quant also
    keeps the factors of its scales (packed as they are, `PackedWeight.from_codes`): scales = d * sub_scales and
    offsets = dmin * sub_offsets, with d / dmin float32 [N, K // 256] (fp16 values) and the integer sub_scales /
    sub_offsets int8 [N, K // group]."""

    q: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None
    bits: int
    group: int
    zero: int
    kind: str
    super_scales: tuple[np.ndarray, np.ndarray] | None = None  # (d, sub_scales)
    super_offsets: tuple[np.ndarray, np.ndarray] | None = None  # (dmin, sub_offsets)


# ---------------------------------------------------------------- GGUF blocks -> codes

def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields [..., 2] -> float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-weight blocks: byte j holds weight j (low nibble) and weight j + 16 (high nibble)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bit_32(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: bit j of the little-endian uint32 is weight j's fifth bit -> 0 or 16 per weight."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits.astype(np.uint8) << 4


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4)."""
    s = packed.astype(np.uint8)
    low = (s[..., 0:4] & 63, s[..., 4:8] & 63)
    high = ((s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4), (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4))
    return np.concatenate([low[0], high[0]], -1), np.concatenate([low[1], high[1]], -1)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: 4 chunks of 32 bytes; chunk j holds weights 64j + l (low) and 64j + 32 + l (high)."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([chunks & 15, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _decode_blocks(kind: str, b: np.ndarray) -> tuple[np.ndarray, tuple, tuple | None]:
    """Blocks [N, nb, bytes] of a type in _FORMATS -> (q [N, nb, weights], scales, offsets or None), the scales
    and offsets each as (factor [N, nb, 1], integer [N, nb, groups] or None): the K-quants' d and sc, the other
    types' scale alone."""
    if kind == "Q8_0":
        q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, (_f16(b[..., 0:2])[..., None], None), None
    if kind in ("Q4_0", "Q4_1"):
        start = 2 if kind == "Q4_0" else 4
        offsets = None if kind == "Q4_0" else (-_f16(b[..., 2:4])[..., None], None)
        return _nibbles_32(b[..., start:start + 16]), (_f16(b[..., 0:2])[..., None], None), offsets
    if kind in ("Q5_0", "Q5_1"):
        start = 2 if kind == "Q5_0" else 4
        offsets = None if kind == "Q5_0" else (-_f16(b[..., 2:4])[..., None], None)
        q = _nibbles_32(b[..., start + 4:start + 20]) | _high_bit_32(b[..., start:start + 4])
        return q, (_f16(b[..., 0:2])[..., None], None), offsets
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, m = _k_scales(b[..., 4:16])
        if kind == "Q4_K":
            q = _k_nibbles(b[..., 16:144])
        else:  # qh[32]: bit 2j (low half) and 2j + 1 (high half) of byte l are the fifth bits of chunk j
            qh = b[..., 16:48]
            q = _k_nibbles(b[..., 48:176])
            fifth = np.stack([(qh >> shift) & 1 for shift in range(8)], axis=-2)  # [.., 8 halves, 32]
            q = q | (fifth.reshape(*qh.shape[:-1], 256) << 4)
        return q, (d, sc.astype(np.int8)), (dmin, m.astype(np.int8))
    # Q6_K
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc = b[..., 192:208].view(np.int8)
    d = _f16(b[..., 208:210])[..., None]
    halves = []
    for h in range(2):  # 128 weights each: 4 runs of 32 (ggml's q1..q4)
        lo, hi = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        runs = [(lo[..., :32] & 15), (lo[..., 32:] & 15), (lo[..., :32] >> 4), (lo[..., 32:] >> 4)]
        halves += [run | (((hi >> (2 * r)) & 3) << 4) for r, run in enumerate(runs)]
    return np.concatenate(halves, axis=-1), (d, sc), None


_FORMATS = {  # kind -> (bits, group, zero, block bytes, weights per block)
    "Q4_0": (4, 32, 8, 18, 32), "Q4_1": (4, 32, 0, 20, 32), "Q5_0": (5, 32, 16, 22, 32),
    "Q5_1": (5, 32, 0, 24, 32), "Q8_0": (8, 32, 128, 34, 32), "Q4_K": (4, 32, 0, 144, 256),
    "Q5_K": (5, 32, 0, 176, 256), "Q6_K": (6, 16, 32, 210, 256),
}


def decode_gguf(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> Codes:
    """A GGUF tensor's raw blocks (uint8 [N, bytes per row]) of HF shape (N, K) -> codes."""
    if kind not in _FORMATS:
        raise QuantizationError(f"GGUF tensor type {kind} is not supported; supported: {', '.join(GGUF_TYPES)} "
                                "(or load it dequantized with quantization: none)")
    bits, group, zero, block_bytes, per_block = _FORMATS[kind]
    n, k = shape
    if k % per_block:
        raise QuantizationError(f"a {kind} tensor needs rows of a multiple of {per_block} weights, not {k}")
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // per_block, block_bytes)
    q, scales, offsets = _decode_blocks(kind, blocks)
    flat = lambda a, dtype=np.float32: None if a is None else np.ascontiguousarray(a.reshape(n, -1), dtype=dtype)
    product = lambda f: None if f is None else flat(f[0] if f[1] is None else f[0] * f[1].astype(np.float32))
    factors = lambda f: None if f is None or f[1] is None else (flat(f[0]), flat(f[1], np.int8))
    return Codes(q.reshape(n, k).astype(np.uint8), product(scales), product(offsets), bits, group, zero, kind,
                 factors(scales), factors(offsets))


# ---------------------------------------------------------------- fp weights -> codes

def quantize_dense(weight: torch.Tensor, kind: str) -> Codes:
    """Weight-only quantization of an fp weight [N, K] (K a multiple of 32): int8 symmetric or int4 asymmetric
    per block of 32."""
    n, k = weight.shape
    if k % BLOCK:
        raise QuantizationError(f"{kind} quantization needs in_features divisible by {BLOCK}, not {k}")
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if kind == "int8":
        scale = as_stored(w.abs().amax(-1) / 127)
        q = torch.round(w / torch.where(scale > 0, scale, 1)[..., None]).clamp(-127, 127) + 128
        return Codes(q.to(torch.uint8).reshape(n, k).numpy(), scale.numpy(), None, 8, 32, 128, "int8")
    if kind == "int4":
        low, high = w.amin(-1), w.amax(-1)
        scale, low = as_stored((high - low) / 15, low)
        q = torch.round((w - low[..., None]) / torch.where(scale > 0, scale, 1)[..., None]).clamp(0, 15)
        return Codes(q.to(torch.uint8).reshape(n, k).numpy(), scale.numpy(), (-low).numpy(), 4, 32, 0, "int4")
    raise QuantizationError(f"cannot quantize dense weights as {kind!r}: use int8 or int4")


def as_stored(scale: torch.Tensor, low: torch.Tensor | None = None):
    """Scales (and a block's lows, the offsets' negatives) as the packed layout holds them (fp16 in the weight's
    unit, `half_unit`): codes chosen against these are within half a step of the weight."""
    unit = half_unit(scale.numpy(), None if low is None else low.numpy())
    store = lambda v: (v / unit).half().float() * unit
    return store(scale) if low is None else (store(scale), store(low))


# ---------------------------------------------------------------- codes -> the kernel's layout

_TENSOR_FIELDS = ("qs", "planes", "scales", "offsets")  # PackedWeight's tensors, in the kernel's argument order

@dataclass
class PackedWeight:
    """A weight in the kernel's layout (see quant_linear.cpp); N padded to whole tiles with zero scales."""

    qs: torch.Tensor  # uint8 [tiles, K/32, 512 (8 bits) or 256 (4..6 bits)]
    planes: torch.Tensor | None  # uint8 [tiles, K/32, bits - 4, 64], 5- and 6-bit formats
    scales: torch.Tensor  # float16 [tiles, K/32, 32/group, 16], in `unit`s; a K-quant's: `_super_layout`
    offsets: torch.Tensor | None  # like scales
    out_features: int
    in_features: int
    bits: int
    group: int
    zero: int
    kind: str
    unit: float = 1.0  # a power of two: the scales' and offsets' true values are unit * the stored ones
    _args: tuple | None = field(default=None, init=False, repr=False, compare=False)  # see `args`
    # set on the parts of a `concat`: (the fused weight, this part's first tile in it); its tensors are views of
    # the fused weight's, so concatenating the same parts again gives that weight back instead of a copy
    fused_into: tuple["PackedWeight", int] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_codes(cls, codes: Codes) -> "PackedWeight":
        n, k = codes.q.shape
        tiles = -(-n // TILE)
        pad = tiles * TILE - n
        q = np.pad(codes.q, ((0, pad), (0, 0)))
        # [tiles, 16 outputs, K/32, 8 groups, 4 inputs] -> [tiles, K/32, 8 groups, 16 outputs * 4 inputs]
        groups = q.reshape(tiles, TILE, k // BLOCK, 8, 4).transpose(0, 2, 3, 1, 4).reshape(tiles, k // BLOCK, 8, 64)
        qs, planes = _pack_groups(torch.from_numpy(np.ascontiguousarray(groups)), codes.bits)
        if codes.super_scales is not None:
            scales, offsets = (None if f is None else _super_layout(*f, tiles, codes.group)
                               for f in (codes.super_scales, codes.super_offsets))
            return cls(qs, planes, scales, offsets, n, k, codes.bits, codes.group, codes.zero, codes.kind)

        unit = half_unit(codes.scales, codes.offsets)

        def per_tile(values: np.ndarray | None) -> torch.Tensor | None:
            if values is None:
                return None
            padded = np.pad(np.asarray(values, dtype=np.float32) / np.float32(unit), ((0, pad), (0, 0)))
            per_block = BLOCK // codes.group
            return torch.from_numpy(np.ascontiguousarray(
                padded.reshape(tiles, TILE, k // BLOCK, per_block).transpose(0, 2, 3, 1), dtype=np.float16))

        return cls(qs, planes, per_tile(codes.scales), per_tile(codes.offsets), n, k, codes.bits, codes.group,
                   codes.zero, codes.kind, unit)

    @staticmethod
    def fusable(parts: list["PackedWeight"]) -> bool:
        """Whether `concat` can make one weight of these: one format, and every part fills whole tiles."""
        first = parts[0]
        key = lambda p: (p.bits, p.group, p.zero, p.offsets is None, p.in_features, p.scales.dtype)
        same = all(key(p) == key(first) for p in parts)
        return same and not any(p.out_features % TILE for p in parts)

    @staticmethod
    def concat(parts: list["PackedWeight"]) -> "PackedWeight | None":
        """One weight for several over the same input (fused q/k/v, gate/up), or None when not `fusable`."""
        if not PackedWeight.fusable(parts):
            return None
        first = parts[0]
        if first.fused_into is not None:
            whole = first.fused_into[0]
            starts = [p.fused_into[1] if p.fused_into and p.fused_into[0] is whole else -1 for p in parts]
            if starts == list(itertools.accumulate([0] + [p.out_features // TILE for p in parts[:-1]])) and \
                    sum(p.out_features for p in parts) == whole.out_features:
                return whole
        unit = max(p.unit for p in parts)  # the parts' scales re-expressed in the largest unit (exact while normal)

        def cat(name: str) -> torch.Tensor | None:
            if getattr(first, name) is None:
                return None
            in_units = name in ("scales", "offsets")  # codes and planes have no unit
            return torch.cat([in_unit(getattr(p, name), p.unit, unit) if in_units else getattr(p, name) for p in parts])

        fused = PackedWeight(cat("qs"), cat("planes"), cat("scales"), cat("offsets"),
                             sum(p.out_features for p in parts), first.in_features, first.bits, first.group,
                             first.zero, first.kind, unit)
        start = 0
        for part in parts:  # the parts become views of the fused tensors: memory is not doubled
            part.view_of(fused, start)
            start += part.out_features // TILE
        return fused

    def view_of(self, fused: "PackedWeight", start: int) -> None:
        """Make this weight's tensors views of `fused`'s tiles from `start` (the values the same: a concat's part)."""
        tiles = -(-self.out_features // TILE)
        for name in _TENSOR_FIELDS:
            if getattr(fused, name) is not None:
                setattr(self, name, getattr(fused, name)[start:start + tiles])
        self.unit = fused.unit
        self._args = None  # its tensors changed
        self.fused_into = (fused, start)

    @staticmethod
    def fuse_runs(parts: list["PackedWeight"]) -> list["PackedWeight"]:
        """Weights over the same input as few weights as `concat` allows: each run of consecutive fusable parts
        as one (a GGUF mixes formats, e.g. Q5_0 q/k with a Q8_0 v: [q+k, v])."""
        runs: list[list[PackedWeight]] = []
        for part in parts:
            if runs and PackedWeight.fusable([runs[-1][0], part]):
                runs[-1].append(part)
            else:
                runs.append([part])
        return [PackedWeight.concat(run) if len(run) > 1 else run[0] for run in runs]

    def output_slice(self, start: int, end: int, copy: bool = True) -> "PackedWeight":
        """Outputs [start, end) as a weight of their own (tensor parallelism's column split, the lm_head's vocabulary
        slice): whole tiles of TILE outputs, so `start` must be a multiple of TILE and `end` one too unless it is
        the last output. `copy=False` keeps views of this weight's tensors."""
        if start % TILE or (end % TILE and end != self.out_features) or not 0 <= start < end <= self.out_features:
            raise QuantizationError(f"outputs [{start}, {end}) of a packed weight of {self.out_features} do not "
                                    f"fall on its tiles of {TILE}")
        first, last = start // TILE, -(-end // TILE)
        part = lambda t: None if t is None else (t[first:last].clone() if copy else t[first:last])
        return PackedWeight(*(part(t) for t in self.tensors), end - start, self.in_features, self.bits, self.group,
                            self.zero, self.kind, self.unit)

    def input_slice(self, start: int, end: int) -> "PackedWeight":
        """Inputs [start, end) as a weight of their own (tensor parallelism's row split of o_proj / down_proj):
        any boundary of its blocks of scales (BLOCK inputs; a K-quant's super-blocks of SUPER_BLOCK) is an exact
        split."""
        span = SUPER_BLOCK if self.super_blocks else BLOCK
        if start % span or end % span or not 0 <= start < end <= self.in_features:
            raise QuantizationError(f"inputs [{start}, {end}) of a packed {self.kind} weight do not fall on its "
                                    f"blocks of {span} weights")

        def part(name: str) -> torch.Tensor | None:
            t, per = getattr(self, name), SUPER_BLOCK if self.super_blocks and name in ("scales", "offsets") else BLOCK
            return None if t is None else t[:, start // per:end // per].contiguous()

        return PackedWeight(*(part(name) for name in _TENSOR_FIELDS), self.out_features, end - start, self.bits,
                            self.group, self.zero, self.kind, self.unit)

    @property
    def super_blocks(self) -> bool:
        """Whether the scales are in a K-quant's super-block layout (`_super_layout`)."""
        return self.scales.dtype == torch.uint8

    @property
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """(qs, planes, scales, offsets): the kernel's arguments, in its order."""
        return tuple(getattr(self, name) for name in _TENSOR_FIELDS)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors if t is not None)

    @property
    def args(self) -> tuple[list, ...]:
        """kernel_args([self]), built on first use and kept: a decoding step makes dozens of kernel calls."""
        if self._args is None:
            self._args = kernel_args([self])
        return self._args

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, out_fp32: bool = False) -> torch.Tensor:
        """x [..., K] (bf16 or fp32) @ W.T + bias -> [..., N] in x's dtype (fp32 with out_fp32)."""
        return packed_matmul(x, self.args, bias, out_fp32)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows `ids` (fp32 [..., K])."""
        flat = _kernel().dequantize_rows(ids.reshape(-1), *self.tensors, self.out_features, self.bits,
                                         self.group, self.zero, self.unit)
        return flat.view(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))

    def greedy_screen(self) -> "PackedWeight | None":
        """The 5-bit screen of an 8-bit weight (Q8_0, int8) for `screen_argmax` (the math is in quant_linear.cpp):
        each code's top 5 bits, packed as Q5_0 with this weight's scales (shared, not copied). None for other
        formats."""
        if (self.bits, self.group, self.zero, self.offsets) != (8, BLOCK, 128, None):
            return None
        qs, planes = _pack_groups(self.qs.view(*self.qs.shape[:2], 8, 64) >> 3, 5)
        return PackedWeight(qs, planes, self.scales, None, self.out_features, self.in_features, 5, BLOCK, 16,
                            f"{self.kind} screen", self.unit)


def _super_layout(factor: np.ndarray, integers: np.ndarray, tiles: int, group: int) -> torch.Tensor:
    """A K-quant's scales (or offsets) as the kernel reads them (quant_linear.cpp): uint8 [tiles, K/256, 32 + 8 *
    (32/group) * 16], per super-block the 16 outputs' fp16 factor d (or dmin), then per block of 32 its int8 sc (or
    m) [32/group][16]. N is padded with zeros."""
    n, supers = factor.shape
    pad = ((0, tiles * TILE - n), (0, 0))
    d = np.pad(factor, pad).astype(np.float16).reshape(tiles, TILE, supers).transpose(0, 2, 1)
    per_block = BLOCK // group
    sc = np.pad(integers, pad).reshape(tiles, TILE, supers, SUPER_BLOCK // BLOCK, per_block).transpose(0, 2, 3, 4, 1)
    d_bytes = np.ascontiguousarray(d).view(np.uint8).reshape(tiles, supers, 2 * TILE)
    sc_bytes = np.ascontiguousarray(sc).view(np.uint8).reshape(tiles, supers, -1)
    return torch.from_numpy(np.ascontiguousarray(np.concatenate([d_bytes, sc_bytes], axis=-1)))


def half_unit(scales: np.ndarray, offsets: np.ndarray | None) -> float:
    """The power of two that puts a weight's largest scale or offset at 2^14..2^15: in that unit fp16 keeps 11
    bits of every value down to 2^-28 of the largest (a GGUF f16 scale exactly), and none overflows."""
    largest = max(float(np.abs(v).max(initial=0.0)) for v in (scales, offsets) if v is not None)
    if not np.isfinite(largest):
        raise QuantizationError("a weight's scales or offsets are not finite")
    return 1.0 if largest == 0 else math.ldexp(1.0, math.frexp(largest)[1] - 15)


def in_unit(values: torch.Tensor, unit: float, new_unit: float) -> torch.Tensor:
    """fp16 scales or offsets in `unit`s re-expressed in `new_unit`s."""
    return values if unit == new_unit else (values.float() * (unit / new_unit)).half()


def _pack_groups(groups: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes uint8 [tiles, K/32, 8 groups, 64] -> (qs, planes) in the kernel's layout."""
    if bits == 8:
        return groups.reshape(*groups.shape[:2], 512).contiguous(), None
    low = groups & 15
    qs = (low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(*groups.shape[:2], 256).contiguous()
    if bits == 4:
        return qs, None
    planes = torch.zeros(*groups.shape[:2], bits - 4, 64, dtype=torch.uint8)
    if bits == 5:  # plane 0, byte j: bit g is bit 4 of group g's code at position j
        for g in range(8):
            planes[:, :, 0] |= ((groups[:, :, g] >> 4) & 1) << g
    else:  # plane g // 4, byte j: bits 2 (g % 4) and up are bits 4 and 5 of group g's code at position j
        for g in range(8):
            planes[:, :, g // 4] |= ((groups[:, :, g] >> 4) & 3) << (2 * (g % 4))
    return qs, planes


PACK_VERSION = 6  # bump when the packed layout changes: cached files of another version are ignored
_META_FIELDS = ("out_features", "in_features", "bits", "group", "zero", "kind", "unit")


def save_packed(weights: dict[str, PackedWeight], path) -> None:
    """Packed weights to one safetensors file (written aside, then renamed: a killed write leaves no file). The
    parts of a fused weight (`concat`) are stored once, as that weight, and read back as views of it."""
    import json

    from safetensors.torch import save_file

    tensors, meta, fused = {}, {}, {}
    for name, w in weights.items():
        meta[name] = {f: getattr(w, f) for f in _META_FIELDS}
        stored, prefix = w, name
        if w.fused_into is not None:
            whole, start = w.fused_into
            prefix = fused.setdefault(id(whole), (f"{name}#fused", whole))[0]
            meta[name].update(fused=prefix, start_tile=start)
            stored = whole
        tensors.update({f"{prefix}.{f}": getattr(stored, f) for f in _TENSOR_FIELDS if getattr(stored, f) is not None})
    wholes = {prefix: {f: getattr(whole, f) for f in _META_FIELDS} for prefix, whole in fused.values()}
    metadata = {"specserve_packed": json.dumps(meta), "specserve_fused": json.dumps(wholes),
                "version": str(PACK_VERSION)}
    write_atomically(path, lambda partial: save_file(tensors, str(partial), metadata=metadata))


def load_packed(path) -> dict[str, PackedWeight] | None:
    """What save_packed wrote (read into huge pages where the system has them: huge_pages.py, else memory-mapped), or
    None if the file is of another layout version."""
    import json

    from safetensors import safe_open

    from specserve.models.huge_pages import read_safetensors

    with safe_open(str(path), framework="pt") as reader:
        header = reader.metadata() or {}
        if header.get("version") != str(PACK_VERSION):
            return None
        loaded = read_safetensors(path) or {key: reader.get_tensor(key) for key in reader.keys()}

        def stored(prefix: str, fields: dict) -> PackedWeight:
            return PackedWeight(*(loaded.get(f"{prefix}.{f}") for f in _TENSOR_FIELDS), **fields)

        wholes = {prefix: stored(prefix, fields) for prefix, fields in json.loads(header["specserve_fused"]).items()}
        weights = {}
        for name, fields in json.loads(header["specserve_packed"]).items():
            prefix, start = fields.pop("fused", None), fields.pop("start_tile", 0)
            if prefix is None:
                weights[name] = stored(name, fields)
            else:
                weights[name] = PackedWeight(*wholes[prefix].tensors, **fields)
                weights[name].view_of(wholes[prefix], start)
        return weights


def kernel_args(weights: list[PackedWeight]) -> tuple[list, ...]:
    """The kernel's per-weight argument lists for these weights: (qs, planes, scales, offsets, N, bits, group,
    zero, unit), each a list with one entry per weight."""
    fields = [list(field) for field in zip(*(w.tensors for w in weights))]
    formats = [[getattr(w, name) for w in weights] for name in ("out_features", "bits", "group", "zero", "unit")]
    return (*fields, *formats)


def packed_matmul(x: torch.Tensor, args: tuple[list, ...], bias: torch.Tensor | None = None,
                  out_fp32: bool = False) -> torch.Tensor:
    """x [..., K] @ [W_0; W_1; ...].T + bias -> [..., sum N]: several weights over one input (`args`: their
    kernel_args) in one kernel call."""
    qs, planes, scales, offsets, *formats = args
    y = _kernel().quant_linear(x.reshape(-1, x.shape[-1]), qs, planes, scales, offsets, bias, *formats, out_fp32)
    return y.view(*x.shape[:-1], y.shape[-1])


def screen_argmax(x: torch.Tensor, weight: PackedWeight, screen: PackedWeight) -> torch.Tensor:
    """torch.argmax(x @ W.T, -1) over the rows of x [..., K] for an 8-bit W, exactly, reading W's `greedy_screen`
    and only the tiles that can hold a row's maximum: int64 [...]."""
    ids = _kernel().screen_argmax(x.reshape(-1, x.shape[-1]), screen.qs, screen.planes, weight.qs, weight.scales,
                                  weight.out_features, weight.unit)
    return ids.view(x.shape[:-1])


def _kernel():
    """The kernels variant that computes packed weights (cpu_kernels.quant_module); QuantizationError naming the
    cause when the kernels cannot load."""
    try:
        return cpu_kernels.quant_module()
    except cpu_kernels.KernelsUnavailable as exc:
        raise QuantizationError(f"{exc}; or use quantization: none") from exc


def quant_path() -> str:
    """The path the quantized kernels run, avx512, avx2 or scalar: the chosen kernels variant's."""
    return _kernel().quant_path()


def int8_peak_macs(seconds: float = 0.2) -> float:
    """The CPU's int8 multiply-adds per second on the multiply instruction of the path the kernels run
    (`quant_path`), measured on all threads (0.0 on the scalar path)."""
    return _kernel().int8_peak_macs(seconds)


def stream_read(buffer: torch.Tensor) -> int:
    """Read every byte of `buffer` once (a bandwidth probe); returns a checksum so nothing is optimized away."""
    return _kernel().stream_read(buffer)


# ---------------------------------------------------------------- modules

class QuantLinear(nn.Module):
    """An nn.Linear whose weight is packed; always row-invariant, for any number of rows."""

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = packed
        # a buffer, so a checkpoint's bias loads into it by name (the loader then makes it fp32 again)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.in_features, self.out_features = packed.in_features, packed.out_features

    @property
    def args(self) -> tuple[list, ...]:
        return self.packed.args

    def forward(self, x: torch.Tensor, out_fp32: bool = False) -> torch.Tensor:
        return self.packed.matmul(x, self.bias, out_fp32)


class FusedQuantLinear(nn.Module):
    """Several quantized linears over the same input (q/k/v, gate/up) as one kernel call, their outputs
    concatenated. Runs of parts in one format share one packed weight (the parts become views of it); parts of
    other formats (a GGUF mixes them, e.g. Q5_0 q/k with a Q8_0 v) ride the same call."""

    def __init__(self, layers: list[QuantLinear]):
        super().__init__()
        self.weights = PackedWeight.fuse_runs([layer.packed for layer in layers])
        biases = [layer.bias for layer in layers]
        self.bias = None if biases[0] is None else torch.cat(biases)
        self.out_features = sum(layer.out_features for layer in layers)
        self.args = kernel_args(self.weights)  # built once: this runs several times in every decoding step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_matmul(x, self.args, self.bias)


class QuantEmbedding(nn.Module):
    """An embedding table stored packed (a tied lm_head): lookups dequantize only the rows asked for."""

    def __init__(self, packed: PackedWeight, dtype: torch.dtype):
        super().__init__()
        self.packed = packed
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = packed.out_features, packed.in_features

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.packed.rows(tokens).to(self.dtype)


def quantize_linear(layer: nn.Linear, kind: str) -> QuantLinear:
    return QuantLinear(PackedWeight.from_codes(quantize_dense(layer.weight, kind)), layer.bias)
