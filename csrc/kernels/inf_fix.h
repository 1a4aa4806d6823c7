// The sm80 family's fp32 GEMM (CUTLASS's in-kernel 3xTF32) splits each operand
// element into a big and a small TF32 part; an infinite element's small part is
// inf - inf = NaN, so every product it meets is NaN where an fp32 GEMM gives
// +-inf. The sm90 statistics GEMM over remainders (remainder_mainloop.h) meets
// the same: an infinity times the other operand's remainder. These kernels find
// the rows of x and W that hold an infinity (there, the remainder passes flag
// them) and rewrite the outputs they reach with what an fp32 GEMM gives there:
// NaN, +inf or -inf, then through the epilogue's (h + b) * a + c. Torch-free.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace cutlass_fused {

// flags[r] = 1 where row r of the rows x cols fp32 matrix t (row stride ld) holds +-inf, else 0.
void flag_inf_rows(float const* t, int64_t rows, int64_t cols, int64_t ld, unsigned char* flags,
                   cudaStream_t stream);

struct InfFixArgs {
  float const* x;  int64_t ldx;      // m x k
  float const* w;  int64_t ldw;      // n x k
  unsigned char const* x_flags;      // m, from flag_inf_rows
  unsigned char const* w_flags;      // n
  float const* b = nullptr;          // n, or nullptr for 0
  float const* a = nullptr;          // n, or nullptr for 1
  float const* c = nullptr;          // n, or nullptr for 0
  float* out;      int64_t ldo;      // m x n
  int m, n, k;
};

// Rewrites out[i, j] for every flagged row i of x and every flagged row j of W.
// Flagged rows are rare (broken data); the others cost a flag read.
void fix_inf_products(InfFixArgs const& a, cudaStream_t stream);

}  // namespace cutlass_fused
