// Row-invariant bf16 CPU kernels for bit-exact speculative decoding.
//
// oneDNN's bf16 GEMM and PyTorch's SDPA pick blockings (and so reduction orders) by problem shape, so a token's
// logits change with the number of tokens in the forward (T=1 decoding vs T=K+1 verification) or the KV length.
// Here each output element goes through one fixed sequence of fp32 operations, whatever the shape, the other
// rows, the masked keys or the thread count. Register blocking (several x rows per weight chunk, several heads
// per key tile) and thread splits only change which independent elements are computed together.
//
// Built with -march=native; the recipe is fixed per build and machine:
//   small_linear   AMX (TDPBF16PS, K in steps of 32) when the CPU and the kernel allow it, else dot_tile's
//                  VDPBF16PS recipe (AVX512-BF16; on AVX2 + FMA the same recipe as FMAs, a bf16 product being
//                  exact in fp32; else a scalar model of it; bit-identical up to denormals);
//   attention      fp32 FMAs on exactly widened bf16 operands (AVX-512F; AVX2 + FMA with each 16-lane register
//                  as two 8-lane halves, the same arithmetic; else the same sums in scalar code, with libm's exp).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include "fp_mode.h"
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

constexpr int64_t kStep = 32;  // bf16 elements per dot-product step (one VDPBF16PS, one AMX tile row)

// The fixed reduction of 16 lanes: lane l + lane l + 8, then + 4, + 2, + 1.
inline float hsum16_lanes(float* lane) {
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
}

#if defined(__AVX2__) && defined(__FMA__)  // 16 lanes as two 8-lane halves (AVX-512 builds use it too)

// lo holds lanes 0..7, hi lanes 8..15; the same tree as hsum16: l + 8, then + 4, + 2, + 1.
inline float hsum16(__m256 lo, __m256 hi) {
  const __m256 h = _mm256_add_ps(lo, hi);                                         // l + 8
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));  // l + 4
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));                                         // l + 2
  q = _mm_add_ss(q, _mm_movehdup_ps(q));                                          // l + 1
  return _mm_cvtss_f32(q);
}

inline __m256 widen_bf16x8(__m128i bits) {  // bf16 -> fp32 is exact: the bits move up 16 places
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline __m256 load_bf16x8(const bf16* p) { return widen_bf16x8(_mm_loadu_si128((const __m128i*)p)); }

// c10::BFloat16's round to nearest even (NaN -> 0x7fc0), 8 lanes.
inline __m128i round_to_bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i words = _mm256_packus_epi32(r, r);  // r < 2^16: no saturation; [r0..3 r0..3 | r4..7 r4..7]
  return _mm_unpacklo_epi64(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
}

// float(bf16(v)), 8 lanes: what a bf16 op between two fp32 steps leaves.
inline __m256 bf16_rounded8(__m256 v) { return widen_bf16x8(round_to_bf16x8(v)); }

// out[0..7] = bf16(float(bf16(act)) * float(up[0..7])): the activation rounded before the product, as the two
// PyTorch ops round.
inline void store_gated8(__m256 act, const bf16* up, bf16* out) {
  const __m256 product = _mm256_mul_ps(bf16_rounded8(act), load_bf16x8(up));
  _mm_storeu_si128((__m128i*)out, round_to_bf16x8(product));
}

#endif

#ifdef __AVX512F__

inline float hsum16(__m512 v) {  // hsum16_lanes' tree: the two-halves version on v's halves
  return hsum16(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

// hsum16 of four vectors at once: the same lane pairs are added, so each sum is bit-identical to hsum16's.
inline __m128 hsum16x4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));  // l + 8
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
  __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));     // l + 4
  r = _mm512_add_ps(r, _mm512_permute_ps(r, 0x4e));                                                    // l + 2
  r = _mm512_add_ps(r, _mm512_permute_ps(r, 0xb1));                                                    // l + 1
  return _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, r));
}

template <int MR, int NR>
void store_sums(__m512 (&acc)[MR][NR], float* out) {
  for (int i = 0; i < MR; ++i) {
    int j = 0;
    for (; j + 4 <= NR; j += 4)
      _mm_storeu_ps(out + i * NR + j, hsum16x4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]));
    for (; j < NR; ++j) out[i * NR + j] = hsum16(acc[i][j]);
  }
}

inline __mmask16 first_n16(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
}

inline __m512 load_bf16x16(const bf16* p) {  // bf16 -> fp32 is exact: the bits move up 16 places
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

inline void widen(const bf16* src, float* dst, int64_t n) {  // n a multiple of 16
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, load_bf16x16(src + i));
}

// out[i * NR + j] = dot(a[i], b[j]) over D (a multiple of 16), b bf16 widened exactly in registers: lane l takes
// fma(a[d], b[d]) for d = l, l + 16, ...
template <int MR, int NR>
void dot_f32(const float* const* a, const bf16* const* b, int64_t D, float* out) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 bv[NR];
    for (int j = 0; j < NR; ++j) bv[j] = load_bf16x16(b[j] + d);
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_loadu_ps(a[i] + d);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
  store_sums(acc, out);
}

// acc[i * stride + e] = fma(p[i][j], v[j][d + e], ...) for j = 0 .. n-1 in order, e < 16 V, rows i < MR; v bf16,
// widened exactly in registers.
template <int MR, int V>
void add_rows(float* acc, int64_t stride, const bf16* const* v, int64_t d, const float* const* p, int n) {
  __m512 sum[MR][V];
  for (int i = 0; i < MR; ++i)
    for (int e = 0; e < V; ++e) sum[i][e] = _mm512_loadu_ps(acc + i * stride + 16 * e);
  for (int j = 0; j < n; ++j) {
    __m512 x[V];
    for (int e = 0; e < V; ++e) x[e] = load_bf16x16(v[j] + d + 16 * e);
    for (int i = 0; i < MR; ++i) {
      const __m512 pj = _mm512_set1_ps(p[i][j]);
      for (int e = 0; e < V; ++e) sum[i][e] = _mm512_fmadd_ps(pj, x[e], sum[i][e]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int e = 0; e < V; ++e) _mm512_storeu_ps(acc + i * stride + 16 * e, sum[i][e]);
}

inline float max_of(const float* p, int64_t n) {  // max is exact: lane grouping can't change it
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) mx = _mm512_max_ps(_mm512_mask_loadu_ps(mx, first_n16(n - i), p + i), mx);
  return _mm512_reduce_max_ps(mx);
}

// exp(x) = 2^n exp(r), n = round(x / ln 2), |r| <= ln(2) / 2, with Cephes' expf polynomial (about 1 ulp).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);  // exp underflows to 0 anyway; keeps NaN (second operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// p[i] <- exp(p[i] - shift); returns sum p: lane i % 16, then the fixed tree.
inline float exp_shifted(float* p, int64_t n, float shift) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first_n16(n - i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + i), _mm512_set1_ps(shift)));
    _mm512_mask_storeu_ps(p + i, m, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
  }
  return hsum16(sum);
}

#elif defined(__AVX2__) && defined(__FMA__)  // AVX-512's arithmetic on 8-lane registers: 16 lanes as two halves

inline __m256i first_n8(int64_t n) {  // lanes < n all ones
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(n, 8))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline void widen(const bf16* src, float* dst, int64_t n) {  // n a multiple of 16
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
}

// dot_f32's lanes: lane l takes fma(a[d], b[d]) for d = l, l + 16, ... (lanes 0..7 in lo, 8..15 in hi). One key of
// b at a time: it is widened once and every row of a (the heads sharing it) takes it, which keeps the MR x 2
// accumulators and the widened key in the 16 registers.
template <int MR, int NR>
void dot_f32(const float* const* a, const bf16* const* b, int64_t D, float* out) {
  for (int j = 0; j < NR; ++j) {
    __m256 lo[MR], hi[MR];
    for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m256 b0 = load_bf16x8(b[j] + d), b1 = load_bf16x8(b[j] + d + 8);
      for (int i = 0; i < MR; ++i) {
        lo[i] = _mm256_fmadd_ps(_mm256_loadu_ps(a[i] + d), b0, lo[i]);
        hi[i] = _mm256_fmadd_ps(_mm256_loadu_ps(a[i] + d + 8), b1, hi[i]);
      }
    }
    for (int i = 0; i < MR; ++i) out[i * NR + j] = hsum16(lo[i], hi[i]);
  }
}

// add_rows: every element its own chain of fmas over j in order, so the lane width does not matter. Per 16
// elements, each value row is widened once and every row of acc (the heads sharing it) takes it.
template <int MR, int V>
void add_rows(float* acc, int64_t stride, const bf16* const* v, int64_t d, const float* const* p, int n) {
  for (int e = 0; e < 2 * V; e += 2) {
    __m256 lo[MR], hi[MR];
    for (int i = 0; i < MR; ++i) {
      lo[i] = _mm256_loadu_ps(acc + i * stride + 8 * e);
      hi[i] = _mm256_loadu_ps(acc + i * stride + 8 * e + 8);
    }
    for (int j = 0; j < n; ++j) {
      const __m256 v0 = load_bf16x8(v[j] + d + 8 * e), v1 = load_bf16x8(v[j] + d + 8 * e + 8);
      for (int i = 0; i < MR; ++i) {
        const __m256 pj = _mm256_set1_ps(p[i][j]);
        lo[i] = _mm256_fmadd_ps(pj, v0, lo[i]);
        hi[i] = _mm256_fmadd_ps(pj, v1, hi[i]);
      }
    }
    for (int i = 0; i < MR; ++i) {
      _mm256_storeu_ps(acc + i * stride + 8 * e, lo[i]);
      _mm256_storeu_ps(acc + i * stride + 8 * e + 8, hi[i]);
    }
  }
}

