// fp32-accurate products on TF32 tensor cores (3xTF32), torch-free.
//
// An fp32 value splits exactly into a TF32 "big" part and an fp32 remainder,
// which is rounded to TF32 as the "small" part: big + small holds ~22 of fp32's
// 24 significand bits. a·b ~ big_a·big_b + small_a·big_b + big_a·small_b (the
// dropped small·small term is ~2^-22 relative). Three TF32 products cost three
// TF32 passes, still far faster than SIMT fp32 on Hopper, where CUTLASS has no
// 3xTF32 kernel: the forward's statistics GEMM (sm90, TF32) runs over operands
// split and concatenated along K, and the backward's GEMMs run as three cuBLAS
// TF32 GEMMs over the parts (csrc/tf32x3_cuda.cpp).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace cutlass_fused {

// Which part goes in each of a row's three K segments. The GEMM's A operand
// takes [big | small | big] and its B operand [big | big | small], so the
// K-concatenated dot product is big·big + small·big + big·small.
enum class SplitOrder { big_small_big, big_big_small };

// out (rows_out x 3 seg, row-major, 16-byte aligned, seg % 4 == 0) from in
// (rows_in x cols, row stride ld_in): each row's three segments in `order`,
// each `seg` long with zeros past `cols`, and zero rows past rows_in.
void split_tf32_rows(float const* in, int64_t rows_in, int64_t cols, int64_t ld_in, int64_t rows_out, int64_t seg,
                     SplitOrder order, float* out, cudaStream_t stream);

// big[i], small[i] for i < n: the same split, elementwise.
void split_tf32(float const* in, int64_t n, float* big, float* small, cudaStream_t stream);

}  // namespace cutlass_fused
