// Row-invariant linear over low-bit packed weights (GGUF's Q4_0..Q8_0 and K-quants, int8 / int4).
//
// The math (the scheme llama.cpp runs on CPUs, with its exactness made explicit):
//   weight row n, block b of G inputs:  w[k] = s[n,b] * (q[n,k] - z) - o[n,b]     q unsigned, 4..8 bits
//   activation row m, block c of 32:    x[k] ~ dx[m,c] * p[m,k]                   p = round(x / dx), |p| <= 127
//   y[m,n] = sum_b dx[m,c(b)] * ( s[n,b] * float(isum - z * psum) - o[n,b] * float(psum) )
//   with isum = sum_k q * p and psum = sum_k p over the block: integers, exact in int32 whatever the order.
//   The K-quants (s = d * sc, o = dmin * m with d, dmin per super-block S of 256) take activations with one dx per
//   super-block (llama.cpp's Q8_K) and keep the sums over S integer, the fp32 tail once per S:
//   y[m,n] = sum_S dx[m,S] * ( d[n,S] * float(sum_b sc * (isum - z * psum)) - dmin[n,S] * float(sum_b m * psum) )
// So every path (AVX-512 VNNI, AVX2, scalar) computes the same integers, then the same fp32 operations in the
// same order per (m, n): the result is bit-identical across paths, row counts, row groupings and threads.
// Activation quantization is per row (it depends only on x[m]), which keeps rows independent.
//
// Packed layout (made once by specserve/models/quant.py), N padded to tiles of 16 outputs, K in blocks of 32:
//   qs      uint8  [tiles, K/32, 512]  8 bits: groups g = 0..7 of 4 inputs, each [16 outputs][4 inputs]
//                  [tiles, K/32, 256]  4..6 bits: chunk c = 0..3 of 64 bytes holds group c (low nibble) and
//                                      group c + 4 (high nibble), each byte at [output * 4 + input]
//   planes uint8   [tiles, K/32, P, 64]  P = bits - 4, 5- and 6-bit formats. 5 bits: byte j's bit g is bit 4 of
//                                      group g's code at byte j. 6 bits: plane g / 4, byte j: bits 2 (g % 4) and
//                                      2 (g % 4) + 1 are bits 4 and 5 of group g's code at byte j. A group's high
//                                      bits come out of one plane with one GF2P8AFFINEQB (AVX-512) or a shift and
//                                      a mask (AVX2, per half tile: one 32-byte load)
//   scales fp16    [tiles, K/32, 32/G, 16], offsets (optional) the same; G = 16 or 32. Both are stored divided by
//                  the weight's `unit`, a power of two that puts its largest at 2^14..2^15, so fp16 holds every
//                  GGUF f16 scale exactly (other scales to 2^-12); a tile's sums come out in that unit and
//                  y is multiplied by it (exact: a power of two), so they equal fp32 scales' sums bit for bit.
//                  Half the bytes of fp32 scales: a one-row step streams 10% fewer (Q4_0, Q8_0).
//   or, for the K-quants (Q4_K, Q5_K, Q6_K), their own super-block layout: scales uint8 [tiles, K/256, 32 + 8 *
//                  (32/G) * 16]: per super-block of 256 inputs the 16 outputs' fp16 d (32 bytes), then per block of
//                  32 the int8 sc [32/G][16]; offsets (Q4_K, Q5_K) the same with dmin and m. s = d * sc and o =
//                  dmin * m are the GGUF's weights exactly (integer sc, m; see the math above), and a
//                  block's scales cost 1 byte, not 2, per output: Q4_K streams 18.5 bytes per 32 weights (GGUF
//                  18), Q6_K 26.25 (GGUF 26.25), against 20 and 28 as fp16 scales per block.

#include "kernels.h"

#include "quant_layout.inc"
#if SPECSERVE_X86  // the vector paths: x86 code
#include "quant_avx512.inc"
#include "quant_avx2.inc"
#endif
#include "quant_dispatch.inc"