inline float max_of(const float* p, int64_t n) {  // max is exact: lane grouping can't change it
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_blendv_ps(mx, _mm256_maskload_ps(p + i, first_n8(n - i)),
                                      _mm256_castsi256_ps(first_n8(n - i)));
    mx = _mm256_max_ps(v, mx);
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// exp16's arithmetic: the same polynomial, and y * 2^n in place of scalef(y, n) (two exact power-of-two factors;
// with the kernels' FTZ mode a result below 2^-126 is zero in both, an overflow infinite in both).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-104.f), x);  // keeps NaN (second operand)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-127.f)), _mm256_set1_ps(129.f)));
  const __m256i half = _mm256_srai_epi32(e, 1), rest = _mm256_sub_epi32(e, half);
  const auto pow2 = [](__m256i k) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23)); };
  return _mm256_mul_ps(_mm256_mul_ps(y, pow2(half)), pow2(rest));
}

// p[i] <- exp(p[i] - shift); returns sum p: lane i % 16, then the fixed tree.
inline float exp_shifted(float* p, int64_t n, float shift) {
  __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = first_n8(n - i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(p + i, m), _mm256_set1_ps(shift)));
    _mm256_maskstore_ps(p + i, m, e);
    __m256& s = sum[(i / 8) % 2];
    s = _mm256_add_ps(s, _mm256_and_ps(e, _mm256_castsi256_ps(m)));
  }
  return hsum16(sum[0], sum[1]);
}

#else  // the same arithmetic, one lane at a time

inline void widen(const bf16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float(src[i]);
}

template <int MR, int NR>
void dot_f32(const float* const* a, const bf16* const* b, int64_t D, float* out) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float lane[16] = {};
      for (int64_t d = 0; d < D; ++d) lane[d % 16] = std::fma(a[i][d], float(b[j][d]), lane[d % 16]);
      out[i * NR + j] = hsum16_lanes(lane);
    }
}

template <int MR, int V>
void add_rows(float* acc, int64_t stride, const bf16* const* v, int64_t d, const float* const* p, int n) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < n; ++j)
      for (int e = 0; e < 16 * V; ++e)
        acc[i * stride + e] = std::fma(p[i][j], float(v[j][d + e]), acc[i * stride + e]);
}

inline float max_of(const float* p, int64_t n) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, p[i]);
  return mx;
}

inline float exp_shifted(float* p, int64_t n, float shift) {
  float lane[16] = {};
  for (int64_t i = 0; i < n; ++i) {
    p[i] = std::exp(p[i] - shift);
    lane[i % 16] += p[i];
  }
  return hsum16_lanes(lane);
}

#endif

#ifdef __AVX512BF16__

constexpr const char* kDotPath = "avx512_bf16";

inline __m512bh load_bf16x32(const bf16* p, int64_t n) {  // zero-filled past n
  return (__m512bh)_mm512_maskz_loadu_epi16(n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1, p);
}

// out[i * NR + j] = dot(a[i], b[j]) over K: lane l accumulates the pairs (k0 + 2l, k0 + 2l + 1), k0 = 0, 32, ...
// (VDPBF16PS), then the fixed tree. Each loaded b chunk serves MR rows of a.
template <int MR, int NR>
void dot_tile(const bf16* const* a, const bf16* const* b, int64_t K, float* out) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kStep) {
    __m512bh bv[NR];
    for (int j = 0; j < NR; ++j) bv[j] = load_bf16x32(b[j] + k, K - k);
    for (int i = 0; i < MR; ++i) {
      const __m512bh av = load_bf16x32(a[i] + k, K - k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, bv[j]);
    }
  }
  store_sums(acc, out);
}

#elif defined(__AVX2__) && defined(__FMA__)  // the VDPBF16PS recipe with FMAs: a bf16 product is exact in fp32

constexpr const char* kDotPath = "avx2_fma";

// 16 bf16 (lanes 8h .. 8h + 7 of a step): dword l holds the pair (2l, 2l + 1), even element in the low half.
struct Pairs {
  __m256 odd, even;
};

inline Pairs load_pairs(const bf16* p, int64_t n) {  // zero-filled past n
  __m256i v;
  if (n >= 16) {
    v = _mm256_loadu_si256((const __m256i*)p);
  } else {
    alignas(32) bf16 part[16] = {};
    std::copy(p, p + std::max<int64_t>(n, 0), part);
    v = _mm256_load_si256((const __m256i*)part);
  }
  return {_mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u)))),
          _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))};
}

// dot_tile's lanes (odd element first, each step rounded once) as fmas, one row of a at a time.
template <int MR, int NR>
void dot_tile(const bf16* const* a, const bf16* const* b, int64_t K, float* out) {
  for (int i = 0; i < MR; ++i) {
    __m256 acc[NR][2];
    for (int j = 0; j < NR; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += kStep)
      for (int h = 0; h < 2; ++h) {
        const Pairs av = load_pairs(a[i] + k + 16 * h, K - k - 16 * h);
        for (int j = 0; j < NR; ++j) {
          const Pairs bv = load_pairs(b[j] + k + 16 * h, K - k - 16 * h);
          acc[j][h] = _mm256_fmadd_ps(av.even, bv.even, _mm256_fmadd_ps(av.odd, bv.odd, acc[j][h]));
        }
      }
    for (int j = 0; j < NR; ++j) out[i * NR + j] = hsum16(acc[j][0], acc[j][1]);
  }
}

#else  // a scalar model of the VDPBF16PS recipe

constexpr const char* kDotPath = "scalar";

// A bf16 x bf16 product is exact in fp32, so each step rounds once, like VDPBF16PS (odd element first).
inline float product(const bf16* a, const bf16* b, int64_t k, int64_t K) {
  return k < K ? float(a[k]) * float(b[k]) : 0.f;
}

template <int MR, int NR>
void dot_tile(const bf16* const* a, const bf16* const* b, int64_t K, float* out) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float lane[16] = {};
      for (int64_t k0 = 0; k0 < K; k0 += kStep)
        for (int l = 0; l < 16; ++l) {
          lane[l] += product(a[i], b[j], k0 + 2 * l + 1, K);
          lane[l] += product(a[i], b[j], k0 + 2 * l, K);
        }
      out[i * NR + j] = hsum16_lanes(lane);
    }
}

#endif

// ---------------------------------------------------------------------------------------------- small_linear

constexpr int kMR = 4;  // x rows per tile
constexpr int kNR = 4;  // weight rows per tile: 16 accumulators + 4 weight vectors fit the 32 zmm registers

using TileFn = void (*)(const bf16* const*, const bf16* const*, int64_t, float*);

template <int MR>
constexpr std::array<TileFn, kNR> tiles_for_rows() {
  return {dot_tile<MR, 1>, dot_tile<MR, 2>, dot_tile<MR, 3>, dot_tile<MR, 4>};
}

// kTiles[mr - 1][nr - 1] handles the ragged edges with the same per-element recipe.
constexpr std::array<std::array<TileFn, kNR>, kMR> kTiles = {
    tiles_for_rows<1>(), tiles_for_rows<2>(), tiles_for_rows<3>(), tiles_for_rows<4>()};

struct Linear {
  const bf16 *x, *w;
  const float* bias;  // fp32 [N] or null
  float* y32;         // exactly one of y32, y16 is set
  bf16* y16;
  int64_t M, N, K;
};

void store(const Linear& L, int64_t m, int64_t n, float acc) {
  const float v = L.bias ? acc + L.bias[n] : acc;
  if (L.y32)
    L.y32[m * L.N + n] = v;
  else
    L.y16[m * L.N + n] = bf16(v);  // round to nearest even
}

// y[:, n0 : n0 + nr], one weight tile at a time so it stays in L1 while every x row passes.
void linear_block(const Linear& L, int64_t n0, int64_t nr) {
  const bf16* b[kNR];
  for (int j = 0; j < nr; ++j) b[j] = L.w + (n0 + j) * L.K;
  for (int64_t m0 = 0; m0 < L.M; m0 += kMR) {
    const int64_t mr = std::min<int64_t>(kMR, L.M - m0);
    const bf16* a[kMR];
    for (int i = 0; i < mr; ++i) a[i] = L.x + (m0 + i) * L.K;
    float tile[kMR * kNR];
    kTiles[mr - 1][nr - 1](a, b, L.K, tile);
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) store(L, m0 + i, n0 + j, tile[i * nr + j]);
  }
}

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)

// AVX2 + FMA: dot_tile's arithmetic (the same FMAs on the same lanes, in the same order), blocked for reuse. x is
// split into its odd and even fp32 lanes once per call (16 bf16 -> 8 odd then 8 even floats, zeros past K), and
// a tile of MR x rows and NR weight rows runs each 16-element half of a step in its own pass: the MR * NR
// accumulators, NR split weight vectors and one x pair fit AVX2's 16 registers, and each weight vector loaded
// serves MR rows (one row at a time, the weights were split again for every row).
constexpr int kPairRows = 4, kPairCols = 2;

template <int MR, int NR>
void pair_tile(const float* const* a, const bf16* const* b, int64_t K, float* out) {
  __m256 half[2][MR][NR];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 16 * h; k < K; k += kStep) {
      Pairs bv[NR];
      for (int j = 0; j < NR; ++j) bv[j] = load_pairs(b[j] + k, K - k);
      for (int i = 0; i < MR; ++i) {
        const __m256 odd = _mm256_loadu_ps(a[i] + k), even = _mm256_loadu_ps(a[i] + k + 8);
        for (int j = 0; j < NR; ++j)
          acc[i][j] = _mm256_fmadd_ps(even, bv[j].even, _mm256_fmadd_ps(odd, bv[j].odd, acc[i][j]));
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) half[h][i][j] = acc[i][j];
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * NR + j] = hsum16(half[0][i][j], half[1][i][j]);
}

using PairTileFn = void (*)(const float* const*, const bf16* const*, int64_t, float*);

template <int MR>
constexpr std::array<PairTileFn, kPairCols> pair_tiles_for_rows() {
  return {pair_tile<MR, 1>, pair_tile<MR, 2>};
}
constexpr std::array<std::array<PairTileFn, kPairCols>, kPairRows> kPairTiles = {
    pair_tiles_for_rows<1>(), pair_tiles_for_rows<2>(), pair_tiles_for_rows<3>(), pair_tiles_for_rows<4>()};

