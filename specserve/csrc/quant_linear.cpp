// Row-invariant linear over low-bit packed weights (GGUF's Q4_0..Q8_0 and K-quants, int8 / int4).
//
// The math (the scheme llama.cpp runs on CPUs, with its exactness made explicit):
//   weight row n, block b of G inputs:  w[k] = s[n,b] * (q[n,k] - z) - o[n,b]     q unsigned, 4..8 bits
//   activation row m, block c of 32:    x[k] ~ dx[m,c] * p[m,k]                   p = round(x / dx), |p| <= 127
//   y[m,n] = sum_b dx[m,c(b)] * ( s[n,b] * float(isum - z * psum) - o[n,b] * float(psum) )
//   with isum = sum_k q * p and psum = sum_k p over the block: integers, exact in int32 whatever the order.
// So every path (AVX-512 VNNI, AVX2, scalar) computes the same integers, then the same fp32 operations in the
// same order per (m, n): the result is bit-identical across paths, row counts, row groupings and threads.
// Activation quantization is per row (it depends only on x[m]), which keeps rows independent.
//
// Packed layout (made once by specserve/models/quant.py), N padded to tiles of 16 outputs, K in blocks of 32:
//   qs      uint8  [tiles, K/32, 512]  8 bits: groups g = 0..7 of 4 inputs, each [16 outputs][4 inputs]
//                  [tiles, K/32, 256]  4..6 bits: chunk c = 0..3 of 64 bytes holds group c (low nibble) and
//                                      group c + 4 (high nibble), each byte at [output * 4 + input]
//   planes uint8   [tiles, K/32, P, 64]  plane p, byte j: bit g is bit 4 + p of group g's code at byte j
//                                      (P = bits - 4, 5- and 6-bit formats); a half tile's plane is one 32-byte
//                                      load, and a group's bits come out of it with a shift and a mask
//   scales fp16    [tiles, K/32, 32/G, 16], offsets (optional) the same; G = 16 or 32. Both are stored divided by
//                  the weight's `unit`, a power of two that puts its largest at 2^14..2^15, so fp16 holds every
//                  GGUF f16 scale exactly and a K-quant's d * sc to 2^-12; a tile's sums come out in that unit and
//                  y is multiplied by it (exact: a power of two), so they equal fp32 scales' sums bit for bit.
//                  Half the bytes of fp32 scales: a one-row step streams 10% (Q4_0) to 16% (Q4_K_M) fewer.

#include "kernels.h"

namespace {

constexpr int kTile = 16;  // outputs per tile (one 512-bit lane each)
constexpr int kBlock = 32;  // inputs per activation block
constexpr int kMaxRows = 8;  // activation rows per pass over a weight tile

struct Packed {
  const uint8_t* qs;
  const uint8_t* planes;  // nullptr unless bits is 5 or 6
  const at::Half* scales;
  const at::Half* offsets;  // nullptr: no offsets
  int64_t tiles, kblocks, N;
  int bits, group, zero;
  float unit = 1.f;  // what the stored scales and offsets are in (a power of two)
  // the AVX-512 path's per-call activation terms for this weight's format (Lanes::for_format), else nullptr
  const int32_t* zero_psum = nullptr;
  const float* psum_f = nullptr;
  // the AVX2 path's per-call terms of this format ([K/32][M][sub], BlockTerms): the integer it adds to a block's
  // isum ((128 - zero) * psum for 8 bits, whose isum holds -128 psum; else -zero * psum), and float(psum)
  const int32_t* block_shift = nullptr;
  const float* block_psum_f = nullptr;
  int64_t qs_stride() const { return bits == 8 ? 512 : 256; }  // bytes per (tile, kblock)
  int planes_count() const { return bits == 8 ? 0 : bits - 4; }
  int subblocks() const { return kBlock / group; }
};

struct Acts {  // quantized activation rows
  const int8_t* p;  // [M, K]
  const float* dx;  // [M, K/32]
  const int32_t* psum16;  // [M, K/16]
  int64_t K;
  // greedy screening only (screen_argmax): per row and block, dx * 3.5 * psum and dx * 3.5 * sum |p|
  const float* center = nullptr;
  const float* radius = nullptr;
  const struct Lanes* lanes = nullptr;  // the same rows interleaved (AVX-512 path)
  const struct BlockTerms* blocks = nullptr;  // the same rows block by block (AVX2 path)
};

// The activation rows interleaved for the AVX-512 path, in groups of kMaxRows rows (the last group: the rest), row
// i of a group of R at [.., i] with stride R: every term a row needs at a block sits at a fixed offset from one
// pointer, so the kernel reads it as an embedded broadcast instead of a register per row. The values are those
// of Acts, unchanged.
struct Lanes {
  int64_t M = 0;  // rows
  std::vector<int32_t> four;  // per group: [K/32, 8 input groups, R]: 4 activation bytes
  std::vector<float> dx;  // per group: [K/32, R]
  // per (zero, sub-blocks) of the call's formats: zero * psum, per group [K/32, sub, R], and float(psum)
  std::vector<std::pair<std::pair<int, int>, std::vector<int32_t>>> zero_psum;
  std::vector<std::pair<int, std::vector<float>>> psum_f;

  void for_format(const Acts& X, int64_t M, Packed& w);
};

// The rows of row m's group in a Lanes array of M rows (kMaxRows, or the rest in the last group).
inline int64_t lane_group_rows(int64_t M, int64_t m) {
  return std::min<int64_t>(kMaxRows, M - (m - m % kMaxRows));
}

// Where row m's term j (of `per_block` per block) of block kb sits in a Lanes array.
inline int64_t lane_index(int64_t M, int64_t kblocks, int64_t m, int64_t kb, int per_block, int j) {
  const int64_t m0 = m - m % kMaxRows;
  return m0 * kblocks * per_block + ((kb * per_block) + j) * lane_group_rows(M, m) + (m - m0);
}

// The activation rows as the AVX2 path reads them, block by block: row m's codes of block kb at p[(kb M + m) 32],
// its dx at dx[kb M + m], and per format the terms a block adds at [(kb M + m) sub + sb]. A tile then finds every
// row's terms of a block at fixed offsets from one pointer. Read row by row, each row cost an index multiply, and
// its zero-point term a multiply and a register broadcast, per block and tile: the multi-row tile was bound by the
// instructions it issued, not by its integer work. The values are Acts', unchanged.
struct BlockTerms {
  int64_t M = 0;
  const int8_t* p;  // Acts' own for one row (the same layout), else `p_copy`
  const float* dx;
  std::vector<int8_t> p_copy;
  std::vector<float> dx_copy;
  std::vector<std::pair<std::pair<int, int>, std::vector<int32_t>>> shift;  // per (multiplier, sub)
  std::vector<std::pair<int, std::vector<float>>> psum_f;  // per sub

