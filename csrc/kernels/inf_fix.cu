#include "kernels/check.h"
#include "kernels/inf_fix.h"

namespace cutlass_fused {
namespace {

// One warp a row: any lane that sees an infinity sets the flag.
__global__ void flag_inf_rows_kernel(float const* __restrict__ t, int64_t rows, int64_t cols, int64_t ld,
                                     unsigned char* __restrict__ flags) {
  int lane = threadIdx.x % 32;
  int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t r = blockIdx.x * int64_t{blockDim.x / 32} + threadIdx.x / 32; r < rows; r += warps) {
    bool inf = false;
    for (int64_t c = lane; c < cols; c += 32) inf = inf || isinf(t[r * ld + c]);
    inf = __any_sync(0xffffffffu, inf);
    if (lane == 0) flags[r] = inf;
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
    nan = nan || isnan(p);
    pos = pos || p == INFINITY;
    neg = neg || p == -INFINITY;
  }
  nan = __any_sync(0xffffffffu, nan);
  pos = __any_sync(0xffffffffu, pos);
  neg = __any_sync(0xffffffffu, neg);
  out = nan || (pos && neg) ? NAN : pos ? INFINITY : -INFINITY;
  return nan || pos || neg;
}

// Lines 0 .. m-1 are x's rows, m .. m+n-1 W's; a flagged line's outputs are
// recomputed one warp each.
__global__ void fix_inf_products_kernel(InfFixArgs a) {
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int64_t line = blockIdx.x; line < int64_t{a.m} + a.n; line += gridDim.x) {
    bool is_x = line < a.m;
    if (!(is_x ? a.x_flags[line] : a.w_flags[line - a.m])) continue;
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
}

}  // namespace

void flag_inf_rows(float const* t, int64_t rows, int64_t cols, int64_t ld, unsigned char* flags,
                   cudaStream_t stream) {
  if (rows == 0) return;
  int64_t blocks = (rows + 7) / 8;
  flag_inf_rows_kernel<<<static_cast<unsigned>(blocks < 4096 ? blocks : 4096), 256, 0, stream>>>(t, rows, cols, ld,
                                                                                                  flags);
  check_cuda(cudaGetLastError(), "flag_inf_rows");
}

void fix_inf_products(InfFixArgs const& a, cudaStream_t stream) {
  int64_t lines = int64_t{a.m} + a.n;
  if (a.m == 0 || a.n == 0) return;
  // Enough blocks to spread a few flagged lines; clean lines cost one byte each.
  fix_inf_products_kernel<<<static_cast<unsigned>(lines < 1024 ? lines : 1024), 256, 0, stream>>>(a);
  check_cuda(cudaGetLastError(), "fix_inf_products");
}

}  // namespace cutlass_fused
