// specserve._C: the kernels of every instruction-set variant compiled here (submodules scalar, avx2, avx512, amx:
// the bf16 layer kernels and the quantized linear on the variant's path), with which of them this CPU runs: the
// one probe of the CPU's features.
#include "kernels.h"

#if SPECSERVE_X86
#include <cpuid.h>
#endif

namespace {

#if SPECSERVE_X86
// CPUID leaf 7 sub-leaf `sub`: register `reg` (0 eax, 1 ebx, 2 ecx, 3 edx) has bit `bit` set.
bool leaf7(unsigned sub, int reg, int bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid_count(7, sub, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1;
}
#endif

// Whether this CPU (and OS: __builtin_cpu_supports checks the saved register state) runs a variant's instructions.
bool cpu_runs(const std::string& variant) {
  if (variant == "scalar") return true;
#if SPECSERVE_X86_VARIANTS
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
  if (variant == "avx2") return avx2;
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("gfni") &&
                      leaf7(1, 0, 5) /* AVX512_BF16 */;
  if (variant == "avx512") return avx512;
  // AMX-BF16 (edx bit 22) and AMX-TILE (bit 24); the kernel asks Linux for the tile state before using it
  if (variant == "amx") return avx512 && leaf7(0, 3, 22) && leaf7(0, 3, 24);
#endif
  return false;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "specserve's CPU kernels: the bf16 kernels and packed low-bit linears of each ISA variant";
  std::vector<std::string> compiled = {"scalar"};
  specserve::scalar::bind(m.def_submodule("scalar", "bf16 kernels, scalar code"));
#if SPECSERVE_X86_VARIANTS
  specserve::avx2::bind(m.def_submodule("avx2", "bf16 kernels, AVX2 + FMA"));
  specserve::avx512::bind(m.def_submodule("avx512", "bf16 kernels, AVX-512 VNNI + BF16"));
  specserve::amx::bind(m.def_submodule("amx", "bf16 kernels, AVX-512 BF16 + AMX"));
  compiled.insert(compiled.end(), {"avx2", "avx512", "amx"});
#endif
  m.attr("VARIANTS") = compiled;  // slowest first
  m.def("cpu_runs", &cpu_runs, "whether this CPU runs a variant's instructions", py::arg("variant"));
}
