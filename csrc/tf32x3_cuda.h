// fp32 without TF32 (3xTF32): the sm90 family's split operands, the sm80
// family's rows holding an infinity (csrc/tf32x3_cuda.cpp).
#pragma once

#include <ATen/ATen.h>

#include "kernels/tf32x3.h"

namespace cutlass_fused {

// t (R x C, fp32, CUDA, any strides) as a GEMM operand over K' = 3 round_up(C, 4):
// rows_out x K', each row's three segments in `order`, zero rows past R. x
// takes small_big_big, the weight (and the backward's second operand) big_small_big.
at::Tensor split_tf32x3(at::Tensor const& t, int64_t rows_out, SplitOrder order);

// w (N x K) as the B operand; kept for the next call only where `cache` (the
// ops' schema argument, csrc/ops.cpp) allows: derived_cache.h.
at::Tensor split_weight_tf32x3(at::Tensor const& w, int64_t rows_out, bool cache);

// An operand of the statistics GEMM beside itself (t: 16-byte aligned rows, x's, or the weight's
// padded to the kernel's rows; csrc/kernels/tf32x3.h): its remainder, t's shape and stride, and the
// byte flags of t's rows that hold +-inf. remainder_weight_tf32x3 keeps w's as split_weight_tf32x3
// keeps its split.
struct Remainder {
  at::Tensor rest, flags;
};
Remainder remainder_tf32x3(at::Tensor const& t);
Remainder remainder_weight_tf32x3(at::Tensor const& w, at::Tensor const& wa, bool cache);

// Byte flags of t's rows (R x C, fp32, CUDA, unit column stride) that hold +-inf
// (csrc/kernels/inf_fix.h); weight_inf_rows keeps w's as split_weight_tf32x3 does.
at::Tensor inf_rows(at::Tensor const& t);
at::Tensor weight_inf_rows(at::Tensor const& w, bool cache);

}  // namespace cutlass_fused
