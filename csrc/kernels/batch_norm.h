// BatchNorm kernels around the fused GEMM; torch-free: raw pointers, sizes, a stream.
//
// Statistics travel as fp64 column sums: stats[0:n] = sum z, stats[n:2n] = sum z^2.
// Sums (not mean/M2) keep the cross-rank reduction of SyncBatchNorm a plain
// all-reduce between statistics and finalize; fp64 keeps them exact enough
// that sum/sum-of-squares does not cancel (see README, "Statistics").
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace cutlass_fused {

enum class DType { bf16, f16, f32 };

// stats[c] = sum_r partials[r * ld + c], in a fixed order, for both halves:
// partials holds `rows` rows of sums then `rows` rows of sums of squares.
void reduce_partials(double const* partial_sum, double const* partial_sumsq, int rows, int64_t ld, int n,
                     double* stats, cudaStream_t stream);

// Deterministic column sums of z (m x n, row stride ldz) into stats, through
// `workspace` (column_stats_workspace(m, n) bytes).
size_t column_stats_workspace(int m, int n);
void column_stats(DType dt, void const* z, int m, int n, int64_t ldz, double* stats, void* workspace,
                  cudaStream_t stream);

struct FinalizeArgs {
  DType dt;                       // of z and y
  DType param_dt;                 // of weight, bias, running_mean, running_var
  void const* z;  int64_t ldz;    // m x n
  void* y;                        // m x n, contiguous
  int m, n;
  double const* stats;            // 2 x n
  double count;                   // rows behind stats (all ranks' for SyncBN)
  void const* weight;             // n or nullptr (1)
  void const* bias;               // n or nullptr (0)
  void* running_mean;             // n or nullptr: updated in place
  void* running_var;              // n or nullptr: updated in place (unbiased variance)
  int64_t const* num_batches_tracked;  // non-null: momentum = 1 / *num_batches_tracked
  double momentum, eps;
  float* save_mean;               // n
  float* save_invstd;             // n
};

// mean/invstd from stats, the running-stat update, and y = (z - mean) * invstd * w + b.
void finalize_normalize(FinalizeArgs const& a, cudaStream_t stream);

// Eval-mode folding: out_a = scale * w * invstd, out_c = b - running_mean * w * invstd,
// with invstd = 1 / sqrt(running_var + eps). scale is fp32; the rest param_dt.
void fold_eval(DType param_dt, int n, float const* scale, void const* weight, void const* bias,
               void const* running_mean, void const* running_var, double eps, float* out_a, float* out_c,
               cudaStream_t stream);

}  // namespace cutlass_fused