// y = x @ [W_0; W_1; ...].T + bias: several packed weights over the same input (fused q/k/v or gate/up whose
// formats differ) in one call, x quantized once, their tiles shared out over the threads together; weight i's
// outputs are columns [sum N_<i}, + N_i) of y.
at::Tensor specserve::quant_linear(const at::Tensor& x_in, const std::vector<at::Tensor>& qs,
                        const std::vector<std::optional<at::Tensor>>& planes, const std::vector<at::Tensor>& scales,
                        const std::vector<std::optional<at::Tensor>>& offsets, const std::optional<at::Tensor>& bias,
                        const std::vector<int64_t>& N, const std::vector<int64_t>& bits,
                        const std::vector<int64_t>& group, const std::vector<int64_t>& zero,
                        const std::vector<double>& unit, bool out_fp32, QuantIsa isa) {
  const size_t parts = qs.size();
  TORCH_CHECK(parts > 0 && planes.size() == parts && scales.size() == parts && offsets.size() == parts &&
                  N.size() == parts && bits.size() == parts && group.size() == parts && zero.size() == parts &&
                  unit.size() == parts,
              "quant_linear: one entry per weight in every list");
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat, "x must be bf16 or fp32");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<Packed> W;
  std::vector<std::array<TileFn, kMaxRows + 1>> fns;
  std::vector<DecodedTiles> decoded_fns;
  int64_t decoded_kblocks = 0;  // the largest K/32 of the weights decoded once per tile
  std::vector<int64_t> column(parts + 1, 0);
  std::vector<int64_t> first_tile(parts + 1, 0);  // the call's items: weight i's tiles from first_tile[i] on
  for (size_t i = 0; i < parts; ++i) {
    W.push_back(packed_from(qs[i], planes[i], scales[i], offsets[i], N[i], bits[i], group[i], zero[i], unit[i]));
    TORCH_CHECK(K == W[i].kblocks * kBlock, "x has K=", K, ", the weight ", W[i].kblocks * kBlock);
    fns.push_back(tiles(isa, W[i]));
    decoded_fns.push_back(decoded_tiles(isa, W[i], M));
    if (decoded_fns.back().decode) decoded_kblocks = std::max(decoded_kblocks, W[i].kblocks);
    column[i + 1] = column[i] + N[i];
    first_tile[i + 1] = first_tile[i] + W[i].tiles;
  }
  const int64_t width = column[parts];
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == width && bias->is_contiguous(),
                "bias: fp32 [sum of N]");

  // the activations once per scale span the weights read: per block of 32 (Q8_0), per super-block (Q8_K: the
  // K-quants' integer sums then run over whole super-blocks)
  const bool any_super = std::any_of(W.begin(), W.end(), [](const Packed& w) { return w.super_scales; });
  const bool any_block = std::any_of(W.begin(), W.end(), [](const Packed& w) { return !w.super_scales; });
  QuantizedRows per_block(x, M, K, any_block ? kBlock : 0, isa);
  QuantizedRows per_super(x, M, K, any_super ? kSuperBlocks * kBlock : 0, isa);
  std::optional<CallLayout> block_layout, super_layout;
  if (any_block) block_layout.emplace(isa, per_block.acts, M);
  if (any_super) super_layout.emplace(isa, per_super.acts, M);
  for (Packed& w : W) (w.super_scales ? *super_layout : *block_layout).for_format(w);
  const auto acts_of = [&](const Packed& w) -> const Acts& { return w.super_scales ? per_super.acts : per_block.acts; };

  const auto out_type = out_fp32 ? at::kFloat : x.scalar_type();
  at::Tensor y = at::empty({M, width}, x.options().dtype(out_type));
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* y32 = out_type == at::kFloat ? y.data_ptr<float>() : nullptr;
  at::BFloat16* y16 = out_type == at::kFloat ? nullptr : y.data_ptr<at::BFloat16>();
  split_items(first_tile[parts], [&](const auto& next) {
    float block[kMaxRows * kTile];
    // in cache lines: an AVX-512 access across two lines costs two
    std::vector<CacheLine> decoded_lines(decoded_kblocks * 8);
    DecodedVector* decoded = reinterpret_cast<DecodedVector*>(decoded_lines.data());
    for (int64_t item; (item = next()) >= 0;) {
      size_t i = 0;
      while (item >= first_tile[i + 1]) ++i;
      const int64_t tile = item - first_tile[i];
      const Packed& w = W[i];
      const DecodedTiles& once = decoded_fns[i];
      if (once.decode) once.decode(w, tile, decoded);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int mr = int(std::min<int64_t>(kMaxRows, M - m0));
        run_tile(fns[i], once, w, acts_of(w), tile, m0, mr, block, decoded);
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

#include "quant_screen.inc"
#include "quant_probes.inc"

void specserve::bind_quant(py::module_ m, QuantIsa isa) {
  m.def("quant_linear",
        [isa](const at::Tensor& x, const std::vector<at::Tensor>& qs, const std::vector<std::optional<at::Tensor>>& planes,
              const std::vector<at::Tensor>& scales, const std::vector<std::optional<at::Tensor>>& offsets,
              const std::optional<at::Tensor>& bias, const std::vector<int64_t>& N, const std::vector<int64_t>& bits,
              const std::vector<int64_t>& group, const std::vector<int64_t>& zero, const std::vector<double>& unit,
              bool out_fp32) {
          return specserve::quant_linear(x, qs, planes, scales, offsets, bias, N, bits, group, zero, unit, out_fp32,
                                         isa);
        },
        "y = x @ [dequant(W_i)].T over packed low-bit weights, row-invariant", py::arg("x"), py::arg("qs"),
        py::arg("planes"), py::arg("scales"), py::arg("offsets"), py::arg("bias"), py::arg("N"), py::arg("bits"),
        py::arg("group"), py::arg("zero"), py::arg("unit"), py::arg("out_fp32"),
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &dequantize_rows, "dequantized rows of a packed weight (fp32)");
  m.def("screen_argmax",
        [isa](const at::Tensor& x, const at::Tensor& screen_qs, const at::Tensor& screen_planes, const at::Tensor& qs,
              const at::Tensor& scales, int64_t N, double unit) {
          return screen_argmax(x, screen_qs, screen_planes, qs, scales, N, unit, isa);
        },
        "each row's argmax of x @ W.T for an 8-bit W, through its 5-bit screen", py::arg("x"), py::arg("screen_qs"),
        py::arg("screen_planes"), py::arg("qs"), py::arg("scales"), py::arg("N"), py::arg("unit"),
        py::call_guard<py::gil_scoped_release>());
  m.def("stream_read", [isa](const at::Tensor& buffer) { return stream_read(buffer, isa); },
        "XOR over a buffer: a streaming-read bandwidth probe", py::arg("buffer"));
  m.def("quant_path", [isa] { return isa_label(isa); }, "the quantized linears' path: avx512, avx2 or scalar");
  m.def("int8_peak_macs", [isa](double seconds) { return int8_peak_macs(seconds, isa); },
        "int8 multiply-adds per second this CPU peaks at on the quantized path", py::arg("seconds") = 0.2,
        py::call_guard<py::gil_scoped_release>());
}
