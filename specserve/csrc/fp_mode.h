// One floating-point mode for every thread of a kernel: denormals flushed to zero (FTZ) and read as zero (DAZ).
//
// The thread that loads a model runs with both on (transformer.py calls torch.set_flush_denormal), but OpenMP
// workers keep whatever mode they were created with, and which thread computes a row depends on how many rows a
// call has. A row could then round differently decoded alone than verified in a batch as soon as one of its values
// is denormal (softmax weights of far-off keys, tiny activations): row invariance needs one mode on every thread.
#pragma once

#include <ATen/Parallel.h>
#include <xmmintrin.h>

#include <cstdint>

namespace specserve {

constexpr unsigned int kFlushDenormals = 0x8040;  // MXCSR bits: FTZ (15) and DAZ (6)

// FTZ and DAZ on for a scope; the thread's own mode back after it.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFlushDenormals); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned int saved_;
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
