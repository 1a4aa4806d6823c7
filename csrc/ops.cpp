// The op schemas (one TORCH_LIBRARY) and the argument checks both backends share.
//
// Schema choices:
//  * linear_stats returns h = x W^T + b and its fp64 column sums, (2, N), so
//    that SyncBatchNorm can all-reduce them before batch_norm_finalize, which
//    applies scale: z = h * scale is never stored, and h is what the backward
//    needs (d scale = sum dz * h, with no division by scale).
//  * linear_scale_batch_norm_train updates the running stats and
//    num_batches_tracked in place (marked (a!), (b!), (c!)), so that on CUDA
//    the whole step after the GEMM is one kernel; update_running_stats does
//    the same for the split ops' path (SyncBatchNorm).
//  * `family` is a string ("auto", "sm90", "sm80"): a compile-time constant
//    for torch.compile, chosen in Python (cutlass_fused.use_kernel_family).
//  * `scale` is optional everywhere: None is the layer without one, y = BN(h)
//    (cutlass_fused.LinearBatchNorm1d), and no kernel reads a scale then (a null
//    vector reads as 1); a 0-dim scale is one value for every column, as `h * scale`
//    broadcasts it (the FP8 ops' alpha beside a layer without a scale). z = h * scale
//    takes PyTorch's dtype for that product (output_dtype in ops.h).
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>

#include "kernels/plan.h"
#include "ops.h"
#if defined(CUTLASS_FUSED_WITH_CUDA)
#include "derived_cache.h"
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

void check_scale(c10::optional<at::Tensor> const& scale, int64_t n) {
  if (scale.has_value() && scale->dim() == 0) return;  // one value for every column, as h * scale broadcasts it
  check_vector(scale, "scale", n);
}

void check_linear_args(at::Tensor const& x, at::Tensor const& weight, c10::optional<at::Tensor> const& bias,
                       c10::optional<at::Tensor> const& scale) {
  TORCH_CHECK(x.dim() == 2, "cutlass_fused: expected input to be 2-D (batch, in_features), but got ", x.dim(),
              "-D input of size ", x.sizes());
  TORCH_CHECK(weight.dim() == 2, "cutlass_fused: expected weight to be 2-D (out_features, in_features), but got ",
              weight.sizes());
  TORCH_CHECK(x.size(1) == weight.size(1), "cutlass_fused: mat1 and mat2 shapes cannot be multiplied (", x.size(0),
              "x", x.size(1), " and ", weight.size(1), "x", weight.size(0), ")");
  // Integer and bool layers would otherwise compute in float and truncate h on the CPU. Checked
  // before the dtypes' match, so that an integer x meets this message whatever the weight's dtype.
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "cutlass_fused: expected input to be a floating-point tensor, ",
              "but got ", x.scalar_type());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(),
              "cutlass_fused: expected input and weight to have the same dtype, but got ", x.scalar_type(), " and ",
              weight.scalar_type());
  check_vector(bias, "bias", weight.size(0));
  check_scale(scale, weight.size(0));
}

void check_running_stats(at::Tensor const& running_mean, at::Tensor const& running_var, int64_t n,
                         c10::optional<at::ScalarType> z) {
  for (auto [t, name] : {std::pair{&running_mean, "running_mean"}, std::pair{&running_var, "running_var"}}) {
    // PyTorch's words for a wrong count; a right count in a wrong shape gets check_vector's.
    TORCH_CHECK(t->numel() == n, name, " should contain ", n, " elements not ", t->numel());
    check_vector(*t, name, n);
    auto dt = t->scalar_type();
    if (!z.has_value()) {
      TORCH_CHECK(at::isFloatingType(dt), "cutlass_fused: expected ", name, " to have dtype Float (or another ",
                  "floating-point dtype), but got ", dt);
      continue;
    }
    // As PyTorch's batch norm takes them: in z's dtype, or float32 for a 16-bit z.
    bool z16 = *z == at::kHalf || *z == at::kBFloat16;
    TORCH_CHECK(dt == *z || (z16 && dt == at::kFloat), "cutlass_fused: expected ", name, " to have dtype ", *z,
                z16 ? " or Float" : "", " (that of h * scale), but got ", dt);
  }
}

void check_cast_dtype(at::ScalarType dtype) {
  TORCH_CHECK_VALUE(dtype == at::kBFloat16 || dtype == at::kHalf,
                    "cutlass_fused: expected dtype to be torch.bfloat16 or torch.float16 (an autocast dtype), but got ",
                    dtype);
}

void check_family(c10::string_view family) {
  try {
    check_family_name(std::string(family.data(), family.size()));
  } catch (std::exception const& e) {
    TORCH_CHECK(false, e.what());
  }
}

void ask_y(Problem& p, at::ScalarType y) {
  p.y_other = y != at::kBFloat16 && y != at::kHalf && y != at::kFloat;
  if (!p.y_other) p.y = dtype_of(y, "output_dtype");
}

DType dtype_of(at::ScalarType t, char const* name) {
  switch (t) {
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    case at::kFloat: return DType::f32;
    default:
      TORCH_CHECK(false, "cutlass_fused: expected ", name,
                  " to be bfloat16, float16 or float32 on CUDA, but got ", t);
      return DType::f32;
  }
}

