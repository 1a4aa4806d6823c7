// 3xTF32 operands for the binding (csrc/tf32x3_cuda.cpp); fp32 CUDA tensors.
#pragma once

#include <ATen/ATen.h>

namespace cutlass_fused {

// x (M x K) as the A operand of a TF32 GEMM over K' = 3 round_up(K, 4): rows [big | small | big].
at::Tensor split_input_tf32x3(at::Tensor const& x);

// w (N x K) as the B operand, rows [big | big | small], zero rows up to rows_out;
// cached while w is unchanged and grad mode is off (see the .cpp).
at::Tensor split_weight_tf32x3(at::Tensor const& w, int64_t rows_out);

// a @ b (2-D fp32) as three cuBLAS TF32 GEMMs over split operands.
at::Tensor matmul_tf32x3(at::Tensor const& a, at::Tensor const& b);

}  // namespace cutlass_fused
