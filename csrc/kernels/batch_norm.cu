#include <algorithm>

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

// 32 columns x 8 row lanes a block; each lane walks its rows of one chunk in
// order and the lanes are combined in order, so the result is bitwise stable.
constexpr int kStatRows = 256;  // rows per chunk

template <class T>
__global__ void column_partials_kernel(T const* __restrict__ z, int m, int n, int64_t ldz, double* __restrict__ psum,
                                       double* __restrict__ psumsq) {
  __shared__ double sh[2][8][32];
  int c = blockIdx.x * 32 + threadIdx.x;
  int r0 = blockIdx.y * kStatRows;
  int r1 = min(m, r0 + kStatRows);
  double s = 0, q = 0;
  if (c < n) {
    for (int r = r0 + threadIdx.y; r < r1; r += 8) {
      double v = to_float(z[r * ldz + c]);
      s += v;
      q += v * v;
    }
  }
  sh[0][threadIdx.y][threadIdx.x] = s;
  sh[1][threadIdx.y][threadIdx.x] = q;
  __syncthreads();
  if (threadIdx.y == 0 && c < n) {
    for (int i = 1; i < 8; ++i) {
      s += sh[0][i][threadIdx.x];
      q += sh[1][i][threadIdx.x];
    }
    psum[blockIdx.y * static_cast<int64_t>(n) + c] = s;
    psumsq[blockIdx.y * static_cast<int64_t>(n) + c] = q;
  }
}

// Per-column constants of the normalization, in fp64 then rounded once.
struct Column {
  float mean, invstd, w, b;
};

template <class P>
__device__ Column column(FinalizeArgs const& a, int c) {
  double mean = a.stats[c] / a.count;
  double var = fmax(a.stats[a.n + c] / a.count - mean * mean, 0.0);  // biased, as BN normalizes
  Column col;
  col.mean = static_cast<float>(mean);
  col.invstd = static_cast<float>(1.0 / sqrt(var + a.eps));
  col.w = a.weight ? to_float(static_cast<P const*>(a.weight)[c]) : 1.f;
  col.b = a.bias ? to_float(static_cast<P const*>(a.bias)[c]) : 0.f;
  return col;
}

template <class P>
__device__ void update_running(FinalizeArgs const& a, int c, Column const& col) {
  a.save_mean[c] = col.mean;
  a.save_invstd[c] = col.invstd;
  if (a.running_mean == nullptr) return;
  double mean = a.stats[c] / a.count;
  double var = fmax(a.stats[a.n + c] / a.count - mean * mean, 0.0);
  double unbiased = var * a.count / (a.count - 1);
  double m = a.num_batches_tracked ? 1.0 / static_cast<double>(*a.num_batches_tracked) : a.momentum;
  auto* rm = static_cast<P*>(a.running_mean);
  auto* rv = static_cast<P*>(a.running_var);
  rm[c] = from_float<P>(static_cast<float>((1 - m) * to_float(rm[c]) + m * mean));
  rv[c] = from_float<P>(static_cast<float>((1 - m) * to_float(rv[c]) + m * unbiased));
}

// Block: 32 column groups of V columns x 8 row lanes. V = 16 bytes of T when
// every row start is 16-byte aligned, else 1.
template <class T, class P, int V>
__global__ void finalize_normalize_kernel(FinalizeArgs a) {
  int c0 = (blockIdx.x * 32 + threadIdx.x) * V;
  if (c0 >= a.n) return;
  Column col[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    if (c0 + v < a.n) {
      col[v] = column<P>(a, c0 + v);
      if (blockIdx.y == 0 && threadIdx.y == 0) update_running<P>(a, c0 + v, col[v]);
    }
  }
  auto const* z = static_cast<T const*>(a.z);
  auto* y = static_cast<T*>(a.y);
  for (int64_t r = blockIdx.y * 8 + threadIdx.y; r < a.m; r += gridDim.y * 8) {
    if constexpr (V > 1) {
      // n % V == 0 here, so a group is either whole or past the end.
      alignas(16) T in[V];
      alignas(16) T out[V];
      *reinterpret_cast<uint4*>(in) = *reinterpret_cast<uint4 const*>(z + r * a.ldz + c0);
#pragma unroll
      for (int v = 0; v < V; ++v)
        out[v] = from_float<T>((to_float(in[v]) - col[v].mean) * col[v].invstd * col[v].w + col[v].b);
      *reinterpret_cast<uint4*>(y + r * a.n + c0) = *reinterpret_cast<uint4*>(out);
    } else {
      y[r * a.n + c0] = from_float<T>((to_float(z[r * a.ldz + c0]) - col[0].mean) * col[0].invstd * col[0].w + col[0].b);
    }
  }
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

void column_stats(DType dt, void const* z, int m, int n, int64_t ldz, double* stats, void* workspace,
                  cudaStream_t stream) {
  int chunks = static_cast<int>(blocks(m, kStatRows));
  auto* psum = static_cast<double*>(workspace);
  auto* psumsq = psum + static_cast<int64_t>(chunks) * n;
  dispatch(dt, [&](auto t) {
    using T = decltype(t);
    column_partials_kernel<T><<<dim3(blocks(n, 32), chunks), dim3(32, 8), 0, stream>>>(
        static_cast<T const*>(z), m, n, ldz, psum, psumsq);
  });
  check_cuda(cudaGetLastError(), "column_stats");
  reduce_partials(psum, psumsq, chunks, n, n, stats, stream);
}

void finalize_normalize(FinalizeArgs const& a, cudaStream_t stream) {
  dispatch(a.dt, [&](auto t) {
    using T = decltype(t);
    dispatch(a.param_dt, [&](auto p) {
      using P = decltype(p);
      constexpr int V = 16 / sizeof(T);
      bool vec = a.n % V == 0 && a.ldz % V == 0 && reinterpret_cast<uintptr_t>(a.z) % 16 == 0 &&
                 reinterpret_cast<uintptr_t>(a.y) % 16 == 0;
      int v = vec ? V : 1;
      // Enough row blocks to fill the GPU several times over; each re-derives
      // its columns' constants from 2 fp64 loads, which is cheap.
      unsigned gx = blocks(a.n, 32 * v);
      unsigned gy = std::max(1u, std::min(blocks(a.m, 8), 1024u / std::max(1u, gx) + 1));
      if (vec)
        finalize_normalize_kernel<T, P, V><<<dim3(gx, gy), dim3(32, 8), 0, stream>>>(a);
      else
        finalize_normalize_kernel<T, P, 1><<<dim3(gx, gy), dim3(32, 8), 0, stream>>>(a);
    });
  });
  check_cuda(cudaGetLastError(), "finalize_normalize");
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