  BlockTerms(const Acts& X, int64_t M);
  void for_format(const Acts& X, Packed& w);
};

// The block's activation sum: per 16 inputs (G = 16, sub == 2) or the two halves of its 32 (G = 32).
inline int32_t block_psum(const int32_t* ps, int sub, int sb) { return sub == 2 ? ps[sb] : ps[0] + ps[1]; }

// The fp32 tail shared by every path: the block's integer sum -> its contribution to y.
inline float block_term(int32_t isum, int32_t psum, float s, float o, float dx, float acc, int zero,
                        bool has_offset) {
  float t = float(isum - zero * psum) * s;
  if (has_offset) t = std::fma(-o, float(psum), t);
  return std::fma(t, dx, acc);
}

// ---------------------------------------------------------------- scalar path (any CPU, and the reference)

inline int unpack_q(const Packed& W, int64_t tile, int64_t kb, int g, int byte) {
  const uint8_t* qs = W.qs + (tile * W.kblocks + kb) * W.qs_stride();
  int q;
  if (W.bits == 8) {
    q = qs[g * 64 + byte];
  } else {
    const uint8_t v = qs[(g & 3) * 64 + byte];
    q = g < 4 ? (v & 15) : (v >> 4);
    const uint8_t* pl = W.planes + (tile * W.kblocks + kb) * W.planes_count() * 64;
    for (int p = 0; p < W.planes_count(); ++p) q |= ((pl[p * 64 + byte] >> g) & 1) << (4 + p);
  }
  return q;
}

void tile_scalar(const Packed& W, const Acts& X, int64_t tile, int64_t m0, int mr, float* out /*[mr][16]*/) {
  const int sub = W.subblocks();
  const int gpsub = 8 / sub;  // groups of 4 inputs per scale block
  for (int i = 0; i < mr; ++i) {
    const int64_t m = m0 + i;
    for (int n = 0; n < kTile; ++n) {
      float acc = 0.f;
      for (int64_t kb = 0; kb < W.kblocks; ++kb) {
        const float dx = X.dx[m * W.kblocks + kb];
        for (int sb = 0; sb < sub; ++sb) {
          int32_t isum = 0;
          for (int g = sb * gpsub; g < (sb + 1) * gpsub; ++g)
            for (int j = 0; j < 4; ++j)
              isum += unpack_q(W, tile, kb, g, n * 4 + j) * int32_t(X.p[m * X.K + kb * kBlock + g * 4 + j]);
          const int32_t psum = block_psum(X.psum16 + m * (X.K / 16) + kb * 2, sub, sb);
          const int64_t si = ((tile * W.kblocks + kb) * sub + sb) * kTile + n;
          acc = block_term(isum, psum, float(W.scales[si]), W.offsets ? float(W.offsets[si]) : 0.f, dx, acc,
                           W.zero, W.offsets != nullptr);
        }
      }
      out[i * kTile + n] = acc;
    }
  }
}

// screen_argmax's bounds of one tile for mr rows from m0 (the math is there), from the screen's own products a
// ([mr][16]: quant_linear's numbers for the 5-bit weight, i.e. A / 8): mid = 8 a + center and rad. Writes the
// largest upper bound mid + rad * slack of the tile's first `count` outputs to top[m - m0] (a tile is a candidate
// for row m where it reaches the row's best lower bound: one number a row, not 16); raises lower[m] to the row's
// best lower bound mid - rad * slack over those outputs, and sets broken[m] where a bound is not finite (such a
// row computes every tile, whatever top holds).
struct ScreenFold {
  float slack;
  float* lower;  // [M]
  char* broken;  // [M]
};

inline void fold_output(const ScreenFold& fold, int64_t m, float center, float radius, float* top) {
  *top = std::max(*top, std::fma(radius, fold.slack, center));
  if (!std::isfinite(center) || !std::isfinite(radius)) fold.broken[m] = 1;
  else fold.lower[m] = std::max(fold.lower[m], std::fma(-radius, fold.slack, center));
}

void screen_bounds_scalar(const Packed& W, const Acts& X, int64_t tile, int64_t m0, int mr, const float* a, int count,
                          const ScreenFold& fold, float* top) {
  for (int i = 0; i < mr; ++i) top[i] = -INFINITY;
  for (int i = 0; i < mr; ++i)
    for (int n = 0; n < count; ++n) {
      float center = 0.f, radius = 0.f;
      for (int64_t kb = 0; kb < W.kblocks; ++kb) {
        const float s = float(W.scales[(tile * W.kblocks + kb) * kTile + n]);
        const int64_t b = (m0 + i) * W.kblocks + kb;
        center = std::fma(s, X.center[b], center);
        radius = std::fma(std::fabs(s), X.radius[b], radius);
      }
      fold_output(fold, m0 + i, std::fma(a[i * kTile + n], 8.f, center), radius, top + i);
    }
}

// The vector paths are templated on the format (BITS, SUB = 32 / group, OFFS = has offsets) and the number of
// rows MR sharing each loaded weight block; the rows' integer sums are interleaved group by group so the
// dot-product latency overlaps across rows.

// Ask for a weight block ahead (codes, planes, scales, offsets) while this one is computed. One row on AVX2: the block
// kPrefetchBlocks ahead into L1. An AVX2 core spends about as long on a block's integer work as on its load from
// memory, and the hardware prefetcher alone does not overlap the two: on a Zen 3 this made the lm_head 1.05x faster
// at one row and 1.10-1.17x at 2..8 rows (where the L2 prefetch below has replaced it).
// Past a weight's last block the addresses lie outside it: a prefetch never faults, so they are not clamped (with
// a bounds test in this function GCC emitted no prefetch at all), and they are formed as integers, not pointers.
constexpr int64_t kPrefetchBlocks = 4;

// Every VNNI tile and the AVX2 tiles of 2+ rows: the block kPrefetchBlocksL2 ahead into L2 (8-16 KB). Without it a
// tile stalled on each miss and took its arithmetic time plus its read time (a Zen 4, two threads, a 65,536 x 2,048
// weight: VNNI tiles Q4_0 1.28x / 1.51x / 1.72x at 2 / 3 / 4 rows, Q8_0 1.0x / 1.16x / 1.33x; its AVX2 tiles Q4_0
// 1.01x / 1.37x / 1.27x / 1.10x at 2 / 3 / 4 / 8 rows, Q5_0 1.22x at 4; the default model's lm_head 1.13-1.20x at 8
// rows on VNNI, 1.16x at 4 on AVX2. A Zen 3 against the L1 prefetch: the 1B shape's forwards of 5 / 8 / 16 rows
// 1.04x / 1.06x / 1.10x, its lm_head at 5 rows 1.10x, the default model's forwards 0.98-1.03x). 4-16 blocks ahead
// into L1 ran the VNNI tiles 0.89-0.97x. The VNNI tiles ask for it at one row too: the default model's short layer
// linears stalled at the start of each call (its layers at one row 1.05x, a greedy step 1.03-1.10x, least and median
// times of alternated builds; the 1B shape 1.00x; greedy generation 1.02x, `kernel_ab.py engine`), where the lm_head
// alone at one row lost 0.96-0.98x. The AVX2 path keeps its L1 prefetch at one row (measured on a Zen 3).
constexpr int kPrefetchRowsL2 = 2;  // from this many rows on the AVX2 path
constexpr int64_t kPrefetchBlocksL2 = 32;

#if SPECSERVE_X86
constexpr int kHintL1 = _MM_HINT_T0, kHintL2 = _MM_HINT_T1;
#else
constexpr int kHintL1 = 3, kHintL2 = 2;  // __builtin_prefetch's locality: into L1, into L2
#endif

template <int HINT>
inline void prefetch_lines(const void* base, int64_t offset, int bytes) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(base) + uintptr_t(offset);
  for (int line = 0; line < bytes; line += 64) {
#if SPECSERVE_X86
    _mm_prefetch(reinterpret_cast<const char*>(at + line), _mm_hint(HINT));
#else
    __builtin_prefetch(reinterpret_cast<const char*>(at + line), 0, HINT);
#endif
  }
}

template <int BITS, int SUB, bool OFFS, int HINT = kHintL1>
inline void prefetch_block(const Packed& W, int64_t at) {
  constexpr int kCodeBytes = BITS == 8 ? 512 : 256, kPlaneBytes = BITS == 8 ? 0 : (BITS - 4) * 64;
  constexpr int kScaleBytes = SUB * kTile * int(sizeof(at::Half));
  prefetch_lines<HINT>(W.qs, at * kCodeBytes, kCodeBytes);
  if constexpr (kPlaneBytes > 0) prefetch_lines<HINT>(W.planes, at * kPlaneBytes, kPlaneBytes);
  prefetch_lines<HINT>(W.scales, at * kScaleBytes, kScaleBytes);
  if constexpr (OFFS) prefetch_lines<HINT>(W.offsets, at * kScaleBytes, kScaleBytes);
}

#if SPECSERVE_X86  // the vector paths: x86 code

// ---------------------------------------------------------------- AVX-512 VNNI path

#define SPECSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

SPECSERVE_AVX512 inline __m512 load16_half(const at::Half* h) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}

template <int BITS>
SPECSERVE_AVX512 inline void load_groups512(const Packed& W, int64_t at, __m512i (&w)[8]) {
  const uint8_t* qs = W.qs + at * (BITS == 8 ? 512 : 256);
  if constexpr (BITS == 8) {
    for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(qs + g * 64);
  } else {
    const __m512i low = _mm512_set1_epi8(15);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(qs + c * 64);
      w[c] = _mm512_and_si512(v, low);
      w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const uint8_t* pl = W.planes + at * (BITS - 4) * 64;
    for (int p = 0; p < BITS - 4; ++p) {
      const __m512i plane = _mm512_loadu_si512(pl + p * 64), bit = _mm512_set1_epi8(char(1 << (4 + p)));
      for (int g = 0; g < 8; ++g)
        w[g] = _mm512_mask_add_epi8(w[g], _mm512_test_epi8_mask(plane, _mm512_set1_epi8(char(1 << g))), w[g], bit);
    }
  }
}

// MR rows of a row group whose terms lie `stride` apart (Lanes): the group's whole width (STRIDE = MR, a
// constant), or any rows of it (STRIDE = 0: `stride` at run time, a greedy screen's row computing its own
// candidates alone). four, dx, zp and pf point at the first row's terms of block 0. DECODED: the tile's codes are
// read from `decoded` (decode_tile_avx512's buffer), not decoded here.
template <int BITS, int SUB, bool OFFS, int MR, int STRIDE, bool DECODED>
SPECSERVE_AVX512 void tile_rows_avx512(const Packed& W, int64_t tile, const int32_t* four, const float* dx,
                                       const int32_t* zp, const float* pf, int64_t stride_at_run, float* out,
                                       const __m512i* decoded) {
  constexpr int kGroups = 8 / SUB;
  const int64_t stride = STRIDE > 0 ? STRIDE : stride_at_run;
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < W.kblocks; ++kb) {
    const int64_t at = tile * W.kblocks + kb;
    __m512i w[8];
    if constexpr (DECODED) {
      for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(decoded + kb * 8 + g);
    } else {
      prefetch_block<BITS, SUB, OFFS, kHintL2>(W, at + kPrefetchBlocksL2);
      load_groups512<BITS>(W, at, w);
    }
    for (int sb = 0; sb < SUB; ++sb) {
      // a lone row or a few: two integer sums per row (even and odd groups), exact whatever the order, to halve
      // the dependency chain; more rows overlap their chains already, and need the registers (the plane
      // formats' decoding needs more of them: with two chains at 3-4 rows GCC spilled, 1.9x slower)
      constexpr int kChains = MR <= (BITS == 5 || BITS == 6 ? 2 : 4) ? 2 : 1;
      __m512i part[kChains][MR];
      for (int c = 0; c < kChains; ++c)
        for (int i = 0; i < MR; ++i) part[c][i] = _mm512_setzero_si512();
      for (int g = sb * kGroups; g < (sb + 1) * kGroups; ++g)
        for (int i = 0; i < MR; ++i) {
          __m512i& sum = part[g % kChains][i];
          sum = _mm512_dpbusd_epi32(sum, w[g], _mm512_set1_epi32(four[g * stride + i]));
        }
      const __m512 s = load16_half(W.scales + (at * SUB + sb) * kTile);
      for (int i = 0; i < MR; ++i) {
        const __m512i isum = kChains == 2 ? _mm512_add_epi32(part[0][i], part[kChains - 1][i]) : part[0][i];
        __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum, _mm512_set1_epi32(zp[sb * stride + i]))),
                                 s);
        if constexpr (OFFS)
          t = _mm512_fnmadd_ps(load16_half(W.offsets + (at * SUB + sb) * kTile),
                               _mm512_set1_ps(pf[sb * stride + i]), t);
        acc[i] = _mm512_fmadd_ps(t, _mm512_set1_ps(dx[i]), acc[i]);
      }
    }
    four += 8 * stride;
    dx += stride;
    zp += SUB * stride;
    if constexpr (OFFS) pf += SUB * stride;
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(out + i * kTile, acc[i]);
}

