#include "kernels/check.h"
#include "kernels/grid.h"
#include "kernels/tf32x3.h"

#include <algorithm>

namespace cutlass_fused {
namespace {

// x rounded to nearest (ties to even) TF32: 10 stored significand bits, the low
// 13 bits zero, so the tensor core reads it exactly. Non-finite values pass
// through; a finite value that would round up to infinity is truncated instead.
__device__ __forceinline__ float tf32_round(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return x;
  uint32_t r = (u + 0x0fffu + ((u >> 13) & 1u)) & 0xffffe000u;
  if ((r & 0x7f800000u) == 0x7f800000u) r = u & 0xffffe000u;
  return __uint_as_float(r);
}

// `again` is big in the segment that meets the other operand's small part: 0 for a non-finite
// x, so that x reaches the dot product once (x * the other's big part), as in an fp32 GEMM;
// otherwise inf * small, with small of either sign, makes inf - inf = NaN.
struct Parts {
  float big, small, again;
};

__device__ __forceinline__ Parts split(float x) {
  float big = tf32_round(x);
  // x - big is exact in fp32; inf - inf would be NaN, so a non-finite x keeps it all in big.
  bool finite = isfinite(x);
  float small = finite ? tf32_round(x - big) : 0.f;
  return {big, small, finite ? big : 0.f};
}

__device__ __forceinline__ float4 part(Parts const (&p)[4], float Parts::*which) {
  return {p[0].*which, p[1].*which, p[2].*which, p[3].*which};
}

// 4 adjacent values of a row from column c0, zero past the row's end or on a padding row: one
// 16-byte load where the row allows it (`vector`: in and ld_in 16-byte aligned).
__device__ __forceinline__ void load4(float const* src, int64_t c0, int64_t cols, bool in_row, bool vector,
                                      float (&v)[4]) {
  if (in_row && vector && c0 + 4 <= cols) {
    float4 q = __ldg(reinterpret_cast<float4 const*>(src + c0));
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    return;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = in_row && c0 + i < cols ? src[c0 + i] : 0.f;
}

// A thread splits 4 adjacent values of a row (load4) with three 16-byte streaming stores, since the
// GEMM reads `out` only after the whole pass. Rows stride over blockIdx.y, so that no thread
// divides by the row length.
__global__ void split_rows_kernel(float const* __restrict__ in, int64_t rows_in, int64_t cols, int64_t ld_in,
                                  bool vector, int64_t rows_out, int64_t seg, SplitOrder order,
                                  float* __restrict__ out) {
  int64_t groups = seg / 4;
  bool small_first = order == SplitOrder::small_big_big;
  for (int64_t r = blockIdx.y; r < rows_out; r += gridDim.y) {
    float const* src = in + r * ld_in;
    float* row = out + r * 3 * seg;
    for (int64_t g = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; g < groups; g += int64_t{gridDim.x} * blockDim.x) {
      int64_t c0 = g * 4;
      float v[4];
      load4(src, c0, cols, r < rows_in, vector, v);
      Parts p[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) p[i] = split(v[i]);
      // split(0) is all zeros, so padding columns and rows come out zero.
      __stcs(reinterpret_cast<float4*>(row + c0), part(p, small_first ? &Parts::small : &Parts::again));
      __stcs(reinterpret_cast<float4*>(row + seg + c0), part(p, small_first ? &Parts::again : &Parts::small));
      __stcs(reinterpret_cast<float4*>(row + 2 * seg + c0), part(p, &Parts::big));
    }
  }
}

// The same split of a transposed input (stride_r == 1): 32 x 32 tiles through
// shared memory, so that both the reads and the writes are coalesced.
__global__ void split_transposed_kernel(float const* __restrict__ in, int64_t rows_in, int64_t cols, int64_t stride_c,
                                        int64_t rows_out, int64_t seg, SplitOrder order, float* __restrict__ out) {
  __shared__ float tile[32][33];
  int64_t c_base = blockIdx.x * int64_t{32}, r_base = blockIdx.y * int64_t{32};
  for (int j = threadIdx.y; j < 32; j += 8) {
    int64_t r = r_base + threadIdx.x, c = c_base + j;
    tile[j][threadIdx.x] = r < rows_in && c < cols ? in[r + c * stride_c] : 0.f;
  }
  __syncthreads();
  for (int j = threadIdx.y; j < 32; j += 8) {
    int64_t r = r_base + j, c = c_base + threadIdx.x;
    if (r >= rows_out || c >= seg) continue;
    Parts p = split(tile[threadIdx.x][j]);
    float* row = out + r * 3 * seg + c;
    bool small_first = order == SplitOrder::small_big_big;
    row[0] = small_first ? p.small : p.again;
    row[seg] = small_first ? p.again : p.small;
    row[2 * seg] = p.big;
  }
}

// w - tf32(w), rounded to TF32, for a finite w; see tf32_remainder_rows.
__device__ __forceinline__ float remainder(float w, bool& inf) {
  uint32_t u = __float_as_uint(w);
  if ((u & 0x7f800000u) != 0x7f800000u) return tf32_round(w - __uint_as_float(u & 0xffffe000u));
  bool nan = (u & 0x007fffffu) != 0;
  inf |= !nan;
  return nan ? __uint_as_float(0x7fc00000u) : 0.f;
}

// A thread takes 4 adjacent values of a row, as split_rows_kernel does, with one 16-byte streaming
// store.
__global__ void remainder_rows_kernel(float const* __restrict__ in, int64_t rows, int64_t cols, int64_t ld,
                                      bool vector, float* __restrict__ rest, unsigned char* __restrict__ flags) {
  int64_t groups = ld / 4;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    float const* src = in + r * ld;
    bool inf = false;
    for (int64_t g = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; g < groups; g += int64_t{gridDim.x} * blockDim.x) {
      int64_t c0 = g * 4;
      float v[4];
      load4(src, c0, cols, true, vector, v);
      float4 o = {remainder(v[0], inf), remainder(v[1], inf), remainder(v[2], inf), remainder(v[3], inf)};
      __stcs(reinterpret_cast<float4*>(rest + r * ld + c0), o);
    }
    // flags were zeroed before the launch; any thread that saw an infinity marks the row.
    if (inf) flags[r] = 1;
  }
}

}  // namespace

void tf32_remainder_rows(float const* in, int64_t rows, int64_t cols, int64_t ld, float* rest, unsigned char* flags,
                         cudaStream_t stream) {
  if (rows == 0) return;
  check_cuda(cudaMemsetAsync(flags, 0, rows, stream), "tf32_remainder_rows");
  unsigned bx = strided_grid(ld / 4, 256, 64);
  unsigned by = strided_grid(rows, 1, std::max<int64_t>(1, 8192 / bx));
  bool vector = ld % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0;
  remainder_rows_kernel<<<dim3(bx, by), 256, 0, stream>>>(in, rows, cols, ld, vector, rest, flags);
  check_cuda(cudaGetLastError(), "tf32_remainder_rows");
}

void split_tf32_rows(float const* in, int64_t rows_in, int64_t cols, int64_t stride_r, int64_t stride_c,
                     int64_t rows_out, int64_t seg, SplitOrder order, float* out, cudaStream_t stream) {
  if (stride_c == 1) {
    // About 8k blocks of 256 threads: several waves on any current GPU, each block a row or more.
    unsigned bx = strided_grid(seg / 4, 256, 64);
    unsigned by = strided_grid(rows_out, 1, std::max<int64_t>(1, 8192 / bx));
    bool vector = stride_r % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0;
    split_rows_kernel<<<dim3(bx, by), 256, 0, stream>>>(in, rows_in, cols, stride_r, vector, rows_out, seg, order, out);
  } else {
    dim3 grid(static_cast<unsigned>((seg + 31) / 32), static_cast<unsigned>((rows_out + 31) / 32));
    split_transposed_kernel<<<grid, dim3(32, 8), 0, stream>>>(in, rows_in, cols, stride_c, rows_out, seg, order, out);
  }
  check_cuda(cudaGetLastError(), "split_tf32_rows");
}

}  // namespace cutlass_fused
