// The bf16 layer kernels (cpu_kernels.inc) and the fp32 linear (f32_linear.inc) for AVX2 + FMA + F16C (Haswell,
// Zen 1 and later): 16-lane arithmetic as two 8-lane halves.
// Compiled with the variant's target; module.cpp offers it only on a CPU that runs it.
#include "kernels.h"

#if SPECSERVE_X86_VARIANTS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")

#define SPECSERVE_ISA_AVX2 1  // AVX2 + FMA
#define SPECSERVE_ISA_AVX512 0  // AVX-512 F/BW/VL/DQ/VNNI/BF16
#define SPECSERVE_ISA_AMX 0  // AMX-TILE + AMX-BF16

namespace specserve::avx2 {
#include "f32_linear.inc"
#include "cpu_kernels.inc"
}  // namespace specserve::avx2

#pragma GCC pop_options
#undef SPECSERVE_ISA_AVX2
#undef SPECSERVE_ISA_AVX512
#undef SPECSERVE_ISA_AMX
#endif
