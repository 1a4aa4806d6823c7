#include "kernels/check.h"
#include "kernels/grid.h"
#include "kernels/inf_fix.h"

namespace cutlass_fused {
namespace {

// One warp a row: any lane that sees an infinity sets the flag. The loads must
// not wait on one another (a short-circuit `inf || isinf(...)` made them, and the
// flags latency-bound; docs/decisions.md, "Inf fix on sm80"), so several are in flight.
__global__ void flag_inf_rows_kernel(float const* __restrict__ t, int64_t rows, int64_t cols, int64_t ld,
                                     unsigned char* __restrict__ flags) {
  int lane = threadIdx.x % 32;
  int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t r = blockIdx.x * int64_t{blockDim.x / 32} + threadIdx.x / 32; r < rows; r += warps) {
    unsigned inf = 0;
#pragma unroll 8
    for (int64_t c = lane; c < cols; c += 32) inf |= isinf(t[r * ld + c]) ? 1u : 0u;
    inf = __any_sync(0xffffffffu, inf != 0);
    if (lane == 0) flags[r] = static_cast<unsigned char>(inf);
  }
}

// The class of sum_k x[k] w[k] in fp32 arithmetic where a product is not finite:
// NaN if a product is NaN (inf * 0, or a NaN operand) or infinities of both signs
// meet, else the infinity's sign; `finite` (the GEMM's value stands) where no
// product is. A warp's lanes split k.
__device__ bool inf_dot(float const* __restrict__ x, float const* __restrict__ w, int k, float& out) {
  bool nan = false, pos = false, neg = false;
  for (int i = threadIdx.x % 32; i < k; i += 32) {
    float p = x[i] * w[i];
    nan |= isnan(p);
    pos |= p == INFINITY;
    neg |= p == -INFINITY;
  }
  nan = __any_sync(0xffffffffu, nan);
  pos = __any_sync(0xffffffffu, pos);
  neg = __any_sync(0xffffffffu, neg);
  out = nan || (pos && neg) ? NAN : pos ? INFINITY : -INFINITY;
  return nan || pos || neg;
}

// Every output of one flagged line, one warp each.
__device__ void fix_line(InfFixArgs const& a, int64_t line, int lane, int warp, int warps) {
  bool is_x = line < a.m;
  int other = is_x ? a.n : a.m;
  for (int o = warp; o < other; o += warps) {
    int64_t i = is_x ? line : o, j = is_x ? o : line - a.m;
    float h;
    if (inf_dot(a.x + i * a.ldx, a.w + j * a.ldw, a.k, h) && lane == 0) {
      float bias = a.b ? a.b[j] : 0.f, mul = a.a ? a.a[j] : 1.f, add = a.c ? a.c[j] : 0.f;
      a.out[i * a.ldo + j] = (h + bias) * mul + add;
    }
  }
}

__device__ __forceinline__ bool flagged(InfFixArgs const& a, int64_t line) {
  return line < a.m ? a.x_flags[line] : a.w_flags[line - a.m];
}

// Lines 0 .. m-1 are x's rows, m .. m+n-1 W's. A block reads a chunk of
// blockDim.x lines' flags at once and, where one is set, recomputes that
// line's outputs one warp each; a clean chunk costs one coalesced read.
__global__ void fix_inf_products_kernel(InfFixArgs a) {
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int64_t lines = int64_t{a.m} + a.n;
  for (int64_t base = blockIdx.x * int64_t{blockDim.x}; base < lines; base += int64_t{gridDim.x} * blockDim.x) {
    int64_t mine = base + threadIdx.x;
    if (!__syncthreads_or(mine < lines && flagged(a, mine))) continue;
    for (int64_t line = base; line < base + blockDim.x && line < lines; ++line) {
      if (!flagged(a, line)) continue;  // the same answer in every thread
      fix_line(a, line, lane, warp, warps);
    }
  }
}

}  // namespace

void flag_inf_rows(float const* t, int64_t rows, int64_t cols, int64_t ld, unsigned char* flags,
                   cudaStream_t stream) {
  if (rows == 0) return;
  flag_inf_rows_kernel<<<strided_grid(rows, 8, 4096), 256, 0, stream>>>(t, rows, cols, ld, flags);
  check_cuda(cudaGetLastError(), "flag_inf_rows");
}

void fix_inf_products(InfFixArgs const& a, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return;
  int64_t chunks = (int64_t{a.m} + a.n + 255) / 256;
  fix_inf_products_kernel<<<static_cast<unsigned>(chunks < 1024 ? chunks : 1024), 256, 0, stream>>>(a);
  check_cuda(cudaGetLastError(), "fix_inf_products");
}

}  // namespace cutlass_fused
