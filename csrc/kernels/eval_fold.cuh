// The eval fold, one column at a time: the fold kernel (bn_eval_fold.cu) and the sm90 eval
// epilogue's fold nodes (gemm/sm90_fold.cuh) both call fold_value, so that y has the same bits
// whichever made the vectors (tests/test_forward.py, test_eval_fold_in_the_epilogue).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/types.h"

namespace cutlass_fused {

// Element c of a per-column vector as fp64; `none` where the vector is absent.
__device__ __forceinline__ double load(ColVec v, int c, double none) {
  if (v.p == nullptr) return none;
  switch (v.dt) {
    case DType::bf16: return __bfloat162float(static_cast<__nv_bfloat16 const*>(v.p)[c]);
    case DType::f16: return __half2float(static_cast<__half const*>(v.p)[c]);
    default: return static_cast<float const*>(v.p)[c];
  }
}

// Which of the epilogue's vectors: a = scale * g, g alone (the fp16 kernels, which multiply by
// scale themselves), c = b - mean * g, or scale; g = w / sqrt(var + eps) = w * invstd.
enum class FoldPart { a, g, c, s };

// The part's value for column c, computed in fp64 and rounded once to fp32; 0 in the padded
// columns (c >= f.n). Every operation is spelled out (_rn), so that no caller's code can contract
// b - mean * g differently.
__device__ __forceinline__ float fold_value(EvalFold const& f, int c, FoldPart part) {
  if (c >= f.n) return 0.0f;
  if (part == FoldPart::s) return static_cast<float>(load(f.scale, c, 1.0));
  double g = __ddiv_rn(load(f.weight, c, 1.0), __dsqrt_rn(__dadd_rn(load(f.var, c, 1.0), f.eps)));
  switch (part) {
    case FoldPart::a: return static_cast<float>(__dmul_rn(load(f.scale, c, 1.0), g));
    case FoldPart::g: return static_cast<float>(g);
    default: return static_cast<float>(__fma_rn(-load(f.mean, c, 0.0), g, load(f.bias, c, 0.0)));
  }
}

}  // namespace cutlass_fused
