#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/batch_norm.h"
#include "kernels/check.h"

namespace cutlass_fused {
namespace {

template <class T> __device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <class T> __device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half(v); }

// Arithmetic type of the elementwise passes: fp32 data gets fp64, so that the
// one rounding is the store's; bf16/f16 get fp32, whose error is far below theirs.
template <class T> using Acc = std::conditional_t<std::is_same_v<T, float>, double, float>;

template <class F>
void dispatch(DType dt, F&& f) {
  switch (dt) {
    case DType::bf16: f(__nv_bfloat16{}); break;
    case DType::f16: f(__half{}); break;
    case DType::f32: f(float{}); break;
  }
}

unsigned blocks(int64_t work, int per_block) { return static_cast<unsigned>((work + per_block - 1) / per_block); }

__global__ void reduce_partials_kernel(double const* __restrict__ psum, double const* __restrict__ psumsq, int rows,
                                       int64_t ld, int n, double* __restrict__ stats) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= n) return;
  double s = 0, q = 0;
  for (int r = 0; r < rows; ++r) {
    s += psum[r * ld + c];
    q += psumsq[r * ld + c];
  }
  stats[c] = s;
  stats[n + c] = q;
}

// Per-column partial sums of two per-element terms over chunks of rows: 32
// columns x 8 row lanes a block; each lane walks its rows of one chunk in
// order and the lanes are combined in order, so the result is bitwise stable.
constexpr int kStatRows = 256;  // rows per chunk

// h -> (h, h^2): the forward statistics.
template <class T>
struct SumSquares {
  T const* h; int64_t ldh;
  __device__ void operator()(int64_t r, int c, double& a, double& b) const {
    double v = to_float(h[r * ldh + c]);
    a += v;
    b += v * v;
  }
};

// (dy, h) -> (dy, dy (h - mean_h)): the backward's sums.
template <class T>
struct GradSums {
  T const* dy; T const* h; int64_t ldh; int n; double const* mean_h;
  __device__ void operator()(int64_t r, int c, double& a, double& b) const {
    double g = to_float(dy[r * n + c]);
    a += g;
    b += g * (static_cast<double>(to_float(h[r * ldh + c])) - mean_h[c]);
  }
};

template <class Terms>
__global__ void column_partials_kernel(Terms terms, int m, int n, double* __restrict__ pa, double* __restrict__ pb) {
  __shared__ double sh[2][8][32];
  int c = blockIdx.x * 32 + threadIdx.x;
  int r0 = blockIdx.y * kStatRows;
  int r1 = min(m, r0 + kStatRows);
  double a = 0, b = 0;
  if (c < n) {
    for (int r = r0 + threadIdx.y; r < r1; r += 8) terms(r, c, a, b);
  }
  sh[0][threadIdx.y][threadIdx.x] = a;
  sh[1][threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < n) {
    for (int i = 1; i < 8; ++i) {
      a += sh[0][i][threadIdx.x];
      b += sh[1][i][threadIdx.x];
    }
    pa[blockIdx.y * static_cast<int64_t>(n) + c] = a;
    pb[blockIdx.y * static_cast<int64_t>(n) + c] = b;
  }
}

// Both sums of `terms` over all m rows into out[0:n], out[n:2n], through
// 2 x chunks x n doubles of workspace.
template <class Terms>
void column_sums(Terms const& terms, int m, int n, double* out, double* workspace, cudaStream_t stream) {
  int chunks = static_cast<int>(blocks(m, kStatRows));
  double* pb = workspace + static_cast<int64_t>(chunks) * n;
  column_partials_kernel<<<dim3(blocks(n, 32), chunks), dim3(32, 8), 0, stream>>>(terms, m, n, workspace, pb);
  check_cuda(cudaGetLastError(), "column_partials");
  reduce_partials(workspace, pb, chunks, n, n, out, stream);
}

// Column c's statistics of z = h * scale, in fp64 (var is biased, as BN normalizes).
struct Moments {
  double mean_h, mean_z, var_z;
};

