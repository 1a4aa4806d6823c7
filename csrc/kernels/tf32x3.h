// fp32-accurate products on TF32 tensor cores (3xTF32), torch-free.
//
// An fp32 value splits exactly into a TF32 "big" part and an fp32 remainder,
// which is rounded to TF32 as the "small" part: big + small holds ~22 of fp32's
// 24 significand bits. a·b ~ big_a·big_b + small_a·big_b + big_a·small_b (the
// dropped small·small term is ~2^-22 relative). Three TF32 products cost three
// TF32 passes, still far faster than SIMT fp32 on Hopper, where CUTLASS has no
// 3xTF32 kernel: the forward's statistics GEMM (sm90, TF32) runs over operands
// split and concatenated along K, as do the backward's GEMMs.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace cutlass_fused {

// Which part goes in each of a row's three K segments. x takes [small | big |
// big] and W [big | small | big] (either may be the GEMM's A operand: the
// statistics kernels swap them), so the K-concatenated dot product is
// small·big + big·small + big·big. The small
// products come first: the promoted mainloop adds each chunk of k into one
// fp32 sum, and a chunk of small products added to the full big·big sum
// would lose up to half an ulp of that sum each time (2/3 of the chunks);
// added first, into a sum ~2^-11 as large, they lose ~2^-11 of that.
enum class SplitOrder { small_big_big, big_small_big };

// out (rows_out x 3 seg, row-major, 16-byte aligned, seg % 4 == 0) from the
// logical rows_in x cols matrix whose element (r, c) is in[r * stride_r + c * stride_c]:
// each row's three segments in `order`, each `seg` long with zeros past
// `cols`, and zero rows past rows_in. Either stride must be 1: stride_c == 1
// reads rows, stride_r == 1 reads a transposed matrix through shared-memory tiles.
void split_tf32_rows(float const* in, int64_t rows_in, int64_t cols, int64_t stride_r, int64_t stride_c,
                     int64_t rows_out, int64_t seg, SplitOrder order, float* out, cudaStream_t stream);

// Either operand of the statistics GEMM (csrc/kernels/remainder_mainloop.h): its mainloop's tensor
// cores read an fp32 w as tf32(w), its low 13 bits dropped (tests/test_fp32.py,
// test_train_operand_bits_below_tf32), so w itself serves as its big part, and
// rest = TF32(w - tf32(w)) (exact before the rounding) as its small one; NaN for a NaN w (whose
// dropped bits may have held its payload: tf32(w) may read as an infinity), 0 for an infinite one,
// whose row gets flags[r] = 1 (else 0). in and rest are rows x ld (ld % 4 == 0, rest 16-byte
// aligned); rest is zero past cols.
void tf32_remainder_rows(float const* in, int64_t rows, int64_t cols, int64_t ld, float* rest, unsigned char* flags,
                         cudaStream_t stream);

}  // namespace cutlass_fused
