// The data types of the fused GEMMs: one small traits struct per `dtype` of
// codegen/kernels.py, named as the kernel table names it, so that a generated
// csrc/generated/<row>.cu can say gemm::dtype::bf16.
//
// Only what all families and modes share is here: the element type of the
// operands (Operand), of the bias and the output (Element), and the type in which the statistics
// kernels form u = h - shift, u^2 and their per-CTA sums. The accumulator and
// the epilogue's own arithmetic are fp32 for every dtype. What a dtype changes in
// one family only is a specialization in that family's header:
//   fp16 eval rounds h and z          sm90_eval.cuh, sm80_eval.cuh
//   3xTF32's mainloop (sm90)          sm90_kernel.cuh (PromotedMainloop)
//   3xTF32's math operator (sm80)     sm80_eval.cuh (OpMultiplyAddFastF32)
#pragma once

#include "cutlass/numeric_types.h"

namespace cutlass_fused::gemm {
namespace dtype {

// bfloat16 operands and output.
struct bf16 {
  using Element = cutlass::bfloat16_t;
  using Operand = Element;
  using StatsCompute = float;
};

// float16 operands and output.
struct f16 {
  using Element = cutlass::half_t;
  using Operand = Element;
  using StatsCompute = float;
};

// fp32 operands and output, TF32 math (torch.backends.cuda.matmul.allow_tf32).
// fp32 tile sums: far more precise than TF32's own error.
struct tf32 {
  using Element = float;
  using Operand = Element;
  using StatsCompute = float;
};

// fp32 without TF32 (3xTF32). Its statistics are fp64 tile sums of an fp32 h,
// as exact as our fp64 pass over h, so that only non-finite columns take that
// pass (a non-final reduction writes its partials in this type: the stats
// kernel's u_sum and u_sumsq are then fp64, "partial64").
struct f32x3 {
  using Element = float;
  using Operand = Element;
  using StatsCompute = double;
};

// FP8 (issue 33): e4m3 operands, x and W each quantized under a per-tensor power-of-two scale
// (cutlass_fused/fp8.py), fp32 accumulation; the bias and h in bf16. The caller folds the scales
// into the op's scale and bias (scale * alpha, b / alpha), so the epilogue and the tail are bf16's.
struct e4m3 {
  using Element = cutlass::bfloat16_t;
  using Operand = cutlass::float_e4m3_t;
  using StatsCompute = float;
};

}  // namespace dtype

// Elements in a 16-byte access: the alignment the builders get for D (kAlignment) and for the
// operands (kOperandAlignment) (rows are 16-byte aligned: gemm_evt.h's kAlignBytes).
template <class Dtype>
inline constexpr int kAlignment = 128 / cutlass::sizeof_bits<typename Dtype::Element>::value;
template <class Dtype>
inline constexpr int kOperandAlignment = 128 / cutlass::sizeof_bits<typename Dtype::Operand>::value;

}  // namespace cutlass_fused::gemm
