// FP8 on CUDA: current scaling's amax pass and cast pass over t, delayed scaling's one cast pass
// that measures the amax, and its history step; no host sync.
#include "fp8_cuda.h"

#include <algorithm>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "derived_cache.h"
#include "kernels/fp8_cast.h"
#include "ops.h"

namespace cutlass_fused {

namespace {

// A frozen weight's fp8 values and scale in one byte buffer (the values, then the scale 16 bytes
// on), so that the derived cache keeps them as one tensor; views into it.
struct Packed {
  at::Tensor bytes, t8, scale;
};

// Past +-252 the exponent saturates at +-126 whatever the margin (fp8.scale_from_amax's clamp),
// so a clamped margin gives the same scale and fits the kernel's int.
int clamped(int64_t margin) { return static_cast<int>(std::clamp<int64_t>(margin, -1000, 1000)); }

int64_t scale_offset(int64_t numel) { return (numel + 15) / 16 * 16; }

Packed packed(at::Tensor bytes, at::IntArrayRef sizes, at::ScalarType fp8) {
  int64_t n = c10::multiply_integers(sizes);
  // select(0, 0), not view({}): torch 2.11's headers take {} as view(ScalarType{}), a Byte view.
  return {bytes, bytes.narrow(0, 0, n).view(fp8).view(sizes),
          bytes.narrow(0, scale_offset(n), 4).view(at::kFloat).select(0, 0)};
}

// A new buffer for t's values in `sizes` (t's or its transpose's).
Packed new_packed(at::Tensor const& t, at::IntArrayRef sizes, at::ScalarType fp8) {
  return packed(at::empty({scale_offset(t.numel()) + 16}, t.options().dtype(at::kByte)), sizes, fp8);
}

Fp8 format_of(at::ScalarType fp8) { return fp8 == at::kFloat8_e4m3fn ? Fp8::e4m3 : Fp8::e5m2; }

// t's fp8 values into t8 and, for a 2-D t, their transpose into t8_t, from one cast pass (either
// may be null, not both), and the scale.
void quantize_into(at::Tensor const& t, int64_t margin, Fp8 format, at::Tensor* t8, at::Tensor* t8_t,
                   at::Tensor& scale) {
  DType dt = dtype_of(t.scalar_type(), "t");
  c10::cuda::CUDAGuard guard(t.device());
  auto src = t.contiguous();
  auto bytes = [](at::Tensor* out) {
    if (!out) return static_cast<uint8_t*>(nullptr);
    poison(*out);
    return reinterpret_cast<uint8_t*>(out->data_ptr());
  };
  uint8_t* out = bytes(t8);
  uint8_t* out_t = bytes(t8_t);  // null where t is empty: then only the scale is written
  poison(scale);
  auto amax = at::empty({}, src.options().dtype(at::kInt));
  int m = clamped(margin);
  auto amax_bits = reinterpret_cast<unsigned*>(amax.data_ptr<int>());
  auto stream = at::cuda::getCurrentCUDAStream().stream();
  if (t8_t) {
    quantize_fp8_transposed(src.data_ptr(), dt, format, src.size(0), src.size(1), m, amax_bits,
                            scale.data_ptr<float>(), out, out_t, stream);
  } else {
    TORCH_INTERNAL_ASSERT(format == Fp8::e4m3, "the flat cast is e4m3's (kernels/fp8_cast.h)");
    quantize_e4m3(src.data_ptr(), dt, src.numel(), m, amax_bits, scale.data_ptr<float>(), out, stream);
  }
}

// The operand scales' inputs, contiguous, and their outputs, poisoned: b in bias's shape (or [0]
// without one) as bf16, the kernel's h dtype; sc like scale, or without one alpha, 0-dim fp32.
struct OperandScaleOutputs {
  c10::optional<at::Tensor> bias_in, sc_in;
  at::Tensor b, sc;
  void const* b_in() const { return bias_in.has_value() ? bias_in->data_ptr() : nullptr; }
  void const* scale_in() const { return sc_in.has_value() ? sc_in->data_ptr() : nullptr; }
  DType bias_dtype() const { return bias_in.has_value() ? dtype_of(bias_in->scalar_type(), "bias") : DType::bf16; }
  DType scale_dtype() const { return dtype_of(sc.scalar_type(), "scale"); }
};

OperandScaleOutputs operand_scale_outputs(c10::optional<at::Tensor> const& bias,
                                          c10::optional<at::Tensor> const& scale, at::TensorOptions fp32) {
  static constexpr int64_t no_bias[] = {0};
  OperandScaleOutputs o;
  if (bias.has_value()) o.bias_in = bias->contiguous();
  if (scale.has_value()) o.sc_in = scale->contiguous();
  o.b = at::empty(bias.has_value() ? bias->sizes() : at::IntArrayRef(no_bias), fp32.dtype(at::kBFloat16));
  o.sc = scale.has_value() ? at::empty(scale->sizes(), scale->options()) : at::empty({}, fp32);
  poison(o.b);
  poison(o.sc);
  return o;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_e4m3_cuda(at::Tensor const& t, int64_t margin, bool cache) {
  if (!cache) {
    auto t8 = at::empty(t.sizes(), t.options().dtype(at::kFloat8_e4m3fn));
    auto scale = at::empty({}, t.options().dtype(at::kFloat));
    quantize_into(t, margin, Fp8::e4m3, &t8, nullptr, scale);
    return {t8, scale};
  }
  // A frozen weight's W8 and scale, kept between calls as the 3xTF32 split is (derived_cache.h).
  auto bytes = derived(Derived::weight_e4m3, {t}, {static_cast<double>(margin)}, cache, [&] {
    auto p = new_packed(t, t.sizes(), at::kFloat8_e4m3fn);
    quantize_into(t, margin, Fp8::e4m3, &p.t8, nullptr, p.scale);
    return p.bytes;
  });
  auto p = packed(bytes, t.sizes(), at::kFloat8_e4m3fn);
  // The op's outputs may not alias each other (its schema; torch.library.opcheck): W8 is a view of
  // the kept buffer, the scale a 4-byte copy.
  return {p.t8, p.scale.clone()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_transposed_cuda(at::Tensor const& t, at::ScalarType dtype,
                                                                        int64_t margin, bool cache) {
  check_quantize_transposed(t, dtype);
  Fp8 format = format_of(dtype);
  int64_t rows = t.size(0), cols = t.size(1);
  if (!cache || format != Fp8::e4m3) {
    auto t8 = at::empty({rows, cols}, t.options().dtype(dtype));
    auto t8_t = at::empty({cols, rows}, t.options().dtype(dtype));
    auto scale = at::empty({}, t.options().dtype(at::kFloat));
    quantize_into(t, margin, format, &t8, &t8_t, scale);
    return {t8, t8_t, scale};
  }
  // A frozen weight: W8 (quantize_e4m3's kept value) and W8^T kept apart, so that the outputs
  // alias nothing of each other; each is made by the pass that writes it alone.
  auto [w8, scale] = quantize_e4m3_cuda(t, margin, true);
  auto bytes = derived(Derived::weight_e4m3_t, {t}, {static_cast<double>(margin)}, cache, [&] {
    auto p = new_packed(t, {cols, rows}, at::kFloat8_e4m3fn);
    quantize_into(t, margin, format, nullptr, &p.t8, p.scale);
    return p.bytes;
  });
  return {w8, packed(bytes, {cols, rows}, at::kFloat8_e4m3fn).t8, scale};
}

at::Tensor dequantize_cuda(at::Tensor const& t8, c10::optional<at::Tensor> const& scale, at::ScalarType dtype) {
  check_dequantize(t8, scale, dtype);
  c10::cuda::CUDAGuard guard(t8.device());
  auto src = t8.contiguous();
  auto out = at::empty(src.sizes(), src.options().dtype(dtype));
  poison(out);
  dequantize_fp8(reinterpret_cast<uint8_t const*>(src.data_ptr()),
                 format_of(src.scalar_type()), src.numel(),
                 scale.has_value() ? scale->data_ptr<float>() : nullptr, dtype_of(dtype, "dtype"), out.data_ptr(),
                 at::cuda::getCurrentCUDAStream().stream());
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_with_scale_cuda(at::Tensor const& t,
                                                                                    at::Tensor const& scale,
                                                                                    at::ScalarType dtype,
                                                                                    bool transposed) {
  check_quantize_with_scale(t, scale, dtype, transposed);
  DType dt = dtype_of(t.scalar_type(), "t");
  c10::cuda::CUDAGuard guard(t.device());
  auto src = t.contiguous();
  auto t8 = at::empty(t.sizes(), t.options().dtype(dtype));
  auto t8_t = transposed ? at::empty({t.size(1), t.size(0)}, t.options().dtype(dtype))
                         : at::empty({0}, t.options().dtype(dtype));
  auto amax = at::empty({}, t.options().dtype(at::kFloat));
  auto scale_out = at::empty({}, t.options().dtype(at::kFloat));
  poison(t8);
  poison(t8_t);
  poison(amax);
  poison(scale_out);
  auto bytes = [](at::Tensor& out) { return reinterpret_cast<uint8_t*>(out.data_ptr()); };
  // The amax's fp32 bits: abs_bits' order is |t|'s, so the kernel's unsigned max is the float's.
  auto amax_bits = reinterpret_cast<unsigned*>(amax.data_ptr<float>());
  auto stream = at::cuda::getCurrentCUDAStream().stream();
  if (transposed) {
    quantize_fp8_transposed_with_scale(src.data_ptr(), dt, format_of(dtype), src.size(0), src.size(1),
                                       scale.data_ptr<float>(), scale_out.data_ptr<float>(), amax_bits, bytes(t8),
                                       bytes(t8_t), stream);
  } else {
    quantize_e4m3_with_scale(src.data_ptr(), dt, src.numel(), scale.data_ptr<float>(), scale_out.data_ptr<float>(),
                             amax_bits, bytes(t8), stream);
  }
  return {t8, t8_t, amax, scale_out};
}

std::tuple<at::Tensor, at::Tensor> fp8_operand_scales_cuda(at::Tensor const& s_x, at::Tensor const& s_w,
                                                           c10::optional<at::Tensor> const& bias,
                                                           c10::optional<at::Tensor> const& scale) {
  check_fp8_operand_scales(s_x, s_w, bias, scale);
  c10::cuda::CUDAGuard guard(s_x.device());
  auto o = operand_scale_outputs(bias, scale, s_x.options());
  fp8_operand_scales(s_x.data_ptr<float>(), s_w.data_ptr<float>(), o.b_in(), o.bias_dtype(), o.b.numel(),
                     o.scale_in(), o.scale_dtype(), o.sc.numel(), o.b.data_ptr(), o.sc.data_ptr(),
                     at::cuda::getCurrentCUDAStream().stream());
  return {o.b, o.sc};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_backward_scales_cuda(at::Tensor const& dsc, at::Tensor const& s_x,
                                                                        at::Tensor const& s_w,
                                                                        c10::optional<at::Tensor> const& s_g,
                                                                        c10::optional<at::ScalarType> bias_dtype,
                                                                        at::ScalarType scale_dtype) {
  check_fp8_backward_scales(dsc, s_x, s_w, s_g, bias_dtype, scale_dtype);
  c10::cuda::CUDAGuard guard(dsc.device());
  auto src = dsc.contiguous();
  auto none = [&] { return at::empty({0}, dsc.options().dtype(at::kFloat)); };
  auto dbias = bias_dtype.has_value() ? at::empty(dsc.sizes(), dsc.options().dtype(*bias_dtype)) : none();
  auto dscale = at::empty(dsc.sizes(), dsc.options().dtype(scale_dtype));
  auto inv_g = s_g.has_value() ? at::empty({}, dsc.options().dtype(at::kFloat)) : none();
  poison(dbias);
  poison(dscale);
  poison(inv_g);
  fp8_backward_scales(src.data_ptr(), dtype_of(src.scalar_type(), "dsc"), src.numel(), s_x.data_ptr<float>(),
                      s_w.data_ptr<float>(), s_g.has_value() ? s_g->data_ptr<float>() : nullptr,
                      bias_dtype.has_value() ? dbias.data_ptr() : nullptr,
                      dtype_of(bias_dtype.value_or(scale_dtype), "bias_dtype"), dscale.data_ptr(),
                      dtype_of(scale_dtype, "scale_dtype"), s_g.has_value() ? inv_g.data_ptr<float>() : nullptr,
                      at::cuda::getCurrentCUDAStream().stream());
  return {dbias, dscale, inv_g};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
fp8_delayed_operands_cuda(at::Tensor const& x, at::Tensor const& weight, c10::optional<at::Tensor> const& bias,
                          c10::optional<at::Tensor> const& scale, at::Tensor& amax_history, at::Tensor& fp8_scale,
                          int64_t margin, c10::string_view amax_compute_algo, bool transposed) {
  check_fp8_delayed_operands(x, weight, amax_history, fp8_scale, amax_compute_algo);
  c10::cuda::CUDAGuard guard(x.device());
  check_quantize_with_scale(x, fp8_scale.select(0, 0), at::kFloat8_e4m3fn, transposed);
  check_quantize_with_scale(weight, fp8_scale.select(0, 1), at::kFloat8_e4m3fn, transposed);
  auto fp32 = x.options().dtype(at::kFloat);
  auto s_x = at::empty({}, fp32), s_w = at::empty({}, fp32);
  check_fp8_operand_scales(s_x, s_w, bias, scale);
  struct Cast {
    at::Tensor src, t8, t8_t;
  };
  auto cast = [&](at::Tensor const& t, char const* name) {
    Cast c{t.contiguous(), at::empty(t.sizes(), t.options().dtype(at::kFloat8_e4m3fn)),
           at::empty(transposed ? at::IntArrayRef{t.size(1), t.size(0)} : at::IntArrayRef{0},
                     t.options().dtype(at::kFloat8_e4m3fn))};
    poison(c.t8);
    poison(c.t8_t);
    return std::make_pair(c, Fp8Operand{c.src.data_ptr(), dtype_of(t.scalar_type(), name), t.size(0), t.size(1),
                                        reinterpret_cast<uint8_t*>(c.t8.data_ptr()),
                                        transposed ? reinterpret_cast<uint8_t*>(c.t8_t.data_ptr()) : nullptr});
  };
  auto [xc, xo] = cast(x, "x");
  auto [wc, wo] = cast(weight, "weight");
  auto o = operand_scale_outputs(bias, scale, fp32);
  auto amax = at::empty({2}, x.options().dtype(at::kInt));
  poison(s_x);
  poison(s_w);
  delayed_operands(xo, wo, amax_history.data_ptr<float>(), amax_history.size(0), fp8_scale.data_ptr<float>(),
                   clamped(margin), amax_compute_algo == "max", reinterpret_cast<unsigned*>(amax.data_ptr<int>()),
                   s_x.data_ptr<float>(), s_w.data_ptr<float>(), o.b_in(), o.bias_dtype(), o.b.numel(),
                   o.scale_in(), o.scale_dtype(), o.sc.numel(), o.b.data_ptr(), o.sc.data_ptr(),
                   at::cuda::getCurrentCUDAStream().stream());
  return {xc.t8, xc.t8_t, wc.t8, wc.t8_t, s_x, s_w, o.b, o.sc};
}

void fp8_record_cuda(at::Tensor& amax_history, at::Tensor& scale, at::Tensor const& amax_x, at::Tensor const& amax_w,
                     int64_t margin, c10::string_view amax_compute_algo) {
  check_fp8_record(amax_history, scale, amax_x, amax_w, amax_compute_algo);
  c10::cuda::CUDAGuard guard(amax_history.device());
  record_amax(amax_history.data_ptr<float>(), amax_history.size(0), amax_x.data_ptr<float>(),
              amax_w.data_ptr<float>(), clamped(margin), amax_compute_algo == "max", scale.data_ptr<float>(),
              at::cuda::getCurrentCUDAStream().stream());
}

}  // namespace cutlass_fused
