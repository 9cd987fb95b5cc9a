// The bf16 layer kernels (cpu_kernels.inc) for the baseline of the architecture: scalar code that any CPU runs
// (the only variant off x86, and with compilers other than GCC).
#include "kernels.h"

#define SPECSERVE_ISA_AVX2 0  // AVX2 + FMA
#define SPECSERVE_ISA_AVX512 0  // AVX-512 F/BW/VL/DQ/VNNI/BF16
#define SPECSERVE_ISA_AMX 0  // AMX-TILE + AMX-BF16

namespace specserve::scalar {
#include "cpu_kernels.inc"
}  // namespace specserve::scalar
