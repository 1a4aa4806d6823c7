// FP8 current and delayed scaling on CUDA (issue 33): the quantize ops' kernels (csrc/kernels/fp8_cast.h).
#pragma once

#include <tuple>

#include <ATen/ATen.h>

namespace cutlass_fused {

// (t rounded to e4m3 under its power-of-two scale, the scale as a 0-dim fp32 tensor).
// cache: keep them for the next call of the same unchanged t (the ops' `cache`, csrc/ops.cpp).
std::tuple<at::Tensor, at::Tensor> quantize_e4m3_cuda(at::Tensor const& t, int64_t margin, bool cache);
// t8.to(dtype) * scale.to(dtype) in one pass (dequantize_fp8).
at::Tensor dequantize_cuda(at::Tensor const& t8, c10::optional<at::Tensor> const& scale, at::ScalarType dtype);
// (t8, t8 transposed, scale) for a 2-D t, in e4m3 or e5m2 (`dtype`), from one cast pass.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_transposed_cuda(at::Tensor const& t, at::ScalarType dtype,
                                                                        int64_t margin, bool cache);

// Delayed scaling: (t8, t8_t or an empty tensor, t's amax, the scale's copy) under the given scale
// (quantize_with_scale).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_with_scale_cuda(at::Tensor const& t,
                                                                                    at::Tensor const& scale,
                                                                                    at::ScalarType dtype,
                                                                                    bool transposed);
// (bias / alpha in bf16, scale * alpha, or alpha itself without a scale) for alpha = 1 / (s_x s_w)
// (fp8_operand_scales).
std::tuple<at::Tensor, at::Tensor> fp8_operand_scales_cuda(at::Tensor const& s_x, at::Tensor const& s_w,
                                                           c10::optional<at::Tensor> const& bias,
                                                           c10::optional<at::Tensor> const& scale);
// (dbias, dscale, inv_g) of the e4m3 op's backward, one launch (fp8_backward_scales).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_backward_scales_cuda(at::Tensor const& dsc, at::Tensor const& s_x,
                                                                        at::Tensor const& s_w,
                                                                        c10::optional<at::Tensor> const& s_g,
                                                                        c10::optional<at::ScalarType> bias_dtype,
                                                                        at::ScalarType scale_dtype);
// Delayed scaling's forward step for a layer (fp8_delayed_operands): (x8, x8_t, w8, w8_t, s_x, s_w,
// b, sc), amax_history and fp8_scale stepped in place.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
fp8_delayed_operands_cuda(at::Tensor const& x, at::Tensor const& weight, c10::optional<at::Tensor> const& bias,
                          c10::optional<at::Tensor> const& scale, at::Tensor& amax_history, at::Tensor& fp8_scale,
                          int64_t margin,
                          c10::string_view amax_compute_algo, bool transposed);
// Delayed scaling's amax-history step, in place (fp8_record).
void fp8_record_cuda(at::Tensor& amax_history, at::Tensor& scale, at::Tensor const& amax_x, at::Tensor const& amax_w,
                     int64_t margin, c10::string_view amax_compute_algo);

}  // namespace cutlass_fused