__device__ Moments moments(double const* stats, float const* scale, double count, int n, int c) {
  double mean_h = stats[c] / count;
  double var_h = fmax(stats[n + c] / count - mean_h * mean_h, 0.0);
  double s = scale[c];
  return {mean_h, s * mean_h, s * s * var_h};
}

// Per-column constants of y = (h - mean_h) * mul + b, rounded once to A.
template <class A>
struct Column {
  A mean_h, mul, b;
};

template <class A, class P>
__device__ Column<A> column(FinalizeArgs const& a, int c) {
  Moments mo = moments(a.stats, a.scale, a.count, a.n, c);
  double invstd = 1.0 / sqrt(mo.var_z + a.eps);
  double w = a.weight ? to_float(static_cast<P const*>(a.weight)[c]) : 1.0;
  if (blockIdx.y == 0 && threadIdx.y == 0) {
    a.save_mean[c] = mo.mean_h;
    a.save_invstd[c] = invstd;
  }
  Column<A> col;
  col.mean_h = static_cast<A>(mo.mean_h);
  col.mul = static_cast<A>(a.scale[c] * invstd * w);
  col.b = a.bias ? to_float(static_cast<P const*>(a.bias)[c]) : 0.f;
  return col;
}

template <class P>
__global__ void update_running_kernel(int n, double const* __restrict__ stats, float const* __restrict__ scale,
                                      double count, P* rm, P* rv, int64_t const* nbt, double momentum) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= n) return;
  Moments mo = moments(stats, scale, count, n, c);
  double unbiased = mo.var_z * count / (count - 1);
  double m = nbt ? 1.0 / static_cast<double>(*nbt) : momentum;
  rm[c] = from_float<P>(static_cast<float>((1 - m) * to_float(rm[c]) + m * mo.mean_z));
  rv[c] = from_float<P>(static_cast<float>((1 - m) * to_float(rv[c]) + m * unbiased));
}

// Block: 32 column groups of V columns x 8 row lanes. V = 16 bytes of T when
// every row start is 16-byte aligned, else 1.
template <class T, class P, int V>
__global__ void finalize_normalize_kernel(FinalizeArgs a) {
  int c0 = (blockIdx.x * 32 + threadIdx.x) * V;
  if (c0 >= a.n) return;
  using A = Acc<T>;
  Column<A> col[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    if (c0 + v < a.n) {
      col[v] = column<A, P>(a, c0 + v);
    }
  }
  auto const* h = static_cast<T const*>(a.h);
  auto* y = static_cast<T*>(a.y);
  for (int64_t r = blockIdx.y * 8 + threadIdx.y; r < a.m; r += gridDim.y * 8) {
    if constexpr (V > 1) {
      // n % V == 0 here, so a group is either whole or past the end.
      alignas(16) T in[V];
      alignas(16) T out[V];
      *reinterpret_cast<uint4*>(in) = *reinterpret_cast<uint4 const*>(h + r * a.ldh + c0);
#pragma unroll
      for (int v = 0; v < V; ++v) out[v] = from_float<T>((A(to_float(in[v])) - col[v].mean_h) * col[v].mul + col[v].b);
      *reinterpret_cast<uint4*>(y + r * a.n + c0) = *reinterpret_cast<uint4*>(out);
    } else {
      y[r * a.n + c0] = from_float<T>((A(to_float(h[r * a.ldh + c0])) - col[0].mean_h) * col[0].mul + col[0].b);
    }
  }
}

// Per-column constants of dh = a dy + b (h - mean_h) + c.
template <class A>
struct GradColumn {
  A mean_h, a, b, c;
};