// Rows m0 .. m0 + MR - 1: a whole row group of Lanes, or rows inside one.
template <int BITS, int SUB, bool OFFS, int MR, bool DECODED>
SPECSERVE_AVX512 void rows_avx512(const Packed& W, const Acts& X, int64_t tile, int64_t m0, float* out,
                                  const __m512i* decoded) {
  const int64_t M = X.lanes->M, rows = lane_group_rows(M, m0);
  const int32_t* four = X.lanes->four.data() + lane_index(M, W.kblocks, m0, 0, 8, 0);
  const float* dx = X.lanes->dx.data() + lane_index(M, W.kblocks, m0, 0, 1, 0);
  const int32_t* zp = W.zero_psum + lane_index(M, W.kblocks, m0, 0, SUB, 0);
  const float* pf = OFFS ? W.psum_f + lane_index(M, W.kblocks, m0, 0, SUB, 0) : nullptr;
  if (rows == MR) tile_rows_avx512<BITS, SUB, OFFS, MR, MR, DECODED>(W, tile, four, dx, zp, pf, MR, out, decoded);
  else tile_rows_avx512<BITS, SUB, OFFS, MR, 0, DECODED>(W, tile, four, dx, zp, pf, rows, out, decoded);
}

template <int BITS, int SUB, bool OFFS, int MR>
SPECSERVE_AVX512 void tile_avx512(const Packed& W, const Acts& X, int64_t tile, int64_t m0, float* out) {
  rows_avx512<BITS, SUB, OFFS, MR, false>(W, X, tile, m0, out, nullptr);
}

// A tile decoded once for calls of more than one row group (decoded_tiles): [K/32][8 groups] of 64 code bytes, in
// the order load_groups512 gives them, so every group's pass reads the codes it would have decoded.
template <int BITS, int SUB, bool OFFS>
SPECSERVE_AVX512 void decode_tile_avx512(const Packed& W, int64_t tile, __m256i* buffer) {
  __m512i* decoded = reinterpret_cast<__m512i*>(buffer);
  for (int64_t kb = 0; kb < W.kblocks; ++kb) {
    const int64_t at = tile * W.kblocks + kb;
    prefetch_block<BITS, SUB, OFFS, kHintL2>(W, at + kPrefetchBlocksL2);
    __m512i w[8];
    load_groups512<BITS>(W, at, w);
    for (int g = 0; g < 8; ++g) _mm512_storeu_si512(decoded + kb * 8 + g, w[g]);
  }
}

template <int BITS, int SUB, bool OFFS, int MR>
SPECSERVE_AVX512 void decoded_tile_avx512(const Packed& W, const Acts& X, int64_t tile, int64_t m0, float* out,
                                          const __m256i* decoded) {
  rows_avx512<BITS, SUB, OFFS, MR, true>(W, X, tile, m0, out, reinterpret_cast<const __m512i*>(decoded));
}

// ---------------------------------------------------------------- AVX2 path (maddubs: u8 x s8 pairs into int16)
//
// A tile's half (8 outputs) of one weight block is decoded once into registers or L1, then every activation row
// streams over it. maddubs adds two u8 x s8 products into a saturating int16, so the codes must keep those sums in
// range (|p| <= 127): 4..6-bit codes (q <= 63) go in as they are, and the int16 sums of kRun groups are added before
// one widening madd (4 bits: 8 groups, 2 * 15 * 127 * 8 < 2^15; 5 bits: 4; 6 bits: 2); 8-bit codes go in as
// |q - 128| against p signed by q - 128 (2 * 128 * 127 < 2^15), which gives sum (q - 128) p, i.e. isum - 128 psum.

#define SPECSERVE_AVX2 __attribute__((target("avx2,fma,f16c")))

SPECSERVE_AVX2 inline __m256 load8_half(const at::Half* h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

// Bit g of every byte of `plane` moved to bit T (the other bits cleared). The shift is per 16-bit lane: a bit it
// carries across the lane's byte boundary lands below bit T (left shifts) or above it (right shifts), so the mask
// drops it.
template <int G, int T>
SPECSERVE_AVX2 inline __m256i plane_bit(__m256i plane) {
  __m256i moved;
  if constexpr (T >= G) moved = _mm256_slli_epi16(plane, T - G);
  else moved = _mm256_srli_epi16(plane, G - T);
  return _mm256_and_si256(moved, _mm256_set1_epi8(char(1 << T)));
}

// Each w[g] gets bit g of `plane`'s bytes as its bit T (the plane's bit 4 + p: T = 4 + p).
template <int T, int... G>
SPECSERVE_AVX2 inline void add_plane(__m256i plane, __m256i (&w)[8], std::integer_sequence<int, G...>) {
  ((w[G] = _mm256_or_si256(w[G], plane_bit<G, T>(plane))), ...);
}

// w[g]: group g's half h (outputs 8h .. 8h + 7) as 32 bytes: the codes, or for 8 bits q - 128 as int8 with its
// magnitude in mag[g].
template <int BITS>
SPECSERVE_AVX2 inline void decode_half(const Packed& W, int64_t at, int h, __m256i (&w)[8], __m256i (&mag)[8]) {
  const uint8_t* qs = W.qs + at * (BITS == 8 ? 512 : 256);
  if constexpr (BITS == 8) {
    for (int g = 0; g < 8; ++g) {
      w[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(qs + g * 64 + h * 32)), _mm256_set1_epi8(char(0x80)));
      mag[g] = _mm256_abs_epi8(w[g]);  // -128 -> 0x80, read as the unsigned 128
    }
  } else {
    const __m256i low = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + c * 64 + h * 32));
      w[c] = _mm256_and_si256(v, low);
      w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    if constexpr (BITS > 4) {
      const uint8_t* pl = W.planes + at * (BITS - 4) * 64 + h * 32;
      const auto groups = std::make_integer_sequence<int, 8>{};
      add_plane<4>(_mm256_loadu_si256((const __m256i*)pl), w, groups);
      if constexpr (BITS == 6) add_plane<5>(_mm256_loadu_si256((const __m256i*)(pl + 64)), w, groups);
    }
  }
}

// A row's integer sums over one weight block's half (its decoded codes w, magnitudes mag for 8 bits), sub-block sb,
// with p the row's 32 codes of the block: sum q p per output, or sum (q - 128) p for 8 bits.
template <int BITS, int SUB>
SPECSERVE_AVX2 inline __m256i block_isum_avx2(const int8_t* p, int sb, const __m256i* w, const __m256i* mag) {
  constexpr int kGroups = 8 / SUB;
  constexpr int kRun = std::min(kGroups, BITS == 4 ? 8 : BITS == 5 ? 4 : BITS == 6 ? 2 : 1);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i isum = _mm256_setzero_si256();
  for (int g0 = sb * kGroups; g0 < (sb + 1) * kGroups; g0 += kRun) {
    __m256i run = _mm256_setzero_si256();
    for (int g = g0; g < g0 + kRun; ++g) {
      int32_t four;
      std::memcpy(&four, p + g * 4, 4);
      const __m256i pv = _mm256_set1_epi32(four);
      if constexpr (BITS == 8) run = _mm256_maddubs_epi16(mag[g], _mm256_sign_epi8(pv, w[g]));
      else run = _mm256_add_epi16(run, _mm256_maddubs_epi16(w[g], pv));
    }
    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(run, ones));
  }
  return isum;
}

// One weight block's half against MR activation rows from m0.
template <int BITS, int SUB, bool OFFS, int MR>
SPECSERVE_AVX2 inline void block_rows_avx2(const Packed& W, const Acts& X, int64_t at, int64_t kb, int h, int64_t m0,
                                           const __m256i* w, const __m256i* mag, __m256 (&acc)[MR]) {
  const int64_t rows_at = kb * X.blocks->M + m0;  // row m0's place in this block's terms
  const int8_t* p = X.blocks->p + rows_at * kBlock;
  const float* dx = X.blocks->dx + rows_at;
  const int32_t* shift = W.block_shift + rows_at * SUB;
  const float* psum_f = OFFS ? W.block_psum_f + rows_at * SUB : nullptr;
  // every row's integers first, then their fp32 tails: issued row by row, each row's tail waited on its integers
  // and the core kept fewer rows in flight (the tiles 1.02-1.22x faster at 2..8 rows on a Zen 3: kernel_ab linear)
  __m256i isums[MR][SUB];
  for (int i = 0; i < MR; ++i)
    for (int sb = 0; sb < SUB; ++sb) isums[i][sb] = block_isum_avx2<BITS, SUB>(p + i * kBlock, sb, w, mag);
  for (int i = 0; i < MR; ++i) {
    for (int sb = 0; sb < SUB; ++sb) {
      const __m256i isum = isums[i][sb];
      // isum - zero * psum (for 8 bits the same integer: its isum already holds -128 psum)
      const int64_t si = (at * SUB + sb) * kTile + 8 * h;
      __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(isum, _mm256_set1_epi32(shift[i * SUB + sb]))),
                               load8_half(W.scales + si));
      if constexpr (OFFS)
        t = _mm256_fnmadd_ps(load8_half(W.offsets + si), _mm256_set1_ps(psum_f[i * SUB + sb]), t);
      acc[i] = _mm256_fmadd_ps(t, _mm256_set1_ps(dx[i]), acc[i]);
    }
  }
}

// Half h of weight block kb of a tile against MR rows: decoded here, or, with `decoded` (decode_tile_avx2's
// buffer), read from it; the arithmetic is block_rows_avx2's either way.
template <int BITS, int SUB, bool OFFS, int MR, bool DECODED>
SPECSERVE_AVX2 inline void half_block_avx2(const Packed& W, const Acts& X, int64_t tile, int64_t kb, int h, int64_t m0,
                                           const __m256i* decoded, __m256 (&acc)[MR]) {
  const int64_t at = tile * W.kblocks + kb;
  __m256i w[8], mag[8];
  if constexpr (DECODED) {
    for (int g = 0; g < 8; ++g) w[g] = _mm256_loadu_si256(decoded + (h * W.kblocks + kb) * 8 + g);
  } else {
    if (h == 0) {  // the second half finds it in cache
      if constexpr (MR >= kPrefetchRowsL2) prefetch_block<BITS, SUB, OFFS, kHintL2>(W, at + kPrefetchBlocksL2);
      else prefetch_block<BITS, SUB, OFFS>(W, at + kPrefetchBlocks);
    }
    decode_half<BITS>(W, at, h, w, mag);
  }
  block_rows_avx2<BITS, SUB, OFFS, MR>(W, X, at, kb, h, m0, w, mag, acc);
}

