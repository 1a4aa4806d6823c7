// CUDA implementations: torch tensors in, raw pointers out to csrc/kernels.
// Each op checks its arguments, asks the plan (csrc/kernels/plan.h) what to run, makes the
// pointers, allocates one workspace, and runs the plan. Everything runs on the inputs' device
// and torch's current stream, with workspaces from the caching allocator, and never
// synchronizes.
#include <limits>
#include <string>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/batch_norm.h"
#include "kernels/gemm_evt.h"
#include "kernels/inf_fix.h"
#include "kernels/limits.h"
#include "kernels/plan.h"
#include "eval_fold_cuda.h"
#include "fp8_cuda.h"
#include "layer_args.h"
#include "ops.h"
#include "tf32x3_cuda.h"

namespace cutlass_fused {
namespace {

// The problem of one call on `device`, with the overrides in force (cutlass_fused.overrides()).
Problem problem(Op op, int64_t m, int64_t n, int64_t k, at::ScalarType x, bool y_wider, c10::string_view family,
                at::Device device) {
  auto* prop = at::cuda::getDeviceProperties(device.index());
  Problem p;
  p.op = op;
  p.m = m;
  p.n = n;
  p.k = k;
  p.x = dtype_of(x, "input");
  p.y_wider = y_wider;
  p.allow_tf32 = at::globalContext().allowTF32CuBLAS();
  p.family = std::string(family.data(), family.size());
  p.capability = prop->major * 10 + prop->minor;
  p.sm_count = prop->multiProcessorCount;
  p.device = device.index();
  p.device_name = prop->name;
  p.overrides = current_overrides();
  return p;
}

Plan planned(Problem const& p) {
  try {
    return make_plan(p);
  } catch (std::exception const& e) {
    TORCH_CHECK(false, e.what());
  }
}

// A 16-byte aligned, unit-stride operand whose row length is a multiple of 16
// bytes: zero-padding K changes no dot product.
at::Tensor aligned_rows(at::Tensor const& t) {
  int64_t k = t.size(1), kp = padded_ld(k, t.scalar_type());
  auto c = t.contiguous();
  if (kp != k) return at::constant_pad_nd(c, {0, kp - k});
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % kAlignBytes != 0) return c.clone();
  return c;
}

// The bias as the EVT's row broadcast reads it: in the kernel's input dtype
// (a cast only where the bias's own dtype differs), 16-byte aligned, and
// zero-padded to `len` (the kernel's N) only where N is unaligned.
c10::optional<at::Tensor> bias_vector(c10::optional<at::Tensor> const& t, at::ScalarType dt, int64_t len) {
  if (!t.has_value()) return c10::nullopt;
  auto v = t->to(dt).contiguous();
  if (len != v.size(0)) return at::constant_pad_nd(v, {0, len - v.size(0)});
  return reinterpret_cast<uintptr_t>(v.data_ptr()) % kAlignBytes ? v.clone() : v;
}

at::Tensor weight_rows(at::Tensor const& w, int64_t rows) {
  auto wa = aligned_rows(w);
  return rows == wa.size(0) ? wa : at::constant_pad_nd(wa, {0, 0, 0, rows - wa.size(0)});
}

// The GEMM's operands: x and w as they are (16-byte aligned rows, w padded to
// kn rows), or split for 3xTF32 with K tripled. Split, the segments of x
// [small | again | big] meet W's [again | small | big] (csrc/kernels/tf32x3.h), in either
// operand order (the stats kernels take W as A). The statistics kernels read x and W themselves
// beside their remainders (`x_rest`, `w_rest`, with their infinite rows' flags), over K'
// = 3 `seg`, seg their K padded to the K tile (csrc/kernels/remainder_mainloop.h).
struct Operands {
  at::Tensor x, w;
  c10::optional<at::Tensor> x_rest, w_rest, x_flags, w_flags;
  int64_t seg = 0;
};

Operands operands(at::Tensor const& x, at::Tensor const& weight, GemmPlan const& g, bool cache) {
  if (!g.split) return {aligned_rows(x), weight_rows(weight, g.kn)};
  if (!g.remainder)
    return {split_tf32x3(x, x.size(0), SplitOrder::small_big_big), split_weight_tf32x3(weight, g.kn, cache)};
  auto xa = aligned_rows(x);
  auto wa = weight_rows(weight, g.kn);
  auto rx = remainder_tf32x3(xa);
  auto rw = remainder_weight_tf32x3(weight, wa, cache);
  int64_t tile_k = g.kernel->tile_k;
  return {xa, wa, rx.rest, rw.rest, rx.flags, rw.flags, (xa.size(1) + tile_k - 1) / tile_k * tile_k};
}

void const* ptr_or_null(c10::optional<at::Tensor> const& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// Rewrites the outputs of x's and W's flagged rows (ops.x and ops.w as the GEMM read them, k
// long) as an fp32 GEMM gives them, then out = (h + b) * a + c (b fp32; a, c nullptr for 1, 0).
void fix_flagged_products(Operands const& ops, at::Tensor const& x_flags, at::Tensor const& w_flags, int64_t n,
                          int64_t k, void const* b, float const* a, float const* c, at::Tensor& out) {
  InfFixArgs f{};
  f.x = ops.x.data_ptr<float>();
  f.ldx = ops.x.stride(0);
  f.w = ops.w.data_ptr<float>();
  f.ldw = ops.w.stride(0);
  f.x_flags = x_flags.data_ptr<unsigned char>();
  f.w_flags = w_flags.data_ptr<unsigned char>();
  f.b = static_cast<float const*>(b);
  f.a = a;
  f.c = c;
  f.out = out.data_ptr<float>();
  f.ldo = out.stride(0);
  f.m = static_cast<int>(ops.x.size(0));
  f.n = static_cast<int>(n);
  f.k = static_cast<int>(k);
  fix_inf_products(f, at::cuda::getCurrentCUDAStream().stream());
}

// The sm80 family's fp32 GEMM (CUTLASS's in-kernel 3xTF32) turns an infinite
// operand into NaN; csrc/kernels/inf_fix.h rewrites the outputs that x's and
// W's infinite rows reach, after the GEMM.
// Where no row holds an infinity this is a pass over x and one over W (kept
// inside frozen_weights(), as its split is) and a launch that reads the flags.
void fix_infinite_operands(Operands const& ops, at::Tensor const& weight, int64_t n, bool cache, void const* b,
                           float const* a, float const* c, at::Tensor& out) {
  fix_flagged_products(ops, inf_rows(ops.x), weight_inf_rows(weight, cache), n, weight.size(1), b, a, c, out);
}

// The statistics kernels' 3xTF32 over x and W beside their remainders: an infinite entry of
// either meets the other's remainder there (NaN, or either sign), so the outputs of their flagged
// rows (the remainder passes' flags) are rewritten. h only: its columns' sums are then not finite,
// and the tail sums them again from h.
void fix_infinite_rows(at::Tensor const& x, Operands const& ops, int64_t n, void const* b, at::Tensor& out) {
  fix_flagged_products(ops, *ops.x_flags, *ops.w_flags, n, x.size(1), b, nullptr, nullptr, out);
}

void check_device(at::Tensor const& t, at::Device d, char const* name) {
  TORCH_CHECK(t.device() == d, "cutlass_fused: expected ", name, " to be on ", d, " like input, but got ", t.device());
}

// The GEMM's Element (of the bias and h): x's dtype, or bf16 beside e4m3 operands (gemm/dtype.cuh).
at::ScalarType element_dtype(at::Tensor const& x) {
  return x.scalar_type() == at::kFloat8_e4m3fn ? at::kBFloat16 : x.scalar_type();
}

// fp8: x and W in e4m3 (linear_scale_batch_norm_train_fp8), h and the rest in bf16.
void check_gemm_inputs(at::Tensor const& x, at::Tensor const& weight, c10::optional<at::Tensor> const& bias,
                       c10::optional<at::Tensor> const& scale, bool fp8 = false) {
  check_linear_args(x, weight, bias, scale);
  if (fp8) {
    TORCH_CHECK(x.scalar_type() == at::kFloat8_e4m3fn, "cutlass_fused: expected input and weight to be float8_e4m3fn, ",
                "but got ", x.scalar_type());
  } else {
    dtype_of(x.scalar_type(), "input");
  }
  // An empty batch is PyTorch's to run (the ops that take one return early); empty features are not.
  TORCH_CHECK(x.size(1) > 0 && weight.size(0) > 0,
              "cutlass_fused: expected non-empty input rows and weight, but got ", x.sizes(), " and ", weight.sizes());
  check_device(weight, x.device(), "weight");
  if (scale.has_value()) check_device(*scale, x.device(), "scale");
  if (bias.has_value()) check_device(*bias, x.device(), "bias");
}

// The epilogue's per-column vectors (eval: the fold, made by the fold kernel or, with fold.n > 0,
// by the sm90 eval epilogue), or none (h = x W^T + b).
struct Epilogue {
  float const* a = nullptr;
  float const* c = nullptr;
  float const* s = nullptr;
  Activation act = Activation::none;
  float slope = 0.f;
  EvalFold fold;
};

// The call's one workspace, held until its kernels are queued: the CUTLASS kernel's own bytes,
// then the plan's (the statistics GEMM's sums, the BatchNorm kernels' scratch) at `scratch`.
struct Workspace {
  at::Tensor bytes;
  char* scratch = nullptr;
  void* u_sum = nullptr;    // a stats kernel's per-CTA sums (in the scratch), for the training tail
  void* u_sumsq = nullptr;
};

// The call's one workspace for a GEMM's args `p`: the kernel's own bytes (p.workspace), then
// the plan's, poisoned, with a statistics or grad kernel's per-CTA partials at its start.
Workspace gemm_workspace(Plan const& plan, KernelEntry const& entry, GemmEvtArgs& p, at::TensorOptions options) {
  int64_t own = (static_cast<int64_t>(entry.workspace_size(p)) + 255) / 256 * 256;
  Workspace ws;
  int64_t total = own + static_cast<int64_t>(plan.workspace);
  if (total > 0) {
    ws.bytes = at::empty({total}, options.dtype(at::kByte));
    if (own > 0) p.workspace = ws.bytes.data_ptr();
    ws.scratch = static_cast<char*>(ws.bytes.data_ptr()) + own;
    if (poison_outputs() && plan.workspace > 0) ws.bytes.narrow(0, own, plan.workspace).fill_(0xff);  // NaN sums
  }
  StatsLayout const& s = plan.gemm.sums;
  if (s.bytes > 0) {
    p.u_sum = ws.u_sum = ws.scratch;
    p.u_sumsq = ws.u_sumsq = ws.scratch + int64_t{s.tiles} * s.ld * s.bytes;
  }
  return ws;
}

// The one way a GEMM runs: the plan's kernel over x and W (laid out or split as it says) into
// `out` (h, or y with the eval epilogue), in its tile order, then the sm80 3xTF32 infinity fix
// where the plan asks for it. The caller holds a device guard and has checked the inputs.
Workspace run_gemm(Plan const& plan, at::Tensor const& x, at::Tensor const& weight,
                   c10::optional<at::Tensor> const& bias, Epilogue const& e, at::Tensor& out, bool cache) {
  GemmPlan const& g = plan.gemm;
  KernelInfo const& info = *g.kernel;
  TORCH_CHECK(info.entry != nullptr, "cutlass_fused: this build has no ", to_string(info.family), " ",
              to_string(info.dtype), " ", to_string(info.mode),
              " kernel; rebuild with that architecture in CUTLASS_FUSED_CUDA_ARCHS");
  auto ops = operands(x, weight, g, cache);
  auto b = bias_vector(bias, element_dtype(x), g.kn);
  GemmEvtArgs p;
  // Swapped (stats kernels): the weight is the A operand (kn rows), x the B operand, h^T the
  // column-major D.
  at::Tensor const& a_op = g.swapped ? ops.w : ops.x;
  at::Tensor const& b_op = g.swapped ? ops.x : ops.w;
  p.m = static_cast<int>(a_op.size(0));
  p.n = static_cast<int>(g.swapped ? x.size(0) : g.kn);
  p.k = static_cast<int>(g.remainder ? 3 * ops.seg : b_op.size(1));
  p.x = a_op.data_ptr();
  p.ldx = a_op.stride(0);
  if (g.remainder) {
    p.x_rest = ptr_or_null(g.swapped ? ops.w_rest : ops.x_rest);
    p.w_rest = ptr_or_null(g.swapped ? ops.x_rest : ops.w_rest);
    p.k_x = static_cast<int>(a_op.size(1));
    p.k_w = static_cast<int>(b_op.size(1));
  }
  p.w = b_op.data_ptr();
  p.ldw = b_op.stride(0);
  p.out = out.data_ptr();
  p.ldo = out.stride(0);
  p.b = ptr_or_null(b);
  p.a = e.a;
  p.c = e.c;
  p.s = e.s;
  p.fold = e.fold;
  p.act = e.act;
  p.slope = e.slope;
  p.swizzle = g.swizzle;
  p.raster = g.raster;
  p.device = x.get_device();
  p.sm_count = at::cuda::getDeviceProperties(p.device)->multiProcessorCount;
  auto const& entry = info.entry();
  Workspace ws = gemm_workspace(plan, entry, p, x.options());
  entry.run(p, at::cuda::getCurrentCUDAStream(p.device).stream());
  if (g.remainder) {
    fix_infinite_rows(x, ops, weight.size(0), p.b, out);
  } else if (g.inf_fix) {
    fix_infinite_operands(ops, weight, weight.size(0), cache, p.b, e.a, e.c, out);
  }
  return ws;
}

// h = x W^T + b, padded rows (ops.h), through the plan's GEMM with no epilogue vectors.
std::pair<at::Tensor, Workspace> linear_h(Plan const& plan, at::Tensor const& x, at::Tensor const& weight,
                                          c10::optional<at::Tensor> const& bias, bool cache,
                                          c10::optional<at::ScalarType> h_dt = c10::nullopt) {
  auto h = empty_padded(x.size(0), weight.size(0), x.options().dtype(h_dt.value_or(x.scalar_type())));
  poison(h);
  auto ws = run_gemm(plan, x, weight, bias, {}, h, cache);
  return {h, ws};
}

std::tuple<at::Tensor, at::Tensor> linear_stats_cuda(at::Tensor const& x, at::Tensor const& weight,
                                                     c10::optional<at::Tensor> const& bias, c10::string_view family,
                                                     bool cache) {
  check_gemm_inputs(x, weight, bias, c10::nullopt);
  int64_t m = x.size(0), n = weight.size(0);
  if (m == 0) return {empty_padded(0, n, x.options()), at::zeros({2, n}, x.options().dtype(at::kDouble))};
  c10::cuda::CUDAGuard guard(x.device());
  Plan plan = planned(problem(Op::linear, m, n, x.size(1), x.scalar_type(), false, family, x.device()));
  auto [h, ws] = linear_h(plan, x, weight, bias, cache);
  auto stats = at::empty({2, n}, x.options().dtype(at::kDouble));
  poison(stats);
  column_stats(dtype_of(x.scalar_type(), "input"), h.data_ptr(), m, n, h.stride(0), stats.data_ptr<double>(),
               ws.scratch + plan.bn_offset, at::cuda::getCurrentCUDAStream().stream());
  return {h, stats};
}

// A vector the kernels can read: t itself, or a dense copy of a strided view (a slice of a
// bigger parameter). Copies of running stats are written back after the kernel (write_back).
c10::optional<at::Tensor> dense(c10::optional<at::Tensor> const& t) {
  return t.has_value() && !t->is_contiguous() ? c10::optional<at::Tensor>(t->contiguous()) : t;
}

void write_back(c10::optional<at::Tensor> const& target, c10::optional<at::Tensor> const& copy) {
  if (target.has_value() && !copy->is_same(*target)) target->copy_(*copy);
}

// A per-column vector for csrc/kernels, read in its own dtype (no cast).
ColVec col_vec(c10::optional<at::Tensor> const& t, char const* name, int64_t n, at::Device device) {
  if (!t.has_value()) return {};
  check_vector(t, name, n);
  check_device(*t, device, name);
  TORCH_CHECK(t->is_contiguous(), "cutlass_fused: expected ", name, " to be contiguous");
  return {t->data_ptr(), dtype_of(t->scalar_type(), name)};
}

// The scale as the kernels read it: none (1), a per-column vector, or a 0-dim one broadcast over
// the columns (ColVec::broadcast).
ColVec scale_vec(c10::optional<at::Tensor> const& t, int64_t n, at::Device device) {
  if (!t.has_value() || t->dim() != 0) return col_vec(t, "scale", n, device);
  check_device(*t, device, "scale");
  return {t->data_ptr(), dtype_of(t->scalar_type(), "scale"), /*broadcast=*/true};
}

ColOut col_out(at::Tensor const& t, char const* name, int64_t n, at::Device device) {
  ColVec v = col_vec(t, name, n, device);
  return {t.data_ptr(), v.dt};
}

// A gradient vector in `like`'s dtype, or fp32 where there is no `like`.
at::Tensor grad_vector(c10::optional<at::Tensor> const& like, at::Tensor const& h) {
  return at::empty({h.size(1)}, h.options().dtype(like ? like->scalar_type() : at::kFloat));
}

// mean/invstd as the forward saved them: fp64, contiguous, n long.
at::Tensor saved_vector(at::Tensor const& t, char const* name, int64_t n, at::Device device) {
  check_vector(t, name, n);
  check_device(t, device, name);
  return t.to(at::kDouble).contiguous();
}

// y = BN(h * scale) and the saved mean/invstd, allocated, with the kernel
// arguments that produce them (all but the statistics).
struct Normalized {
  at::Tensor y, mean, invstd;
  FinalizeArgs a{};
};

Normalized normalized(at::Tensor const& h, c10::optional<at::Tensor> const& scale, int64_t count,
                      c10::optional<at::Tensor> const& weight, c10::optional<at::Tensor> const& bias, double eps,
                      at::ScalarType y_dt) {
  TORCH_CHECK(h.dim() == 2 && h.stride(1) == 1, "cutlass_fused: expected h to be 2-D with unit column stride");
  int64_t m = h.size(0), n = h.size(1);
  FinalizeArgs a{};
  a.scale = scale_vec(scale, n, h.device());
  a.weight = col_vec(weight, "bn_weight", n, h.device());
  a.bias = col_vec(bias, "bn_bias", n, h.device());
  auto y = at::empty({m, n}, h.options().dtype(y_dt));
  poison(y);
  auto mean = at::empty({n}, h.options().dtype(at::kDouble));
  auto invstd = at::empty({n}, h.options().dtype(at::kDouble));
  a.dt = dtype_of(h.scalar_type(), "h");
  a.dt_y = dtype_of(y.scalar_type(), "h * scale");
  TORCH_CHECK(a.dt_y == a.dt || a.dt_y == DType::f32, "cutlass_fused: expected h * scale to promote to h's dtype ",
              h.scalar_type(), " or to float32, but got ", y.scalar_type());
  a.h = h.data_ptr();
  a.ldh = h.stride(0);
  a.y = y.data_ptr();
  a.m = static_cast<int>(m);
  a.n = static_cast<int>(n);
  a.count = static_cast<double>(count);
  a.eps = eps;
  a.save_mean = mean.data_ptr<double>();
  a.save_invstd = invstd.data_ptr<double>();
  a.z_rounded = scale.has_value() && output_dtype(h.scalar_type(), scale) == h.scalar_type();  // without one z is h
  return {y, mean, invstd, a};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_finalize_cuda(
    at::Tensor const& h, at::Tensor const& stats, c10::optional<at::Tensor> const& scale, int64_t count,
    c10::optional<at::Tensor> const& weight, c10::optional<at::Tensor> const& bias, double eps,
    c10::string_view activation, double negative_slope) {
  check_sums(stats, "stats", h.size(1));
  check_device(stats, h.device(), "stats");
  c10::cuda::CUDAGuard guard(h.device());
  auto scale_d = dense(scale), weight_d = dense(weight), bias_d = dense(bias);  // alive until the launch
  auto out = normalized(h, scale_d, count, weight_d, bias_d, eps, output_dtype(h.scalar_type(), scale));
  out.a.stats = stats.data_ptr<double>();
  out.a.act = activation_of(activation);
  out.a.slope = static_cast<float>(negative_slope);
  finalize_normalize(out.a, at::cuda::getCurrentCUDAStream().stream());
  return {out.y, out.mean, out.invstd};
}

void check_num_batches_tracked(c10::optional<at::Tensor> const& t, at::Device dev) {
  if (!t.has_value()) return;
  check_device(*t, dev, "num_batches_tracked");
  TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == 1,
              "cutlass_fused: expected num_batches_tracked to be a one-element int64 tensor");
}

void update_running_stats_cuda(at::Tensor const& stats, c10::optional<at::Tensor> const& scale, int64_t count,
                               at::Tensor& running_mean, at::Tensor& running_var,
                               c10::optional<at::Tensor> const& num_batches_tracked, c10::optional<double> momentum) {
  int64_t n = stats.size(1);
  check_sums(stats, "stats", n);
  check_batch(count, n);
  check_running_stats(running_mean, running_var, n, c10::nullopt);
  check_running_args(running_mean, running_var, num_batches_tracked, momentum);
  auto dev = stats.device();
  auto scale_d = dense(scale), rm_d = dense(running_mean), rv_d = dense(running_var);
  ColVec s = scale_vec(scale_d, n, dev);
  ColOut rm = col_out(*rm_d, "running_mean", n, dev), rv = col_out(*rv_d, "running_var", n, dev);
  check_num_batches_tracked(num_batches_tracked, dev);
  c10::cuda::CUDAGuard guard(dev);
  update_running_stats(static_cast<int>(n), stats.data_ptr<double>(), s, static_cast<double>(count), rm, rv,
                       momentum ? nullptr : num_batches_tracked->data_ptr<int64_t>(), momentum.value_or(0.0),
                       at::cuda::getCurrentCUDAStream().stream());
  write_back(running_mean, rm_d);
  write_back(running_var, rv_d);
}

// The training forward: the plan's GEMM (the statistics GEMM where it fills the GPU), then one
// kernel for everything after it (csrc/kernels/batch_norm.h, batch_norm_train).
// fp8: x and W in e4m3 (linear_scale_batch_norm_train_fp8), h, y and the BN part as bf16's.
TrainOut train_cuda(LayerArgs const& a) {
  auto const &x = a.x, &weight = a.weight;
  auto const &bias = a.bias, &scale = a.scale, &running_mean = a.running_mean, &running_var = a.running_var;
  auto const &num_batches_tracked = a.num_batches_tracked;
  auto const momentum = a.momentum;
  check_gemm_inputs(x, weight, bias, scale, a.fp8);
  auto xt = element_dtype(x);  // h's dtype
  int64_t m = x.size(0), n = weight.size(0);
  check_batch(m, n);
  Activation act = activation_of(a.activation);
  auto y_dt = y_dtype(xt, scale, a.output_dtype);
  auto dev = x.device();
  check_running_args(running_mean, running_var, num_batches_tracked, momentum);
  // Every device checked before the guard, which refuses a CPU device in its own words.
  if (a.bn_weight.has_value()) check_device(*a.bn_weight, dev, "bn_weight");
  if (a.bn_bias.has_value()) check_device(*a.bn_bias, dev, "bn_bias");
  auto out_dtype = output_dtype(xt, scale);
  auto rm_d = dense(running_mean), rv_d = dense(running_var);
  TrainArgs t{};
  if (running_mean.has_value()) {
    check_running_stats(*running_mean, *running_var, n, out_dtype);
    t.running_mean = col_out(*rm_d, "running_mean", n, dev);
    t.running_var = col_out(*rv_d, "running_var", n, dev);
  }
  check_num_batches_tracked(num_batches_tracked, dev);
  c10::cuda::CUDAGuard guard(dev);
  Problem pr = problem(Op::train, m, n, x.size(1), xt, out_dtype != xt, a.family, dev);
  pr.cumulative = !momentum.has_value();
  pr.fp8 = a.fp8;
  pr.fast_accum = a.fast_accum;
  pr.aligned = true;  // h (padded rows) and y (contiguous) are fresh allocations
  ask_y(pr, y_dt);
  Plan plan = planned(pr);
  auto [h, ws] = linear_h(plan, x, weight, bias, a.cache, xt);
  auto scale_d = dense(scale), bn_weight_d = dense(a.bn_weight), bn_bias_d = dense(a.bn_bias);  // alive until the launch
  auto out = normalized(h, scale_d, m, bn_weight_d, bn_bias_d, a.eps, plan.y_cast ? out_dtype : y_dt);
  out.a.act = act;
  out.a.slope = static_cast<float>(a.negative_slope);
  auto stats = at::empty({2, n}, x.options().dtype(at::kDouble));
  poison(stats);
  t.norm = out.a;
  t.stats = stats.data_ptr<double>();
  t.num_batches_tracked = num_batches_tracked ? num_batches_tracked->data_ptr<int64_t>() : nullptr;
  t.cumulative = pr.cumulative;
  t.momentum = momentum.value_or(0.0);
  t.workspace = ws.scratch + plan.bn_offset;
  t.sm_count = pr.sm_count;
  t.tail = plan.tail;
  t.pieces = plan.pieces;
  if (plan.gemm.sums.bytes > 0) {
    StatsLayout const& u = plan.gemm.sums;
    t.u_sum = ws.u_sum;
    t.u_sumsq = ws.u_sumsq;
    t.u_fp64 = u.bytes == 8;
    t.u_tiles = u.tiles;
    t.u_ld = u.ld;
  }
  batch_norm_train(t, at::cuda::getCurrentCUDAStream().stream());
  write_back(running_mean, rm_d);
  write_back(running_var, rv_d);
  return {plan.y_cast ? out.y.to(y_dt) : out.y, h, stats, out.mean, out.invstd};
}

// The backward's kernel arguments for dy and h, with the tensors they point into (dense copies
// of strided vectors, dy contiguous) kept alive until the launch; dh allocated and poisoned.
struct Backward {
  BackwardArgs g{};
  at::Tensor dy, dh, mean, invstd;
  c10::optional<at::Tensor> scale, weight, bias;
};

Backward backward_args(at::Tensor const& dy_in, at::Tensor const& h, at::Tensor const& mean,
                       at::Tensor const& invstd, c10::optional<at::Tensor> const& scale,
                       c10::optional<at::Tensor> const& weight,
                       double eps, c10::optional<at::Tensor> const& bias, c10::string_view activation,
                       double negative_slope) {
  int64_t m = h.size(0), n = h.size(1);
  TORCH_CHECK(dy_in.sizes() == h.sizes() && (dy_in.scalar_type() == h.scalar_type() || dy_in.scalar_type() == at::kFloat),
              "cutlass_fused: expected the gradient to have h's shape ", h.sizes(), " and h's dtype ", h.scalar_type(),
              " or float32 (y's dtype), but got ", dy_in.sizes(), " ", dy_in.scalar_type());
  TORCH_CHECK(h.stride(1) == 1, "cutlass_fused: expected h to have unit column stride");
  check_device(dy_in, h.device(), "grad");
  Backward b;
  BackwardArgs& g = b.g;
  b.scale = dense(scale);
  b.weight = dense(weight);
  b.bias = dense(bias);
  g.scale = scale_vec(b.scale, n, h.device());
  g.weight = col_vec(b.weight, "bn_weight", n, h.device());
  g.bias = col_vec(b.bias, "bn_bias", n, h.device());
  g.act = activation_of(activation);
  g.slope = static_cast<float>(negative_slope);
  b.mean = saved_vector(mean, "mean", n, h.device());
  b.invstd = saved_vector(invstd, "invstd", n, h.device());
  b.dy = dy_in.contiguous();
  b.dh = at::empty({m, n}, h.options());
  poison(b.dh);
  g.dt = dtype_of(h.scalar_type(), "h");
  g.dt_dy = dtype_of(b.dy.scalar_type(), "grad");
  g.sm_count = at::cuda::getDeviceProperties(h.device().index())->multiProcessorCount;
  g.dy = b.dy.data_ptr();
  g.h = h.data_ptr();
  g.ldh = h.stride(0);
  g.dh = b.dh.data_ptr();
  g.m = static_cast<int>(m);
  g.n = static_cast<int>(n);
  g.mean_h = b.mean.data_ptr<double>();
  g.invstd = b.invstd.data_ptr<double>();
  g.eps = eps;
  return b;
}

// dscale comes back in scale's dtype, dweight and dbias in weight's (fp32
// without a weight): what autograd hands to the parameters, with no cast. dscale has a value a
// column (a 0-dim scale's gradient is their sum); without a scale it is empty (fp32) and no kernel
// writes it.
using BackwardOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The backward's outputs beside dh, allocated and pointed to by b.g: dscale, dweight, dbias and
// dlinear_bias.
BackwardOut backward_outputs(Backward& b, at::Tensor const& h, c10::optional<at::Tensor> const& scale,
                             c10::optional<at::Tensor> const& weight,
                             c10::optional<at::ScalarType> linear_bias_dtype) {
  int64_t n = h.size(1);
  BackwardArgs& g = b.g;
  at::Tensor dscale = scale.has_value() ? grad_vector(scale, h) : at::empty({0}, h.options().dtype(at::kFloat));
  at::Tensor dweight = grad_vector(weight, h), dbias = grad_vector(weight, h);
  if (scale.has_value()) g.dscale = col_out(dscale, "dscale", n, h.device());
  g.dweight = col_out(dweight, "dweight", n, h.device());
  g.dbias = col_out(dbias, "dbias", n, h.device());
  at::Tensor dlinear_bias =
      at::empty({linear_bias_dtype ? n : 0}, h.options().dtype(linear_bias_dtype.value_or(dscale.scalar_type())));
  if (linear_bias_dtype) g.dlinear_bias = col_out(dlinear_bias, "dlinear_bias", n, h.device());
  return {b.dh, dscale, dweight, dbias, dlinear_bias};
}

BackwardOut batch_norm_backward_cuda(at::Tensor const& dy_in, at::Tensor const& h, at::Tensor const& mean,
                                     at::Tensor const& invstd, c10::optional<at::Tensor> const& scale,
                                     c10::optional<at::Tensor> const& weight, double eps,
                                     c10::optional<at::Tensor> const& bias, c10::string_view activation,
                                     double negative_slope, c10::optional<at::ScalarType> linear_bias_dtype) {
  int64_t m = h.size(0), n = h.size(1);
  c10::cuda::CUDAGuard guard(h.device());
  Backward b = backward_args(dy_in, h, mean, invstd, scale, weight, eps, bias, activation, negative_slope);
  BackwardArgs& g = b.g;
  Problem pr = problem(Op::backward, m, n, 0, h.scalar_type(), b.dy.scalar_type() != h.scalar_type(), "auto",
                       h.device());
  pr.aligned = limits::aligned16(static_cast<int>(c10::elementSize(h.scalar_type())), h.stride(0),
                                 {b.dy.data_ptr(), h.data_ptr(), b.dh.data_ptr()});
  pr.act = g.act;
  Plan plan = planned(pr);
  auto ws = at::empty({static_cast<int64_t>(plan.workspace)}, h.options().dtype(at::kByte));
  BackwardOut out = backward_outputs(b, h, scale, weight, linear_bias_dtype);
  g.workspace = ws.data_ptr();
  batch_norm_backward(g, plan.backward, plan.pieces, at::cuda::getCurrentCUDAStream().stream());
  return out;
}

// batch_norm_backward of dz @ next_weight: where the plan has a grad kernel, that GEMM writes g
// (dy times the activation's derivative) with this layer's sums in its epilogue, and one pass
// makes dh and the vectors (batch_norm.h, batch_norm_backward_partials); else torch.mm, then the
// backward op.
BackwardOut batch_norm_backward_linear_cuda(at::Tensor const& dz, at::Tensor const& next_weight, at::Tensor const& h,
                                            at::Tensor const& mean, at::Tensor const& invstd,
                                            c10::optional<at::Tensor> const& scale,
                                            c10::optional<at::Tensor> const& weight, double eps,
                                            c10::optional<at::Tensor> const& bias, c10::string_view activation,
                                            double negative_slope, c10::optional<at::ScalarType> linear_bias_dtype,
                                            c10::string_view family) {
  check_backward_linear(dz, next_weight, h);
  check_device(dz, h.device(), "dz");
  check_device(next_weight, h.device(), "next_weight");
  int64_t m = h.size(0), n = h.size(1), k = dz.size(1);
  c10::cuda::CUDAGuard guard(h.device());
  Problem pr = problem(Op::backward_linear, m, n, k, h.scalar_type(), false, family, h.device());
  pr.act = activation_of(activation);
  int bytes = static_cast<int>(c10::elementSize(h.scalar_type()));
  pr.aligned = h.stride(1) == 1 && dz.stride(1) == 1 && next_weight.stride(1) == 1 &&
               limits::aligned16(bytes, h.stride(0), {h.data_ptr()}) &&
               limits::aligned16(bytes, dz.stride(0), {dz.data_ptr()}) &&
               limits::aligned16(bytes, next_weight.stride(0), {next_weight.data_ptr()});
  Plan plan = planned(pr);
  if (plan.gemm.kernel == nullptr)
    return batch_norm_backward_cuda(at::mm(dz, next_weight), h, mean, invstd, scale, weight, eps, bias, activation,
                                    negative_slope, linear_bias_dtype);
  KernelInfo const& info = *plan.gemm.kernel;
  TORCH_CHECK(info.entry != nullptr, "cutlass_fused: this build has no ", to_string(info.family), " ",
              to_string(info.dtype), " grad kernel; rebuild with that architecture in CUTLASS_FUSED_CUDA_ARCHS");
  at::Tensor g_out = at::empty({m, n}, h.options());  // the GEMM writes g here
  poison(g_out);
  Backward b = backward_args(g_out, h, mean, invstd, scale, weight, eps, bias, activation, negative_slope);
  BackwardOut out = backward_outputs(b, h, scale, weight, linear_bias_dtype);
  GemmEvtArgs p;
  p.m = static_cast<int>(n);
  p.n = static_cast<int>(m);
  p.k = static_cast<int>(k);
  p.x = next_weight.data_ptr();
  p.ldx = next_weight.stride(0);
  p.w = dz.data_ptr();
  p.ldw = dz.stride(0);
  p.out = g_out.data_ptr();
  p.ldo = g_out.stride(0);
  p.r = h.data_ptr();
  p.ldr = h.stride(0);
  p.act = b.g.act;
  p.slope = b.g.slope;
  p.swizzle = plan.gemm.swizzle;
  p.raster = plan.gemm.raster;
  p.device = h.get_device();
  p.sm_count = b.g.sm_count;
  auto const& entry = info.entry();
  Workspace ws = gemm_workspace(plan, entry, p, h.options());  // partials, then sums and vectors
  StatsLayout const& s = plan.gemm.sums;
  auto* sums = reinterpret_cast<double*>(ws.scratch + plan.bn_offset);
  auto* shift = reinterpret_cast<float*>(sums + 2 * n);
  p.shift = shift;
  p.mul = shift + n;
  p.beta = shift + 2 * n;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(p.device).stream();
  grad_gemm_columns(b.g, shift, shift + n, shift + 2 * n, stream);
  entry.run(p, stream);
  GradPartials parts{static_cast<float const*>(p.u_sum), static_cast<float const*>(p.u_sumsq), s.tiles, s.ld, shift};
  batch_norm_backward_partials(b.g, parts, sums, stream);
  return out;
}

at::Tensor batch_norm_backward_reduce_cuda(at::Tensor const& dy, at::Tensor const& h, at::Tensor const& mean,
                                           at::Tensor const& invstd, c10::optional<at::Tensor> const& scale,
                                           c10::optional<at::Tensor> const& weight, double eps,
                                           c10::optional<at::Tensor> const& bias, c10::string_view activation,
                                           double negative_slope) {
  int64_t m = h.size(0), n = h.size(1);
  c10::cuda::CUDAGuard guard(h.device());
  Backward b = backward_args(dy, h, mean, invstd, scale, weight, eps, bias, activation, negative_slope);
  auto sums = at::empty({2, n}, h.options().dtype(at::kDouble));
  poison(sums);
  if (m == 0) return sums.zero_();
  auto ws = at::empty({static_cast<int64_t>(limits::column_stats_workspace(static_cast<int>(m), static_cast<int>(n)))},
                      h.options().dtype(at::kByte));
  b.g.workspace = ws.data_ptr();
  batch_norm_backward_reduce(b.g, sums.data_ptr<double>(), at::cuda::getCurrentCUDAStream().stream());
  return sums;
}

at::Tensor batch_norm_backward_elemt_cuda(at::Tensor const& dy, at::Tensor const& h, at::Tensor const& mean,
                                          at::Tensor const& invstd, c10::optional<at::Tensor> const& scale,
                                          c10::optional<at::Tensor> const& weight, at::Tensor const& sums,
                                          at::Tensor const& count, double eps, c10::optional<at::Tensor> const& bias,
                                          c10::string_view activation, double negative_slope) {
  int64_t n = h.size(1);
  check_sums(sums, "sums", n);
  check_count(count);
  check_device(sums, h.device(), "sums");
  check_device(count, h.device(), "count");
  c10::cuda::CUDAGuard guard(h.device());
  Backward b = backward_args(dy, h, mean, invstd, scale, weight, eps, bias, activation, negative_slope);
  if (h.size(0) == 0) return b.dh;
  auto total = count.contiguous();
  batch_norm_backward_elemt(b.g, sums.data_ptr<double>(), total.data_ptr<double>(),
                            at::cuda::getCurrentCUDAStream().stream());
  return b.dh;
}

at::Tensor sync_batch_norm_row_cuda(at::Tensor const& stats, int64_t count) {
  check_sync_row_args(stats, count);
  int64_t n = stats.size(1);
  c10::cuda::CUDAGuard guard(stats.device());
  auto row = at::empty({2 * n + 1}, stats.options());
  poison(row);
  sync_row(n, stats.data_ptr<double>(), static_cast<double>(count), row.data_ptr<double>(),
           at::cuda::getCurrentCUDAStream().stream());
  return row;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sync_batch_norm_merge_cuda(at::Tensor const& rows) {
  check_rows(rows, -1);
  int64_t n = (rows.size(1) - 1) / 2;
  c10::cuda::CUDAGuard guard(rows.device());
  auto stats = at::empty({2, n}, rows.options()), running = at::empty({2, n}, rows.options());
  auto count = at::empty({1}, rows.options());
  for (auto* t : {&stats, &running, &count}) poison(*t);
  sync_merge(n, static_cast<int>(rows.size(0)), rows.data_ptr<double>(), stats.data_ptr<double>(),
             running.data_ptr<double>(), count.data_ptr<double>(), at::cuda::getCurrentCUDAStream().stream());
  return {stats, running, count};
}

at::Tensor sync_batch_norm_grads_cuda(at::Tensor const& local, at::Tensor const& sums, at::Tensor const& row,
                                      at::Tensor const& count, at::Tensor const& mean, at::Tensor const& invstd,
                                      c10::optional<at::Tensor> const& scale,
                                      c10::optional<at::Tensor> const& weight) {
  check_sync_grads_args(local, sums, row, count, mean, invstd, scale, weight);
  int64_t n = local.size(1);
  auto dev = local.device();
  for (auto [t, name] : {std::pair{&sums, "sums"}, std::pair{&row, "row"}, std::pair{&count, "count"}}) {
    check_device(*t, dev, name);
  }
  c10::cuda::CUDAGuard guard(dev);
  auto scale_d = dense(scale), weight_d = dense(weight);
  auto mean_d = saved_vector(mean, "mean", n, dev), invstd_d = saved_vector(invstd, "invstd", n, dev);
  auto total = count.contiguous();
  auto out = at::empty({4, n}, local.options());
  poison(out);
  sync_grads(n, local.data_ptr<double>(), sums.data_ptr<double>(), row.data_ptr<double>(), total.data_ptr<double>(),
             mean_d.data_ptr<double>(), invstd_d.data_ptr<double>(), scale_vec(scale_d, n, dev),
             col_vec(weight_d, "weight", n, dev), out.data_ptr<double>(), at::cuda::getCurrentCUDAStream().stream());
  return out;
}

// The eval forward: the plan's eval GEMM with the fold in its epilogue.
// fp8: x and W in e4m3 (linear_scale_batch_norm_eval_fp8), y and the rest as bf16 x's.
at::Tensor eval_cuda(LayerArgs const& a) {
  auto const &x = a.x, &weight = a.weight, &running_mean_in = *a.running_mean, &running_var_in = *a.running_var;
  auto const &bias = a.bias, &scale_in = a.scale;
  bool const cache = a.cache;
  double const negative_slope = a.negative_slope;
  check_gemm_inputs(x, weight, bias, scale_in, a.fp8);
  int64_t m = x.size(0), n = weight.size(0), k = x.size(1);
  auto dev = x.device();
  Activation act = activation_of(a.activation);
  auto xt = element_dtype(x);  // h's (and a 16-bit y's) dtype
  auto z = output_dtype(xt, scale_in);
  auto y_dt = y_dtype(xt, scale_in, a.output_dtype);
  check_running_stats(running_mean_in, running_var_in, n, z);
  // After the epilogue: the activation where the epilogue did not apply it (on y in its dtype, as
  // the unfused model applies it), then a requested dtype the epilogue does not write.
  auto finish = [&](at::Tensor y, bool activation_done) {
    if (!activation_done) y = activated(y, act, negative_slope);
    return y.scalar_type() == y_dt ? y : y.to(y_dt);
  };
  auto scale = dense(scale_in);
  auto running_mean = *dense(running_mean_in), running_var = *dense(running_var_in);
  auto bn_weight = dense(a.bn_weight), bn_bias = dense(a.bn_bias);
  scale_vec(scale, n, dev);  // the checks eval_fold relies on
  col_vec(bn_weight, "bn_weight", n, dev);
  col_vec(bn_bias, "bn_bias", n, dev);
  col_vec(running_mean, "running_mean", n, dev);
  col_vec(running_var, "running_var", n, dev);
  if (m == 0) return at::empty({0, n}, x.options().dtype(y_dt));
  c10::cuda::CUDAGuard guard(dev);
  Problem pr = problem(Op::eval, m, n, k, xt, z != xt, a.family, dev);
  pr.fp8 = a.fp8;
  pr.fast_accum = a.fast_accum;
  pr.fold_kept = eval_fold_kept(scale, bn_weight, bn_bias, running_mean, running_var, cache);
  ask_y(pr, y_dt);
  Plan plan = planned(pr);
  auto out = plan.y_in_x ? xt : z;  // the dtype the epilogue writes y in
  // Where the plan says, the sm90 eval kernel makes the fold in its epilogue (gemm/sm90_fold.cuh):
  // one launch. Else the fold kernel's (kept for the next call where frozen_weights() keeps it),
  // as on sm80 and the fp32 route; both give y the same bits (eval_fold.cuh).
  bool const fold_in_epilogue = plan.fold_in_epilogue;
  // One (2 or 3, kn) allocation: each row starts a multiple of kn floats in,
  // which keeps it 16-byte aligned for the EVT.
  // fp16's rounding of z = h * scale apart from the fold needs a scale: without one z is h, whose
  // rounding the epilogue makes anyway, and the fold's a is then its g (w * invstd) with s read as 1.
  bool scale_apart = plan.fold_scale_apart && scale.has_value();
  at::Tensor ac;
  if (!fold_in_epilogue)
    ac = eval_fold(scale, bn_weight, bn_bias, running_mean, running_var, a.eps, plan.gemm.kn, cache, scale_apart);
  if (plan.eval_in_fp32) {
    // y = h * a + c in one fp32 pass, which moves the bytes that widening a 16-bit y would.
    auto y =
        at::addcmul(ac[1].narrow(0, 0, n), linear_h(plan, x, weight, bias, cache, xt).first, ac[0].narrow(0, 0, n));
    return finish(y.scalar_type() == out ? y : y.to(out), false);
  }
  auto y = empty_padded(m, n, x.options().dtype(xt));
  poison(y);
  bool in_epilogue = plan.act_in_epilogue;
  Epilogue e{nullptr, nullptr, nullptr, in_epilogue ? act : Activation::none, static_cast<float>(negative_slope)};
  if (fold_in_epilogue) {
    e.fold = eval_fold_inputs(scale, bn_weight, bn_bias, running_mean, running_var, a.eps);
  } else {
    e.a = ac[0].data_ptr<float>();
    e.c = ac[1].data_ptr<float>();
    e.s = scale_apart ? ac[2].data_ptr<float>() : nullptr;
  }
  run_gemm(plan, x, weight, bias, e, y, cache);
  return finish(y.is_contiguous() ? y : y.contiguous(), in_epilogue);
}

// The backward's GEMMs in the forward's precision: fp32 without TF32 on the
// sm90 family is 3xTF32 there too (cuBLAS's TF32 GEMMs drift like unpromoted
// ones: csrc/kernels/promoted_mainloop.h); everything else is torch's own mm.
at::Tensor matmul_cuda(at::Tensor const& a, at::Tensor const& b, c10::string_view family) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0),
              "cutlass_fused: mat1 and mat2 shapes cannot be multiplied (", a.size(0), "x", a.size(1), " and ",
              b.size(0), "x", b.size(1), ")");
  if (a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat || a.numel() == 0 || b.numel() == 0)
    return at::mm(a, b);
  check_device(b, a.device(), "mat2");
  c10::cuda::CUDAGuard guard(a.device());
  int64_t m = a.size(0), n = b.size(1);
  Plan plan = planned(problem(Op::matmul, m, n, a.size(1), at::kFloat, false, family, a.device()));
  if (plan.gemm.kernel == nullptr) return at::mm(a, b);
  // out = A' B'^T: A' from a's rows, B' from b's columns (b^T's rows, read transposed).
  auto out = empty_padded(m, n, a.options());
  poison(out);
  run_gemm(plan, a, b.t(), c10::nullopt, {}, out, /*cache=*/false);
  return out.is_contiguous() ? out : out.contiguous();
}

}  // namespace