void linear_dot(const Linear& L) {
  const int64_t padded = (L.K + kStep - 1) / kStep * kStep;
  std::vector<float> wide(L.M * padded);
  for (int64_t m = 0; m < L.M; ++m)
    for (int64_t k = 0; k < padded; k += 16) {
      const Pairs p = load_pairs(L.x + m * L.K + k, L.K - k);
      _mm256_storeu_ps(wide.data() + m * padded + k, p.odd);
      _mm256_storeu_ps(wide.data() + m * padded + k + 8, p.even);
    }
  // Threads split N: that moves whole output columns between threads, never changes their arithmetic.
  const int64_t blocks = (L.N + kPairCols - 1) / kPairCols;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (kPairCols * std::max<int64_t>(L.K, 1) * L.M));
  specserve::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kPairCols, nr = std::min<int64_t>(kPairCols, L.N - n0);
      const bf16* b[kPairCols];
      for (int j = 0; j < nr; ++j) b[j] = L.w + (n0 + j) * L.K;
      for (int64_t m0 = 0; m0 < L.M; m0 += kPairRows) {
        const int64_t mr = std::min<int64_t>(kPairRows, L.M - m0);
        const float* a[kPairRows];
        for (int i = 0; i < mr; ++i) a[i] = wide.data() + (m0 + i) * padded;
        float tile[kPairRows * kPairCols];
        kPairTiles[mr - 1][nr - 1](a, b, L.K, tile);
        for (int i = 0; i < mr; ++i)
          for (int j = 0; j < nr; ++j) store(L, m0 + i, n0 + j, tile[i * nr + j]);
      }
    }
  });
}

#else

void linear_dot(const Linear& L) {
  // Threads split N: that moves whole output columns between threads, never changes their arithmetic.
  const int64_t blocks = (L.N + kNR - 1) / kNR;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (kNR * std::max<int64_t>(L.K, 1) * L.M));
  specserve::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) linear_block(L, blk * kNR, std::min<int64_t>(kNR, L.N - blk * kNR));
  });
}

#endif

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)

// AMX computes y^T = W x^T: W rows load straight into A tiles (16 n x 32 k), x^T is packed once per call into
// B tiles (16 k pairs x 16 m). TDPBF16PS updates C[n][m] from A row n and B column m only, so padded or other
// columns of x never change a result, and one instruction sequence serves every M up to 32 (memory-bound).
constexpr int64_t kTileN = 16, kTileM = 16;
constexpr int64_t kBTile = kStep / 2 * kTileM;  // bf16 pairs in one B tile

bool amx_permitted() {  // Linux hands out the 8 KiB tile state only on request
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

void configure_tiles() {  // all 8 tiles are 16 rows x 64 bytes: C 0-3, B 4-5, A 6-7
  struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// B tile (mb, c) holds the bf16 pair x[mb * 16 + j][c * 32 + 2 i + {0, 1}] at row i, column j (16 x 16 pairs);
// zeros beyond M and K.
std::vector<uint32_t> pack_x(const Linear& L, int64_t chunks, int64_t mblocks) {
  std::vector<uint32_t> packed(mblocks * chunks * kBTile, 0);
  for (int64_t m = 0; m < L.M; ++m) {
    const bf16* row = L.x + m * L.K;
    uint32_t* dst = packed.data() + m / kTileM * chunks * kBTile + m % kTileM;
    for (int64_t k = 0; k < L.K; k += 2) {
      uint32_t pair = row[k].x;
      if (k + 1 < L.K) std::memcpy(&pair, row + k, sizeof pair);
      dst[k / 2 * kTileM] = pair;  // row k / 2 % 16 of the B tile of chunk k / 32
    }
  }
  return packed;
}

// W rows n0 .. n0+15, columns k0 .. k0+31 as an A tile: in place when whole, else a zero-padded copy.
const bf16* weight_tile(const Linear& L, int64_t n0, int64_t k0, bf16* pad, int64_t& stride) {
  stride = L.K * 2;
  if (n0 + kTileN <= L.N && k0 + kStep <= L.K) return L.w + n0 * L.K + k0;
  std::fill(pad, pad + kTileN * kStep, bf16(0.f));
  for (int64_t n = n0; n < std::min(L.N, n0 + kTileN); ++n)
    std::copy(L.w + n * L.K + k0, L.w + n * L.K + std::min(L.K, k0 + kStep), pad + (n - n0) * kStep);
  stride = kStep * 2;
  return pad;
}

// c10::BFloat16's round to nearest even (NaN -> 0x7fc0), 16 lanes at a time.
inline __m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

// C tile c[n][m] -> y[m0 + m, n0 + n] (+ bias), one gathered column of C per row of y.
void store_tile(const Linear& L, int64_t n0, int64_t m0, const float (*c)[kTileM]) {
  if (n0 >= L.N) return;
  const __mmask16 keep = __mmask16((1u << std::min(L.N - n0, kTileN)) - 1);
  const __m512i column = _mm512_mullo_epi32(_mm512_set1_epi32(kTileM),
                                            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  const __m512 bias = L.bias ? _mm512_maskz_loadu_ps(keep, L.bias + n0) : _mm512_setzero_ps();
  for (int64_t m = m0; m < std::min(L.M, m0 + kTileM); ++m) {
    const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, &c[0][m - m0], 4), bias);
    if (L.y32)
      _mm512_mask_storeu_ps(L.y32 + m * L.N + n0, keep, v);
    else
      _mm256_mask_storeu_epi16(L.y16 + m * L.N + n0, keep, round_to_bf16(v));
  }
}

// y[m0 : m0 + 32, n0 : n0 + 32] from four C tiles; the B tile of rows m0 + 16 .. is skipped when M is smaller.
void amx_block(const Linear& L, const uint32_t* packed, int64_t chunks, int64_t n0, int64_t m0) {
  const bool two_m = m0 + kTileM < L.M;
  const uint32_t* b = packed + m0 / kTileM * chunks * kBTile;
  alignas(64) bf16 pad[2][kTileN * kStep];
  int64_t stride;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(4, b + c * kBTile, 64);
    if (two_m) _tile_loadd(5, b + (chunks + c) * kBTile, 64);
    _tile_loadd(6, weight_tile(L, n0, c * kStep, pad[0], stride), stride);
    _tile_dpbf16ps(0, 6, 4);
    if (two_m) _tile_dpbf16ps(1, 6, 5);
    _tile_loadd(7, weight_tile(L, n0 + kTileN, c * kStep, pad[1], stride), stride);
    _tile_dpbf16ps(2, 7, 4);
    if (two_m) _tile_dpbf16ps(3, 7, 5);
  }
  alignas(64) float out[kTileN][kTileM];
  _tile_stored(0, out, 64); store_tile(L, n0, m0, out);
  _tile_stored(2, out, 64); store_tile(L, n0 + kTileN, m0, out);
  if (!two_m) return;
  _tile_stored(1, out, 64); store_tile(L, n0, m0 + kTileM, out);
  _tile_stored(3, out, 64); store_tile(L, n0 + kTileN, m0 + kTileM, out);
}

void linear_amx(const Linear& L) {
  const int64_t chunks = (L.K + kStep - 1) / kStep, mblocks = (L.M + kTileM - 1) / kTileM;
  const std::vector<uint32_t> packed = pack_x(L, chunks, mblocks);
  const int64_t nblocks = (L.N + 2 * kTileN - 1) / (2 * kTileN);
  const int64_t grain = std::max<int64_t>(1, 64 / std::max<int64_t>(chunks, 1));
  specserve::parallel_for(0, nblocks, grain, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t m0 = 0; m0 < L.M; m0 += 2 * kTileM) amx_block(L, packed.data(), chunks, nb * 2 * kTileN, m0);
    _tile_release();
  });
}

#endif

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        bool out_fp32) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_linear: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "small_linear: bf16 x and weight expected");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "small_linear: contiguous x and weight expected");
  TORCH_CHECK(x.size(1) == weight.size(1), "small_linear: x and weight disagree on K");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "small_linear: bias [N] expected");
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat,
                "small_linear: bf16 or fp32 bias expected");
    b32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  const Linear L{x.data_ptr<bf16>(), weight.data_ptr<bf16>(), b32.defined() ? b32.data_ptr<float>() : nullptr,
                 out_fp32 ? y.data_ptr<float>() : nullptr, out_fp32 ? nullptr : y.data_ptr<bf16>(), M, N, K};
  if (M == 0) return y;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
  if (amx_permitted()) {
    linear_amx(L);
    return y;
  }
#endif
  linear_dot(L);
  return y;
}

// ------------------------------------------------------------------------------------------ decode_attention
//
// Per query row (b, h, t) and the keys its mask row shows, in increasing order (masked keys are never read):
//   score_s = scale * dot(q, k_s), dot_f32's recipe on bf16 keys widened exactly (so every product is exact);
//   p_s = exp(score_s - max score); sum = sum p_s by position in the visible list mod 16, then the fixed tree;
//   out = bf16(acc / sum) with acc = fma(p_s, v_s, acc) over the visible keys in order.
// The G = H / Hkv query heads of a kv head share their mask rows, so they are computed together: each key (or
// value) is read from the cache once per block of kHeads heads and widened in registers. A call with little work
// runs on the calling thread alone: waking the other threads for its phases costs more than the work. With mask
// rows enough for every thread, each thread computes whole rows (one parallel region; 1.06-1.8x at 4-16 rows on a
// Zen 4, 1.07-1.6x on a Zen 3's AVX2 build, least times of alternated builds); with fewer (one row of few kv heads),
// three phases split its keys, then its head dims. Items of a single mask row each re-read the keys from L2 and ran
// 0.91-0.93x on a 1,000-token context.

constexpr int64_t kKeyTile = 32;
constexpr int kHeads = 4;  // query heads per register block
// Query-key multiply-adds below which a call stays on one thread. Against 2^19, 2^17 ran the default model's one row
// 1.05x / 1.28x faster at 200 / 400 cached tokens and 2 rows 1.79x; 2^16 ran 100 cached tokens 0.91x.
constexpr int64_t kInlineWork = 1 << 17;

using Keys = std::vector<int32_t>;  // visible keys of one mask row (b, t), increasing

struct Attn {
  const bf16 *k, *v;
  int64_t Hkv, T, S, D, G;
  float scale;
  at::IntArrayRef ks, vs;  // element strides
};