// A tile's outputs for MR activation rows from m0. Up to kOnePassRows rows take both halves of each block in turn:
// the weight then streams from memory in one pass. Done half by half, the second half re-read the tile from cache
// while the memory stood idle. More rows go half by half, as their accumulators for both halves would not fit
// the 16 registers. Each output's sum runs over the blocks in the same order either way: the same bits.
constexpr int kOnePassRows = 2;

template <int BITS, int SUB, bool OFFS, int MR, bool DECODED>
SPECSERVE_AVX2 inline void tile_rows_avx2(const Packed& W, const Acts& X, int64_t tile, int64_t m0, float* out,
                                          const __m256i* decoded) {
  static_assert(!DECODED || BITS != 8, "a decoded tile holds codes only, not the 8-bit magnitudes");
  if constexpr (MR <= kOnePassRows) {
    __m256 acc[2][MR];
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < MR; ++i) acc[h][i] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < W.kblocks; ++kb)
      for (int h = 0; h < 2; ++h) half_block_avx2<BITS, SUB, OFFS, MR, DECODED>(W, X, tile, kb, h, m0, decoded, acc[h]);
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < MR; ++i) _mm256_storeu_ps(out + i * kTile + 8 * h, acc[h][i]);
  } else {
    for (int h = 0; h < 2; ++h) {
      __m256 acc[MR];
      for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t kb = 0; kb < W.kblocks; ++kb)
        half_block_avx2<BITS, SUB, OFFS, MR, DECODED>(W, X, tile, kb, h, m0, decoded, acc);
      for (int i = 0; i < MR; ++i) _mm256_storeu_ps(out + i * kTile + 8 * h, acc[i]);
    }
  }
}

template <int BITS, int SUB, bool OFFS, int MR>
SPECSERVE_AVX2 void tile_avx2(const Packed& W, const Acts& X, int64_t tile, int64_t m0, float* out) {
  tile_rows_avx2<BITS, SUB, OFFS, MR, false>(W, X, tile, m0, out, nullptr);
}

// Calls with more rows than one pass takes (a prefill chunk, a large batch) would decode each block once per pass
// of kMaxRows rows. For the 5- and 6-bit formats, whose bit planes cost 3 instructions per group and plane to
// expand, a tile is decoded once into `decoded` ([2 halves][K/32][8 groups], 32 bytes each), and every pass reads
// it (tile_rows_avx2).
template <int BITS>
SPECSERVE_AVX2 void decode_tile_avx2(const Packed& W, int64_t tile, __m256i* decoded) {
  static_assert(BITS == 5 || BITS == 6, "only the plane formats pay for a decoded tile");
  for (int h = 0; h < 2; ++h)
    for (int64_t kb = 0; kb < W.kblocks; ++kb) {
      __m256i w[8], unused[8];
      decode_half<BITS>(W, tile * W.kblocks + kb, h, w, unused);
      for (int g = 0; g < 8; ++g) _mm256_storeu_si256(decoded + (h * W.kblocks + kb) * 8 + g, w[g]);
    }
}

template <int BITS, int SUB, bool OFFS, int MR>
SPECSERVE_AVX2 void decoded_tile_avx2(const Packed& W, const Acts& X, int64_t tile, int64_t m0, float* out,
                                      const __m256i* decoded) {
  tile_rows_avx2<BITS, SUB, OFFS, MR, true>(W, X, tile, m0, out, decoded);
}

// screen_bounds_scalar's numbers, in the same order of operations; two rows at a time, so that eight fma chains
// (two rows, two halves, center and radius) hide each other's latency.
template <int R>
SPECSERVE_AVX2 inline void screen_bounds_rows_avx2(const Packed& W, const Acts& X, int64_t tile, int64_t m,
                                                   const float* a, const ScreenFold& fold, float* top) {
  const __m256 sign = _mm256_set1_ps(-0.f), eight = _mm256_set1_ps(8.f), slack = _mm256_set1_ps(fold.slack);
  __m256 center[R][2], radius[R][2];
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < 2; ++h) center[i][h] = radius[i][h] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < W.kblocks; ++kb) {
    const at::Half* scales = W.scales + (tile * W.kblocks + kb) * kTile;
    const __m256 s[2] = {load8_half(scales), load8_half(scales + 8)};
    for (int i = 0; i < R; ++i) {
      const int64_t b = (m + i) * W.kblocks + kb;
      const __m256 c = _mm256_set1_ps(X.center[b]), r = _mm256_set1_ps(X.radius[b]);
      for (int h = 0; h < 2; ++h) {
        center[i][h] = _mm256_fmadd_ps(s[h], c, center[i][h]);
        radius[i][h] = _mm256_fmadd_ps(_mm256_andnot_ps(sign, s[h]), r, radius[i][h]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    __m256 best = _mm256_set1_ps(-INFINITY), highest = best, checks = _mm256_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      const __m256 c = _mm256_fmadd_ps(_mm256_loadu_ps(a + i * kTile + 8 * h), eight, center[i][h]);
      highest = _mm256_max_ps(_mm256_fmadd_ps(radius[i][h], slack, c), highest);  // a NaN bound is skipped
      best = _mm256_max_ps(best, _mm256_fnmadd_ps(radius[i][h], slack, c));
      // c * 0 + r * 0 is NaN exactly where c or r is not finite
      checks = _mm256_add_ps(checks, _mm256_add_ps(_mm256_mul_ps(c, _mm256_setzero_ps()),
                                                   _mm256_mul_ps(radius[i][h], _mm256_setzero_ps())));
    }
    alignas(32) float lanes[8], nan[8];
    _mm256_store_ps(lanes, best);
    _mm256_store_ps(nan, checks);
    for (int j = 0; j < 8; ++j) {
      if (nan[j] != 0.f) fold.broken[m + i] = 1;  // NaN compares unequal to 0
      fold.lower[m + i] = std::max(fold.lower[m + i], lanes[j]);
    }
    __m128 high = _mm_max_ps(_mm256_castps256_ps128(highest), _mm256_extractf128_ps(highest, 1));
    high = _mm_max_ps(high, _mm_movehl_ps(high, high));
    top[i] = _mm_cvtss_f32(_mm_max_ss(high, _mm_movehdup_ps(high)));
  }
}

// A tile whose outputs all exist; screen_bounds_scalar takes the last, partial one.
SPECSERVE_AVX2 void screen_bounds_avx2(const Packed& W, const Acts& X, int64_t tile, int64_t m0, int mr, const float* a,
                                       const ScreenFold& fold, float* top) {
  int i = 0;
  for (; i + 2 <= mr; i += 2) screen_bounds_rows_avx2<2>(W, X, tile, m0 + i, a + i * kTile, fold, top + i);
  if (i < mr) screen_bounds_rows_avx2<1>(W, X, tile, m0 + i, a + i * kTile, fold, top + i);
}

#endif  // SPECSERVE_X86

// ---------------------------------------------------------------- dispatch

enum class Isa { scalar, avx2, avx512 };

Isa detect() {
#if !SPECSERVE_X86
  return Isa::scalar;
#else
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni"))
    return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::avx2;
  return Isa::scalar;
#endif
}

Isa parse_isa(const std::string& name) {
  const Isa best = detect();
  if (name.empty() || name == "auto") return best;
  const Isa want = name == "avx512" ? Isa::avx512 : name == "avx2" ? Isa::avx2 : Isa::scalar;
  TORCH_CHECK(name == "avx512" || name == "avx2" || name == "scalar", "unknown ISA '", name,
              "'; use auto, avx512, avx2 or scalar");
  TORCH_CHECK(int(want) <= int(best), "this CPU cannot run the ", name, " path");
  return want;
}

using TileFn = void (*)(const Packed&, const Acts&, int64_t, int64_t, float*);

#if SPECSERVE_X86
template <int BITS, int SUB, bool OFFS, int... MR>
constexpr std::array<TileFn, kMaxRows + 1> tiles_for(Isa isa, std::integer_sequence<int, MR...>) {
  if (isa == Isa::avx512) return {nullptr, tile_avx512<BITS, SUB, OFFS, MR + 1>...};
  return {nullptr, tile_avx2<BITS, SUB, OFFS, MR + 1>...};
}
#endif  // SPECSERVE_X86

// The vector tile functions for a format, indexed by row count; empty for the scalar path.
std::array<TileFn, kMaxRows + 1> tiles(Isa isa, const Packed& W) {
  if (isa == Isa::scalar) return {};
#if SPECSERVE_X86
  const auto rows = std::make_integer_sequence<int, kMaxRows>{};
  const bool offs = W.offsets != nullptr;
  if (W.bits == 8 && !offs) return tiles_for<8, 1, false>(isa, rows);
  if (W.bits == 4) return offs ? tiles_for<4, 1, true>(isa, rows) : tiles_for<4, 1, false>(isa, rows);
  if (W.bits == 5) return offs ? tiles_for<5, 1, true>(isa, rows) : tiles_for<5, 1, false>(isa, rows);
  if (W.bits == 6 && W.group == 16 && !offs) return tiles_for<6, 2, false>(isa, rows);
#endif
  return {};  // a combination no GGUF type or quantizer makes: the scalar path still computes it
}

struct alignas(64) CacheLine {  // a decoded tile's buffer holds 8 of them per block (both paths' layouts)
  uint8_t bytes[64];
};

#if SPECSERVE_X86
using DecodedVector = __m256i;  // 32 bytes of a decoded tile
#else
struct alignas(32) DecodedVector {
  uint8_t bytes[32];
};
#endif
using DecodedTileFn = void (*)(const Packed&, const Acts&, int64_t, int64_t, float*, const DecodedVector*);
using DecodeFn = void (*)(const Packed&, int64_t, DecodedVector*);

struct DecodedTiles {  // a plane format's decode (AVX2 or AVX-512) and its tile functions by row count; empty: none
  DecodeFn decode = nullptr;
  std::array<DecodedTileFn, kMaxRows + 1> rows{};
};

#if SPECSERVE_X86
template <int BITS, int SUB, bool OFFS, int... MR>
DecodedTiles decoded_for(Isa isa, std::integer_sequence<int, MR...>) {
  if (isa == Isa::avx512)
    return {decode_tile_avx512<BITS, SUB, OFFS>, {nullptr, decoded_tile_avx512<BITS, SUB, OFFS, MR + 1>...}};
  return {decode_tile_avx2<BITS>, {nullptr, decoded_tile_avx2<BITS, SUB, OFFS, MR + 1>...}};
}
#endif  // SPECSERVE_X86

// Only where a call's rows take more than one pass (and the format has planes) does decoding once pay. On the
// AVX-512 path (kernel_ab.py linear --rows 9,16,64): Q6_K, two tails a block, 1.12x / 1.10x / 1.19x at 9 / 16 / 64
// rows, Q5_0 1.00x / 1.02x / 1.10x; a 4-bit tile decodes about as fast as it reads a decoded one back (0.88x / 0.92x /
// 0.99x).
DecodedTiles decoded_tiles(Isa isa, const Packed& W, int64_t M) {
  if (isa == Isa::scalar || M <= kMaxRows) return {};
#if SPECSERVE_X86
  const auto rows = std::make_integer_sequence<int, kMaxRows>{};
  const bool offs = W.offsets != nullptr;
  if (W.bits == 5) return offs ? decoded_for<5, 1, true>(isa, rows) : decoded_for<5, 1, false>(isa, rows);
  if (W.bits == 6 && W.group == 16 && !offs) return decoded_for<6, 2, false>(isa, rows);
#endif
  return {};
}

// p = round(x / dx) with dx = max|x| / 127 per block of 32; psum per 16. Row by row, in one fixed order. The
// vector versions compute the same numbers: max is exact in any order (a NaN is skipped, as std::max skips it),
// and the conversions round to nearest even, as std::nearbyint does in the default rounding mode.
inline float load_float(const float* x) { return *x; }
inline float load_float(const at::BFloat16* x) { return float(*x); }

template <typename T>
void quantize_block_scalar(const T* src, int8_t* p, float* dx, int32_t* psum16) {
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(load_float(src + j)));
  const float d = amax / 127.f;
  const float inv = d > 0.f ? 127.f / amax : 0.f;
  *dx = d;
  int32_t sums[2] = {0, 0};
  for (int j = 0; j < kBlock; ++j) {
    const int q = int(std::nearbyint(load_float(src + j) * inv));
    p[j] = int8_t(q);
    sums[j / 16] += q;
  }
  psum16[0] = sums[0];
  psum16[1] = sums[1];
}