TORCH_LIBRARY_IMPL(cutlass_fused, CUDA, m) {
  m.impl("matmul", &matmul_cuda);
  m.impl("linear_stats", &linear_stats_cuda);
  m.impl("linear_scale_batch_norm_train", &train_op<&train_cuda>);
  m.impl("linear_scale_batch_norm_train_fp8", &train_fp8_op<&train_cuda>);
  m.impl("quantize_e4m3", &quantize_e4m3_cuda);
  m.impl("quantize_transposed", &quantize_transposed_cuda);
  m.impl("dequantize", &dequantize_cuda);
  m.impl("quantize_with_scale", &quantize_with_scale_cuda);
  m.impl("fp8_record", &fp8_record_cuda);
  m.impl("fp8_delayed_operands", &fp8_delayed_operands_cuda);
  m.impl("fp8_operand_scales", &fp8_operand_scales_cuda);
  m.impl("fp8_backward_scales", &fp8_backward_scales_cuda);
  m.impl("batch_norm_finalize", &batch_norm_finalize_cuda);
  m.impl("update_running_stats", &update_running_stats_cuda);
  m.impl("batch_norm_backward", &batch_norm_backward_cuda);
  m.impl("batch_norm_backward_linear", &batch_norm_backward_linear_cuda);
  m.impl("batch_norm_backward_reduce", &batch_norm_backward_reduce_cuda);
  m.impl("batch_norm_backward_elemt", &batch_norm_backward_elemt_cuda);
  m.impl("sync_batch_norm_row", &sync_batch_norm_row_cuda);
  m.impl("sync_batch_norm_merge", &sync_batch_norm_merge_cuda);
  m.impl("sync_batch_norm_grads", &sync_batch_norm_grads_cuda);
  m.impl("linear_scale_batch_norm_eval", &eval_op<&eval_cuda>);
  m.impl("linear_scale_batch_norm_eval_fp8", &eval_fp8_op<&eval_cuda>);
}

}  // namespace cutlass_fused
