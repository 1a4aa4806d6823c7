// The eval fold: the running statistics and affine parameters as the eval GEMM epilogue's vectors.
#include "kernels/bn_common.cuh"

namespace cutlass_fused {
namespace {

__global__ void fold_eval_kernel(int n, int kn, ColVec scale, ColVec w, ColVec b, ColVec rm, ColVec rv, double eps,
                                 float* __restrict__ out_a, float* __restrict__ out_c, float* __restrict__ out_s) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= kn) return;
  if (c >= n) {
    out_a[c] = out_c[c] = 0.0f;
    if (out_s != nullptr) out_s[c] = 0.0f;
    return;
  }
  double g = load(w, c, 1.0) / sqrt(load(rv, c, 1.0) + eps);
  if (out_s != nullptr) out_s[c] = static_cast<float>(load(scale, c, 1.0));
  out_a[c] = static_cast<float>(out_s != nullptr ? g : load(scale, c, 1.0) * g);
  out_c[c] = static_cast<float>(load(b, c, 0.0) - load(rm, c, 0.0) * g);
}

}  // namespace

void fold_eval(int n, int kn, ColVec scale, ColVec weight, ColVec bias, ColVec running_mean, ColVec running_var,
               double eps, float* out_a, float* out_c, float* out_s, cudaStream_t stream) {
  fold_eval_kernel<<<blocks(kn, 256), 256, 0, stream>>>(n, kn, scale, weight, bias, running_mean, running_var, eps,
                                                        out_a, out_c, out_s);
  check_cuda(cudaGetLastError(), "fold_eval");
}

}  // namespace cutlass_fused