template <class A, class P>
__device__ GradColumn<A> grad_column(BackwardArgs const& g, double const* sums, int c) {
  double sdy = sums[c], q = sums[g.n + c], count = g.m;
  double s = g.scale[c], istd = g.invstd[c];
  double w = g.weight ? to_float(static_cast<P const*>(g.weight)[c]) : 1.0;
  double a = s * w * istd;
  if (blockIdx.y == 0 && threadIdx.y == 0) {
    g.dbias[c] = static_cast<float>(sdy);
    g.dweight[c] = static_cast<float>(istd * s * q);
    // sum_i dz_i h_i = w istd q (1 - istd^2 var(z)) = w istd q eps istd^2: BN is
    // invariant to scale but for eps, and this form has no cancellation.
    g.dscale[c] = static_cast<float>(w * istd * q * g.eps * istd * istd);
  }
  return {static_cast<A>(g.mean_h[c]), static_cast<A>(a), static_cast<A>(-a * s * s * istd * istd * q / count),
          static_cast<A>(-a * sdy / count)};
}

template <class T, class P, int V>
__global__ void grad_input_kernel(BackwardArgs g, double const* __restrict__ sums) {
  int c0 = (blockIdx.x * 32 + threadIdx.x) * V;
  if (c0 >= g.n) return;
  using A = Acc<T>;
  GradColumn<A> col[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    if (c0 + v < g.n) col[v] = grad_column<A, P>(g, sums, c0 + v);
  }
  auto const* dy = static_cast<T const*>(g.dy);
  auto const* h = static_cast<T const*>(g.h);
  auto* dh = static_cast<T*>(g.dh);
  for (int64_t r = blockIdx.y * 8 + threadIdx.y; r < g.m; r += gridDim.y * 8) {
    if constexpr (V > 1) {
      alignas(16) T in_dy[V];
      alignas(16) T in_h[V];
      alignas(16) T out[V];
      *reinterpret_cast<uint4*>(in_dy) = *reinterpret_cast<uint4 const*>(dy + r * g.n + c0);
      *reinterpret_cast<uint4*>(in_h) = *reinterpret_cast<uint4 const*>(h + r * g.ldh + c0);
#pragma unroll
      for (int v = 0; v < V; ++v)
        out[v] = from_float<T>(col[v].a * A(to_float(in_dy[v])) + col[v].b * (A(to_float(in_h[v])) - col[v].mean_h) +
                               col[v].c);
      *reinterpret_cast<uint4*>(dh + r * g.n + c0) = *reinterpret_cast<uint4*>(out);
    } else {
      GradColumn<A> const& k = col[0];
      dh[r * g.n + c0] =
          from_float<T>(k.a * A(to_float(dy[r * g.n + c0])) + k.b * (A(to_float(h[r * g.ldh + c0])) - k.mean_h) + k.c);
    }
  }
}

// Launches an elementwise row pass over m x n: 32 column groups x 8 row lanes
// a block, a group V columns wide (16 bytes of T) when n, ld and every pointer
// allow it, else 1. Enough row blocks to fill the GPU several times over; each
// re-derives its columns' constants, which costs a few loads.
template <class T, class Launch>
void launch_rows(int m, int n, int64_t ld, std::initializer_list<void const*> ptrs, Launch&& launch) {
  constexpr int V = 16 / sizeof(T);
  bool vec = n % V == 0 && ld % V == 0;
  for (void const* p : ptrs) vec = vec && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  unsigned gx = blocks(n, 32 * (vec ? V : 1));
  dim3 grid(gx, std::max(1u, std::min(blocks(m, 8), 1024u / gx + 1)));
  if (vec)
    launch(std::integral_constant<int, V>{}, grid);
  else
    launch(std::integral_constant<int, 1>{}, grid);
}

template <class P>
__global__ void fold_eval_kernel(int n, float const* __restrict__ scale, P const* __restrict__ w,
                                 P const* __restrict__ b, P const* __restrict__ rm, P const* __restrict__ rv,
                                 double eps, float* __restrict__ out_a, float* __restrict__ out_c) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= n) return;
  double g = (w ? to_float(w[c]) : 1.0) / sqrt(static_cast<double>(to_float(rv[c])) + eps);
  out_a[c] = static_cast<float>(scale[c] * g);
  out_c[c] = static_cast<float>((b ? to_float(b[c]) : 0.0) - to_float(rm[c]) * g);
}

}  // namespace