#if SPECSERVE_X86
SPECSERVE_AVX512 inline __m512 load16_avx512(const float* x) { return _mm512_loadu_ps(x); }
SPECSERVE_AVX512 inline __m512 load16_avx512(const at::BFloat16* x) {  // bf16 -> fp32 is exact: 16 bits up
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <typename T>
SPECSERVE_AVX512 void quantize_block_avx512(const T* src, int8_t* p, float* dx, int32_t* psum16) {
  const __m512 x[2] = {load16_avx512(src), load16_avx512(src + 16)};
  const __m512 sign = _mm512_set1_ps(-0.f);
  __m512 amax16 = _mm512_setzero_ps();
  for (const __m512& v : x) amax16 = _mm512_max_ps(_mm512_andnot_ps(sign, v), amax16);  // a NaN lane keeps amax16
  const float amax = _mm512_reduce_max_ps(amax16);
  const float d = amax / 127.f;
  const float inv = d > 0.f ? 127.f / amax : 0.f;
  *dx = d;
  for (int h = 0; h < 2; ++h) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(x[h], _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 16 * h), _mm512_cvtepi32_epi8(q));
    psum16[h] = _mm512_reduce_add_epi32(q);
  }
}

SPECSERVE_AVX2 inline __m256 load8_avx2(const float* x) { return _mm256_loadu_ps(x); }
SPECSERVE_AVX2 inline __m256 load8_avx2(const at::BFloat16* x) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

SPECSERVE_AVX2 inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

template <typename T>
SPECSERVE_AVX2 void quantize_block_avx2(const T* src, int8_t* p, float* dx, int32_t* psum16) {
  __m256 x[4];
  for (int i = 0; i < 4; ++i) x[i] = load8_avx2(src + 8 * i);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax8 = _mm256_setzero_ps();
  for (const __m256& v : x) amax8 = _mm256_max_ps(_mm256_andnot_ps(sign, v), amax8);  // a NaN lane keeps amax8
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  const float d = amax / 127.f;
  const float inv = d > 0.f ? 127.f / amax : 0.f;
  *dx = d;
  for (int h = 0; h < 2; ++h) {
    const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(x[2 * h], _mm256_set1_ps(inv)));
    const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(x[2 * h + 1], _mm256_set1_ps(inv)));
    // each code's low byte, as int8_t(q) keeps it (a NaN's code too); packs interleave 128-bit lanes, which the
    // permute undoes
    const __m256i low = _mm256_set1_epi32(0xff);
    const __m256i words = _mm256_packus_epi32(_mm256_and_si256(q0, low), _mm256_and_si256(q1, low));
    const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 16 * h), _mm_shuffle_epi32(bytes, 0xd8));
    psum16[h] = hsum8_epi32(_mm256_add_epi32(q0, q1));
  }
}
#endif  // SPECSERVE_X86

// One tile's outputs for mr rows from m0 into out ([mr][16]): from the tile decoded once (`decoded`, where `once`
// has a decode), else the vector tile for mr rows, else the scalar one.
inline void run_tile(const std::array<TileFn, kMaxRows + 1>& fns, const DecodedTiles& once, const Packed& W,
                     const Acts& X, int64_t tile, int64_t m0, int mr, float* out, const DecodedVector* decoded) {
  if (once.decode) once.rows[mr](W, X, tile, m0, out, decoded);
  else if (fns[mr]) fns[mr](W, X, tile, m0, out);
  else tile_scalar(W, X, tile, m0, mr, out);
}

// Where a tile's outputs go: y = block * unit (+ bias), fp32 or bf16, row r at y + r * width.
struct TileOut {
  float* y32;  // or nullptr
  at::BFloat16* y16;  // or nullptr
  int64_t width;
  const float* bias;  // or nullptr
  float unit;
};

void store_tile_scalar(const float* block, int mr, int count, const TileOut& to) {
  for (int r = 0; r < mr; ++r)
    for (int j = 0; j < count; ++j) {
      const float v = to.bias ? block[r * kTile + j] * to.unit + to.bias[j] : block[r * kTile + j] * to.unit;
      if (to.y32) to.y32[r * to.width + j] = v;
      else to.y16[r * to.width + j] = at::BFloat16(v);
    }
}

// 8 floats rounded to bf16 as at::BFloat16 rounds them (to nearest even; any NaN -> 0x7FC0), in int32 lanes.
#if SPECSERVE_X86
SPECSERVE_AVX2 inline __m256i bf16_bits_avx2(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

// store_tile_scalar's numbers for a whole tile, 8 outputs a vector: the same multiply then add (not fused), and
// the same bf16 rounding. Stored one by one, the outputs cost the default model's 640-input linears about a sixth
// of their time.
SPECSERVE_AVX2 void store_tile_avx2(const float* block, int mr, const TileOut& to) {
  const __m256 unit = _mm256_set1_ps(to.unit);
  for (int r = 0; r < mr; ++r) {
    __m256 v[2];
    for (int h = 0; h < 2; ++h) {
      v[h] = _mm256_mul_ps(_mm256_loadu_ps(block + r * kTile + 8 * h), unit);
      if (to.bias) v[h] = _mm256_add_ps(v[h], _mm256_loadu_ps(to.bias + 8 * h));
    }
    if (to.y32) {
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(to.y32 + r * to.width + 8 * h, v[h]);
    } else {  // packus interleaves the 128-bit lanes of its two sources; the permute puts them back in order
      const __m256i packed = _mm256_packus_epi32(bf16_bits_avx2(v[0]), bf16_bits_avx2(v[1]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to.y16 + r * to.width),
                          _mm256_permute4x64_epi64(packed, 0b11011000));
    }
  }
}
#endif  // SPECSERVE_X86

template <typename T>
void quantize_rows(Isa isa, const T* x, int64_t M, int64_t K, int8_t* p, float* dx, int32_t* psum16) {
  // a few rows take less time than waking the other threads: threads share rows only past ~1k blocks each
  const int64_t grain = std::max<int64_t>(1, 1024 / (K / kBlock));
  specserve::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t c = 0; c < K / kBlock; ++c) {
        const int64_t at = m * K + c * kBlock, block = m * (K / kBlock) + c;
#if SPECSERVE_X86
        if (isa == Isa::avx512) quantize_block_avx512(x + at, p + at, dx + block, psum16 + 2 * block);
        else if (isa == Isa::avx2) quantize_block_avx2(x + at, p + at, dx + block, psum16 + 2 * block);
        else
#endif
          quantize_block_scalar(x + at, p + at, dx + block, psum16 + 2 * block);
      }
  });
}

// X's rows as the AVX-512 path reads them (Lanes).
void interleave(const Acts& X, int64_t M, Lanes& L) {
  const int64_t kblocks = X.K / kBlock;
  L.M = M;
  L.four.resize(M * kblocks * 8);
  L.dx.resize(M * kblocks);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      for (int g = 0; g < 8; ++g)
        std::memcpy(&L.four[lane_index(M, kblocks, m, kb, 8, g)], X.p + m * X.K + kb * kBlock + g * 4, 4);
      L.dx[lane_index(M, kblocks, m, kb, 1, 0)] = X.dx[m * kblocks + kb];
    }
}

