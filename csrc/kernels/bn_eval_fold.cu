// The eval fold: the running statistics and affine parameters as the eval GEMM epilogue's vectors.
#include "kernels/bn_common.cuh"

namespace cutlass_fused {
namespace {

__global__ void fold_eval_kernel(EvalFold f, int kn, float* __restrict__ out_a, float* __restrict__ out_c,
                                 float* __restrict__ out_s) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= kn) return;
  out_a[c] = fold_value(f, c, out_s != nullptr ? FoldPart::g : FoldPart::a);
  out_c[c] = fold_value(f, c, FoldPart::c);
  if (out_s != nullptr) out_s[c] = fold_value(f, c, FoldPart::s);
}

}  // namespace

void fold_eval(EvalFold const& f, int kn, float* out_a, float* out_c, float* out_s, cudaStream_t stream) {
  fold_eval_kernel<<<blocks(kn, 256), 256, 0, stream>>>(f, kn, out_a, out_c, out_s);
  check_cuda(cudaGetLastError(), "fold_eval");
}

}  // namespace cutlass_fused
