// What every source of the specserve._C extension includes, and what its sources call across files.
//
// One extension holds every kernel: quant_linear.cpp (its vector paths carry their own target attributes), and the
// bf16 layer kernels of cpu_kernels.inc compiled once per instruction-set variant (variant_*.cpp, each in its own
// namespace and submodule). module.cpp's probe says which variants the CPU runs; Python picks one
// (models/cpu_kernels.py), and that variant's quantized path is the one its functions call (QuantIsa): one
// choice for every kernel. The build itself targets the baseline of its architecture, so the .so runs on any CPU
// of it.
#pragma once

// the headers of what the kernels call, not torch/extension.h or ATen.h: those took ~12-17 s of every source's compile
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/split_with_sizes.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 and the at::Tensor caster

#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(_M_X64)
#define SPECSERVE_X86 1
#include <immintrin.h>
#include <sys/syscall.h>
#else
#define SPECSERVE_X86 0
#endif
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fp_mode.h"

// The x86 variants are compiled with GCC's target pragma, which also sets the ISA macros (__AVX2__, ...) that
// cpu_kernels.inc selects its code with; other compilers build the scalar variant only.
#if SPECSERVE_X86 && defined(__GNUC__) && !defined(__clang__)
#define SPECSERVE_X86_VARIANTS 1
#else
#define SPECSERVE_X86_VARIANTS 0
#endif

namespace specserve {

// The quantized linears' vector path of a variant: the AVX-512 one needs AVX-512 F/BW/VL/DQ/VNNI, the AVX2 one
// AVX2 + FMA + F16C, both a subset of what module.cpp's probe requires of the variant that calls it.
enum class QuantIsa { scalar, avx2, avx512 };

// y = x @ [dequant(W_i)].T + bias over packed low-bit weights (quant_linear.cpp); the layer stacks call it directly.
at::Tensor quant_linear(const at::Tensor& x_in, const std::vector<at::Tensor>& qs,
                        const std::vector<std::optional<at::Tensor>>& planes, const std::vector<at::Tensor>& scales,
                        const std::vector<std::optional<at::Tensor>>& offsets, const std::optional<at::Tensor>& bias,
                        const std::vector<int64_t>& N, const std::vector<int64_t>& bits,
                        const std::vector<int64_t>& group, const std::vector<int64_t>& zero,
                        const std::vector<double>& unit, bool out_fp32, QuantIsa isa);

// The quantized linear, its greedy screen and probes on path `isa`, into a variant's submodule.
void bind_quant(pybind11::module_ m, QuantIsa isa);

// Each variant's bind (variant_*.cpp) fills its submodule of specserve._C.
namespace scalar { void bind(pybind11::module_ m); }
#if SPECSERVE_X86_VARIANTS
namespace avx2 { void bind(pybind11::module_ m); }
namespace avx512 { void bind(pybind11::module_ m); }
namespace amx { void bind(pybind11::module_ m); }
#endif

}  // namespace specserve