struct Row {  // query row (b, h, t); the rows of kv head (b, hkv) are ordered t * G + (h - hkv * G)
  const float* q;  // fp32 copy
  bf16* out;
  const Keys* keys;
  std::vector<float> p;  // scores, then unnormalized probabilities
  float sum;
};

struct Span {  // keys[i0:i1]: a mask row's visible keys within one tile
  size_t i0, i1;
};

// Calls f(spans) for each key tile of [s0, s1) (kKeyTile keys); spans[t] covers mask row t's keys in it.
template <typename F>
void for_key_tiles(const Keys* keys, int64_t T, int64_t s0, int64_t s1, F&& f) {
  std::vector<Span> spans(T);
  for (int64_t t = 0; t < T; ++t)
    spans[t].i1 = std::lower_bound(keys[t].begin(), keys[t].end(), s0) - keys[t].begin();
  for (int64_t t0 = s0; t0 < s1; t0 += kKeyTile) {
    const int64_t t1 = std::min(s1, t0 + kKeyTile);
    for (int64_t t = 0; t < T; ++t)
      for (spans[t].i0 = spans[t].i1; spans[t].i1 < keys[t].size() && keys[t][spans[t].i1] < t1;) ++spans[t].i1;
    f(spans);
  }
}

using DotFn = void (*)(const float* const*, const bf16* const*, int64_t, float*);
template <int MR>
constexpr std::array<DotFn, 2> dots_for_heads() {
  return {dot_f32<MR, 1>, dot_f32<MR, 4>};
}
constexpr std::array<std::array<DotFn, 2>, kHeads> kDots = {dots_for_heads<1>(), dots_for_heads<2>(),
                                                            dots_for_heads<3>(), dots_for_heads<4>()};

// Scores of mr (<= kHeads) heads sharing one mask row, for its keys in span sp; key s at k + s * stride.
void score_block(const Attn& a, Row* rows, int mr, Span sp, const bf16* k_head, int64_t stride) {
  const Keys& keys = *rows[0].keys;
  const float* q[kHeads];
  for (int i = 0; i < mr; ++i) q[i] = rows[i].q;
  for (size_t i = sp.i0; i < sp.i1;) {
    const int nr = sp.i1 - i >= 4 ? 4 : 1;
    const bf16* k[4];
    for (int j = 0; j < nr; ++j) k[j] = k_head + keys[i + j] * stride;
    float out[kHeads * 4];
    kDots[mr - 1][nr / 4](q, k, a.D, out);
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < nr; ++j) rows[r].p[i + j] = a.scale * out[r * nr + j];
    i += nr;
  }
}

using AddFn = void (*)(float*, int64_t, const bf16* const*, int64_t, const float* const*, int);
template <int MR>
constexpr std::array<AddFn, 2> adds_for_heads() {
  return {add_rows<MR, 1>, add_rows<MR, 4>};
}
constexpr std::array<std::array<AddFn, 2>, kHeads> kAdds = {adds_for_heads<1>(), adds_for_heads<2>(),
                                                            adds_for_heads<3>(), adds_for_heads<4>()};

// acc (mr rows of width w) += p times the values (value s at v_head + s * stride), for mr heads sharing one mask
// row and its span sp.
void add_block(Row* rows, int mr, Span sp, const bf16* v_head, int64_t stride, int64_t w, float* acc) {
  const Keys& keys = *rows[0].keys;
  const int n = int(sp.i1 - sp.i0);
  if (n == 0) return;
  const bf16* v[kKeyTile];
  for (int j = 0; j < n; ++j) v[j] = v_head + keys[sp.i0 + j] * stride;
  const float* p[kHeads];
  for (int i = 0; i < mr; ++i) p[i] = &rows[i].p[sp.i0];
  for (int64_t d = 0; d < w;) {
    const int64_t vecs = w - d >= 64 ? 4 : 1;
    kAdds[mr - 1][vecs / 4](acc + d, w, v, d, p, n);
    d += 16 * vecs;
  }
}

// Phase 1: scores of keys [s0, s1) for the rows of kv head `head`; keys holds its batch's T mask rows.
void score_range(const Attn& a, int64_t head, Row* rows, const Keys* keys, int64_t s0, int64_t s1) {
  const bf16* kb = a.k + head / a.Hkv * a.ks[0] + head % a.Hkv * a.ks[1];
  for_key_tiles(keys, a.T, s0, s1, [&](const std::vector<Span>& spans) {
    for (int64_t t = 0; t < a.T; ++t)
      for (int64_t g = 0; g < a.G; g += kHeads)
        score_block(a, &rows[t * a.G + g], int(std::min<int64_t>(kHeads, a.G - g)), spans[t], kb, a.ks[2]);
  });
}

// Phase 2: p <- exp(p - max p), sum p.
void softmax_numerators(Row& row) {
  const int64_t n = int64_t(row.p.size());
  row.sum = exp_shifted(row.p.data(), n, max_of(row.p.data(), n));
}

// Phase 3: output dims [d0, d1) of the rows of kv head `head`; accumulators are private to the call.
void value_range(const Attn& a, int64_t head, Row* rows, const Keys* keys, int64_t d0, int64_t d1) {
  const bf16* vb = a.v + head / a.Hkv * a.vs[0] + head % a.Hkv * a.vs[1] + d0;
  const int64_t w = d1 - d0, R = a.T * a.G;
  std::vector<float> acc(R * w, 0.f);
  for_key_tiles(keys, a.T, 0, a.S, [&](const std::vector<Span>& spans) {
    for (int64_t t = 0; t < a.T; ++t)
      for (int64_t g = 0; g < a.G; g += kHeads)
        add_block(&rows[t * a.G + g], int(std::min<int64_t>(kHeads, a.G - g)), spans[t], vb, a.vs[2], w,
                  &acc[(t * a.G + g) * w]);
  });
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < w; ++d)
      rows[r].out[d0 + d] = rows[r].keys->empty() ? bf16(0.f) : bf16(acc[r * w + d] / rows[r].sum);
}

int64_t round_up(int64_t x, int64_t m) {
  return std::max<int64_t>(m, (x + m - 1) / m * m);
}

void visible_keys(const bool* m, int64_t stride, int64_t S, Keys& keys) {
  keys.resize(S);
  size_t n = 0;
  for (int64_t s = 0; s < S; ++s) {  // branch-free: mask rows are long and unpredictable
    keys[n] = int32_t(s);
    n += m[s * stride];
  }
  keys.resize(n);
}

// Where a call's query rows, mask rows and output rows start: q [B, H, T, D], mask [B, 1, T, S], out [B, T, H, D].
struct AttnIO {
  const bf16* q;
  at::IntArrayRef qs;
  const bool* mask;
  at::IntArrayRef ms;
  bf16* out;
  int64_t H, T, D;

  const bool* mask_row(int64_t b, int64_t t) const { return mask + b * ms[0] + t * ms[2]; }
  const bf16* query(int64_t b, int64_t h, int64_t t) const { return q + b * qs[0] + h * qs[1] + t * qs[2]; }
  bf16* output(int64_t b, int64_t h, int64_t t) const { return out + ((b * T + t) * H + h) * D; }
};

// Query row (b, h, t) widened into q32, and `row` pointed at it, at its output and at its mask row's visible keys.
void start_row(Row& row, const AttnIO& io, int64_t b, int64_t h, int64_t t, float* q32, const Keys& keys) {
  widen(io.query(b, h, t), q32, io.D);
  row.q = q32;
  row.out = io.output(b, h, t);
  row.keys = &keys;
  row.p.resize(keys.size());
  row.sum = 0.f;
}

// Mask rows [t0, t1) of kv head `head` (batch and kv head), whole: visible keys, scores, softmax and values, the
// phases' arithmetic on one thread. keys, q32 and rows are the caller's scratch, reused from item to item.
void attend_rows(const Attn& a, const AttnIO& io, int64_t head, int64_t t0, int64_t t1, std::vector<Keys>& keys,
                 std::vector<float>& q32, std::vector<Row>& rows) {
  const int64_t b = head / a.Hkv, G = a.G, D = a.D, n = (t1 - t0) * G;
  keys.resize(t1 - t0);
  q32.resize(n * D);
  rows.resize(n);
  for (int64_t t = t0; t < t1; ++t) {
    Keys& visible = keys[t - t0];
    visible_keys(io.mask_row(b, t), io.ms[3], a.S, visible);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (t - t0) * G + g;
      start_row(rows[r], io, b, head % a.Hkv * G + g, t, &q32[r * D], visible);
    }
  }
  Attn span = a;
  span.T = t1 - t0;
  score_range(span, head, rows.data(), keys.data(), 0, a.S);
  for (Row& row : rows) softmax_numerators(row);
  value_range(span, head, rows.data(), keys.data(), 0, D);
}