at::ScalarType y_dtype(at::ScalarType x, c10::optional<at::Tensor> const& scale,
                       c10::optional<at::ScalarType> requested) {
  if (!requested.has_value()) return output_dtype(x, scale);
  TORCH_CHECK_VALUE(at::isFloatingType(*requested), "cutlass_fused: expected output_dtype to be None or a ",
                    "floating-point dtype, but got ", *requested);
  return *requested;
}

Activation activation_of(c10::string_view name) {
  try {
    return parse_activation(std::string(name.data(), name.size()));
  } catch (std::exception const& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

at::Tensor activated(at::Tensor const& y, Activation act, double slope) {
  switch (act) {
    case Activation::none: return y;
    case Activation::relu: return at::relu(y);
    case Activation::leaky_relu: return at::leaky_relu(y, slope);
    case Activation::gelu: return at::gelu(y, "none");
    case Activation::gelu_tanh: return at::gelu(y, "tanh");
    case Activation::silu: return at::silu(y);
  }
  return y;
}

at::Tensor activation_backward(at::Tensor const& grad, at::Tensor const& pre, Activation act, double slope) {
  switch (act) {
    case Activation::none: return grad;
    case Activation::relu: return at::threshold_backward(grad, pre, 0);
    case Activation::leaky_relu: return at::leaky_relu_backward(grad, pre, slope, false);
    case Activation::gelu: return at::gelu_backward(grad, pre, "none");
    case Activation::gelu_tanh: return at::gelu_backward(grad, pre, "tanh");
    case Activation::silu: return at::silu_backward(grad, pre);
  }
  return grad;
}

namespace {

// Whether outputs start as NaN (cutlass_fused.overrides(poison=True)); read by every output
// allocation: no lock. The plan's overrides are kept beside it (current_overrides, plan.h).
std::atomic<bool> poison_now{false};

void set_overrides(std::string const& kernel, std::string const& tail, std::string const& backward, int64_t swizzle,
                   std::string const& raster, bool stats_gemm, bool poison) {
  Overrides o;
  try {
    o = parse_overrides(kernel, tail, backward, swizzle, raster, stats_gemm);
  } catch (std::exception const& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  set_current_overrides(o);
  poison_now = poison;
}

// torch.ops.cutlass_fused.plan: what make_plan chooses for a problem on a GPU described by its
// compute capability and SM count, with the overrides in force; "key=value" lines.
std::string plan_op(std::string const& op, int64_t m, int64_t n, int64_t k, at::ScalarType dtype, bool y_wider,
                    bool allow_tf32, std::string const& family, int64_t capability, int64_t sm_count,
                    bool cumulative, bool aligned, c10::string_view activation, c10::string_view fp8,
                    c10::optional<at::ScalarType> output_dtype, bool fold_kept) {
  TORCH_CHECK_VALUE(fp8 == "none" || fp8 == "e4m3" || fp8 == "e4m3_fast",
                    "cutlass_fused: expected fp8 to be 'none', 'e4m3' or 'e4m3_fast', but got '", fp8, "'");
  Problem p;
  try {
    p.op = parse_op(op);
  } catch (std::exception const& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  TORCH_CHECK_VALUE(m > 0 && n > 0 && k >= 0 && sm_count > 0, "cutlass_fused: expected positive sizes and SM count");
  p.m = m;
  p.n = n;
  p.k = k;
  p.x = dtype_of(dtype, "dtype");
  p.y_wider = y_wider;
  ask_y(p, output_dtype.value_or(y_wider ? at::kFloat : dtype));
  p.allow_tf32 = allow_tf32;
  p.family = family;
  p.capability = static_cast<int>(capability);
  p.sm_count = static_cast<int>(sm_count);
  p.cumulative = cumulative;
  p.aligned = aligned;
  p.fold_kept = fold_kept;
  p.act = activation_of(activation);
  p.fp8 = fp8 != "none";
  p.fast_accum = fp8 == "e4m3_fast";
  p.overrides = current_overrides();
  try {
    return describe(make_plan(p));
  } catch (std::exception const& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace

bool poison_outputs() { return poison_now.load(std::memory_order_relaxed); }

void check_batch(int64_t count, int64_t n) {
  TORCH_CHECK(count > 1, "Expected more than 1 value per channel when training, got input size [", count, ", ", n,
              "]");
}

void check_sums(at::Tensor const& sums, char const* name, int64_t n) {
  TORCH_CHECK(sums.dim() == 2 && sums.size(0) == 2 && sums.size(1) == n && sums.scalar_type() == at::kDouble &&
                  sums.is_contiguous(),
              "cutlass_fused: expected ", name, " to be a contiguous float64 tensor of shape [2, ", n, "], but got ",
              sums.scalar_type(), " ", sums.sizes());
}

void check_backward_linear(at::Tensor const& dz, at::Tensor const& next_weight, at::Tensor const& h) {
  TORCH_CHECK(h.dim() == 2, "cutlass_fused: expected h to be 2-D (batch x features), but got ", h.sizes());
  TORCH_CHECK(dz.dim() == 2 && dz.size(0) == h.size(0),
              "cutlass_fused: expected dz to be 2-D with h's ", h.size(0), " rows (the next Linear's output "
              "gradient), but got ", dz.sizes());
  TORCH_CHECK(next_weight.dim() == 2 && next_weight.size(0) == dz.size(1) && next_weight.size(1) == h.size(1),
              "cutlass_fused: expected next_weight of shape [", dz.size(1), ", ", h.size(1),
              "] (the next Linear's weight: dz's columns x h's), but got ", next_weight.sizes());
  TORCH_CHECK(dz.scalar_type() == h.scalar_type() && next_weight.scalar_type() == h.scalar_type(),
              "cutlass_fused: expected dz and next_weight in h's dtype ", h.scalar_type(), ", but got ",
              dz.scalar_type(), " and ", next_weight.scalar_type());
}

void check_link_args(at::Tensor const& x, c10::optional<at::Tensor> const& prev_h,
                     c10::optional<at::Tensor> const& prev_mean, c10::optional<at::Tensor> const& prev_invstd) {
  if (!prev_h.has_value()) {
    TORCH_CHECK(!prev_mean.has_value() && !prev_invstd.has_value(),
                "cutlass_fused: expected prev_mean and prev_invstd to be None without prev_h");
    return;
  }
  TORCH_CHECK(prev_mean.has_value() && prev_invstd.has_value(),
              "cutlass_fused: expected prev_mean and prev_invstd beside prev_h (the previous layer's statistics)");
  // Symbolic sizes: torch.compile traces this check, and sizes() would fix its batch to a constant.
  TORCH_CHECK(prev_h->dim() == 2 && x.dim() == 2 && prev_h->sym_sizes() == x.sym_sizes(),
              "cutlass_fused: expected prev_h of x's shape ", x.sym_sizes(), " (x is the previous layer's y), but got ",
              prev_h->sym_sizes());
  c10::SymInt const& n = prev_h->sym_size(1);
  for (auto const* t : {&*prev_mean, &*prev_invstd}) {
    TORCH_CHECK(t->dim() == 1 && t->sym_size(0) == n && t->scalar_type() == at::kDouble,
                "cutlass_fused: expected prev_mean and prev_invstd to be float64 vectors of ", n,
                " (the previous layer's training op's mean and invstd), but got ", t->scalar_type(), " ",
                t->sym_sizes());
  }
}

void check_sync_row_args(at::Tensor const& stats, int64_t count) {
  int64_t n = stats.dim() == 2 ? stats.size(1) : 0;
  check_sums(stats, "stats", n);
  TORCH_CHECK(n > 0, "cutlass_fused: expected stats to have at least one column");
  TORCH_CHECK(count >= 0, "cutlass_fused: expected count to be non-negative, but got ", count);
}

void check_rows(at::Tensor const& rows, int64_t n) {
  bool ok = rows.dim() == 2 && rows.size(0) > 0 && rows.scalar_type() == at::kDouble && rows.is_contiguous();
  if (n < 0) n = ok ? (rows.size(1) - 1) / 2 : 0;
  ok = ok && n > 0 && rows.size(1) == 2 * n + 1;
  TORCH_CHECK(ok, "cutlass_fused: expected rows to be a contiguous float64 tensor of shape [world, 2 * n + 1]"
              " (count, mean, M2), but got ", rows.scalar_type(), " ", rows.sizes());
}

void check_sync_grads_args(at::Tensor const& local, at::Tensor const& sums, at::Tensor const& row,
                           at::Tensor const& count, at::Tensor const& mean, at::Tensor const& invstd,
                           c10::optional<at::Tensor> const& scale, c10::optional<at::Tensor> const& weight) {
  int64_t n = local.dim() == 2 ? local.size(1) : 0;
  check_sums(local, "local", n);
  check_sums(sums, "sums", n);
  TORCH_CHECK(row.dim() == 1 && row.size(0) == 2 * n + 1 && row.scalar_type() == at::kDouble && row.is_contiguous(),
              "cutlass_fused: expected row to be a contiguous float64 tensor of shape [", 2 * n + 1,
              "] (count, mean, M2), but got ", row.scalar_type(), " ", row.sizes());
  check_count(count);
  for (auto [t, name] : {std::pair{&mean, "mean"}, std::pair{&invstd, "invstd"}}) {
    check_vector(*t, name, n);
    TORCH_CHECK(t->scalar_type() == at::kDouble, "cutlass_fused: expected ", name, " to be float64 (as "
                "batch_norm_finalize returns it), but got ", t->scalar_type());
  }
  check_scale(scale, n);
  check_vector(weight, "weight", n);
}

void check_count(at::Tensor const& count) {
  TORCH_CHECK(count.numel() == 1 && count.scalar_type() == at::kDouble,
              "cutlass_fused: expected count to be a float64 tensor of one element, but got ", count.scalar_type(),
              " ", count.sizes());
}

void check_quantize_transposed(at::Tensor const& t, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 2, "cutlass_fused: expected t to be 2-D, but got ", t.dim(), "-D");
  TORCH_CHECK_VALUE(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
                    "cutlass_fused: expected dtype to be torch.float8_e4m3fn or torch.float8_e5m2, but got ", dtype);
}

void check_fp32_element(at::Tensor const& t, char const* name, c10::Device device) {
  TORCH_CHECK(t.numel() == 1 && t.scalar_type() == at::kFloat && t.device() == device, "cutlass_fused: expected ",
              name, " to be one float32 element on ", device, ", but got ", t.scalar_type(), " ", t.sizes(), " on ",
              t.device());
}

void check_dequantize(at::Tensor const& t8, c10::optional<at::Tensor> const& scale, at::ScalarType dtype) {
  TORCH_CHECK(t8.scalar_type() == at::kFloat8_e4m3fn || t8.scalar_type() == at::kFloat8_e5m2,
              "cutlass_fused: expected t8 to be torch.float8_e4m3fn or torch.float8_e5m2, but got ", t8.scalar_type());
  if (scale.has_value()) check_fp32_element(*scale, "scale", t8.device());
  TORCH_CHECK_VALUE(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
                    "cutlass_fused: expected dtype to be torch.bfloat16, torch.float16 or torch.float32, but got ",
                    dtype);
}

void check_quantize_with_scale(at::Tensor const& t, at::Tensor const& scale, at::ScalarType dtype, bool transposed) {
  if (transposed) {
    check_quantize_transposed(t, dtype);
  } else {
    TORCH_CHECK_VALUE(dtype == at::kFloat8_e4m3fn,
                      "cutlass_fused: expected dtype to be torch.float8_e4m3fn where transposed is False, but got ",
                      dtype);
  }
  check_fp32_element(scale, "scale", t.device());
}

namespace {
// The FP8 scale ops' 16- and 32-bit floating dtypes (their kernels' dispatch), a RuntimeError else.
void check_floating16or32(at::ScalarType dt, char const* name) {
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat, "cutlass_fused: expected ", name,
              " to be torch.bfloat16, torch.float16 or torch.float32, but got ", dt);
}
}  // namespace

void check_fp8_operand_scales(at::Tensor const& s_x, at::Tensor const& s_w, c10::optional<at::Tensor> const& bias,
                              c10::optional<at::Tensor> const& scale) {
  auto device = scale.has_value() ? scale->device() : s_x.device();
  check_fp32_element(s_x, "s_x", device);
  check_fp32_element(s_w, "s_w", device);
  if (scale.has_value()) check_floating16or32(scale->scalar_type(), "scale");
  if (bias.has_value()) {
    check_floating16or32(bias->scalar_type(), "bias");
    TORCH_CHECK(bias->device() == device, "cutlass_fused: expected bias on ", device, ", but got ", bias->device());
  }
}

void check_fp8_backward_scales(at::Tensor const& dsc, at::Tensor const& s_x, at::Tensor const& s_w,
                               c10::optional<at::Tensor> const& s_g, c10::optional<at::ScalarType> bias_dtype,
                               at::ScalarType scale_dtype) {
  check_fp32_element(s_x, "s_x", dsc.device());
  check_fp32_element(s_w, "s_w", dsc.device());
  if (s_g.has_value()) check_fp32_element(*s_g, "s_g", dsc.device());
  check_floating16or32(dsc.scalar_type(), "dsc");
  check_floating16or32(scale_dtype, "scale_dtype");
  if (bias_dtype.has_value()) check_floating16or32(*bias_dtype, "bias_dtype");
}

void check_fp8_record(at::Tensor const& amax_history, at::Tensor const& scale, at::Tensor const& amax_x,
                      at::Tensor const& amax_w, c10::string_view amax_compute_algo) {
  check_fp8_state(amax_history, scale, amax_compute_algo, "scale");
  check_fp32_element(amax_x, "amax_x", amax_history.device());
  check_fp32_element(amax_w, "amax_w", amax_history.device());
}

void check_fp8_state(at::Tensor const& amax_history, at::Tensor const& scale, c10::string_view amax_compute_algo,
                     char const* scale_name) {
  TORCH_CHECK(amax_history.dim() == 2 && amax_history.size(0) >= 1 && amax_history.size(1) == 2 &&
                  amax_history.scalar_type() == at::kFloat && amax_history.is_contiguous(),
              "cutlass_fused: expected amax_history to be a contiguous float32 tensor of shape [length >= 1, 2], "
              "but got ", amax_history.scalar_type(), " ", amax_history.sizes());
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == 2 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.device() == amax_history.device(),
              "cutlass_fused: expected ", scale_name, " to be a contiguous float32 tensor of shape [2] on ",
              amax_history.device(), ", but got ", scale.scalar_type(), " ", scale.sizes(), " on ", scale.device());
  TORCH_CHECK_VALUE(amax_compute_algo == "max" || amax_compute_algo == "most_recent",
                    "cutlass_fused: expected amax_compute_algo to be 'max' or 'most_recent', but got '",
                    amax_compute_algo, "'");
}

void check_fp8_delayed_operands(at::Tensor const& x, at::Tensor const& weight, at::Tensor const& amax_history,
                                at::Tensor const& fp8_scale, c10::string_view amax_compute_algo) {
  check_fp8_state(amax_history, fp8_scale, amax_compute_algo, "fp8_scale");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "cutlass_fused: expected x and weight to be 2-D, but got ", x.dim(),
              "-D and ", weight.dim(), "-D");
}

void check_running_args(c10::optional<at::Tensor> const& running_mean, c10::optional<at::Tensor> const& running_var,
                        c10::optional<at::Tensor> const& num_batches_tracked, c10::optional<double> momentum) {
  // ValueError, as the Python API raised these before it relied on this one check.
  TORCH_CHECK_VALUE(running_mean.has_value() == running_var.has_value(),
                    "cutlass_fused: running_mean and running_var must both be given or both be None");
  TORCH_CHECK_VALUE(momentum.has_value() || !running_mean.has_value() || num_batches_tracked.has_value(),
                    "cutlass_fused: momentum=None (a cumulative average) needs num_batches_tracked");
}

namespace {

// The kernel table's rows this build compiled.
std::vector<std::string> kernel_names() {
  std::vector<std::string> out;
  for (auto const* k = kernels_begin(); k != kernels_end(); ++k) {
    if (k->entry != nullptr) out.emplace_back(k->name);
  }
  return out;
}

bool grad_runs_op(std::string const& family, int64_t capability, at::ScalarType dtype,
                  std::string const& activation) {
  try {
    DType d = dtype == at::kBFloat16 ? DType::bf16 : dtype == at::kHalf ? DType::f16 : DType::f32;
    return grad_runs(family, static_cast<int>(capability), d, activation_of(activation));
  } catch (std::exception const& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

bool e4m3_runs_op(std::string const& family, int64_t capability, at::ScalarType operands) {
  try {
    // The plan's DType for the kernels' dtypes; any other is not bf16 either.
    DType d = operands == at::kBFloat16 ? DType::bf16 : operands == at::kHalf ? DType::f16 : DType::f32;
    return e4m3_runs(family, static_cast<int>(capability), d);
  } catch (std::exception const& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

void clear_cache() {
#if defined(CUTLASS_FUSED_WITH_CUDA)
  clear_derived();
#endif
}

}  // namespace

TORCH_LIBRARY(cutlass_fused, m) {
  // `cache`: whether the GEMM ops may keep what they derive from parameters (the
  // weight's 3xTF32 split, the eval fold) for the next call: set by Python only
  // inside cutlass_fused.frozen_weights(), where the user promises no writes
  // through `.data` (which no version counter sees; csrc/derived_cache.h), and
  // never while torch.compile traces (Inductor's CUDA-graph warm-up allocates
  // from the graph's private pool, which must hold no tensor a cache outlives).
  //
  // The training forward in two steps, so SyncBN can all-reduce `stats` between them.
  m.def("linear_stats(Tensor x, Tensor weight, Tensor? bias, str family, bool cache=False)"
        " -> (Tensor h, Tensor stats)");
  m.def(
      "batch_norm_finalize(Tensor h, Tensor stats, Tensor? scale, SymInt count, Tensor? weight, Tensor? bias, float eps,"
      " str activation=\"none\", float negative_slope=0.01) -> (Tensor y, Tensor mean, Tensor invstd)");
  // Both steps and the running-stats update as one op: the unit autograd is
  // registered on (csrc/autograd.cpp). momentum=None is the cumulative average.
  //
  // `activation` ("none", "relu", "leaky_relu" with `negative_slope`, "gelu", "gelu_tanh",
  // "silu"): applied to BN(z) before y is rounded; a string, as `family`, so that torch.compile
  // sees a constant. `output_dtype`: y's dtype (None: h * scale's, as the unfused model's), so
  // that under autocast a block can hand the next Linear the 16-bit y it would cast to anyway.
  m.def(
      "linear_scale_batch_norm_train(Tensor x, Tensor weight, Tensor? bias, Tensor? scale, Tensor? bn_weight,"
      " Tensor? bn_bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked,"
      " float? momentum, float eps, str family, bool cache=False, str activation=\"none\","
      " float negative_slope=0.01, ScalarType? output_dtype=None)"
      " -> (Tensor y, Tensor h, Tensor stats, Tensor mean, Tensor invstd)");
  // The training op for linked layers (issue 71, item 1; docs/decisions.md, "Backward": linked
  // layers), where one layer's y is the next one's x alone: x is act(BN(prev_h)) of the layer
  // before, made by that layer's linked op, whose h, mean, invstd, linear bias and BN vectors
  // come as prev_*. The backward gives x no gradient but prev_h's and the previous layer's
  // vectors', from dh through this layer's weight (batch_norm_backward_linear: the dX GEMM's
  // epilogue makes that layer's sums), and prev_bias the linear bias's (exactly zero but NaN, as
  // batch_norm_backward's). h is differentiable here: its gradient (prev_h's, from the next
  // layer's linked op) reaches x and weight, not the linear bias, whose gradient that op gives.
  // prev_h None: the first linked layer, whose x gets its gradient as the training op's.
  m.def(
      "linear_scale_batch_norm_train_linked(Tensor x, Tensor weight, Tensor? bias, Tensor? scale, Tensor? bn_weight,"
      " Tensor? bn_bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked,"
      " float? momentum, float eps, str family, bool cache=False, str activation=\"none\","
      " float negative_slope=0.01, ScalarType? output_dtype=None, Tensor? prev_h=None, Tensor? prev_mean=None,"
      " Tensor? prev_invstd=None, Tensor? prev_bias=None, Tensor? prev_scale=None, Tensor? prev_bn_weight=None,"
      " Tensor? prev_bn_bias=None, float prev_eps=1e-05, str prev_activation=\"none\","
      " float prev_negative_slope=0.01) -> (Tensor y, Tensor h, Tensor stats, Tensor mean, Tensor invstd)");
  // F.linear(x, weight, bias) for a plain Linear whose x is a linked layer's y (its Link as prev_*,
  // as above): the backward gives x no gradient but the previous layer's, through
  // batch_norm_backward_linear, and weight and bias theirs as F.linear's.
  m.def(
      "linear_linked(Tensor x, Tensor weight, Tensor? bias, Tensor prev_h, Tensor prev_mean, Tensor prev_invstd,"
      " Tensor? prev_bias=None, Tensor? prev_scale=None, Tensor? prev_bn_weight=None, Tensor? prev_bn_bias=None,"
      " float prev_eps=1e-05, str prev_activation=\"none\", float prev_negative_slope=0.01, str family=\"auto\")"
      " -> Tensor");
  // FP8 (issue 33): the training op over e4m3 x and W that the caller scaled and rounded (x8 = x s_x,
  // W8 = W s_w, powers of two), given bias / alpha and scale * alpha (alpha = 1 / (s_x s_w)): h =
  // x8 W8^T + bias in bf16, then as the training op with a bf16 x, so y, the statistics and the
  // running stats are the layer's (BN cancels alpha but in eps, which scale * alpha carries). No
  // autograd: its caller differentiates around it. A separate op, so that the training op's
  // contract (autocast, autograd, h in x's dtype) stays as it is. fast_accum: the e4m3 GEMM
  // accumulates in the tensor cores alone (the plan's e4m3_fast rows); the CPU's bf16 reference
  // ignores it. The e4m3 ops below pass it on.
  m.def(
      "linear_scale_batch_norm_train_fp8(Tensor x, Tensor weight, Tensor? bias, Tensor? scale, Tensor? bn_weight,"
      " Tensor? bn_bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked,"
      " float? momentum, float eps, str family, str activation=\"none\", float negative_slope=0.01,"
      " ScalarType? output_dtype=None, bool fast_accum=False)"
      " -> (Tensor y, Tensor h, Tensor stats, Tensor mean, Tensor invstd)");
  // The e4m3 training path as one op with its autograd (csrc/fp8_autograd.cpp): x and W rounded
  // by quantize_e4m3 under current scaling (a frozen W8 kept where `cache` allows), the FP8 op
  // above, and the backward in bf16 over the dequantized operands or, backward="e5m2", as FP8 GEMMs
  // over dh rounded to e5m2. y only: the op's other outputs stay inside.
  // Delayed scaling (fp8_scale given: a layer's two scales, x's and W's): x and W rounded under
  // them by fp8_delayed_operands, whose casts measure their amaxes and whose fp8_record step
  // updates the layer's amax_history and fp8_scale in place, as the running stats are (no cache:
  // W8 moves with the scale).
  m.def(
      "linear_scale_batch_norm_train_e4m3(Tensor x, Tensor weight, Tensor? bias, Tensor? scale, Tensor? bn_weight,"
      " Tensor? bn_bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked,"
      " float? momentum, float eps, str family, str activation=\"none\", float negative_slope=0.01,"
      " ScalarType? output_dtype=None, int margin=0, str backward=\"bf16\", bool cache=False,"
      " Tensor(d!)? amax_history=None, Tensor(e!)? fp8_scale=None, str amax_compute_algo=\"max\","
      " bool fast_accum=False) -> Tensor");
  // FP8 current scaling (issue 33): t rounded to e4m3 under the power-of-two scale that maps its
  // amax into (224, 448] (less `margin` powers of two; 1 where the amax is 0 or not finite), and
  // that scale (0-dim fp32), as cutlass_fused/fp8.py's scale_of and quantize compute them: one op,
  // so that CUDA measures the amax and casts in two passes with no host sync.
  // `cache` as the GEMM ops' (above): a frozen weight's W8 is kept between calls.
  m.def("quantize_e4m3(Tensor t, int margin=0, bool cache=False) -> (Tensor t8, Tensor scale)");
  // A 2-D t rounded as above to `dtype` (float8_e4m3fn, or float8_e5m2 with 57344 in place of 448:
  // dh in the FP8 backward, Float8Recipe(backward="e5m2")), with the values also
  // transposed (t8_t = t8.t().contiguous()): the K-major operands of the FP8 backward's GEMMs,
  // made by the cast's own pass on CUDA. `cache`: a frozen e4m3 weight's values and transpose kept.
  m.def("quantize_transposed(Tensor t, ScalarType dtype, int margin=0, bool cache=False)"
        " -> (Tensor t8, Tensor t8_t, Tensor scale)");
  // t8.to(dtype) * scale.to(dtype) (scale: a 0-dim fp32 power of two, or None for 1): the bf16
  // FP8 backward's operands, one pass on CUDA where torch's float8 cast is slow.
  m.def("dequantize(Tensor t8, Tensor? scale, ScalarType dtype) -> Tensor");
  // Delayed scaling (issue 33): t rounded to `dtype` under the given power-of-two scale (one fp32
  // element, carried from earlier steps), fp8.quantize's values, and t's amax (0-dim fp32, NaN
  // where t holds one) measured by the cast's own pass on CUDA: one read of t, where current
  // scaling takes two. transposed: t 2-D, t8_t its values transposed (the FP8 backward's K-major
  // operand); else t8_t is empty and dtype is float8_e4m3fn.
  // scale_out: the scale it used, as a tensor of its own (the layer's state moves on after the
  // call; the backward keeps this one).
  m.def("quantize_with_scale(Tensor t, Tensor scale, ScalarType dtype, bool transposed=False)"
        " -> (Tensor t8, Tensor t8_t, Tensor amax, Tensor scale_out)");
  // The bias and scale the FP8 ops take for x8 = x s_x and W8 = W s_w (powers of two): alpha =
  // 1 / (s_x s_w), b = bias / alpha rounded to bf16 (empty where bias is None), sc = scale * alpha
  // in scale's dtype. The bits of those torch ops, in one launch on CUDA where they took 4 to 6.
  m.def("fp8_operand_scales(Tensor s_x, Tensor s_w, Tensor? bias, Tensor? scale) -> (Tensor b, Tensor sc)");
  // The e4m3 op's backward scalars, its BN backward's dsc (the gradient of sc above) in hand:
  // dbias = (dsc * 0).to(bias_dtype) (exactly zero, NaN where dsc is not finite; empty where
  // bias_dtype is None), dscale = (dsc / (s_x * s_w)).to(scale_dtype), and inv_g = 1 / s_g, the
  // e5m2 dh's dequantize scale (empty where s_g is None). The bits of those torch ops, in one
  // launch on CUDA where they took three or four (~25 us less host time a layer, H100).
  m.def("fp8_backward_scales(Tensor dsc, Tensor s_x, Tensor s_w, Tensor? s_g, ScalarType? bias_dtype,"
        " ScalarType scale_dtype) -> (Tensor dbias, Tensor dscale, Tensor inv_g)");
  // Delayed scaling's step, cutlass_fused/fp8.py's DelayedState.record: amax_history's rows shift
  // down one and row 0 takes (amax_x, amax_w); each scale becomes the power of two of the history's
  // max ("max") or of row 0 ("most_recent"), kept where that is 0 or not finite. One launch on CUDA.
  m.def("fp8_record(Tensor(a!) amax_history, Tensor(b!) scale, Tensor amax_x, Tensor amax_w, int margin=0,"
        " str amax_compute_algo=\"max\") -> ()");
  // Delayed scaling's forward step for a layer, one op: x and W (2-D) through quantize_with_scale
  // under fp8_scale[0] and [1] (e4m3; transposed as there), fp8_record of their amaxes, and
  // fp8_operand_scales of the scales the casts used (s_x, s_w): those ops' outputs and updates,
  // in four launches on CUDA where they took six, and one call of the dispatcher where four.
  m.def("fp8_delayed_operands(Tensor x, Tensor weight, Tensor? bias, Tensor? scale, Tensor(a!) amax_history,"
        " Tensor(b!) fp8_scale, int margin=0, str amax_compute_algo=\"max\", bool transposed=False)"
        " -> (Tensor x8, Tensor x8_t, Tensor w8, Tensor w8_t, Tensor s_x, Tensor s_w, Tensor b, Tensor sc)");
  m.def(
      "update_running_stats(Tensor stats, Tensor? scale, SymInt count, Tensor(a!) running_mean, Tensor(b!) running_var,"
      " Tensor? num_batches_tracked, float? momentum) -> ()");
  // With an activation, dy is act(BN(z))'s gradient; its derivative is recomputed from h, the
  // saved statistics and the BN bias (`bias`), so the forward saves nothing more.
  // dlinear_bias: the linear bias's gradient in linear_bias_dtype (empty without one), exactly zero
  // but NaN where dscale is not finite (as PyTorch's sum of dh is), from the kernel that writes
  // dscale: the training backward launched a multiplication a layer for it (a Triton kernel under
  // torch.compile), which a host-bound step feels.
  m.def(
      "batch_norm_backward(Tensor dy, Tensor h, Tensor mean, Tensor invstd, Tensor? scale, Tensor? weight, float eps,"
      " Tensor? bias=None, str activation=\"none\", float negative_slope=0.01, ScalarType? linear_bias_dtype=None)"
      " -> (Tensor dh, Tensor dscale, Tensor dweight, Tensor dbias, Tensor dlinear_bias)");
  // batch_norm_backward(dz @ next_weight, h, ...) for a layer whose y is the input of a Linear
  // (next_weight: its weight, dz: its output's gradient), with the GEMM's epilogue making the sums
  // where the plan has a kernel for it (csrc/kernels/plan.h, Op::backward_linear).
  m.def(
      "batch_norm_backward_linear(Tensor dz, Tensor next_weight, Tensor h, Tensor mean, Tensor invstd, Tensor? scale,"
      " Tensor? weight, float eps, Tensor? bias=None, str activation=\"none\", float negative_slope=0.01,"
      " ScalarType? linear_bias_dtype=None, str family=\"auto\")"
      " -> (Tensor dh, Tensor dscale, Tensor dweight, Tensor dbias, Tensor dlinear_bias)");
  // SyncBatchNorm's backward: batch_norm_backward's two passes apart, the group all-reducing
  // `sums` (2 x n fp64: sum g, sum g (h - mean), g = dy times act's derivative) between them.
  // `count`, the group's batch, is a one-element fp64 tensor on h's device: the ranks merge it
  // there, and a host int would sync the stream each step.
  m.def(
      "batch_norm_backward_reduce(Tensor dy, Tensor h, Tensor mean, Tensor invstd, Tensor? scale, Tensor? weight,"
      " float eps, Tensor? bias=None, str activation=\"none\", float negative_slope=0.01) -> Tensor");
  m.def(
      "batch_norm_backward_elemt(Tensor dy, Tensor h, Tensor mean, Tensor invstd, Tensor? scale, Tensor? weight,"
      " Tensor sums, Tensor count, float eps, Tensor? bias=None, str activation=\"none\","
      " float negative_slope=0.01) -> Tensor");
  // SyncBatchNorm's column arithmetic between its collectives (csrc/kernels/sync_stats.h has the
  // formulas), one launch each on CUDA where torch ops took ~50 a layer and step, all fp64.
  // This rank's row [count, mean(n), M2(n)] from linear_stats' sums over `count` rows:
  m.def("sync_batch_norm_row(Tensor stats, SymInt count) -> Tensor");
  // The group's gathered rows (world x (2n + 1)) merged in rank order: batch_norm_finalize's sums
  // for count 1 and update_running_stats' for count 2 (2 x n each), and the group's count (one
  // element, on the device: a host int would sync the stream):
  m.def("sync_batch_norm_merge(Tensor rows) -> (Tensor stats, Tensor running_stats, Tensor count)");
  // This rank's gradients of the linear bias, the scale, the BN weight and the BN bias (4 x n), from
  // its batch_norm_backward_reduce sums (`local`), the group's (`sums`), its row, the group's count
  // and the forward's mean and invstd:
  m.def(
      "sync_batch_norm_grads(Tensor local, Tensor sums, Tensor row, Tensor count, Tensor mean, Tensor invstd,"
      " Tensor? scale, Tensor? weight) -> Tensor");
  m.def(
      "linear_scale_batch_norm_eval(Tensor x, Tensor weight, Tensor? bias, Tensor? scale, Tensor? bn_weight,"
      " Tensor? bn_bias, Tensor running_mean, Tensor running_var, float eps, str family, bool cache=False,"
      " str activation=\"none\", float negative_slope=0.01, ScalarType? output_dtype=None) -> Tensor");
  // FP8 (issue 33): the eval op over e4m3 x and W that the caller scaled and rounded, given bias /
  // alpha and scale * alpha, as the FP8 training op: one e4m3 GEMM with the fold in its epilogue,
  // y = act((x8 W8^T + bias / alpha) (scale alpha) gamma invstd + ...), the emulated layer's y. No
  // cache (alpha moves with x's scale every call) and no autograd: inference.
  m.def(
      "linear_scale_batch_norm_eval_fp8(Tensor x, Tensor weight, Tensor? bias, Tensor? scale, Tensor? bn_weight,"
      " Tensor? bn_bias, Tensor running_mean, Tensor running_var, float eps, str family,"
      " str activation=\"none\", float negative_slope=0.01, ScalarType? output_dtype=None,"
      " bool fast_accum=False) -> Tensor");
  // The e4m3 eval path as one op (csrc/fp8_autograd.cpp): x and W rounded by quantize_e4m3 under
  // current scaling (a frozen W8 kept where `cache` allows), or under fp8_scale's two scales
  // (delayed scaling, which eval reads and does not update), then the op above. No autograd: the
  // layer takes it where no gradient is asked for.
  m.def(
      "linear_scale_batch_norm_eval_e4m3(Tensor x, Tensor weight, Tensor? bias, Tensor? scale, Tensor? bn_weight,"
      " Tensor? bn_bias, Tensor running_mean, Tensor running_var, float eps, str family,"
      " str activation=\"none\", float negative_slope=0.01, ScalarType? output_dtype=None, int margin=0,"
      " bool cache=False, Tensor? fp8_scale=None, bool fast_accum=False) -> Tensor");
  // a @ b in the precision of the layer's forward for `family` (3xTF32 for fp32
  // without TF32 on sm90; torch.mm otherwise): the backward's dX and dW GEMMs.
  m.def("matmul(Tensor a, Tensor b, str family) -> Tensor");
  // Autocast's casts of the training op's x, weight and bias to `dtype` (bf16 or f16), each where
  // autocast would cast it (autocast_casts in ops.h: floating point, not fp64, not already dtype),
  // else an empty tensor: the Autograd kernel's, where autocast leaves them to it (autocast.cpp).
  // One op and, on CUDA, one launch for the three, so that torch.compile traces neither a cast
  // kernel nor a wrapper call for each (docs/decisions.md, "Autocast").
  m.def("cast_linear_inputs(Tensor x, Tensor weight, Tensor? bias, ScalarType dtype)"
        " -> (Tensor x16, Tensor weight16, Tensor bias16)");
  m.def("kernel_names() -> str[]", &kernel_names);
  // The overrides of the plan's choices (cutlass_fused.overrides(); empty or "auto": the plan's).
  m.def("set_overrides(str kernel, str tail, str backward, int swizzle, str raster, bool stats_gemm, bool poison)"
        " -> ()",
        &set_overrides);
  // What the plan chooses for a problem (cutlass_fused.plan()), on any device.
  m.def("plan(str op, int m, int n, int k, ScalarType dtype, bool y_wider, bool allow_tf32, str family,"
        " int capability, int sm_count, bool cumulative, bool aligned, str activation=\"none\","
        " str fp8=\"none\", ScalarType? output_dtype=None, bool fold_kept=False) -> str",
        &plan_op);
  // Whether the e4m3 route runs for the family on a GPU of that compute capability (major * 10 +
  // minor), x and W reaching the GEMM in `operands` (kernels/plan.h, e4m3_runs); on any device.
  m.def("e4m3_runs(str family, int capability, ScalarType operands) -> bool", &e4m3_runs_op);
  // Whether batch_norm_backward_linear has a grad kernel for `family` on a GPU of compute
  // capability `capability` (major * 10 + minor), h in `dtype`, `activation` (kernels/plan.h,
  // grad_runs); on any device.
  m.def("grad_runs(str family, int capability, ScalarType dtype, str activation) -> bool", &grad_runs_op);
  // Drops every value kept under `cache` (frozen_weights' exit).
  m.def("clear_cache() -> ()", &clear_cache);
}

}  // namespace cutlass_fused
