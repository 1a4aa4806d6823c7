#include "kernels/check.h"
#include "kernels/grid.h"
#include "kernels/tf32x3.h"

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

__global__ void split_rows_kernel(float const* __restrict__ in, int64_t rows_in, int64_t cols, int64_t ld_in,
                                  int64_t rows_out, int64_t seg, SplitOrder order, float* __restrict__ out) {
  int64_t groups = seg / 4, total = rows_out * groups;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    int64_t r = i / groups, c0 = (i - r * groups) * 4;
    float4 big{0.f, 0.f, 0.f, 0.f}, small{0.f, 0.f, 0.f, 0.f}, again{0.f, 0.f, 0.f, 0.f};
    float* b = &big.x;
    float* s = &small.x;
    float* a = &again.x;
    if (r < rows_in) {
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        if (c0 + v < cols) {
          Parts p = split(in[r * ld_in + c0 + v]);
          b[v] = p.big;
          s[v] = p.small;
          a[v] = p.again;
        }
      }
    }
    float4* row = reinterpret_cast<float4*>(out + r * 3 * seg + c0);
    int64_t step = seg / 4;
    bool small_first = order == SplitOrder::small_big_big;
    row[0] = small_first ? small : again;
    row[step] = small_first ? again : small;
    row[2 * step] = big;
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

}  // namespace

void split_tf32_rows(float const* in, int64_t rows_in, int64_t cols, int64_t stride_r, int64_t stride_c,
                     int64_t rows_out, int64_t seg, SplitOrder order, float* out, cudaStream_t stream) {
  if (stride_c == 1) {
    split_rows_kernel<<<strided_grid(rows_out * (seg / 4), 256, 4096), 256, 0, stream>>>(in, rows_in, cols, stride_r,
                                                                                          rows_out, seg, order, out);
  } else {
    dim3 grid(static_cast<unsigned>((seg + 31) / 32), static_cast<unsigned>((rows_out + 31) / 32));
    split_transposed_kernel<<<grid, dim3(32, 8), 0, stream>>>(in, rows_in, cols, stride_c, rows_out, seg, order, out);
  }
  check_cuda(cudaGetLastError(), "split_tf32_rows");
}

}  // namespace cutlass_fused
