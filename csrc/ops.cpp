// The op schemas (one TORCH_LIBRARY) and their CPU implementations.
//
// Schema choices:
//  * linear_scale_stats returns the statistics as fp64 column sums, (2, N), so
//    that SyncBatchNorm can all-reduce them before batch_norm_finalize.
//  * batch_norm_finalize mutates the running stats; they are marked (a!)/(b!).
//  * `family` is a string ("auto", "sm90", "sm80"): a compile-time constant
//    for torch.compile, chosen in Python from cutlass_fused.kernel_family().
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"
#if defined(CUTLASS_FUSED_WITH_CUDA)
#include "kernels/gemm_evt.h"
#endif

extern "C" {
// `import cutlass_fused._C` loads this library and so registers the ops.
PyObject* PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&def);
}
}

namespace cutlass_fused {

void check_vector(c10::optional<at::Tensor> const& t, char const* name, int64_t n) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == n, "cutlass_fused: expected ", name, " to have shape [", n,
              "], but got ", t->sizes());
}

void check_linear_args(at::Tensor const& x, at::Tensor const& weight, c10::optional<at::Tensor> const& bias,
                       at::Tensor const& scale) {
  TORCH_CHECK(x.dim() == 2, "cutlass_fused: expected input to be 2-D (batch, in_features), but got ", x.dim(),
              "-D input of size ", x.sizes());
  TORCH_CHECK(weight.dim() == 2, "cutlass_fused: expected weight to be 2-D (out_features, in_features), but got ",
              weight.sizes());
  TORCH_CHECK(x.size(1) == weight.size(1), "cutlass_fused: mat1 and mat2 shapes cannot be multiplied (", x.size(0),
              "x", x.size(1), " and ", weight.size(1), "x", weight.size(0), ")");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(),
              "cutlass_fused: expected input and weight to have the same dtype, but got ", x.scalar_type(), " and ",
              weight.scalar_type());
  check_vector(bias, "bias", weight.size(0));
  check_vector(scale, "scale", weight.size(0));
}

namespace {

at::ScalarType acc_type(at::ScalarType dt) { return dt == at::kDouble ? at::kDouble : at::kFloat; }

// The CPU path mirrors the CUDA one: fp32 accumulation ((x W^T + b) * scale in
// fp32, then rounded once to z's dtype) and fp64 column sums of z as stored.
at::Tensor affine_linear(at::Tensor const& x, at::Tensor const& weight, c10::optional<at::Tensor> const& bias,
                         at::Tensor const& a, c10::optional<at::Tensor> const& c) {
  auto acc = acc_type(x.scalar_type());
  auto out = at::matmul(x.to(acc), weight.to(acc).t());
  if (bias.has_value()) out.add_(bias->to(acc));
  out.mul_(a.to(acc));
  if (c.has_value()) out.add_(c->to(acc));
  return out;
}

at::Tensor into_padded(at::Tensor const& z, at::ScalarType dt) {
  auto out = empty_padded(z.size(0), z.size(1), z.options().dtype(dt));
  out.copy_(z);
  return out;
}

std::tuple<at::Tensor, at::Tensor> linear_scale_stats_cpu(at::Tensor const& x, at::Tensor const& weight,
                                                          c10::optional<at::Tensor> const& bias,
                                                          at::Tensor const& scale, c10::string_view family,
                                                          bool deterministic) {
  check_linear_args(x, weight, bias, scale);
  auto z = into_padded(affine_linear(x, weight, bias, scale, c10::nullopt), x.scalar_type());
  auto z64 = z.to(at::kDouble);
  auto stats = at::stack({z64.sum(0), (z64 * z64).sum(0)});
  return {z, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_finalize_cpu(
    at::Tensor const& z, at::Tensor const& stats, int64_t count, c10::optional<at::Tensor> const& weight,
    c10::optional<at::Tensor> const& bias, c10::optional<at::Tensor> running_mean,
    c10::optional<at::Tensor> running_var, c10::optional<at::Tensor> const& num_batches_tracked, double momentum,
    double eps) {
  auto mean = stats[0] / static_cast<double>(count);
  auto var = (stats[1] / static_cast<double>(count) - mean * mean).clamp_min(0);
  auto invstd = (var + eps).rsqrt();
  auto acc = acc_type(z.scalar_type());
  auto y = (z.to(acc) - mean.to(acc)) * invstd.to(acc);
  if (weight.has_value()) y = y * weight->to(acc);
  if (bias.has_value()) y = y + bias->to(acc);
  if (running_mean.has_value()) {
    double m = momentum;
    if (num_batches_tracked.has_value()) m = 1.0 / num_batches_tracked->item<double>();  // a CPU tensor: no sync
    auto unbiased = var * (static_cast<double>(count) / static_cast<double>(count - 1));
    running_mean->copy_(running_mean->to(at::kDouble) * (1 - m) + mean * m);
    running_var->copy_(running_var->to(at::kDouble) * (1 - m) + unbiased * m);
  }
  return {y.to(z.scalar_type()).contiguous(), mean.to(acc), invstd.to(acc)};
}

at::Tensor linear_scale_batch_norm_eval_cpu(at::Tensor const& x, at::Tensor const& weight,
                                            c10::optional<at::Tensor> const& bias, at::Tensor const& scale,
                                            c10::optional<at::Tensor> const& bn_weight,
                                            c10::optional<at::Tensor> const& bn_bias, at::Tensor const& running_mean,
                                            at::Tensor const& running_var, double eps, c10::string_view family) {
  check_linear_args(x, weight, bias, scale);
  auto g = (running_var.to(at::kDouble) + eps).rsqrt();
  if (bn_weight.has_value()) g = g * bn_weight->to(at::kDouble);
  auto a = scale.to(at::kDouble) * g;
  auto c = -running_mean.to(at::kDouble) * g;
  if (bn_bias.has_value()) c = c + bn_bias->to(at::kDouble);
  auto acc = acc_type(x.scalar_type());
  return affine_linear(x, weight, bias, a.to(acc), c.to(acc)).to(x.scalar_type()).contiguous();
}

std::vector<std::string> kernel_names() {
  std::vector<std::string> out;
#if defined(CUTLASS_FUSED_WITH_CUDA)
  for (auto const* k = kernels_begin(); k != kernels_end(); ++k) out.emplace_back(k->name);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY(cutlass_fused, m) {
  m.def(
      "linear_scale_stats(Tensor x, Tensor weight, Tensor? bias, Tensor scale, str family, bool deterministic)"
      " -> (Tensor z, Tensor stats)");
  m.def(
      "batch_norm_finalize(Tensor z, Tensor stats, int count, Tensor? weight, Tensor? bias,"
      " Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor? num_batches_tracked, float momentum,"
      " float eps) -> (Tensor y, Tensor mean, Tensor invstd)");
  m.def(
      "linear_scale_batch_norm_eval(Tensor x, Tensor weight, Tensor? bias, Tensor scale, Tensor? bn_weight,"
      " Tensor? bn_bias, Tensor running_mean, Tensor running_var, float eps, str family) -> Tensor");
  m.def("kernel_names() -> str[]", &kernel_names);
}

TORCH_LIBRARY_IMPL(cutlass_fused, CPU, m) {
  m.impl("linear_scale_stats", &linear_scale_stats_cpu);
  m.impl("batch_norm_finalize", &batch_norm_finalize_cpu);
  m.impl("linear_scale_batch_norm_eval", &linear_scale_batch_norm_eval_cpu);
}

}  // namespace cutlass_fused
