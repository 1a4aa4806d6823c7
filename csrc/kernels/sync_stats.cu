// SyncBatchNorm's column arithmetic (sync_stats.h), a thread a column: one launch each where the
// torch ops it replaces took ~10 (the row), ~12 (the merge) and ~30 (the gradients).
#include "kernels/bn_common.cuh"
#include "kernels/sync_stats.h"

namespace cutlass_fused {
namespace {

__global__ void sync_row_kernel(int64_t n, double const* __restrict__ stats, double count, double* __restrict__ row) {
  int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (c < n) sync_stats::row_column(stats, n, count, c, row);
}

__global__ void sync_merge_kernel(int64_t n, int world, double const* __restrict__ rows, double* __restrict__ stats,
                                  double* __restrict__ running, double* __restrict__ count) {
  int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (c < n) sync_stats::merge_column(rows, world, n, c, stats, running, count);
}

__global__ void sync_grads_kernel(int64_t n, double const* __restrict__ local, double const* __restrict__ sums,
                                  double const* __restrict__ row, double const* __restrict__ count,
                                  double const* __restrict__ mean_h, double const* __restrict__ invstd, ColVec scale,
                                  ColVec weight, double* __restrict__ out) {
  int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (c >= n) return;
  int i = static_cast<int>(c);
  sync_stats::grads_column(local, sums, row, *count, mean_h[c], invstd[c], load(scale, i, 1.0), load(weight, i, 1.0),
                           n, c, out);
}

}  // namespace

void sync_row(int64_t n, double const* stats, double count, double* row, cudaStream_t stream) {
  sync_row_kernel<<<blocks(n, 256), 256, 0, stream>>>(n, stats, count, row);
  check_cuda(cudaGetLastError(), "sync_row");
}

void sync_merge(int64_t n, int world, double const* rows, double* stats, double* running, double* count,
                cudaStream_t stream) {
  sync_merge_kernel<<<blocks(n, 256), 256, 0, stream>>>(n, world, rows, stats, running, count);
  check_cuda(cudaGetLastError(), "sync_merge");
}

void sync_grads(int64_t n, double const* local, double const* sums, double const* row, double const* count,
                double const* mean_h, double const* invstd, ColVec scale, ColVec weight, double* out,
                cudaStream_t stream) {
  sync_grads_kernel<<<blocks(n, 256), 256, 0, stream>>>(n, local, sums, row, count, mean_h, invstd, scale, weight,
                                                        out);
  check_cuda(cudaGetLastError(), "sync_grads");
}

}  // namespace cutlass_fused
