// Row-invariant fp32 x @ weight.T for CPUs with AVX2 + FMA (no AVX-512 needed).
//
// Used for the linears of fp32 models in forwards of few tokens: PyTorch's fp32 GEMM reaches ~13 GB/s on a 262k-row
// lm_head here and gets slower per row as rows are added (a verify step of 8 tokens cost ~3x one token). This
// kernel reads each weight row once for all x rows (up to 6 at a time in registers), so a step's cost barely grows
// with its token count, and every output element is one fixed sequence of fp32 operations: 8-lane FMAs over k in
// steps of 8, a fixed lane-sum tree, a scalar tail in k order, then the bias. The result of row m never depends on
// the other rows.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include "fp_mode.h"
#include <immintrin.h>

#include <algorithm>

namespace {

inline float lane_sum(__m256 v) {  // ((0+4)+(2+6)) + ((1+5)+(3+7)), the same for every element
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// out[m][n] for MR x rows and NR weight rows; every (m, n) has its own accumulator and the same operations.
template <int MR, int NR>
void tile(const float* const* x, const float* const* w, int64_t K, float* const* out) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  const int64_t body = K - K % 8;
  for (int64_t k = 0; k < body; k += 8) {
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm256_loadu_ps(w[n] + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x[m] + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = lane_sum(acc[m][n]);
      for (int64_t k = body; k < K; ++k) s = std::fma(x[m][k], w[n][k], s);
      out[m][n] = s;
    }
}

template <int MR, int NR>
void rows_tile(const float* xd, int64_t m, const float* const* w, int64_t n0, int64_t K, float* yd, int64_t N) {
  const float* x[MR];
  float r[MR][NR];
  float* o[MR];
  for (int i = 0; i < MR; ++i) x[i] = xd + (m + i) * K, o[i] = r[i];
  tile<MR, NR>(x, w, K, o);
  for (int i = 0; i < MR; ++i)
    for (int n = 0; n < NR; ++n) yd[(m + i) * N + n0 + n] = r[i][n];
}

// All x rows against NR weight rows: up to 6 x rows per pass (12 accumulators + 3 loads fit AVX2's 16 registers),
// so a verify step of up to 6 tokens reads each weight row from memory once and runs it once.
template <int NR>
void rows_block(const float* xd, int64_t M, const float* wd, int64_t n0, int64_t K, float* yd, int64_t N) {
  const float* w[NR];
  for (int n = 0; n < NR; ++n) w[n] = wd + (n0 + n) * K;
  for (int64_t m = 0; m < M;) {
    const int64_t rows = std::min<int64_t>(6, M - m);
    switch (rows) {
      case 6: rows_tile<6, NR>(xd, m, w, n0, K, yd, N); break;
      case 5: rows_tile<5, NR>(xd, m, w, n0, K, yd, N); break;
      case 4: rows_tile<4, NR>(xd, m, w, n0, K, yd, N); break;
      case 3: rows_tile<3, NR>(xd, m, w, n0, K, yd, N); break;
      case 2: rows_tile<2, NR>(xd, m, w, n0, K, yd, N); break;
      default: rows_tile<1, NR>(xd, m, w, n0, K, yd, N); break;
    }
    m += rows;
  }
}

torch::Tensor linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32, "fp32 tensors expected");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, K] and weight [N, K]");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xd = x.data_ptr<float>();
  const float* wd = weight.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  constexpr int64_t kNR = 2;
  const int64_t pairs = N / kNR;
  specserve::parallel_for(0, pairs, 64, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) rows_block<kNR>(xd, M, wd, p * kNR, K, yd, N);
  });
  if (N % kNR) rows_block<1>(xd, M, wd, N - 1, K, yd, N);
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));  // one rounding per element, same for every row
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "row-invariant fp32 x @ weight.T (+ bias), AVX2 + FMA", py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none());
}