at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            const at::Tensor& mask_in, double scale) {
  TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4, "decode_attention: 4-d q, k, v expected");
  TORCH_CHECK(q_in.scalar_type() == at::kBFloat16 && k_in.scalar_type() == at::kBFloat16 &&
                  v_in.scalar_type() == at::kBFloat16, "decode_attention: bf16 q, k, v expected");
  TORCH_CHECK(mask_in.scalar_type() == at::kBool, "decode_attention: bool mask expected");
  const int64_t B = q_in.size(0), H = q_in.size(1), T = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_in.size(1), S = k_in.size(2);
  TORCH_CHECK(k_in.sizes() == v_in.sizes() && k_in.size(0) == B && k_in.size(3) == D,
              "decode_attention: k, v [B, Hkv, S, D] expected");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "decode_attention: num heads must be a multiple of num kv heads");
  TORCH_CHECK(D % 16 == 0, "decode_attention: head dim must be a multiple of 16");
  // Only the innermost stride must be 1: k, v may be [:, :, :S] slices of a larger cache.
  const auto unit = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  const at::Tensor q = unit(q_in), k = unit(k_in), v = unit(v_in);
  const at::Tensor mask = mask_in.expand({B, 1, T, S});
  // stored [B, T, H, D] so the o projection reads it without a copy; returned as the [B, H, T, D] view
  at::Tensor out = at::empty({B, T, H, D}, q.options());
  const int64_t G = H / Hkv, heads = B * Hkv, R = T * G;
  const Attn a{k.data_ptr<bf16>(), v.data_ptr<bf16>(), Hkv, T, S, D, G, float(scale), k.strides(), v.strides()};

  const AttnIO io{q.data_ptr<bf16>(), q.strides(), mask.data_ptr<bool>(), mask.strides(), out.data_ptr<bf16>(),
                  H, T, D};
  // each phase over n items: split over the threads, or all on this one for a small call (grain n)
  const int64_t threads = at::get_num_threads();
  const bool alone = B * H * T * S * D < kInlineWork || threads == 1;
  const auto phase = [alone](int64_t n, const auto& f) {
    specserve::parallel_for(0, n, alone ? std::max<int64_t>(n, 1) : 1, f);
  };
  // Each thread a kv head's mask rows, or a share of them: an item (kv head, rows [t0, t1)) computes its rows
  // whole in one parallel region, where the phases below wait for each other three times. A key tile is read
  // once for all the item's rows, as in the phases; the same arithmetic either way.
  const int64_t threads_per_head = (threads + heads - 1) / std::max<int64_t>(heads, 1);
  const int64_t row_chunks = std::min(T, threads_per_head);
  if (!alone && heads * row_chunks >= threads) {
    phase(heads * row_chunks, [&](int64_t begin, int64_t end) {
      std::vector<Keys> keys;
      std::vector<float> q32;
      std::vector<Row> rows;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t head = i / row_chunks, chunk = i % row_chunks;
        attend_rows(a, io, head, chunk * T / row_chunks, (chunk + 1) * T / row_chunks, keys, q32, rows);
      }
    });
    return out.transpose(1, 2);
  }
  std::vector<Keys> keys(B * T);
  std::vector<float> q32(B * H * T * D);
  std::vector<Row> rows(heads * R);
  phase(B * T, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / T, t = bt % T;
      visible_keys(io.mask_row(b, t), io.ms[3], S, keys[bt]);
      for (int64_t h = 0; h < H; ++h)
        start_row(rows[(b * Hkv + h / G) * R + t * G + h % G], io, b, h, t, &q32[((b * H + h) * T + t) * D], keys[bt]);
    }
  });
  // Every thread gets work even for one kv head: phase 1 splits its keys, phase 3 its head dims. A split only
  // decides which thread computes an element, never how.
  const int64_t split = alone ? 1 : threads_per_head;
  const int64_t key_chunk = round_up((S + split - 1) / split, kKeyTile), key_chunks = (S + key_chunk - 1) / key_chunk;
  const int64_t dim_chunk = round_up((D + split - 1) / split, 32), dim_chunks = (D + dim_chunk - 1) / dim_chunk;
  phase(heads * key_chunks, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t head = i / key_chunks, s0 = i % key_chunks * key_chunk;
      score_range(a, head, &rows[head * R], &keys[head / Hkv * T], s0, std::min(S, s0 + key_chunk));
    }
  });
  phase(heads * R, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) softmax_numerators(rows[i]);
  });
  phase(heads * dim_chunks, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t head = i / dim_chunks, d0 = i % dim_chunks * dim_chunk;
      value_range(a, head, &rows[head * R], &keys[head / Hkv * T], d0, std::min(D, d0 + dim_chunk));
    }
  });
  return out.transpose(1, 2);
}

// lane[i % 16] = fma(x_i, x_i, lane[i % 16]) for i in [from, D): the whole scalar path, and the vector path's tail.
inline void add_squares(const bf16* row, int64_t from, int64_t D, float* lane) {
  for (int64_t i = from; i < D; ++i) lane[i % 16] = std::fma(float(row[i]), float(row[i]), lane[i % 16]);
}

// RMSNorm of one row in fp32; `o` may be `row`. The sum of squares runs in 16 lanes (lane l: fma(x_i, x_i, .) for
// i = l, l + 16, ... in order), then hsum16's tree: one fixed order per row on every path, and ~16x shorter than a
// sequential sum's chain of dependent adds, which made the norms most of a layer's glue.
// gemma: bf16((x * r) * w) with w = 1 + weight precomputed in fp32; llama: bf16(w * bf16(x * r)), as HF rounds.
#if defined(__AVX2__) && defined(__FMA__)
inline float sum_squares(const bf16* row, int64_t D) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    const __m256 a = load_bf16x8(row + i), b = load_bf16x8(row + i + 8);
    lo = _mm256_fmadd_ps(a, a, lo);
    hi = _mm256_fmadd_ps(b, b, hi);
  }
  if (i == D) return hsum16(lo, hi);
  float lane[16];
  _mm256_storeu_ps(lane, lo);
  _mm256_storeu_ps(lane + 8, hi);
  add_squares(row, i, D, lane);
  return hsum16_lanes(lane);
}

// o[0..7] = the norm's rounding of x[0..7] * inv with weights w[0..7] (see norm_row).
inline void store_normed8(const bf16* x, __m256 inv, const float* w, bool gemma, bf16* o) {
  const __m256 normed = _mm256_mul_ps(load_bf16x8(x), inv);
  const __m256 scaled = gemma ? _mm256_mul_ps(normed, _mm256_loadu_ps(w))
                              : _mm256_mul_ps(_mm256_loadu_ps(w), bf16_rounded8(normed));
  _mm_storeu_si128((__m128i*)o, round_to_bf16x8(scaled));
}
#else
inline float sum_squares(const bf16* row, int64_t D) {
  float lane[16] = {};
  add_squares(row, 0, D, lane);
  return hsum16_lanes(lane);
}
#endif

void norm_row(const bf16* row, const float* w, int64_t D, float eps, bool gemma, bf16* o) {
  const float inv = 1.0f / std::sqrt(sum_squares(row, D) / static_cast<float>(D) + eps);
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (const __m256 inv8 = _mm256_set1_ps(inv); i + 8 <= D; i += 8) store_normed8(row + i, inv8, w + i, gemma, o + i);
#endif
  for (; i < D; ++i) {
    const float normed = static_cast<float>(row[i]) * inv;
    o[i] = gemma ? bf16(normed * w[i]) : bf16(w[i] * static_cast<float>(bf16(normed)));
  }
}

const float* norm_weight(const std::optional<at::Tensor>& w, int64_t D, const char* what) {
  if (!w.has_value()) return nullptr;
  TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == D, what,
              ": fp32 weight of the normed size expected");
  return w->data_ptr<float>();
}

// Row-wise kernels below run on one thread for up to kRowGrain rows (one request's decoding step) and split more
// over the threads: at 8 requests of one row each, a layer's glue ran on one thread while the other waited.
constexpr int64_t kRowGrain = 4;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "rms_norm: x must be contiguous bf16");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  const float* w = norm_weight(weight, D, "rms_norm");
  at::Tensor out = at::empty_like(x);
  const bf16* src = x.data_ptr<bf16>();
  bf16* dst = out.data_ptr<bf16>();
  specserve::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(src + r * D, w, D, float(eps), gemma, dst + r * D);
  });
  return out;
}

// ---- The glue of a decoder layer between its linears and attention, one call each (the same roundings as the
// PyTorch ops they replace: every bf16 op there rounds its fp32 result once, and so does each step here).

// x <- rope(x) = x * cos + rotate_half(x) * sin for one head row, each product and the sum rounded to bf16.
inline void rope_row(bf16* x, const bf16* cos, const bf16* sin, int64_t D) {
  const int64_t half = D / 2;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= half; i += 8) {
    const __m256 a = load_bf16x8(x + i), b = load_bf16x8(x + i + half);
    const __m256 lo = _mm256_add_ps(bf16_rounded8(_mm256_mul_ps(a, load_bf16x8(cos + i))),
                                    bf16_rounded8(_mm256_mul_ps(_mm256_xor_ps(b, sign), load_bf16x8(sin + i))));
    const __m256 hi = _mm256_add_ps(bf16_rounded8(_mm256_mul_ps(b, load_bf16x8(cos + i + half))),
                                    bf16_rounded8(_mm256_mul_ps(a, load_bf16x8(sin + i + half))));
    _mm_storeu_si128((__m128i*)(x + i), round_to_bf16x8(lo));
    _mm_storeu_si128((__m128i*)(x + i + half), round_to_bf16x8(hi));
  }
#endif
  for (; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    const float lo = float(bf16(a * float(cos[i]))) + float(bf16(-b * float(sin[i])));
    const float hi = float(bf16(b * float(cos[i + half]))) + float(bf16(a * float(sin[i + half])));
    x[i] = bf16(lo);
    x[i + half] = bf16(hi);
  }
}

// Element (b, t, j) of a [B, T, N] tensor whose last dim is contiguous (views of one fused projection are).
inline const bf16* at_bt(const at::Tensor& t, int64_t b, int64_t i) {
  return t.data_ptr<bf16>() + b * t.stride(0) + i * t.stride(1);
}

