#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernels/check.h"
#include "kernels/fp8_cast.h"

namespace cutlass_fused {
namespace {

constexpr float kE4M3Max = 448.f;
constexpr float kMaxExponent = 126.f;  // fp8.MAX_EXPONENT: scales stay normal fp32
constexpr int kThreads = 256;

__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// |v|'s bits: their unsigned order is |v|'s, with NaN above +inf above every finite value, so
// an atomicMax over them gives torch's abs().amax() (NaN wherever a NaN is).
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

template <typename T, int V>
__global__ void amax_kernel(T const* __restrict__ t, int64_t n, unsigned* __restrict__ amax) {
  unsigned m = 0;
  int64_t stride = int64_t{gridDim.x} * kThreads, first = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  auto packs = reinterpret_cast<Pack<T, V> const*>(t);
  for (int64_t i = first; i < n / V; i += stride) {
    Pack<T, V> p = packs[i];
#pragma unroll
    for (int j = 0; j < V; ++j) m = max(m, abs_bits(widen(p.v[j])));
  }
  for (int64_t i = n / V * V + first; i < n; i += stride) m = max(m, abs_bits(widen(t[i])));
#pragma unroll
  for (int off = 16; off > 0; off /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
  __shared__ unsigned warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) m = max(m, warp_max[w]);
    atomicMax(amax, m);
  }
}

// fp8.scale_from_amax with a fallback of 1, in torch's fp32 operations: Python's 448 / amax is
// torch's amax.reciprocal() * 448 (Tensor.__rtruediv__), two roundings, not one division.
__device__ __forceinline__ float scale_of(unsigned amax_bits, int margin) {
  float amax = __uint_as_float(amax_bits);
  if (amax_bits == 0 || amax_bits >= 0x7f800000u) return 1.f;
  float e = floorf(log2f((1.f / amax) * kE4M3Max)) - static_cast<float>(margin);
  return exp2f(fminf(fmaxf(e, -kMaxExponent), kMaxExponent));
}

__device__ __forceinline__ uint8_t to_e4m3(float v) {
  // The clamp is the saturation fp8.quantize applies before torch's cast, which would make an
  // overflow NaN; a non-finite product becomes NaN (0x7f), not 448.
  if (!isfinite(v)) return 0x7f;
  return __nv_cvt_float_to_fp8(fminf(fmaxf(v, -kE4M3Max), kE4M3Max), __NV_SATFINITE, __NV_E4M3);
}

template <typename T, int V>
__global__ void cast_kernel(T const* __restrict__ t, int64_t n, unsigned const* __restrict__ amax, int margin,
                            float* __restrict__ scale_out, uint8_t* __restrict__ out) {
  float s = scale_of(*amax, margin);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_out = s;
  int64_t stride = int64_t{gridDim.x} * kThreads, first = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  auto packs = reinterpret_cast<Pack<T, V> const*>(t);
  auto out_packs = reinterpret_cast<Pack<uint8_t, V>*>(out);
  for (int64_t i = first; i < n / V; i += stride) {
    Pack<T, V> p = packs[i];
    Pack<uint8_t, V> q;
#pragma unroll
    for (int j = 0; j < V; ++j) q.v[j] = to_e4m3(widen(p.v[j]) * s);
    out_packs[i] = q;
  }
  for (int64_t i = n / V * V + first; i < n; i += stride) out[i] = to_e4m3(widen(t[i]) * s);
}

// Enough blocks to fill any current GPU several times over; the loops stride over the rest.
unsigned grid_for(int64_t packs) {
  int64_t blocks = (packs + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 2048 ? (blocks > 0 ? blocks : 1) : 2048);
}

template <typename T>
void run(void const* t_, int64_t n, int margin, unsigned* amax, float* scale, uint8_t* out, cudaStream_t stream) {
  auto t = static_cast<T const*>(t_);
  constexpr int V = 16 / sizeof(T);  // 16-byte loads, V-byte stores
  bool packed = reinterpret_cast<uintptr_t>(t) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % V == 0;
  check_cuda(cudaMemsetAsync(amax, 0, sizeof(unsigned), stream), "quantize_e4m3 (amax reset)");
  if (packed) {
    amax_kernel<T, V><<<grid_for(n / V), kThreads, 0, stream>>>(t, n, amax);
    cast_kernel<T, V><<<grid_for(n / V), kThreads, 0, stream>>>(t, n, amax, margin, scale, out);
  } else {
    amax_kernel<T, 1><<<grid_for(n), kThreads, 0, stream>>>(t, n, amax);
    cast_kernel<T, 1><<<grid_for(n), kThreads, 0, stream>>>(t, n, amax, margin, scale, out);
  }
  check_cuda(cudaGetLastError(), "quantize_e4m3");
}

}  // namespace

void quantize_e4m3(void const* t, DType dtype, int64_t n, int margin, unsigned* amax_bits, float* scale,
                   uint8_t* out, cudaStream_t stream) {
  switch (dtype) {
    case DType::bf16: return run<__nv_bfloat16>(t, n, margin, amax_bits, scale, out, stream);
    case DType::f16: return run<__half>(t, n, margin, amax_bits, scale, out, stream);
    case DType::f32: return run<float>(t, n, margin, amax_bits, scale, out, stream);
  }
}

}  // namespace cutlass_fused