void reduce_partials(double const* partial_sum, double const* partial_sumsq, int rows, int64_t ld, int n,
                     double* stats, cudaStream_t stream) {
  reduce_partials_kernel<<<blocks(n, 256), 256, 0, stream>>>(partial_sum, partial_sumsq, rows, ld, n, stats);
  check_cuda(cudaGetLastError(), "reduce_partials");
}

size_t column_stats_workspace(int m, int n) {
  return 2 * sizeof(double) * static_cast<size_t>(blocks(m, kStatRows)) * n;
}

void column_stats(DType dt, void const* h, int m, int n, int64_t ldh, double* stats, void* workspace,
                  cudaStream_t stream) {
  dispatch(dt, [&](auto t) {
    using T = decltype(t);
    column_sums(SumSquares<T>{static_cast<T const*>(h), ldh}, m, n, stats, static_cast<double*>(workspace), stream);
  });
}

void finalize_normalize(FinalizeArgs const& a, cudaStream_t stream) {
  dispatch(a.dt, [&](auto t) {
    using T = decltype(t);
    dispatch(a.param_dt, [&](auto p) {
      using P = decltype(p);
      launch_rows<T>(a.m, a.n, a.ldh, {a.h, a.y}, [&](auto v, dim3 grid) {
        finalize_normalize_kernel<T, P, decltype(v)::value><<<grid, dim3(32, 8), 0, stream>>>(a);
      });
    });
  });
  check_cuda(cudaGetLastError(), "finalize_normalize");
}

size_t batch_norm_backward_workspace(int m, int n) {
  return column_stats_workspace(m, n) + 2 * sizeof(double) * static_cast<size_t>(n);
}

void batch_norm_backward(BackwardArgs const& g, cudaStream_t stream) {
  auto* sums = static_cast<double*>(g.workspace);
  auto* partials = sums + 2 * static_cast<int64_t>(g.n);
  dispatch(g.dt, [&](auto t) {
    using T = decltype(t);
    GradSums<T> terms{static_cast<T const*>(g.dy), static_cast<T const*>(g.h), g.ldh, g.n, g.mean_h};
    column_sums(terms, g.m, g.n, sums, partials, stream);
    dispatch(g.param_dt, [&](auto p) {
      using P = decltype(p);
      launch_rows<T>(g.m, g.n, g.ldh, {g.h, g.dy, g.dh}, [&](auto v, dim3 grid) {
        grad_input_kernel<T, P, decltype(v)::value><<<grid, dim3(32, 8), 0, stream>>>(g, sums);
      });
    });
  });
  check_cuda(cudaGetLastError(), "batch_norm_backward");
}

void update_running_stats(DType param_dt, int n, double const* stats, float const* scale, double count,
                          void* running_mean, void* running_var, int64_t const* num_batches_tracked,
                          double momentum, cudaStream_t stream) {
  dispatch(param_dt, [&](auto p) {
    using P = decltype(p);
    update_running_kernel<P><<<blocks(n, 256), 256, 0, stream>>>(n, stats, scale, count, static_cast<P*>(running_mean),
                                                                  static_cast<P*>(running_var), num_batches_tracked,
                                                                  momentum);
  });
  check_cuda(cudaGetLastError(), "update_running_stats");
}

void fold_eval(DType param_dt, int n, float const* scale, void const* weight, void const* bias,
               void const* running_mean, void const* running_var, double eps, float* out_a, float* out_c,
               cudaStream_t stream) {
  dispatch(param_dt, [&](auto p) {
    using P = decltype(p);
    fold_eval_kernel<P><<<blocks(n, 256), 256, 0, stream>>>(
        n, scale, static_cast<P const*>(weight), static_cast<P const*>(bias), static_cast<P const*>(running_mean),
        static_cast<P const*>(running_var), eps, out_a, out_c);
  });
  check_cuda(cudaGetLastError(), "fold_eval");
}

}  // namespace cutlass_fused