// The terms value(m, kb, sb) of every row, block and sub-block, term (m, kb, sb) at place(m, kb, sb), made once per
// `key` and call (Lanes and BlockTerms order them differently).
template <typename Key, typename T, typename F, typename P>
const T* terms_once(std::vector<std::pair<Key, std::vector<T>>>& made, const Key& key, int64_t M, int64_t kblocks,
                    int sub, F value, P place) {
  const auto found = std::find_if(made.begin(), made.end(), [&](const auto& e) { return e.first == key; });
  if (found != made.end()) return found->second.data();
  std::vector<T> terms(M * kblocks * sub);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kb = 0; kb < kblocks; ++kb)
      for (int sb = 0; sb < sub; ++sb) terms[place(m, kb, sb)] = value(m, kb, sb);
  made.emplace_back(key, std::move(terms));
  return made.back().second.data();
}

// Row m's activation sum over sub-block sb of block kb.
inline int32_t psum_at(const Acts& X, int64_t m, int64_t kb, int sub, int sb) {
  return block_psum(X.psum16 + m * (X.K / 16) + kb * 2, sub, sb);
}

// Points w at the per-call terms of its format (zero * psum, and float(psum) where it has offsets): the same
// integers and floats the scalar path computes per block.
void Lanes::for_format(const Acts& X, int64_t M, Packed& w) {
  const int sub = w.subblocks();
  const int64_t kblocks = X.K / kBlock;
  const auto place = [&](int64_t m, int64_t kb, int sb) { return lane_index(M, kblocks, m, kb, sub, sb); };
  const auto zero_psum_of = [&](int64_t m, int64_t kb, int sb) { return int32_t(w.zero * psum_at(X, m, kb, sub, sb)); };
  const auto psum_f_of = [&](int64_t m, int64_t kb, int sb) { return float(psum_at(X, m, kb, sub, sb)); };
  w.zero_psum = terms_once(zero_psum, std::pair<int, int>{w.zero, sub}, M, kblocks, sub, zero_psum_of, place);
  if (w.offsets) w.psum_f = terms_once(psum_f, sub, M, kblocks, sub, psum_f_of, place);
}

BlockTerms::BlockTerms(const Acts& X, int64_t M) : M(M), p(X.p), dx(X.dx) {
  if (M <= 1) return;
  const int64_t kblocks = X.K / kBlock;
  p_copy.resize(M * X.K);
  dx_copy.resize(M * kblocks);
  for (int64_t kb = 0; kb < kblocks; ++kb)
    for (int64_t m = 0; m < M; ++m) {
      std::memcpy(&p_copy[(kb * M + m) * kBlock], X.p + m * X.K + kb * kBlock, kBlock);
      dx_copy[kb * M + m] = X.dx[m * kblocks + kb];
    }
  p = p_copy.data();
  dx = dx_copy.data();
}

// Points w at the terms of its format: the integer its tiles add to a block's isum, and float(psum).
void BlockTerms::for_format(const Acts& X, Packed& w) {
  const int sub = w.subblocks();
  const int64_t kblocks = X.K / kBlock;
  const auto place = [&](int64_t m, int64_t kb, int sb) { return (kb * M + m) * sub + sb; };
  const int multiplier = w.bits == 8 ? 128 - w.zero : -w.zero;
  const auto shift_of = [&](int64_t m, int64_t kb, int sb) { return int32_t(multiplier * psum_at(X, m, kb, sub, sb)); };
  const auto psum_f_of = [&](int64_t m, int64_t kb, int sb) { return float(psum_at(X, m, kb, sub, sb)); };
  w.block_shift = terms_once(shift, std::pair<int, int>{multiplier, sub}, M, kblocks, sub, shift_of, place);
  if (w.offsets) w.block_psum_f = terms_once(psum_f, sub, M, kblocks, sub, psum_f_of, place);
}

Packed packed_from(const at::Tensor& qs, const std::optional<at::Tensor>& planes, const at::Tensor& scales,
                   const std::optional<at::Tensor>& offsets, int64_t N, int64_t bits, int64_t group, int64_t zero,
                   double unit) {
  TORCH_CHECK(qs.dtype() == at::kByte && qs.is_contiguous() && qs.dim() == 3, "qs: contiguous uint8 [tiles, K/32, B]");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 4, 5, 6 or 8");
  TORCH_CHECK(group == 16 || group == 32, "group must be 16 or 32");
  Packed W{qs.data_ptr<uint8_t>(), nullptr, nullptr, nullptr, qs.size(0), qs.size(1), N, int(bits), int(group),
           int(zero)};
  TORCH_CHECK(qs.size(2) == W.qs_stride(), "qs has ", qs.size(2), " bytes per block, expected ", W.qs_stride());
  TORCH_CHECK(N <= W.tiles * kTile, "N exceeds the packed tiles");
  int exponent = 0;
  TORCH_CHECK(unit > 0 && std::frexp(unit, &exponent) == 0.5, "unit must be a power of two, not ", unit);
  W.unit = float(unit);
  if (W.planes_count() > 0) {
    TORCH_CHECK(planes.has_value() && planes->dtype() == at::kByte && planes->is_contiguous() &&
                    planes->numel() == W.tiles * W.kblocks * W.planes_count() * 64,
                "planes: contiguous uint8 [tiles, K/32, bits - 4, 64]");
    W.planes = planes->data_ptr<uint8_t>();
  }
  const int64_t scale_count = W.tiles * W.kblocks * W.subblocks() * kTile;
  TORCH_CHECK(scales.dtype() == at::kHalf && scales.is_contiguous() && scales.numel() == scale_count,
              "scales: contiguous float16 [tiles, K/32, 32/group, 16]");
  W.scales = scales.data_ptr<at::Half>();
  if (offsets.has_value()) {
    TORCH_CHECK(offsets->dtype() == at::kHalf && offsets->is_contiguous() && offsets->numel() == scale_count,
                "offsets: like scales");
    W.offsets = offsets->data_ptr<at::Half>();
  }
  return W;
}

// The activation layout a call's vector tiles read, made once per call and pointed to from X, then from each
// weight the call reads (for_format): Lanes on the AVX-512 path, BlockTerms on the AVX2 path, nothing on the
// scalar one.
class CallLayout {
 public:
  CallLayout(Isa isa, Acts& X, int64_t M) : X_(X), M_(M) {
    if (isa == Isa::avx512) {
      interleave(X, M, lanes_);
      X.lanes = &lanes_;
    } else if (isa == Isa::avx2) {
      blocks_.emplace(X, M);
      X.blocks = &*blocks_;
    }
  }
  CallLayout(const CallLayout&) = delete;  // X and the weights point into it
  CallLayout& operator=(const CallLayout&) = delete;

  void for_format(Packed& w) {
    if (X_.lanes) lanes_.for_format(X_, M_, w);
    if (blocks_) blocks_->for_format(X_, w);
  }

 private:
  const Acts& X_;
  int64_t M_;
  Lanes lanes_;
  std::optional<BlockTerms> blocks_;
};

// Items 0..n-1 over the threads: f(next) runs once on each thread, next() giving its next item or -1. A call of
// fewer than kSharedFrom items (a layer's linear at a decoding step) splits them statically, one contiguous share
// per thread. A longer one (the lm_head and its greedy screen: 16k tiles) shares them out as threads come free: a
// thread takes a run of consecutive items, 1 / (2 threads) of those left and at least kShortestRun, so runs are
// long (sequential reads) early and short near the end. Statically, whichever thread was slowed (stolen time on a
// VM) held the other at the join: the greedy screen at 8 rows ran 1.03-1.12x slower (docs/design-notes.md, "Work
// sharing between the two threads"). Which thread computes an item never changes how it is computed.
constexpr int64_t kSharedFrom = 1024;
constexpr int64_t kShortestRun = 4;  // each take is an atomic add on a line both threads write

template <typename F>
void split_items(int64_t n, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  std::atomic<int64_t> taken{0};
  specserve::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    // statically: this share's [first, last) of `threads` shares; an inline call (nested, one thread) has them all
    int64_t at = n * first / threads, end = n * last / threads;
    const bool shared = n >= kSharedFrom;
    if (shared) at = end = 0;
    f([&]() -> int64_t {
      if (at == end && shared) {
        const int64_t run = std::max(kShortestRun, (n - taken.load(std::memory_order_relaxed)) / (2 * threads));
        at = std::min(n, taken.fetch_add(run));
        end = std::min(n, at + run);
      }
      return at < end ? at++ : -1;
    });
  });
}

// y = x @ [W_0; W_1; ...].T + bias: several packed weights over the same input (fused q/k/v or gate/up whose
// formats differ) in one call, x quantized once, their tiles shared out over the threads together; weight i's
// outputs are columns [sum N_<i}, + N_i) of y.
}  // namespace

