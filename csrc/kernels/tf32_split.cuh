// The 3xTF32 split of one fp32 value, shared by the split kernels
// (tf32x3.cu) and the mainloop that splits x in shared memory
// (split_mainloop.h).
#pragma once

#include <cstdint>

namespace cutlass_fused {

// x rounded to nearest (ties to even) TF32: 10 stored significand bits, the low
// 13 bits zero, so the tensor core reads it exactly. Non-finite values pass
// through; a finite value that would round up to infinity is truncated instead.
__device__ __forceinline__ float tf32_round(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return x;
  uint32_t r = (u + 0x0fffu + ((u >> 13) & 1u)) & 0xffffe000u;
  if ((r & 0x7f800000u) == 0x7f800000u) r = u & 0xffffe000u;
  return __uint_as_float(r);
}

// `again` is big in the segment that meets the other operand's small part: 0 for a non-finite
// x, so that x reaches the dot product once (x * the other's big part), as in an fp32 GEMM;
// otherwise inf * small, with small of either sign, makes inf - inf = NaN.
struct Parts {
  float big, small, again;
};

__device__ __forceinline__ Parts split(float x) {
  float big = tf32_round(x);
  // x - big is exact in fp32; inf - inf would be NaN, so a non-finite x keeps it all in big.
  bool finite = isfinite(x);
  float small = finite ? tf32_round(x - big) : 0.f;
  return {big, small, finite ? big : 0.f};
}

}  // namespace cutlass_fused
