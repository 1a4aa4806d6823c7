#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cast16.h"
#include "kernels/check.h"
#include "kernels/grid.h"

namespace cutlass_fused {
namespace {

constexpr int kThreads = 256;
constexpr int kPack = 4;  // floats a 16-byte load

struct Spans {
  CastSpan s[kCastSpans];
};

template <typename Out>
__device__ __forceinline__ Out narrow(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 narrow(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half narrow(float v) {
  return __float2half_rn(v);
}

template <typename Out>
struct alignas(sizeof(Out) * kPack) OutPack {
  Out v[kPack];
};

// blockIdx.y picks the span; the blocks along x stride over it, 16-byte loads where in and out
// are aligned for them, the values past the last whole pack one at a time. The span is picked
// by constant indices: a runtime index into the parameter struct copies it to the stack.
template <typename Out>
__global__ void cast_kernel(Spans spans) {
  static_assert(kCastSpans == 3, "the pick below names each span");
  CastSpan const sp = blockIdx.y == 0 ? spans.s[0] : blockIdx.y == 1 ? spans.s[1] : spans.s[2];
  auto in = sp.in;
  auto out = static_cast<Out*>(sp.out);
  int64_t stride = int64_t{gridDim.x} * kThreads, first = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  bool packed = reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % (2 * kPack) == 0;
  int64_t whole = packed ? sp.n / kPack : 0;
  for (int64_t i = first; i < whole; i += stride) {
    float4 p = reinterpret_cast<float4 const*>(in)[i];
    OutPack<Out> q;
    q.v[0] = narrow<Out>(p.x);
    q.v[1] = narrow<Out>(p.y);
    q.v[2] = narrow<Out>(p.z);
    q.v[3] = narrow<Out>(p.w);
    reinterpret_cast<OutPack<Out>*>(out)[i] = q;
  }
  for (int64_t i = whole * kPack + first; i < sp.n; i += stride) out[i] = narrow<Out>(in[i]);
}

}  // namespace

void cast_to_16(CastSpan const (&spans)[kCastSpans], DType out, cudaStream_t stream) {
  Spans all{};
  int64_t largest = 0;
  for (int i = 0; i < kCastSpans; ++i) {
    all.s[i] = spans[i];
    largest = std::max(largest, spans[i].n);
  }
  if (largest == 0) return;
  // A pack a thread per step; the cap fills any current GPU several times over.
  dim3 grid(strided_grid((largest + kPack - 1) / kPack, kThreads, 4096), kCastSpans);
  if (out == DType::bf16) {
    cast_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(all);
  } else {
    cast_kernel<__half><<<grid, kThreads, 0, stream>>>(all);
  }
  check_cuda(cudaGetLastError(), "cast_to_16");
}

}  // namespace cutlass_fused
