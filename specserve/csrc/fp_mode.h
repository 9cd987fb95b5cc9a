// One floating-point mode for every thread of a kernel: denormals flushed to zero (FTZ) and read as zero (DAZ).
//
// The thread that loads a model runs with both on (transformer.py calls torch.set_flush_denormal), but OpenMP
// workers keep whatever mode they were created with, and which thread computes a row depends on how many rows a
// call has. A row could then round differently decoded alone than verified in a batch as soon as one of its values
// is denormal (softmax weights of far-off keys, tiny activations): row invariance needs one mode on every thread.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace specserve {

#if defined(__x86_64__) || defined(_M_X64)
constexpr unsigned int kFlushDenormals = 0x8040;  // MXCSR bits: FTZ (15) and DAZ (6)
inline uint64_t fp_mode() { return _mm_getcsr(); }
inline void set_fp_mode(uint64_t mode) { _mm_setcsr(static_cast<unsigned int>(mode)); }
#elif defined(__aarch64__)
constexpr uint64_t kFlushDenormals = uint64_t(1) << 24;  // FPCR.FZ: denormal inputs and results flushed to zero
inline uint64_t fp_mode() {
  uint64_t mode;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(mode));
  return mode;
}
inline void set_fp_mode(uint64_t mode) { __asm__ __volatile__("msr fpcr, %0" : : "r"(mode)); }
#else
#error "specserve's kernels set the denormal mode on x86-64 and aarch64 only"
#endif

// FTZ and DAZ on for a scope; the thread's own mode back after it.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(fp_mode()) { set_fp_mode(saved_ | kFlushDenormals); }
  ~FlushDenormals() { set_fp_mode(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  uint64_t saved_;
};

// at::parallel_for whose every chunk, on whichever thread, computes in the FlushDenormals mode.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, [&](int64_t first, int64_t last) {
    FlushDenormals mode;
    f(first, last);
  });
}

}  // namespace specserve