at::Tensor specserve::quant_linear(const at::Tensor& x_in, const std::vector<at::Tensor>& qs,
                        const std::vector<std::optional<at::Tensor>>& planes, const std::vector<at::Tensor>& scales,
                        const std::vector<std::optional<at::Tensor>>& offsets, const std::optional<at::Tensor>& bias,
                        const std::vector<int64_t>& N, const std::vector<int64_t>& bits,
                        const std::vector<int64_t>& group, const std::vector<int64_t>& zero,
                        const std::vector<double>& unit, bool out_fp32, const std::string& isa_name) {
  const size_t parts = qs.size();
  TORCH_CHECK(parts > 0 && planes.size() == parts && scales.size() == parts && offsets.size() == parts &&
                  N.size() == parts && bits.size() == parts && group.size() == parts && zero.size() == parts &&
                  unit.size() == parts,
              "quant_linear: one entry per weight in every list");
  const Isa isa = parse_isa(isa_name);
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat, "x must be bf16 or fp32");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<Packed> W;
  std::vector<std::array<TileFn, kMaxRows + 1>> fns;
  std::vector<DecodedTiles> decoded_fns;
  int64_t decoded_kblocks = 0;  // the largest K/32 of the weights decoded once per tile
  std::vector<int64_t> column(parts + 1, 0);
  std::vector<std::pair<int, int64_t>> work;  // (weight, tile)
  for (size_t i = 0; i < parts; ++i) {
    W.push_back(packed_from(qs[i], planes[i], scales[i], offsets[i], N[i], bits[i], group[i], zero[i], unit[i]));
    TORCH_CHECK(K == W[i].kblocks * kBlock, "x has K=", K, ", the weight ", W[i].kblocks * kBlock);
    fns.push_back(tiles(isa, W[i]));
    decoded_fns.push_back(decoded_tiles(isa, W[i], M));
    if (decoded_fns.back().decode) decoded_kblocks = std::max(decoded_kblocks, W[i].kblocks);
    column[i + 1] = column[i] + N[i];
    for (int64_t t = 0; t < W[i].tiles; ++t) work.emplace_back(int(i), t);
  }
  const int64_t width = column[parts];
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == width && bias->is_contiguous(),
                "bias: fp32 [sum of N]");

  std::vector<int8_t> p(M * K);
  std::vector<float> dx(M * (K / kBlock));
  std::vector<int32_t> psum16(M * (K / 16));
  if (x.scalar_type() == at::kFloat)
    quantize_rows(isa, x.data_ptr<float>(), M, K, p.data(), dx.data(), psum16.data());
  else
    quantize_rows(isa, x.data_ptr<at::BFloat16>(), M, K, p.data(), dx.data(), psum16.data());
  Acts X{p.data(), dx.data(), psum16.data(), K};
  CallLayout layout(isa, X, M);
  for (Packed& w : W) layout.for_format(w);

  const auto out_type = out_fp32 ? at::kFloat : x.scalar_type();
  at::Tensor y = at::empty({M, width}, x.options().dtype(out_type));
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* y32 = out_type == at::kFloat ? y.data_ptr<float>() : nullptr;
  at::BFloat16* y16 = out_type == at::kFloat ? nullptr : y.data_ptr<at::BFloat16>();
  split_items(int64_t(work.size()), [&](const auto& next) {
    float block[kMaxRows * kTile];
    // in cache lines: an AVX-512 access across two lines costs two (unaligned, the decoded Q6_K tile ran 0.77x)
    std::vector<CacheLine> decoded_lines(decoded_kblocks * 8);
    DecodedVector* decoded = reinterpret_cast<DecodedVector*>(decoded_lines.data());
    for (int64_t item; (item = next()) >= 0;) {
      const auto [i, tile] = work[item];
      const Packed& w = W[i];
      const DecodedTiles& once = decoded_fns[i];
      if (once.decode) once.decode(w, tile, decoded);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int mr = int(std::min<int64_t>(kMaxRows, M - m0));
        run_tile(fns[i], once, w, X, tile, m0, mr, block, decoded);
        const int64_t n0 = column[i] + tile * kTile, count = std::min<int64_t>(kTile, w.N - tile * kTile);
        const TileOut to{y32 ? y32 + m0 * width + n0 : nullptr, y16 ? y16 + m0 * width + n0 : nullptr, width,
                         b ? b + n0 : nullptr, w.unit};
#if SPECSERVE_X86
        if (isa != Isa::scalar && count == kTile) store_tile_avx2(block, mr, to);
        else
#endif
          store_tile_scalar(block, mr, int(count), to);
      }
    }
  });
  return y;
}

namespace {

// ---------------------------------------------------------------- greedy screening of an 8-bit lm_head
//
// Greedy decoding needs each row's argmax of y = x @ W.T, not y. For an 8-bit weight (Q8_0, int8: codes q with
// zero 128, one scale s per block of 32) write q = 8 qh + ql with qh = q >> 3 (5 bits) and ql in 0..7. Per
// block b of the row (dx, p as quant_linear quantizes it):
//   y[n] = sum_b dx_b s_nb (sum q p - 128 psum_b)
//        = sum_b 8 dx_b s_nb (sum qh p - 16 psum_b)  +  sum_b dx_b s_nb sum ql p
// The first sum (A) is the product with a 5-bit weight, the screen: qh packed as Q5_0 (zero 16), which reads 20 of
// a block's 32 code bytes. In the second, sum ql p lies in [7 sum p-, 7 sum p+] = 3.5 psum_b +- 3.5 sum |p|, so
//   |y[n] - mid[n]| <= rad[n],   mid = A + sum_b s_nb dx_b 3.5 psum_b,   rad = sum_b |s_nb| dx_b 3.5 sum |p|.
// The argmax is among the outputs whose mid + rad reaches the row's best mid - rad (the exact bound of each block,
// not a looser per-row one: that kept most of the vocabulary). Only their tiles are computed exactly, by
// quant_linear's own tile functions, so the logits compared are quant_linear's bit for bit and the answer is
// torch.argmax's over them: the first maximum, or the first NaN. Every term of y, A or the center is at most 128 / 3.5
// times its radius term, so the fp32 rounding of all the sums (one or two per block and term) stays below
// 2^-24 * 512 (K/32 + 2) * rad: rad is widened by that much (`slack`). A row with a non-finite activation or bound
// has all its tiles computed.

// The quantized rows and each block's center and radius terms; rows holding a NaN or an infinity are marked in
// `broken` (their codes are not what the bound assumes: psum16 need not be sum p, and the paths may differ there).
template <typename T>
void screen_terms(const T* x, int64_t M, int64_t K, Isa isa, std::vector<int8_t>& p, std::vector<float>& dx,
                  std::vector<int32_t>& psum16, std::vector<float>& center, std::vector<float>& radius,
                  char* broken) {
  quantize_rows(isa, x, M, K, p.data(), dx.data(), psum16.data());
  for (int64_t m = 0; m < M; ++m)
    broken[m] = !std::all_of(x + m * K, x + (m + 1) * K, [](T v) { return std::isfinite(float(v)); });
  for (int64_t b = 0; b < M * (K / kBlock); ++b) {
    int32_t sum = 0, magnitude = 0;
    for (int k = 0; k < kBlock; ++k) {
      sum += p[b * kBlock + k];
      magnitude += std::abs(int32_t(p[b * kBlock + k]));
    }
    center[b] = dx[b] * 3.5f * float(sum);
    radius[b] = dx[b] * 3.5f * float(magnitude);
  }
}

at::Tensor screen_argmax(const at::Tensor& x_in, const at::Tensor& screen_qs, const at::Tensor& screen_planes,
                         const at::Tensor& qs, const at::Tensor& scales, int64_t N, double unit,
                         const std::string& isa_name) {
  const Isa isa = parse_isa(isa_name);
#if SPECSERVE_X86
  // the bounds and the candidate test are AVX2 code, which every AVX-512 CPU runs; the products come from the
  // call's own path (VNNI on AVX-512), bit-identical to the other paths' as every tile's are
  const bool vector_bounds = isa != Isa::scalar;
#endif
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat, "x must be bf16 or fp32");
  // both in the weight's unit, never multiplied out: the argmax of y / unit is y's (a power of two scales exactly)
  Packed S = packed_from(screen_qs, screen_planes, scales, std::nullopt, N, 5, 32, 16, unit);
  Packed W = packed_from(qs, std::nullopt, scales, std::nullopt, N, 8, 32, 128, unit);
  TORCH_CHECK(S.tiles == W.tiles && S.kblocks == W.kblocks, "the screen and the weight differ in shape");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), kblocks = K / kBlock;
  TORCH_CHECK(K == W.kblocks * kBlock, "x has K=", K, ", the weight ", W.kblocks * kBlock);
  std::vector<int8_t> p(M * K);
  std::vector<float> dx(M * kblocks), center(M * kblocks), radius(M * kblocks);
  std::vector<int32_t> psum16(M * (K / 16));
  const int threads = at::get_num_threads() + 1;
  std::vector<char> bad(threads * M, 0);  // per thread, set where a row's bound cannot be trusted
  if (x.scalar_type() == at::kFloat)
    screen_terms(x.data_ptr<float>(), M, K, isa, p, dx, psum16, center, radius, bad.data());
  else
    screen_terms(x.data_ptr<at::BFloat16>(), M, K, isa, p, dx, psum16, center, radius, bad.data());
  Acts X{p.data(), dx.data(), psum16.data(), K};
  X.center = center.data();
  X.radius = radius.data();
  CallLayout layout(isa, X, M);
  layout.for_format(S);
  layout.for_format(W);
  const float slack = 1.f + 512.f * float(kblocks + 2) / float(1 << 24);
  const auto screen_fns = tiles(isa, S);
  const DecodedTiles screen_once = decoded_tiles(isa, S, M);
  const int64_t decoded_blocks = screen_once.decode ? S.kblocks : 0;
  const auto count = [&](int64_t tile) { return int(std::min<int64_t>(kTile, N - tile * kTile)); };

  // each tile's largest upper bound per row ([tile][m]; every one is written before it is read), and each row's
  // best lower bound and non-finite flag per thread
  const std::unique_ptr<float[]> top(new float[W.tiles * M]);
  std::vector<float> lower(threads * M, -INFINITY);
  split_items(W.tiles, [&](const auto& next) {
    const ScreenFold fold{slack, lower.data() + at::get_thread_num() * M, bad.data() + at::get_thread_num() * M};
    float block[kMaxRows * kTile];
    std::vector<uint8_t> decoded_bytes(decoded_blocks * 2 * 8 * sizeof(DecodedVector));
    DecodedVector* decoded = reinterpret_cast<DecodedVector*>(decoded_bytes.data());
    for (int64_t tile; (tile = next()) >= 0;) {
      if (screen_once.decode) screen_once.decode(S, tile, decoded);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int mr = int(std::min<int64_t>(kMaxRows, M - m0));
        float* bounds = top.get() + tile * M + m0;
        run_tile(screen_fns, screen_once, S, X, tile, m0, mr, block, decoded);
#if SPECSERVE_X86
        if (vector_bounds && count(tile) == kTile) screen_bounds_avx2(S, X, tile, m0, mr, block, fold, bounds);
        else
#endif
          screen_bounds_scalar(S, X, tile, m0, mr, block, count(tile), fold, bounds);
      }
    }
  });
  for (int t = 1; t < threads; ++t)
    for (int64_t m = 0; m < M; ++m) {
      lower[m] = std::max(lower[m], lower[t * M + m]);
      bad[m] |= bad[t * M + m];
    }

  // which rows have candidates in which tiles ([tile][m])
  std::vector<char> wants(W.tiles * M, 0);
  for (int64_t tile = 0; tile < W.tiles; ++tile)
    for (int64_t m = 0; m < M; ++m) wants[tile * M + m] = bad[m] != 0 || top[tile * M + m] >= lower[m];
  std::vector<int64_t> candidates;
  for (int64_t tile = 0; tile < W.tiles; ++tile)
    if (std::any_of(&wants[tile * M], &wants[tile * M] + M, [](char w) { return w != 0; })) candidates.push_back(tile);

  // their exact logits for the rows that want them ([candidate][m][16]): one row at a time where few rows do
  // (a row's own candidates are a small part of the rows' union), else all the rows in passes
  const auto fns = tiles(isa, W);
  std::vector<float> exact(candidates.size() * M * kTile);
  specserve::parallel_for(0, int64_t(candidates.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const char* rows = &wants[candidates[c] * M];
      const int64_t wanting = std::count(rows, rows + M, char(1));
      for (int64_t m0 = 0; m0 < M;) {
        const int mr = 2 * wanting > M ? int(std::min<int64_t>(kMaxRows, M - m0)) : 1;
        if (mr == 1 && !rows[m0]) {
          ++m0;
          continue;
        }
        run_tile(fns, DecodedTiles{}, W, X, candidates[c], m0, mr, exact.data() + (c * M + m0) * kTile, nullptr);
        m0 += mr;
      }
    }
  });
  at::Tensor ids = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    int64_t best = -1;
    float best_value = 0.f;
    bool nan = false;
    for (size_t c = 0; c < candidates.size() && !nan; ++c) {
      if (!wants[candidates[c] * M + m]) continue;  // none of this row's candidates (its logits were not computed)
      for (int j = 0; j < count(candidates[c]) && !nan; ++j) {
        const float v = exact[(c * M + m) * kTile + j];
        const int64_t n = candidates[c] * kTile + j;
        if (std::isnan(v)) best = n, nan = true;
        else if (best < 0 || v > best_value) best = n, best_value = v;
      }
    }
    id[m] = best;
  }
  return ids;
}