// The attention inputs of new tokens: per head, the optional q/k norm (Gemma 3, Qwen3), then rope on q and k;
// k and v are stored in the cache at their slots, q is returned as [B, H, T, D].
//   q, k, v     [B, T, H * D], [B, T, Hkv * D], [B, T, Hkv * D] bf16
//   cos, sin    [B, T, D] bf16 rope tables at the tokens' positions
//   k_cache, v_cache [rows >= B, Hkv, capacity, D] bf16 (this layer's); slots [B, T] int64
at::Tensor rope_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps,
                      bool gemma, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& slots_in) {
  const at::Tensor slots = slots_in.contiguous();
  const int64_t B = q.size(0), T = q.size(1), D = k_cache.size(3), Hkv = k_cache.size(1);
  const int64_t H = q.size(2) / D, C = k_cache.size(2);
  for (const at::Tensor* t : {&q, &k, &v, &cos, &sin})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == B && t->size(1) == T && t->stride(2) == 1 &&
                    t->scalar_type() == at::kBFloat16, "rope_store: bf16 [B, T, *] inputs expected");
  TORCH_CHECK(k.size(2) == Hkv * D && v.size(2) == Hkv * D && q.size(2) == H * D && cos.size(2) == D &&
                  sin.size(2) == D && D % 2 == 0, "rope_store: head sizes disagree with the cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(0) >= B && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, "rope_store: bf16 caches [rows, Hkv, C, D] expected");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(0) == B &&
                  slots.size(1) == T, "rope_store: int64 slots [B, T] expected");
  const float* qw = norm_weight(q_norm, D, "rope_store q_norm");
  const float* kw = norm_weight(k_norm, D, "rope_store k_norm");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < C, "rope_store: slot out of range");
  at::Tensor out = at::empty({B, H, T, D}, q.options());
  bf16* qo = out.data_ptr<bf16>();
  bf16* kc = k_cache.data_ptr<bf16>();
  bf16* vc = v_cache.data_ptr<bf16>();
  const auto ks = k_cache.strides(), vs = v_cache.strides();
  const auto norm_rope = [&](const bf16* src, const float* w, const bf16* c, const bf16* sn, bf16* dst) {
    if (w) norm_row(src, w, D, float(eps), gemma, dst);
    else std::copy(src, src + D, dst);
    rope_row(dst, c, sn, D);
  };
  specserve::parallel_for(0, B * T, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / T, t = bt % T, s = slot[bt];
      const bf16 *c = at_bt(cos, b, t), *sn = at_bt(sin, b, t);
      for (int64_t h = 0; h < H; ++h) norm_rope(at_bt(q, b, t) + h * D, qw, c, sn, qo + ((b * H + h) * T + t) * D);
      for (int64_t h = 0; h < Hkv; ++h) {
        norm_rope(at_bt(k, b, t) + h * D, kw, c, sn, kc + b * ks[0] + h * ks[1] + s * ks[2]);
        const bf16* vsrc = at_bt(v, b, t) + h * D;
        std::copy(vsrc, vsrc + D, vc + b * vs[0] + h * vs[1] + s * vs[2]);
      }
    }
  });
  return out;
}

// x / (1 + exp(-z)) for 16 lanes: silu with z = x, tanh-approximated gelu with z = 2 sqrt(2/pi) (x + 0.044715 x^3)
// (0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), with no cancellation near 0).
#ifdef __AVX512F__
inline __m512 activation16(__m512 x, bool gelu) {
  __m512 z = x;
  if (gelu) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    z = _mm512_mul_ps(_mm512_set1_ps(1.5957691216057308f),
                      _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(0.044715f), cube)));
  }
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), z));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

void gated_row(const bf16* gate, const bf16* up, int64_t n, bool gelu, bf16* out) {
  float a[16];
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 act = activation16(load_bf16x16(gate + i), gelu);
    store_gated8(_mm512_castps512_ps256(act), up + i, out + i);
    store_gated8(_mm512_extractf32x8_ps(act, 1), up + i + 8, out + i + 8);
  }
  for (; i < n; ++i) {  // the tail through the same vector code, one lane used
    _mm512_storeu_ps(a, activation16(_mm512_set1_ps(float(gate[i])), gelu));
    out[i] = bf16(float(bf16(a[0])) * float(up[i]));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 activation8(__m256 x, bool gelu) {  // activation16's arithmetic, 8 lanes
  __m256 z = x;
  if (gelu) {
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    z = _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f),
                      _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube)));
  }
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), z));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}

void gated_row(const bf16* gate, const bf16* up, int64_t n, bool gelu, bf16* out) {
  float a[8];
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store_gated8(activation8(load_bf16x8(gate + i), gelu), up + i, out + i);
  for (; i < n; ++i) {  // the tail through the same vector code, one lane used
    _mm256_storeu_ps(a, activation8(_mm256_set1_ps(float(gate[i])), gelu));
    out[i] = bf16(float(bf16(a[0])) * float(up[i]));
  }
}
#else
void gated_row(const bf16* gate, const bf16* up, int64_t n, bool gelu, bf16* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = gate[i];
    const float z = gelu ? 1.5957691216057308f * (x + 0.044715f * (x * x * x)) : x;
    out[i] = bf16(float(bf16(x / (1.f + std::exp(-z)))) * float(up[i]));
  }
}
#endif

// act(gate) * up for gate, up [M, I] bf16 (or both halves of one fused [M, 2 I] when up is None); act(gate) is
// rounded to bf16 before the product, as the two PyTorch ops do.
at::Tensor gated_activation(const at::Tensor& gate_in, const std::optional<at::Tensor>& up_in, bool gelu) {
  TORCH_CHECK(gate_in.scalar_type() == at::kBFloat16 && gate_in.is_contiguous(),
              "gated_activation: contiguous bf16 gate expected");
  const int64_t width = gate_in.size(-1), M = gate_in.numel() / width;
  const int64_t I = up_in.has_value() ? width : width / 2;
  const bf16* gate = gate_in.data_ptr<bf16>();
  const bf16* up = gate + I;
  const int64_t stride = width;  // a row of the fused tensor holds gate then up
  if (up_in.has_value()) {
    TORCH_CHECK(up_in->sizes() == gate_in.sizes() && up_in->is_contiguous() &&
                    up_in->scalar_type() == at::kBFloat16, "gated_activation: up must match gate");
    up = up_in->data_ptr<bf16>();
  } else {
    TORCH_CHECK(width % 2 == 0, "gated_activation: a fused gate/up needs an even width");
  }
  std::vector<int64_t> shape(gate_in.sizes().begin(), gate_in.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, gate_in.options());
  bf16* dst = out.data_ptr<bf16>();
  specserve::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) gated_row(gate + m * stride, up + m * stride, I, gelu, dst + m * I);
  });
  return out;
}

// The residual add of a sublayer's output y to x (Gemma first norms y with `post`), and the next norm of the
// sum: returns (x + y, next_norm(x + y)), x, y [.., D] bf16.
std::vector<at::Tensor> residual_norm(const at::Tensor& x, const at::Tensor& y,
                                      const std::optional<at::Tensor>& post, const at::Tensor& next, double eps,
                                      bool gemma) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && y.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  y.is_contiguous() && x.sizes() == y.sizes(), "residual_norm: contiguous bf16 x, y of one shape");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  const float* pw = norm_weight(post, D, "residual_norm post");
  const float* nw = norm_weight(next, D, "residual_norm next");
  at::Tensor sum = at::empty_like(x), normed = at::empty_like(x);
  const bf16 *xs = x.data_ptr<bf16>(), *ys = y.data_ptr<bf16>();
  bf16 *out = sum.data_ptr<bf16>(), *no = normed.data_ptr<bf16>();
  specserve::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<bf16> yn(D);
    for (int64_t r = begin; r < end; ++r) {
      const bf16* yr = ys + r * D;
      if (pw) {
        norm_row(yr, pw, D, float(eps), gemma, yn.data());
        yr = yn.data();
      }
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= D; i += 8)
        _mm_storeu_si128((__m128i*)(out + r * D + i),
                         round_to_bf16x8(_mm256_add_ps(load_bf16x8(xs + r * D + i), load_bf16x8(yr + i))));
#endif
      for (; i < D; ++i) out[r * D + i] = bf16(float(xs[r * D + i]) + float(yr[i]));
      norm_row(out + r * D, nw, D, float(eps), gemma, no + r * D);
    }
  });
  return {sum, normed};
}

// ---- The decoder layers in one call: the nine kernel calls of each layer (kernel_forward.py's KernelLayer) for
// every layer of a forward, with no Python between them. Each step is the same function on the same arguments
// as the Python loop's, so the results are bit-identical to it; what goes is ~15 us of Python glue per layer.

// quant_linear.cpp's quant_linear, handed over as a function pointer in a capsule of this name (the name states
// the signature: the two sides are built separately, quant_linear.cpp without -march=native so its rounding is
// that of every ISA path).
using QuantLinearFn = at::Tensor (*)(const at::Tensor&, const std::vector<at::Tensor>&,
                                     const std::vector<std::optional<at::Tensor>>&, const std::vector<at::Tensor>&,
                                     const std::vector<std::optional<at::Tensor>>&, const std::optional<at::Tensor>&,
                                     const std::vector<int64_t>&, const std::vector<int64_t>&,
                                     const std::vector<int64_t>&, const std::vector<int64_t>&,
                                     const std::vector<double>&, bool, const std::string&);
constexpr const char* kQuantLinearCapsule = "specserve.quant_linear.v2";

// quant_linear's per-weight argument lists (quant.py's kernel_args).
struct PackedArgs {
  std::vector<at::Tensor> qs;
  std::vector<std::optional<at::Tensor>> planes;
  std::vector<at::Tensor> scales;
  std::vector<std::optional<at::Tensor>> offsets;
  std::vector<int64_t> N, bits, group, zero;
  std::vector<double> unit;
};

// One row-invariant linear: small_linear over a bf16 weight, or quant_linear over packed weights.
struct KernelLinear {
  std::optional<at::Tensor> weight;  // bf16 [N, K]; none: packed
  PackedArgs packed;
  std::optional<at::Tensor> bias;

  bool is_packed() const { return !weight.has_value(); }

  // x [..., K] -> [..., N] in bf16, as cpu_kernels.small_linear or quant.packed_matmul computes it.
  at::Tensor operator()(const at::Tensor& x, QuantLinearFn quant, const std::string& isa) const {
    const at::Tensor rows = x.reshape({-1, x.size(-1)});
    const at::Tensor y = is_packed() ? quant(rows, packed.qs, packed.planes, packed.scales, packed.offsets, bias,
                                             packed.N, packed.bits, packed.group, packed.zero, packed.unit, false,
                                             isa)
                                     : small_linear(rows.contiguous(), *weight, bias, false);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = y.size(-1);
    return y.view(shape);
  }
};

KernelLinear bf16_linear(const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "bf16_linear: bf16 weight [N, K]");
  return {weight.contiguous(), {}, bias};
}

KernelLinear packed_linear(PackedArgs packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(!packed.qs.empty(), "packed_linear: at least one packed weight");
  return {std::nullopt, std::move(packed), bias};
}

