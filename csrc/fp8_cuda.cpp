// FP8 current scaling on CUDA: one amax pass and one cast pass over t, no host sync.
#include "fp8_cuda.h"

#include <algorithm>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/fp8_cast.h"
#include "ops.h"

namespace cutlass_fused {

namespace {

std::tuple<at::Tensor, at::Tensor> quantize(at::Tensor const& t, int64_t margin, Fp8 format) {
  DType dt = dtype_of(t.scalar_type(), "t");
  c10::cuda::CUDAGuard guard(t.device());
  auto src = t.contiguous();
  auto out = at::empty(src.sizes(), src.options().dtype(format == Fp8::e4m3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2));
  auto scale = at::empty({}, src.options().dtype(at::kFloat));
  poison(out);
  poison(scale);
  auto amax = at::empty({}, src.options().dtype(at::kInt));
  // Past +-252 the exponent saturates at +-126 whatever the margin (fp8.scale_from_amax's clamp),
  // so a clamped margin gives the same scale and fits the kernel's int.
  int m = static_cast<int>(std::clamp<int64_t>(margin, -1000, 1000));
  quantize_fp8(src.data_ptr(), dt, format, src.numel(), m, reinterpret_cast<unsigned*>(amax.data_ptr<int>()),
               scale.data_ptr<float>(), reinterpret_cast<uint8_t*>(out.data_ptr()),
               at::cuda::getCurrentCUDAStream().stream());
  return {out, scale};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_e4m3_cuda(at::Tensor const& t, int64_t margin) {
  return quantize(t, margin, Fp8::e4m3);
}

std::tuple<at::Tensor, at::Tensor> quantize_e5m2_cuda(at::Tensor const& t, int64_t margin) {
  return quantize(t, margin, Fp8::e5m2);
}

}  // namespace cutlass_fused
