// CPU implementations: the same semantics as the CUDA path, in ATen. x W^T + b
// accumulates in fp32 (fp64 for fp64 inputs) and is rounded once to the input
// dtype; statistics are fp64 sums of h as stored.
#include <limits>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "kernels/sync_stats.h"
#include "layer_args.h"
#include "ops.h"

namespace cutlass_fused {
namespace {

at::ScalarType acc_type(at::ScalarType dt) { return dt == at::kDouble ? at::kDouble : at::kFloat; }

at::Tensor linear_acc(at::Tensor const& x, at::Tensor const& weight, c10::optional<at::Tensor> const& bias) {
  auto acc = acc_type(x.scalar_type());
  auto out = at::matmul(x.to(acc), weight.to(acc).t());
  if (bias.has_value()) out.add_(bias->to(acc));
  return out;
}

at::Tensor opt64(c10::optional<at::Tensor> const& t, double missing) {
  return t.has_value() ? t->to(at::kDouble) : at::scalar_tensor(missing, at::kDouble);
}

// t * scale in fp64, or t itself without a scale (the layer without one reads none).
at::Tensor scaled(at::Tensor const& t, c10::optional<at::Tensor> const& scale) {
  return scale.has_value() ? t * scale->to(at::kDouble) : t;
}

// z = h * scale: mean(h), mean(z) and the biased var(z), in fp64.
struct Moments {
  at::Tensor mean_h, mean_z, var_z;
};

Moments moments(at::Tensor const& stats, c10::optional<at::Tensor> const& scale, int64_t count) {
  auto mean_h = stats[0] / static_cast<double>(count);
  auto var_h = (stats[1] / static_cast<double>(count) - mean_h * mean_h).clamp_min(0);
  return {mean_h, scaled(mean_h, scale), scaled(scaled(var_h, scale), scale)};
}

// The unfused model rounds z = h * scale to y's dtype. Where that is 16-bit and z overflows, its
// batch mean is infinite and its variance NaN; ours follow from sums of h, so each overflowing
// element adds an infinity of h's sign to sum h and to sum h^2. Without a scale z is h, whose
// overflow its sums already hold.
at::Tensor with_overflow(at::Tensor const& stats, at::Tensor const& h, c10::optional<at::Tensor> const& scale) {
  auto out = output_dtype(h.scalar_type(), scale);
  if (!scale.has_value() || (out != at::kHalf && out != at::kBFloat16)) return stats;
  auto hf = h.to(at::kFloat);
  auto inf = at::where(at::isinf((hf * scale->to(at::kFloat)).to(out)), std::numeric_limits<double>::infinity(), 0.0);
  return stats + at::stack({(inf * at::sign(hf).to(at::kDouble)).sum(0), inf.sum(0)});
}

std::tuple<at::Tensor, at::Tensor> linear_stats_cpu(at::Tensor const& x, at::Tensor const& weight,
                                                    c10::optional<at::Tensor> const& bias, c10::string_view family,
                                                    bool /*cache: nothing is cached on CPU*/) {
  check_linear_args(x, weight, bias, c10::nullopt);
  check_family(family);
  auto out = linear_acc(x, weight, bias);
  auto h = empty_padded(out.size(0), out.size(1), x.options());
  h.copy_(out);
  auto h64 = h.to(at::kDouble);
  return {h, at::stack({h64.sum(0), (h64 * h64).sum(0)})};
}

// BN(z) before any activation: the forward's value, which the backward recomputes for the
// activation's derivative. A 16-bit h in fp32, as the CUDA tail does; an fp32 h in fp64: in fp32 a
// column of a tiny batch whose mean dwarfs its spread cancels ~|mean| / spread ulps (torch's own
// fp32 path as much), so whether ours or torch's lost more was luck, and the 2x rule failed at
// random (2 x 5125 x 40); fp64 leaves y one rounding.
at::Tensor pre_activation(at::Tensor const& h, at::Tensor const& mean_h, at::Tensor const& invstd,
                          c10::optional<at::Tensor> const& scale, c10::optional<at::Tensor> const& weight,
                          c10::optional<at::Tensor> const& bias) {
  auto acc = h.scalar_type() == at::kFloat ? at::kDouble : acc_type(h.scalar_type());
  auto mul = scaled(invstd, scale) * opt64(weight, 1.0);
  return (h.to(acc) - mean_h.to(acc)) * mul.to(acc) + opt64(bias, 0.0).to(acc);
}

// y = act(BN(z)), rounded once to y_dt, and the saved mean and 1 / std.
std::tuple<at::Tensor, at::Tensor, at::Tensor> normalize(at::Tensor const& h, at::Tensor const& stats,
                                                         c10::optional<at::Tensor> const& scale, int64_t count,
                                                         c10::optional<at::Tensor> const& weight,
                                                         c10::optional<at::Tensor> const& bias, double eps,
                                                         Activation act, double slope, at::ScalarType y_dt) {
  int64_t n = h.size(1);
  check_scale(scale, n);
  check_vector(weight, "bn_weight", n);
  check_vector(bias, "bn_bias", n);
  auto mo = moments(with_overflow(stats, h, scale), scale, count);
  // PyTorch's InvStd: 0 where the variance and eps are both 0 (torch versions that take eps = 0
  // in training), so that a constant column normalizes to the BN bias, not to 0 * inf = NaN.
  auto invstd = eps == 0.0 ? at::where(mo.var_z == 0, at::zeros_like(mo.var_z), mo.var_z.rsqrt())
                           : (mo.var_z + eps).rsqrt();
  auto y = activated(pre_activation(h, mo.mean_h, invstd, scale, weight, bias), act, slope);
  return {y.to(y_dt).contiguous(), mo.mean_h, invstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_finalize_cpu(
    at::Tensor const& h, at::Tensor const& stats, c10::optional<at::Tensor> const& scale, int64_t count,
    c10::optional<at::Tensor> const& weight, c10::optional<at::Tensor> const& bias, double eps,
    c10::string_view activation, double negative_slope) {
  return normalize(h, stats, scale, count, weight, bias, eps, activation_of(activation), negative_slope,
                   output_dtype(h.scalar_type(), scale));
}

void update_running_stats_cpu(at::Tensor const& stats, c10::optional<at::Tensor> const& scale, int64_t count,
                              at::Tensor& running_mean, at::Tensor& running_var,
                              c10::optional<at::Tensor> const& num_batches_tracked, c10::optional<double> momentum) {
  int64_t n = stats.size(1);
  check_running_stats(running_mean, running_var, n, c10::nullopt);
  check_batch(count, n);
  check_running_args(running_mean, running_var, num_batches_tracked, momentum);
  auto mo = moments(stats, scale, count);
  // momentum=None: the cumulative average over the batches counted so far (a CPU tensor: no sync).
  double m = momentum.has_value() ? *momentum : 1.0 / num_batches_tracked->item<double>();
  auto unbiased = mo.var_z * (static_cast<double>(count) / static_cast<double>(count - 1));
  running_mean.copy_(running_mean.to(at::kDouble) * (1 - m) + mo.mean_z * m);
  running_var.copy_(running_var.to(at::kDouble) * (1 - m) + unbiased * m);
}

// cast_linear_inputs: torch's own casts.
CastOut cast_linear_inputs_cpu(at::Tensor const& x, at::Tensor const& weight, c10::optional<at::Tensor> const& bias,
                               at::ScalarType dtype) {
  check_cast_dtype(dtype);
  auto cast = [&](at::Tensor const& t) {
    return autocast_casts(t, dtype) ? t.to(dtype) : at::empty({0}, t.options().dtype(dtype));
  };
  return {cast(x), cast(weight), bias.has_value() ? cast(*bias) : at::empty({0}, x.options().dtype(dtype))};
}

// The three steps in order, as the CUDA kernel does them in one.
TrainOut train_cpu(LayerArgs const& a) {
  auto const &x = a.x, &weight = a.weight;
  auto const &bias = a.bias, &scale = a.scale, &running_mean = a.running_mean, &running_var = a.running_var;
  auto const& num_batches_tracked = a.num_batches_tracked;
  check_linear_args(x, weight, bias, scale);
  Activation act = activation_of(a.activation);
  auto y_dt = y_dtype(x.scalar_type(), scale, a.output_dtype);
  check_batch(x.size(0), weight.size(0));
  check_running_args(running_mean, running_var, num_batches_tracked, a.momentum);
  if (running_mean.has_value()) {  // before anything is updated
    check_running_stats(*running_mean, *running_var, weight.size(0), output_dtype(x.scalar_type(), scale));
  }
  auto [h, stats_h] = linear_stats_cpu(x, weight, bias, a.family, a.cache);
  auto stats = with_overflow(stats_h, h, scale);
  auto [y, mean, invstd] =
      normalize(h, stats, scale, x.size(0), a.bn_weight, a.bn_bias, a.eps, act, a.negative_slope, y_dt);
  if (num_batches_tracked.has_value()) num_batches_tracked->add_(1);
  if (running_mean.has_value()) {
    at::Tensor rm = *running_mean, rv = *running_var;
    update_running_stats_cpu(stats, scale, x.size(0), rm, rv, num_batches_tracked, a.momentum);
  }
  return {y, h, stats, mean, invstd};
}

// g, BN(z)'s gradient, in fp64: dy times the activation's derivative at the forward's value, by
// PyTorch's own backward formulas (dy itself without an activation).
at::Tensor bn_grad(at::Tensor const& dy, at::Tensor const& h, at::Tensor const& mean, at::Tensor const& invstd,
                   c10::optional<at::Tensor> const& scale, c10::optional<at::Tensor> const& weight,
                   c10::optional<at::Tensor> const& bias, c10::string_view activation, double negative_slope) {
  int64_t n = h.size(1);
  check_vector(mean, "mean", n);
  check_vector(invstd, "invstd", n);
  check_vector(bias, "bn_bias", n);
  TORCH_CHECK(dy.sizes() == h.sizes(), "cutlass_fused: expected the gradient to have h's shape ", h.sizes(),
              ", but got ", dy.sizes());
  Activation act = activation_of(activation);
  auto dy64 = dy.to(at::kDouble);
  if (act == Activation::none) return dy64;
  auto pre = pre_activation(h, mean, invstd.to(at::kDouble), scale, weight, bias).to(at::kDouble);
  return activation_backward(dy64, pre, act, negative_slope);
}

// (sum g, sum g (h - mean_h)) per column, hc = h - mean_h: the backward's sums.
at::Tensor grad_sums(at::Tensor const& g, at::Tensor const& hc) {
  return at::stack({g.sum(0), (g * hc).sum(0)});
}

// dh = a g + b (h - mean_h) + c per column, from the sums of g and g (h - mean_h) over `count`
// rows; see csrc/kernels/bn_backward.cu (grad_column) for the derivation's results.
at::Tensor grad_input(at::Tensor const& g, at::Tensor const& h, at::Tensor const& hc, at::Tensor const& sums,
                      at::Tensor const& count, c10::optional<at::Tensor> const& scale,
                      c10::optional<at::Tensor> const& weight, at::Tensor const& invstd) {
  auto istd = invstd.to(at::kDouble), w = opt64(weight, 1.0);
  auto a = scaled(w, scale) * istd;
  auto dh = a * g - scaled(scaled(a, scale), scale) * istd * istd * sums[1] / count * hc - a * sums[0] / count;
  return dh.to(h.scalar_type()).contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_cpu(
    at::Tensor const& dy, at::Tensor const& h, at::Tensor const& mean, at::Tensor const& invstd,
    c10::optional<at::Tensor> const& scale, c10::optional<at::Tensor> const& weight, double eps,
    c10::optional<at::Tensor> const& bias, c10::string_view activation, double negative_slope,
    c10::optional<at::ScalarType> linear_bias_dtype) {
  auto acc = acc_type(h.scalar_type());
  auto g = bn_grad(dy, h, mean, invstd, scale, weight, bias, activation, negative_slope);
  auto hc = h.to(at::kDouble) - mean.to(at::kDouble);
  auto sums = grad_sums(g, hc);
  auto dh = grad_input(g, h, hc, sums, at::scalar_tensor(static_cast<double>(h.size(0)), at::kDouble), scale,
                       weight, invstd);
  auto istd = invstd.to(at::kDouble), w = opt64(weight, 1.0);
  auto dscale = w * istd * sums[1] * eps * istd * istd;
  auto dweight = scaled(istd, scale) * sums[1];
  // Output dtypes as on CUDA: dscale in scale's (a value a column; fp32 as stored, and empty,
  // without a scale), dweight and dbias in weight's.
  auto vec = weight ? weight->scalar_type() : acc;
  auto dscale_dt = scale.has_value() ? scale->scalar_type() : at::kFloat;
  auto dscale_out = dscale.to(dscale_dt);
  // As CUDA's: 0 x dscale as stored (0, or NaN where dscale is not finite).
  auto dlinear_bias = linear_bias_dtype ? (dscale_out * 0.0).to(*linear_bias_dtype)
                                        : at::empty({0}, h.options().dtype(dscale_dt));
  if (!scale.has_value()) dscale_out = at::empty({0}, h.options().dtype(dscale_dt));
  return {dh, dscale_out, dweight.to(vec), sums[0].to(vec), dlinear_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_linear_cpu(
    at::Tensor const& dz, at::Tensor const& next_weight, at::Tensor const& h, at::Tensor const& mean,
    at::Tensor const& invstd, c10::optional<at::Tensor> const& scale, c10::optional<at::Tensor> const& weight,
    double eps, c10::optional<at::Tensor> const& bias, c10::string_view activation, double negative_slope,
    c10::optional<at::ScalarType> linear_bias_dtype, c10::string_view family) {
  check_backward_linear(dz, next_weight, h);
  check_family(family);
  return batch_norm_backward_cpu(at::mm(dz, next_weight), h, mean, invstd, scale, weight, eps, bias, activation,
                                 negative_slope, linear_bias_dtype);
}

at::Tensor batch_norm_backward_reduce_cpu(at::Tensor const& dy, at::Tensor const& h, at::Tensor const& mean,
                                          at::Tensor const& invstd, c10::optional<at::Tensor> const& scale,
                                          c10::optional<at::Tensor> const& weight, double /*eps*/,
                                          c10::optional<at::Tensor> const& bias, c10::string_view activation,
                                          double negative_slope) {
  auto g = bn_grad(dy, h, mean, invstd, scale, weight, bias, activation, negative_slope);
  return grad_sums(g, h.to(at::kDouble) - mean.to(at::kDouble));
}

at::Tensor batch_norm_backward_elemt_cpu(at::Tensor const& dy, at::Tensor const& h, at::Tensor const& mean,
                                         at::Tensor const& invstd, c10::optional<at::Tensor> const& scale,
                                         c10::optional<at::Tensor> const& weight, at::Tensor const& sums,
                                         at::Tensor const& count, double /*eps*/,
                                         c10::optional<at::Tensor> const& bias, c10::string_view activation,
                                         double negative_slope) {
  check_sums(sums, "sums", h.size(1));
  check_count(count);
  auto g = bn_grad(dy, h, mean, invstd, scale, weight, bias, activation, negative_slope);
  auto hc = h.to(at::kDouble) - mean.to(at::kDouble);
  return grad_input(g, h, hc, sums, count.reshape({}), scale, weight, invstd);
}

at::Tensor eval_cpu(LayerArgs const& a) {
  auto const &x = a.x, &weight = a.weight, &running_mean = *a.running_mean, &running_var = *a.running_var;
  auto const &bias = a.bias, &scale = a.scale;
  check_linear_args(x, weight, bias, scale);
  check_family(a.family);
  Activation act = activation_of(a.activation);
  auto y_dt = y_dtype(x.scalar_type(), scale, a.output_dtype);
  int64_t n = weight.size(0);
  check_vector(a.bn_weight, "bn_weight", n);
  check_vector(a.bn_bias, "bn_bias", n);
  auto out = output_dtype(x.scalar_type(), scale);
  check_running_stats(running_mean, running_var, n, out);
  // As the unfused model computes it: h rounded to x's dtype and z = h * scale to y's (so that
  // an fp16 overflow of either shows), then y = z alpha + beta, batch norm's own fold.
  auto acc = acc_type(out);
  auto h = linear_acc(x, weight, bias).to(x.scalar_type());
  auto z = scale.has_value() ? (h.to(acc) * scale->to(acc)).to(out) : h;
  auto alpha = (running_var.to(at::kDouble) + a.eps).rsqrt() * opt64(a.bn_weight, 1.0);
  auto beta = opt64(a.bn_bias, 0.0) - running_mean.to(at::kDouble) * alpha;
  // The activation on y as the unfused model has it (in its dtype), then the requested dtype.
  return activated((z.to(acc) * alpha.to(acc) + beta.to(acc)).to(out), act, a.negative_slope).to(y_dt).contiguous();
}

// The FP8 ops' operands on the CPU: e4m3 values are exact in bfloat16, so the 16-bit ops over
// the bf16 copies of x and W (and the bias in bf16, as the e4m3 GEMM's epilogue reads it) compute
// what the e4m3 GEMM does, to its accumulation order.
struct Fp8Reference {
  at::Tensor x, weight;
  c10::optional<at::Tensor> bias;
};

Fp8Reference fp8_reference(at::Tensor const& x, at::Tensor const& weight, c10::optional<at::Tensor> const& bias,
                           c10::optional<at::Tensor> const& scale) {
  check_linear_args(x, weight, bias, scale);
  TORCH_CHECK(x.scalar_type() == at::kFloat8_e4m3fn, "cutlass_fused: expected input and weight to be float8_e4m3fn, ",
              "but got ", x.scalar_type());
  return {x.to(at::kBFloat16), weight.to(at::kBFloat16),
          bias.has_value() ? c10::optional<at::Tensor>(bias->to(at::kBFloat16)) : c10::nullopt};
}

// The FP8 ops on the CPU: the training and eval ops over fp8_reference's operands. fast_accum is
// ignored: the CPU's sums are its bf16 reference's.
TrainOut train_fp8_cpu(LayerArgs const& a) {
  auto r = fp8_reference(a.x, a.weight, a.bias, a.scale);
  return train_cpu(a.with_operands(r.x, r.weight, r.bias, a.scale));
}

at::Tensor eval_fp8_cpu(LayerArgs const& a) {
  auto r = fp8_reference(a.x, a.weight, a.bias, a.scale);
  return eval_cpu(a.with_operands(r.x, r.weight, r.bias, a.scale));
}

at::Tensor matmul_cpu(at::Tensor const& a, at::Tensor const& b, c10::string_view) { return at::mm(a, b); }

// FP8 on the CPU: cutlass_fused/fp8.py's amax_of, scale_from_amax and quantize, op for op (its
// largest / amax is torch's amax.reciprocal() * largest), so that both backends and the emulated
// path round alike.
double largest_of(at::ScalarType fp8) { return fp8 == at::kFloat8_e4m3fn ? 448.0 : 57344.0; }

at::Tensor amax_cpu(at::Tensor const& t) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()) && c10::elementSize(t.scalar_type()) > 1,
              "cutlass_fused: expected t to be a 16-, 32- or 64-bit floating-point tensor, but got ", t.scalar_type());
  return t.numel() == 0 ? at::zeros({}, t.options().dtype(at::kFloat)) : t.abs().amax().to(at::kFloat);
}

at::Tensor scale_from_amax_cpu(at::Tensor const& amax, int64_t margin, at::Tensor const& fallback, double largest) {
  auto usable = at::isfinite(amax).logical_and(amax.gt(0));
  auto ratio = at::where(usable, amax, at::ones_like(amax)).reciprocal().mul(largest);
  auto exponent = at::floor(at::log2(ratio)).sub(margin).clamp(-126, 126);
  return at::where(usable, at::exp2(exponent), fallback);
}

at::Tensor round_cpu(at::Tensor const& t, at::Tensor const& scale, at::ScalarType fp8) {
  double largest = largest_of(fp8);
  auto v = t.to(at::promote_types(t.scalar_type(), at::kFloat)).mul(scale);
  v = at::where(at::isfinite(v), v.clamp(-largest, largest), at::full_like(v, std::numeric_limits<double>::quiet_NaN()));
  return v.to(fp8).contiguous();
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_cpu(at::Tensor const& t, int64_t margin, at::ScalarType fp8) {
  auto amax = amax_cpu(t);
  auto scale = scale_from_amax_cpu(amax, margin, at::ones({}, amax.options()), largest_of(fp8));
  return {round_cpu(t, scale, fp8), scale};
}

std::tuple<at::Tensor, at::Tensor> quantize_e4m3_cpu(at::Tensor const& t, int64_t margin, bool) {
  return quantize_fp8_cpu(t, margin, at::kFloat8_e4m3fn);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_transposed_cpu(at::Tensor const& t, at::ScalarType dtype,
                                                                       int64_t margin, bool) {
  check_quantize_transposed(t, dtype);
  auto [t8, scale] = quantize_fp8_cpu(t, margin, dtype);
  return {t8, t8.t().contiguous(), scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_with_scale_cpu(at::Tensor const& t,
                                                                                   at::Tensor const& scale,
                                                                                   at::ScalarType dtype,
                                                                                   bool transposed) {
  check_quantize_with_scale(t, scale, dtype, transposed);
  auto amax = amax_cpu(t);
  auto t8 = round_cpu(t, scale, dtype);
  return {t8, transposed ? t8.t().contiguous() : at::empty({0}, t8.options()), amax, scale.reshape({}).clone()};
}

// The torch ops fp8_operand_scales stands for, as e4m3_forward ran them.
// Without a scale, sc is alpha itself (0-dim fp32): the FP8 ops' one scale for every column.
std::tuple<at::Tensor, at::Tensor> fp8_operand_scales_cpu(at::Tensor const& s_x, at::Tensor const& s_w,
                                                          c10::optional<at::Tensor> const& bias,
                                                          c10::optional<at::Tensor> const& scale) {
  check_fp8_operand_scales(s_x, s_w, bias, scale);
  auto alpha = (s_x.reshape({}) * s_w.reshape({})).reciprocal();
  auto b = bias.has_value() ? (*bias / alpha).to(at::kBFloat16).contiguous()
                            : at::empty({0}, s_x.options().dtype(at::kBFloat16));
  return {b, scale.has_value() ? (*scale * alpha).to(scale->scalar_type()).contiguous() : alpha};
}

// The torch ops fp8_backward_scales stands for, as the e4m3 backward ran them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_backward_scales_cpu(at::Tensor const& dsc, at::Tensor const& s_x,
                                                                       at::Tensor const& s_w,
                                                                       c10::optional<at::Tensor> const& s_g,
                                                                       c10::optional<at::ScalarType> bias_dtype,
                                                                       at::ScalarType scale_dtype) {
  check_fp8_backward_scales(dsc, s_x, s_w, s_g, bias_dtype, scale_dtype);
  auto none = at::empty({0}, dsc.options().dtype(at::kFloat));
  auto dbias = bias_dtype.has_value() ? (dsc * 0).to(*bias_dtype).contiguous() : none;
  auto dscale = (dsc / (s_x.reshape({}) * s_w.reshape({}))).to(scale_dtype).contiguous();
  return {dbias, dscale, s_g.has_value() ? s_g->reshape({}).reciprocal() : none.clone()};
}

// fp8.DelayedState.record, op for op.
void fp8_record_cpu(at::Tensor& amax_history, at::Tensor& scale, at::Tensor const& amax_x, at::Tensor const& amax_w,
                    int64_t margin, c10::string_view amax_compute_algo) {
  check_fp8_record(amax_history, scale, amax_x, amax_w, amax_compute_algo);
  auto amax = at::stack({amax_x.reshape({}), amax_w.reshape({})});
  amax_history.copy_(at::cat({amax.unsqueeze(0), amax_history.narrow(0, 0, amax_history.size(0) - 1)}));
  auto reduced = amax_compute_algo == "max" ? amax_history.amax(0) : amax_history.select(0, 0);
  scale.copy_(scale_from_amax_cpu(reduced, margin, scale, 448.0));
}

at::Tensor dequantize_cpu(at::Tensor const& t8, c10::optional<at::Tensor> const& scale, at::ScalarType dtype) {
  check_dequantize(t8, scale, dtype);
  auto out = t8.to(dtype);
  return (scale.has_value() ? out * scale->to(dtype) : out).contiguous();
}

// SyncBatchNorm's column arithmetic: sync_stats.h's lines, the columns in a loop.
at::Tensor sync_batch_norm_row_cpu(at::Tensor const& stats, int64_t count) {
  check_sync_row_args(stats, count);
  int64_t n = stats.size(1);
  auto row = at::empty({2 * n + 1}, stats.options());
  double const* s = stats.data_ptr<double>();
  double* out = row.data_ptr<double>();
  for (int64_t c = 0; c < n; ++c) sync_stats::row_column(s, n, static_cast<double>(count), c, out);
  return row;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sync_batch_norm_merge_cpu(at::Tensor const& rows) {
  check_rows(rows, -1);
  int64_t n = (rows.size(1) - 1) / 2;
  auto stats = at::empty({2, n}, rows.options()), running = at::empty({2, n}, rows.options());
  auto count = at::empty({1}, rows.options());
  double const* r = rows.data_ptr<double>();
  double *s = stats.data_ptr<double>(), *run = running.data_ptr<double>(), *k = count.data_ptr<double>();
  for (int64_t c = 0; c < n; ++c) sync_stats::merge_column(r, static_cast<int>(rows.size(0)), n, c, s, run, k);
  return {stats, running, count};
}

at::Tensor sync_batch_norm_grads_cpu(at::Tensor const& local, at::Tensor const& sums, at::Tensor const& row,
                                     at::Tensor const& count, at::Tensor const& mean, at::Tensor const& invstd,
                                     c10::optional<at::Tensor> const& scale, c10::optional<at::Tensor> const& weight) {
  check_sync_grads_args(local, sums, row, count, mean, invstd, scale, weight);
  int64_t n = local.size(1);
  auto vec = [](at::Tensor const& t) { return t.to(at::kDouble).contiguous(); };
  auto mean_d = vec(mean), invstd_d = vec(invstd);
  // A missing vector reads 1 and a 0-dim one its value in every column, as the CUDA kernel's ColVec.
  auto vec_or_none = [&](c10::optional<at::Tensor> const& t) { return t.has_value() ? vec(*t) : at::Tensor(); };
  auto scale_d = vec_or_none(scale), weight_d = vec_or_none(weight);
  auto at_column = [](at::Tensor const& t, int64_t c) {
    return !t.defined() ? 1.0 : t.data_ptr<double>()[t.dim() == 0 ? 0 : c];
  };
  auto out = at::empty({4, n}, local.options());
  double total = count.item<double>();  // a CPU tensor: no sync
  double const *l = local.data_ptr<double>(), *g = sums.data_ptr<double>(), *r = row.data_ptr<double>();
  double const *mh = mean_d.data_ptr<double>(), *is = invstd_d.data_ptr<double>();
  double* o = out.data_ptr<double>();
  for (int64_t c = 0; c < n; ++c)
    sync_stats::grads_column(l, g, r, total, mh[c], is[c], at_column(scale_d, c), at_column(weight_d, c), n, c, o);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(cutlass_fused, CPU, m) {
  m.impl("matmul", &matmul_cpu);
  m.impl("linear_stats", &linear_stats_cpu);
  m.impl("cast_linear_inputs", &cast_linear_inputs_cpu);
  m.impl("linear_scale_batch_norm_train", &train_op<&train_cpu>);
  m.impl("linear_scale_batch_norm_train_fp8", &train_fp8_op<&train_fp8_cpu>);
  m.impl("quantize_e4m3", &quantize_e4m3_cpu);
  m.impl("quantize_transposed", &quantize_transposed_cpu);
  m.impl("dequantize", &dequantize_cpu);
  m.impl("quantize_with_scale", &quantize_with_scale_cpu);
  m.impl("fp8_record", &fp8_record_cpu);
  m.impl("fp8_operand_scales", &fp8_operand_scales_cpu);
  m.impl("fp8_backward_scales", &fp8_backward_scales_cpu);
  m.impl("batch_norm_finalize", &batch_norm_finalize_cpu);
  m.impl("update_running_stats", &update_running_stats_cpu);
  m.impl("batch_norm_backward", &batch_norm_backward_cpu);
  m.impl("batch_norm_backward_linear", &batch_norm_backward_linear_cpu);
  m.impl("batch_norm_backward_reduce", &batch_norm_backward_reduce_cpu);
  m.impl("batch_norm_backward_elemt", &batch_norm_backward_elemt_cpu);
  m.impl("sync_batch_norm_row", &sync_batch_norm_row_cpu);
  m.impl("sync_batch_norm_merge", &sync_batch_norm_merge_cpu);
  m.impl("sync_batch_norm_grads", &sync_batch_norm_grads_cpu);
  m.impl("linear_scale_batch_norm_eval", &eval_op<&eval_cpu>);
  m.impl("linear_scale_batch_norm_eval_fp8", &eval_fp8_op<&eval_fp8_cpu>);
}

}  // namespace cutlass_fused