// One decoder layer's linears, norm weights (fp32 kernel weights, RMSNorm.kernel_weight) and settings.
struct StackLayer {
  std::vector<KernelLinear> qkv;  // one fused linear, or q, k, v
  std::vector<int64_t> qkv_sizes;  // the widths of q, k, v
  KernelLinear o;
  std::vector<KernelLinear> gate_up;  // one fused linear (its output [.., 2 I] read as it is), or gate, up
  KernelLinear down;
  std::optional<at::Tensor> q_norm, k_norm, pre_feedforward, post_feedforward;  // Gemma 3 / Qwen3 only
  at::Tensor post_attention, next_norm;  // next_norm: the next layer's input norm, or the final norm
  double eps, scale;
  bool gemma, gelu;
  int64_t cache_index, kind;  // kind: the layer type, an index into forward's per-type rope tables and masks

  bool uses_packed() const {
    bool any = o.is_packed() || down.is_packed();
    for (const auto* parts : {&qkv, &gate_up})
      for (const KernelLinear& part : *parts) any = any || part.is_packed();
    return any;
  }
};

// The per-forward inputs shared by the layers.
struct StackInputs {
  const std::vector<at::Tensor>& cos;  // per layer kind: rope tables [B, T, D] and masks [B, 1, T, S]
  const std::vector<at::Tensor>& sin;
  const std::vector<at::Tensor>& masks;
  const std::vector<at::Tensor>& keys;  // the cache, per layer
  const std::vector<at::Tensor>& values;
  const at::Tensor& slots;
  const std::string& isa;  // quant_linear's path (quant.isa())
};

class LayerStack {
 public:
  LayerStack(std::vector<StackLayer> layers, const std::optional<py::capsule>& quant_linear)
      : layers_(std::move(layers)) {
    if (quant_linear.has_value()) {
      TORCH_CHECK(PyCapsule_IsValid(quant_linear->ptr(), kQuantLinearCapsule),
                  "LayerStack: quant_linear must be the capsule named ", kQuantLinearCapsule);
      quant_ = reinterpret_cast<QuantLinearFn>(PyCapsule_GetPointer(quant_linear->ptr(), kQuantLinearCapsule));
    }
    for (const StackLayer& layer : layers_) {
      TORCH_CHECK(quant_ || !layer.uses_packed(), "LayerStack: packed linears need the quant_linear capsule");
      TORCH_CHECK(layer.qkv.size() == 1 || layer.qkv.size() == 3, "LayerStack: qkv is one fused linear or three");
      TORCH_CHECK(layer.gate_up.size() == 1 || layer.gate_up.size() == 2, "LayerStack: gate_up is one or two");
      TORCH_CHECK(layer.qkv_sizes.size() == 3, "LayerStack: qkv_sizes holds the q, k, v widths");
      TORCH_CHECK(!layer.gemma || (layer.pre_feedforward.has_value() && layer.post_feedforward.has_value()),
                  "LayerStack: a Gemma layer has pre- and post-feedforward norms");
    }
  }

  // Every layer over the residual stream x [B, T, H] and normed = its first input norm: returns (the final norm
  // of the last layer's output, the outputs of the layers `keep` asks for, in increasing layer order).
  std::pair<at::Tensor, std::vector<at::Tensor>> forward(at::Tensor x, at::Tensor normed,
                                                          const StackInputs& in, std::vector<int64_t> keep) const {
    check(in);
    std::sort(keep.begin(), keep.end());
    std::vector<at::Tensor> kept;
    for (size_t i = 0; i < layers_.size(); ++i) {
      std::tie(x, normed) = layer_forward(layers_[i], x, normed, in);
      if (std::binary_search(keep.begin(), keep.end(), int64_t(i))) kept.push_back(x);
    }
    return {normed, kept};
  }

 private:
  void check(const StackInputs& in) const {
    TORCH_CHECK(in.cos.size() == in.sin.size() && in.cos.size() == in.masks.size(),
                "LayerStack: one cos, sin and mask per layer kind");
    for (const StackLayer& layer : layers_) {
      TORCH_CHECK(layer.kind >= 0 && layer.kind < int64_t(in.masks.size()), "LayerStack: no mask for a kind");
      TORCH_CHECK(layer.cache_index >= 0 && layer.cache_index < int64_t(in.keys.size()) &&
                      in.keys.size() == in.values.size(), "LayerStack: the cache has too few layers");
    }
  }

  std::vector<at::Tensor> project(const std::vector<KernelLinear>& parts, const at::Tensor& x,
                                  const std::string& isa) const {
    std::vector<at::Tensor> out;
    for (const KernelLinear& part : parts) out.push_back(part(x, quant_, isa));
    return out;
  }

  // KernelLayer.__call__, step for step.
  std::pair<at::Tensor, at::Tensor> layer_forward(const StackLayer& L, const at::Tensor& x, const at::Tensor& normed,
                                                  const StackInputs& in) const {
    const int64_t B = x.size(0), T = x.size(1);
    std::vector<at::Tensor> qkv = project(L.qkv, normed, in.isa);
    if (qkv.size() == 1) qkv = at::split_with_sizes(qkv[0], L.qkv_sizes, -1);
    at::Tensor keys = in.keys[L.cache_index], values = in.values[L.cache_index];
    const at::Tensor q = rope_store(qkv[0], qkv[1], qkv[2], L.q_norm, L.k_norm, L.eps, L.gemma, in.cos[L.kind],
                                    in.sin[L.kind], keys, values, in.slots);
    const at::Tensor& mask = in.masks[L.kind];
    const int64_t span = mask.size(-1);
    const at::Tensor heads = decode_attention(q, keys.slice(2, 0, span), values.slice(2, 0, span), mask, L.scale);
    const at::Tensor attn = L.o(heads.transpose(1, 2).reshape({B, T, -1}), quant_, in.isa);
    // Gemma's sandwich norms: the sublayer's output is normed before the residual add
    std::vector<at::Tensor> mid = L.gemma ? residual_norm(x, attn, L.post_attention, *L.pre_feedforward, L.eps, true)
                                          : residual_norm(x, attn, std::nullopt, L.post_attention, L.eps, false);
    const std::vector<at::Tensor> gate_up = project(L.gate_up, mid[1], in.isa);
    const at::Tensor act = gated_activation(gate_up[0], gate_up.size() > 1 ? std::optional<at::Tensor>(gate_up[1])
                                                                            : std::nullopt, L.gelu);
    const at::Tensor mlp = L.down(act, quant_, in.isa);
    const std::vector<at::Tensor> out = residual_norm(mid[0], mlp, L.post_feedforward, L.next_norm, L.eps, L.gemma);
    return {out[0], out[1]};
  }

  std::vector<StackLayer> layers_;
  QuantLinearFn quant_ = nullptr;
};

// ---- Greedy choice: torch.argmax's answer (the first index of the maximum; the first NaN if any) in one pass
// over the row, far cheaper than PyTorch's reduction over a 262k vocabulary.

int64_t first_nan(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(row[i])) return i;
  return -1;
}

#ifdef __AVX512F__
// Four independent chains of 16 lanes, each lane keeping its first maximum (strict compare): one chain waits on
// its compare's latency every vector (38 us a 262k row). The answer is the smallest index among the lanes holding
// the row's maximum, which is the first index of it.
int64_t argmax_row(const float* row, int64_t n) {
  constexpr int kChains = 4;
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best[kChains];
  __m512i best_at[kChains], at[kChains];
  for (int c = 0; c < kChains; ++c) {
    best[c] = _mm512_set1_ps(-INFINITY);
    best_at[c] = at[c] = _mm512_add_epi32(lanes, _mm512_set1_epi32(16 * c));
  }
  __mmask16 nan = 0;
  const auto take = [&](int c, __m512 v) {
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 better = _mm512_cmp_ps_mask(v, best[c], _CMP_GT_OQ);
    best[c] = _mm512_mask_mov_ps(best[c], better, v);
    best_at[c] = _mm512_mask_mov_epi32(best_at[c], better, at[c]);
  };
  int64_t i = 0;
  for (; i + 16 * kChains <= n; i += 16 * kChains) {
    for (int c = 0; c < kChains; ++c) {
      take(c, _mm512_loadu_ps(row + i + 16 * c));
      at[c] = _mm512_add_epi32(at[c], _mm512_set1_epi32(16 * kChains));
    }
  }
  at[0] = _mm512_add_epi32(lanes, _mm512_set1_epi32(int32_t(i)));
  for (; i < n; i += 16) {
    take(0, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), first_n16(n - i), row + i));
    at[0] = _mm512_add_epi32(at[0], _mm512_set1_epi32(16));
  }
  if (nan) return first_nan(row, n);
  __m512 top_lanes = best[0];
  for (int c = 1; c < kChains; ++c) top_lanes = _mm512_max_ps(top_lanes, best[c]);
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(top_lanes));
  int64_t first = n;
  for (int c = 0; c < kChains; ++c) {
    const __mmask16 holders = _mm512_cmp_ps_mask(best[c], top, _CMP_EQ_OQ);
    if (holders) first = std::min<int64_t>(first, _mm512_mask_reduce_min_epi32(holders, best_at[c]));
  }
  return first;
}
#elif defined(__AVX2__) && defined(__FMA__)
// The AVX-512 version's scheme on 8 lanes: four chains, each lane keeping its first maximum.
int64_t argmax_row(const float* row, int64_t n) {
  constexpr int kChains = 4;
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 best[kChains];
  __m256i best_at[kChains], at[kChains];
  for (int c = 0; c < kChains; ++c) {
    best[c] = _mm256_set1_ps(-INFINITY);
    best_at[c] = at[c] = _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * c));
  }
  __m256 nan = _mm256_setzero_ps();
  const auto take = [&](int c, __m256 v) {
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 better = _mm256_cmp_ps(v, best[c], _CMP_GT_OQ);
    best[c] = _mm256_blendv_ps(best[c], v, better);
    best_at[c] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_at[c]), _mm256_castsi256_ps(at[c]),
                                                      better));
  };
  int64_t i = 0;
  for (; i + 8 * kChains <= n; i += 8 * kChains) {
    for (int c = 0; c < kChains; ++c) {
      take(c, _mm256_loadu_ps(row + i + 8 * c));
      at[c] = _mm256_add_epi32(at[c], _mm256_set1_epi32(8 * kChains));
    }
  }
  at[0] = _mm256_add_epi32(lanes, _mm256_set1_epi32(int32_t(i)));
  for (; i < n; i += 8) {
    const __m256i m = first_n8(n - i);
    take(0, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(row + i, m), _mm256_castsi256_ps(m)));
    at[0] = _mm256_add_epi32(at[0], _mm256_set1_epi32(8));
  }
  if (_mm256_movemask_ps(nan)) return first_nan(row, n);
  float values[kChains][8];
  int32_t where[kChains][8];
  for (int c = 0; c < kChains; ++c) {
    _mm256_storeu_ps(values[c], best[c]);
    _mm256_storeu_si256((__m256i*)where[c], best_at[c]);
  }
  float top = -INFINITY;
  for (int c = 0; c < kChains; ++c)
    for (int l = 0; l < 8; ++l) top = std::max(top, values[c][l]);
  int64_t first = n;
  for (int c = 0; c < kChains; ++c)
    for (int l = 0; l < 8; ++l)
      if (values[c][l] == top) first = std::min<int64_t>(first, where[c][l]);
  return first;
}
#else
int64_t argmax_row(const float* row, int64_t n) {
  const int64_t nan = first_nan(row, n);
  if (nan >= 0) return nan;
  int64_t at = 0;
  for (int64_t i = 1; i < n; ++i)
    if (row[i] > row[at]) at = i;
  return at;
}
#endif

