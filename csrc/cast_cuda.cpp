// cast_linear_inputs on CUDA: the contiguous fp32 operands in one launch of
// kernels/cast16.h, any other that autocast casts (a 16-bit dtype to the other, a strided
// tensor) by torch's own cast.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/cast16.h"
#include "ops.h"

namespace cutlass_fused {
namespace {

CastOut cast_linear_inputs_cuda(at::Tensor const& x, at::Tensor const& weight, c10::optional<at::Tensor> const& bias,
                                at::ScalarType dtype) {
  check_cast_dtype(dtype);
  c10::cuda::CUDAGuard guard(x.device());
  CastSpan spans[kCastSpans];
  int used = 0;
  auto cast = [&](at::Tensor const& t) {
    if (!autocast_casts(t, dtype)) return at::empty({0}, t.options().dtype(dtype));
    if (t.scalar_type() != at::kFloat || !t.is_contiguous() || t.device() != x.device()) return t.to(dtype);
    auto out = at::empty_like(t, t.options().dtype(dtype));  // t.to(dtype)'s strides
    poison(out);
    spans[used++] = {t.data_ptr<float>(), out.data_ptr(), t.numel()};
    return out;
  };
  auto x16 = cast(x), w16 = cast(weight);
  auto b16 = bias.has_value() ? cast(*bias) : at::empty({0}, x.options().dtype(dtype));
  if (used > 0) {
    cast_to_16(spans, dtype == at::kBFloat16 ? DType::bf16 : DType::f16, at::cuda::getCurrentCUDAStream().stream());
  }
  return {x16, w16, b16};
}

}  // namespace

TORCH_LIBRARY_IMPL(cutlass_fused, CUDA, m) { m.impl("cast_linear_inputs", &cast_linear_inputs_cuda); }

}  // namespace cutlass_fused