// The dequantized weight rows `rows` (fp32 [len, K]): s * (q - z) - o, for embedding lookups and tests.
at::Tensor dequantize_rows(const at::Tensor& rows_in, const at::Tensor& qs, const std::optional<at::Tensor>& planes,
                           const at::Tensor& scales, const std::optional<at::Tensor>& offsets, int64_t N,
                           int64_t bits, int64_t group, int64_t zero, double unit) {
  const Packed W = packed_from(qs, planes, scales, offsets, N, bits, group, zero, unit);
  const at::Tensor rows = rows_in.to(at::kLong).contiguous();
  const int64_t R = rows.numel(), K = W.kblocks * kBlock;
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(ids[r] >= 0 && ids[r] < N, "row ", ids[r], " out of range [0, ", N, ")");
  at::Tensor out = at::empty({R, K}, at::TensorOptions().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  const int sub = W.subblocks();
  specserve::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t tile = ids[r] / kTile, n = ids[r] % kTile;
      for (int64_t kb = 0; kb < W.kblocks; ++kb)
        for (int k = 0; k < kBlock; ++k) {
          const int g = k / 4, sb = k / W.group;
          const int64_t si = ((tile * W.kblocks + kb) * sub + sb) * kTile + n;
          const float q = float(unpack_q(W, tile, kb, g, int(n) * 4 + k % 4) - W.zero);
          dst[r * K + kb * kBlock + k] = (q * float(W.scales[si]) - (W.offsets ? float(W.offsets[si]) : 0.f)) * W.unit;
        }
    }
  });
  return out;
}

// XOR of every 64-byte line of a buffer with wide loads, split over the threads: a pure streaming read, the
// ceiling a memory-bound kernel can reach on this machine (bench's roofline).
#if SPECSERVE_X86
SPECSERVE_AVX2 uint64_t xor_lines_avx2(const uint8_t* p, int64_t begin, int64_t end) {
  __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
  for (int64_t line = begin; line < end; ++line) {
    a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i*)(p + line * 64)));
    b = _mm256_xor_si256(b, _mm256_loadu_si256((const __m256i*)(p + line * 64 + 32)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256((__m256i*)lanes, _mm256_xor_si256(a, b));
  return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
}
#endif  // SPECSERVE_X86

uint64_t xor_lines_scalar(const uint8_t* p, int64_t begin, int64_t end) {
  uint64_t acc = 0;
  for (int64_t line = begin; line < end; ++line)
    for (int j = 0; j < 8; ++j) {
      uint64_t word;
      std::memcpy(&word, p + line * 64 + j * 8, 8);
      acc ^= word;
    }
  return acc;
}

int64_t stream_read(const at::Tensor& buffer) {
  TORCH_CHECK(buffer.is_contiguous() && buffer.nbytes() % 64 == 0, "a contiguous buffer of whole cache lines");
  const uint8_t* bytes = static_cast<const uint8_t*>(buffer.data_ptr());
  std::vector<uint64_t> partial(at::get_num_threads() + 1, 0);
#if SPECSERVE_X86
  const bool wide = detect() != Isa::scalar;
  const auto lines = wide ? xor_lines_avx2 : xor_lines_scalar;
#else
  const auto lines = xor_lines_scalar;
#endif
  specserve::parallel_for(0, int64_t(buffer.nbytes() / 64), 4096, [&](int64_t begin, int64_t end) {
    partial[at::get_thread_num()] ^= lines(bytes, begin, end);
  });
  uint64_t total = 0;
  for (uint64_t x : partial) total ^= x;
  return int64_t(total);
}

// The CPU's int8 multiply-add peak on the instruction the best path multiplies with (VPDPBUSD on AVX-512 VNNI:
// 64 u8 x s8 products each; VPMADDUBSW on AVX2: 32), as measured: independent accumulator chains on every thread,
// no memory traffic. The kernels' achieved multiply-adds per second are read against it (`bench --step-costs`).
// Enough independent chains to cover the instruction's latency on both ports, and few enough to stay in registers:
// with 12 on AVX2 (16 registers) GCC kept some on the stack, and the loop's stores read ~2/3 of the peak.
constexpr int kPeakChains512 = 12, kPeakChains256 = 8;

#if SPECSERVE_X86
SPECSERVE_AVX512 int64_t peak_chains_avx512(int64_t rounds) {
  __m512i acc[kPeakChains512];
  for (int c = 0; c < kPeakChains512; ++c) acc[c] = _mm512_set1_epi32(c);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (int64_t r = 0; r < rounds; ++r)
    for (int c = 0; c < kPeakChains512; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
  int64_t out = 0;
  for (int c = 0; c < kPeakChains512; ++c) out += _mm512_reduce_add_epi32(acc[c]);
  return out;
}

SPECSERVE_AVX2 int64_t peak_chains_avx2(int64_t rounds) {
  __m256i acc[kPeakChains256];
  for (int c = 0; c < kPeakChains256; ++c) acc[c] = _mm256_set1_epi16(short(c));
  const __m256i b = _mm256_set1_epi8(-2);
  for (int64_t r = 0; r < rounds; ++r)  // each product feeds the next (as bytes): nothing to hoist or fold
    for (int c = 0; c < kPeakChains256; ++c) acc[c] = _mm256_maddubs_epi16(acc[c], b);
  int64_t out = 0;
  for (int c = 0; c < kPeakChains256; ++c) out += _mm256_extract_epi16(acc[c], 0);
  return out;
}
#endif  // SPECSERVE_X86

double int8_peak_macs(double seconds) {
#if !SPECSERVE_X86
  (void)seconds;
  return 0.0;  // no vector path
#else
  const Isa isa = detect();
  if (isa == Isa::scalar) return 0.0;
  const int64_t per_instruction = isa == Isa::avx512 ? 64 : 32;
  const int64_t rounds = 1 << 16;
  const auto run = [&] {
    std::atomic<int64_t> sink{0};
    const int threads = at::get_num_threads();
    const auto start = std::chrono::steady_clock::now();
    specserve::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        sink += isa == Isa::avx512 ? peak_chains_avx512(rounds) : peak_chains_avx2(rounds);
    });
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const int chains = isa == Isa::avx512 ? kPeakChains512 : kPeakChains256;
    return double(threads) * rounds * chains * per_instruction / elapsed + 0.0 * double(sink.load());
  };
  double best = run();
  for (auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
       std::chrono::steady_clock::now() < until;)
    best = std::max(best, run());
  return best;
#endif
}

std::string best_isa() {
  switch (detect()) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace

void specserve::bind_quant(py::module_ m) {
  m.def("quant_linear", &specserve::quant_linear,
        "y = x @ [dequant(W_i)].T over packed low-bit weights, row-invariant",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &dequantize_rows, "dequantized rows of a packed weight (fp32)");
  m.def("screen_argmax", &screen_argmax, "each row's argmax of x @ W.T for an 8-bit W, through its 5-bit screen",
        py::call_guard<py::gil_scoped_release>());
  m.def("stream_read", &stream_read, "XOR over a buffer: a streaming-read bandwidth probe");
  m.def("best_isa", &best_isa, "the fastest path this CPU runs: avx512, avx2 or scalar");
  m.def("int8_peak_macs", &int8_peak_macs, "int8 multiply-adds per second this CPU peaks at on the best path",
        py::arg("seconds") = 0.2, py::call_guard<py::gil_scoped_release>());
}
