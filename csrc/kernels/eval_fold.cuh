// The eval fold, one column at a time: the fold kernel (bn_eval_fold.cu) and the sm90 eval
// epilogue's fold nodes (gemm/sm90_fold.cuh) both call fold_value, so that y has the same bits
// whichever made the vectors (tests/test_forward.py, test_eval_fold_in_the_epilogue).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/types.h"

namespace cutlass_fused {

// Element c of a per-column vector as stored (a 16-bit one in the low half), 0 where the vector is
// absent; from_bits gives its value. A thread that needs several vectors loads all their bits
// before it converts any: converted one at a time, each load waited out the one before it (the
// dtype switch between them), and a tail's column constants took five loads' latency in a row
// (decisions.md, "Training tails").
__device__ __forceinline__ uint32_t load_bits(ColVec v, int c) {
  if (v.p == nullptr) return 0;
  if (v.broadcast) c = 0;
  if (v.dt == DType::f32) return static_cast<uint32_t const*>(v.p)[c];
  return static_cast<uint16_t const*>(v.p)[c];
}

// The value of load_bits' `bits` as fp64 (exact); `none` where the vector is absent.
__device__ __forceinline__ double from_bits(ColVec v, uint32_t bits, double none) {
  if (v.p == nullptr) return none;
  auto half = static_cast<unsigned short>(bits);
  switch (v.dt) {
    case DType::bf16: return __bfloat162float(__ushort_as_bfloat16(half));
    case DType::f16: return __half2float(__ushort_as_half(half));
    default: return __uint_as_float(bits);
  }
}

// Element c of a per-column vector as fp64; `none` where the vector is absent.
__device__ __forceinline__ double load(ColVec v, int c, double none) { return from_bits(v, load_bits(v, c), none); }

// Which of the epilogue's vectors: a = scale * g, g alone (the fp16 kernels, which multiply by
// scale themselves), c = b - mean * g, or scale; g = w / sqrt(var + eps) = w * invstd.
enum class FoldPart { a, g, c, s };

// The part's value for column c, computed in fp64 and rounded once to fp32; 0 in the padded
// columns (c >= f.n). Every operation is spelled out (_rn), so that no caller's code can contract
// b - mean * g differently.
__device__ __forceinline__ float fold_value(EvalFold const& f, int c, FoldPart part) {
  if (c >= f.n) return 0.0f;
  if (part == FoldPart::s) return static_cast<float>(load(f.scale, c, 1.0));
  // Every load first (load_bits); then the fp64 math.
  bool a = part == FoldPart::a, offset = part == FoldPart::c;
  uint32_t weight = load_bits(f.weight, c), var = load_bits(f.var, c), scale = a ? load_bits(f.scale, c) : 0;
  uint32_t mean = offset ? load_bits(f.mean, c) : 0, bias = offset ? load_bits(f.bias, c) : 0;
  double g = __ddiv_rn(from_bits(f.weight, weight, 1.0), __dsqrt_rn(__dadd_rn(from_bits(f.var, var, 1.0), f.eps)));
  switch (part) {
    case FoldPart::a: return static_cast<float>(__dmul_rn(from_bits(f.scale, scale, 1.0), g));
    case FoldPart::g: return static_cast<float>(g);
    default: return static_cast<float>(__fma_rn(-from_bits(f.mean, mean, 0.0), g, from_bits(f.bias, bias, 0.0)));
  }
}

}  // namespace cutlass_fused