at::Tensor argmax(const at::Tensor& logits_in) {
  TORCH_CHECK(logits_in.scalar_type() == at::kFloat && logits_in.dim() >= 1, "argmax: fp32 logits expected");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t V = logits.size(-1), rows = V ? logits.numel() / V : 0;
  TORCH_CHECK(V > 0 && V < (int64_t(1) << 31), "argmax: the last dimension must hold 1 .. 2^31 - 1 values");
  std::vector<int64_t> shape(logits.sizes().begin(), logits.sizes().end() - 1);
  at::Tensor out = at::empty(shape, logits.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  const float* src = logits.data_ptr<float>();
  specserve::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(src + r * V, V);
  });
  return out;
}

// ---- Attention masks: KVCache.attention_masks' boolean masks [B, 1, T, S] (True = attend) in one pass instead of
// ~12 PyTorch ops. A row's query t sees its committed slots (s < length) and the new tokens its tree allows
// (tree[b, t, u]: the token at slots[b, u]); with a sliding window, only keys less than `window` positions back
// (a key's position: its slot's, or the new token's written there).

std::vector<at::Tensor> attention_masks(const at::Tensor& lengths_in, const at::Tensor& positions_in,
                                        const at::Tensor& slots_in, const std::optional<at::Tensor>& tree_in,
                                        int64_t window, int64_t span) {
  const at::Tensor lengths = lengths_in.to(at::kLong).contiguous();
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.dim() == 2 && positions.sizes() == slots.sizes() && lengths.numel() == slots.size(0),
              "attention_masks: slots and positions [B, T], lengths [B]");
  const int64_t B = slots.size(0), T = slots.size(1), S = span;
  at::Tensor tree;
  if (tree_in.has_value()) {
    tree = tree_in->to(at::kBool).expand({B, T, T}).contiguous();
  }
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const bool* allowed = tree.defined() ? tree.data_ptr<bool>() : nullptr;
  for (int64_t i = 0; i < B * T; ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < S, "attention_masks: a slot past span");
  at::Tensor full = at::zeros({B, 1, T, S}, at::TensorOptions().dtype(at::kBool));
  at::Tensor near = window > 0 ? at::empty({B, 1, T, S}, at::TensorOptions().dtype(at::kBool)) : full;
  bool* f = full.data_ptr<bool>();
  bool* w = near.data_ptr<bool>();
  std::vector<int64_t> key_pos(S);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) key_pos[s] = s;
    for (int64_t u = 0; u < T; ++u) key_pos[slot[b * T + u]] = pos[b * T + u];
    const int64_t committed = std::clamp<int64_t>(len[b], 0, S);
    for (int64_t t = 0; t < T; ++t) {
      bool* row = f + (b * T + t) * S;
      std::fill(row, row + committed, true);
      for (int64_t u = 0; u < T; ++u)
        if (allowed ? allowed[(b * T + t) * T + u] : u <= t) row[slot[b * T + u]] = true;
      if (window > 0) {
        bool* sliding = w + (b * T + t) * S;
        for (int64_t s = 0; s < S; ++s) sliding[s] = row[s] && pos[b * T + t] - key_pos[s] < window;
      }
    }
  }
  return {full, near};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "row-wise RMSNorm of bf16 rows (fp32 math, fixed order)", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::arg("gemma"), py::call_guard<py::gil_scoped_release>());
  m.def("small_linear", &small_linear, "row-invariant bf16 x @ weight.T (+ bias)", py::arg("x"), py::arg("weight"),
        py::arg("bias"), py::arg("out_fp32"), py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention", &decode_attention, "row-invariant masked attention (bf16)", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("mask"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("rope_store", &rope_store, "q/k norms, rope, k/v into the cache; q as [B, H, T, D]", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"), py::arg("gemma"),
        py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gated_activation", &gated_activation, "act(gate) * up (bf16)", py::arg("gate"), py::arg("up"),
        py::arg("gelu"), py::call_guard<py::gil_scoped_release>());
  m.def("residual_norm", &residual_norm, "(x + [post_norm] y, next_norm(x + [post_norm] y))", py::arg("x"),
        py::arg("y"), py::arg("post"), py::arg("next"), py::arg("eps"), py::arg("gemma"),
        py::call_guard<py::gil_scoped_release>());
  m.def("attention_masks", &attention_masks, "KVCache.attention_masks' (full, sliding) masks in one pass",
        py::arg("lengths"), py::arg("positions"), py::arg("slots"), py::arg("tree_mask"), py::arg("window"),
        py::arg("span"));
  m.def("argmax", &argmax, "torch.argmax(logits, -1) of fp32 logits, one pass", py::arg("logits"),
        py::call_guard<py::gil_scoped_release>());
  py::class_<KernelLinear>(m, "KernelLinear", "a row-invariant linear of a LayerStack");
  m.def("bf16_linear", &bf16_linear, "a LayerStack linear over a bf16 weight (small_linear)", py::arg("weight"),
        py::arg("bias"));
  m.def("packed_linear",
        [](std::vector<at::Tensor> qs, std::vector<std::optional<at::Tensor>> planes, std::vector<at::Tensor> scales,
           std::vector<std::optional<at::Tensor>> offsets, std::vector<int64_t> N, std::vector<int64_t> bits,
           std::vector<int64_t> group, std::vector<int64_t> zero, std::vector<double> unit,
           const std::optional<at::Tensor>& bias) {
          return packed_linear({std::move(qs), std::move(planes), std::move(scales), std::move(offsets), std::move(N),
                                std::move(bits), std::move(group), std::move(zero), std::move(unit)}, bias);
        },
        "a LayerStack linear over packed weights (quant_linear; the arguments of quant.kernel_args)", py::arg("qs"),
        py::arg("planes"), py::arg("scales"), py::arg("offsets"), py::arg("N"), py::arg("bits"), py::arg("group"),
        py::arg("zero"), py::arg("unit"), py::arg("bias"));
  py::class_<StackLayer>(m, "StackLayer", "one decoder layer of a LayerStack")
      .def(py::init([](std::vector<KernelLinear> qkv, std::vector<int64_t> qkv_sizes, KernelLinear o,
                       std::vector<KernelLinear> gate_up, KernelLinear down, std::optional<at::Tensor> q_norm,
                       std::optional<at::Tensor> k_norm, at::Tensor post_attention,
                       std::optional<at::Tensor> pre_feedforward, std::optional<at::Tensor> post_feedforward,
                       at::Tensor next_norm, double eps, double scale, bool gemma, bool gelu, int64_t cache_index,
                       int64_t kind) {
             return StackLayer{std::move(qkv), std::move(qkv_sizes), std::move(o), std::move(gate_up),
                               std::move(down), std::move(q_norm), std::move(k_norm), std::move(pre_feedforward),
                               std::move(post_feedforward), std::move(post_attention), std::move(next_norm), eps,
                               scale, gemma, gelu, cache_index, kind};
           }),
           py::arg("qkv"), py::arg("qkv_sizes"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("post_attention"), py::arg("pre_feedforward"),
           py::arg("post_feedforward"), py::arg("next_norm"), py::arg("eps"), py::arg("scale"), py::arg("gemma"),
           py::arg("gelu"), py::arg("cache_index"), py::arg("kind"))
      .def_property_readonly("uses_packed", &StackLayer::uses_packed);
  py::class_<LayerStack>(m, "LayerStack", "every decoder layer of a forward in one call")
      .def(py::init<std::vector<StackLayer>, std::optional<py::capsule>>(), py::arg("layers"),
           py::arg("quant_linear"))
      .def("forward",
           [](const LayerStack& stack, at::Tensor x, at::Tensor normed, const std::vector<at::Tensor>& cos,
              const std::vector<at::Tensor>& sin, const std::vector<at::Tensor>& masks,
              const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values, const at::Tensor& slots,
              const std::string& isa, std::vector<int64_t> keep) {
             return stack.forward(std::move(x), std::move(normed), {cos, sin, masks, keys, values, slots, isa},
                                  std::move(keep));
           },
           "(final norm of the last layer's output, the outputs of the layers in keep)", py::arg("x"),
           py::arg("normed"), py::arg("cos"), py::arg("sin"), py::arg("masks"), py::arg("keys"), py::arg("values"),
           py::arg("slots"), py::arg("isa"), py::arg("keep"), py::call_guard<py::gil_scoped_release>());
  m.def("variant", [] {
    std::string linear = kDotPath;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
    if (amx_permitted()) linear = "amx_bf16";
#endif
#ifdef __AVX512F__
    return "small_linear: " + linear + ", decode_attention: avx512f";
#elif defined(__AVX2__) && defined(__FMA__)
    return "small_linear: " + linear + ", decode_attention: avx2_fma";
#else
    return "small_linear: " + linear + ", decode_attention: scalar";
#endif
  });
}
