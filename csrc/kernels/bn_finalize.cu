// The statistics and normalization steps the split ops run (SyncBatchNorm all-reduces the sums
// between them): column sums of h, their reduction, finalize and normalize, the running stats.
#include "kernels/bn_common.cuh"

namespace cutlass_fused {
namespace {

__global__ void reduce_partials_kernel(double const* __restrict__ psum, double const* __restrict__ psumsq, int rows,
                                       int64_t ld, int n, double* __restrict__ stats, double const* __restrict__ center) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= n) return;
  double s = 0, q = 0;
  for (int r = 0; r < rows; ++r) {
    s += psum[r * ld + c];
    q += psumsq[r * ld + c];
  }
  stats[c] = s;
  stats[n + c] = center ? centered(s, q, center[c]) : q;
}

__global__ void update_running_kernel(int n, double const* __restrict__ stats, ColVec scale, double count, ColOut rm,
                                      ColOut rv, int64_t const* nbt, double momentum) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= n) return;
  double m = nbt ? 1.0 / static_cast<double>(*nbt) : momentum;
  ColVec mean{rm.p, rm.dt}, var{rv.p, rv.dt};
  uint32_t bits[3] = {load_bits(mean, c), load_bits(var, c), load_bits(scale, c)};
  double old_mean = from_bits(mean, bits[0], 0.0), old_var = from_bits(var, bits[1], 0.0);
  update_running(moments(stats[c], stats[n + c], from_bits(scale, bits[2], 1.0), count), count, m, old_mean, old_var,
                 rm, rv, c);
}

template <class T, class TO, bool Act, int V, int R>
__global__ void finalize_normalize_kernel(FinalizeArgs a) {
  using A = Acc<T>;
  Column<A> col[V];
  block_columns<V>(a.n, blockIdx.x, col, [&](int c) { return column<A>(a, c); });
  int c0 = (blockIdx.x * 32 + threadIdx.x) * V;  // n % V == 0 when V > 1: groups are whole
  if (c0 >= a.n) return;
  normalize_rows<T, TO, Act, V, R>(a, c0, col, blockIdx.y * 8 * R, a.m, int64_t{gridDim.y} * 8 * R);
}

}  // namespace

void reduce_partials(double const* partial_sum, double const* partial_sumsq, int rows, int64_t ld, int n,
                     double* stats, cudaStream_t stream, double const* center) {
  reduce_partials_kernel<<<blocks(n, 256), 256, 0, stream>>>(partial_sum, partial_sumsq, rows, ld, n, stats,
                                                             center);
  check_cuda(cudaGetLastError(), "reduce_partials");
}

void column_stats(DType dt, void const* h, int m, int n, int64_t ldh, double* stats, void* workspace,
                  cudaStream_t stream) {
  dispatch(dt, [&](auto t) {
    using T = decltype(t);
    column_sums<T>(SumSquares<T>{static_cast<T const*>(h), ldh}, m, n, ldh, {h}, stats,
                   static_cast<double*>(workspace), nullptr, stream, [](int m, int) { return stat_rows(m); });
  });
}

void finalize_normalize(FinalizeArgs const& a, cudaStream_t stream) {
  dispatch_pair(a.dt, a.dt_y, [&](auto t, auto to) {
    dispatch_act(a.act, [&](auto act) {
      using T = decltype(t);
      using TO = decltype(to);
      constexpr bool Act = decltype(act)::value;
      launch_rows<T, 4>(a.m, a.n, a.ldh, {a.h, a.y}, 4096, [&](auto v, dim3 grid) {
        finalize_normalize_kernel<T, TO, Act, decltype(v)::value, 4><<<grid, dim3(32, 8), 0, stream>>>(a);
      });
    });
  });
  check_cuda(cudaGetLastError(), "finalize_normalize");
}

void update_running_stats(int n, double const* stats, ColVec scale, double count, ColOut running_mean,
                          ColOut running_var, int64_t const* num_batches_tracked, double momentum,
                          cudaStream_t stream) {
  update_running_kernel<<<blocks(n, 256), 256, 0, stream>>>(n, stats, scale, count, running_mean, running_var,
                                                             num_batches_tracked, momentum);
  check_cuda(cudaGetLastError(), "update_running_stats");
}

}  // namespace cutlass_fused
