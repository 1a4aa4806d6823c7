// Autograd for the training and eval ops, in C++ at the Autograd key.
//
// Why C++: a step of the layer is short enough on a GPU that host time shows.
// torch.library.register_autograd runs its wrapper and our formulas in Python,
// which cost more host time per step than the GPU work at 1024x8192x8192 on
// the machines we measured (benchmarks/host.py host_overhead). A
// torch::autograd::Function at the Autograd key is what ATen's own ops do, and
// torch.compile traces through it (AOTAutograd runs forward and backward on
// fake tensors, which reach the fakes in cutlass_fused/ops.py).
//
// Training: y = BN(h * scale) depends on whole columns through the batch
// statistics, so the backward is batch_norm_backward (a reduction pass and an
// elementwise pass) and then dX = dH W and dW = dH^T x, each only when asked
// for. The linear bias gets exactly zero: y does not change when a column of h
// shifts. Eval: the running statistics are constants, so the layer is a linear map.
#include <ATen/ATen.h>
#include <ATen/SavedTensorHooks.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <utility>

#include "autograd_util.h"
#include "op_handles.h"

namespace cutlass_fused {
namespace {

// batch_norm_backward already returns each vector in its parameter's dtype
// but for a bn_bias whose dtype differs from bn_weight's.
at::Tensor as_dtype(at::Tensor const& t, int64_t code) {
  auto dt = static_cast<at::ScalarType>(code);
  return t.scalar_type() == dt ? t : t.to(dt);
}

int64_t dtype_of(OptTensor const& t) { return t.has_value() ? static_cast<int64_t>(t->scalar_type()) : -1; }

// Whether the forward cast an fp32 weight itself (deferred_linear_cast): dW is then fp32.
bool wide_dw(AutogradContext* ctx) {
  auto it = ctx->saved_data.find("wide_dw");
  return it != ctx->saved_data.end() && it->second.toBool();
}


// Whether saved-tensor default hooks are in force: get_hooks() gives an optional from torch 2.5
// on, a (pack, unpack) pair of Python objects, null when unset, in 2.4.
template <class T>
bool saved_tensor_hooks_set(std::optional<T> const& hooks) {
  return hooks.has_value();
}
template <class A, class B>
bool saved_tensor_hooks_set(std::pair<A, B> const& hooks) {
  return hooks.first != nullptr;
}

// dX = dH W and dW = dH^T x, each only when needed: no dX GEMM for a first
// layer, no dW GEMM for a frozen weight. fp32 goes through our matmul op, which
// keeps the forward's precision (3xTF32 on sm90 without TF32); 16-bit dtypes
// go straight to torch's mm.
void linear_grads(at::Tensor const& dh, at::Tensor const& x, at::Tensor const& weight, bool need_x, bool need_w,
                  AutogradContext* ctx, variable_list& out) {
  static auto op = op_handle<MatmulSig>("cutlass_fused::matmul");
  bool fp32 = dh.scalar_type() == at::kFloat;
  auto family = ctx->saved_data["family"].toStringRef();
  auto mm = [&](at::Tensor const& a, at::Tensor const& b) { return fp32 ? op.call(a, b, family) : at::mm(a, b); };
  if (need_x) out[0] = mm(dh, weight);
  if (need_w) out[1] = wide_dw(ctx) ? mm_to_fp32(dh.t(), x) : mm(dh.t(), x);
}

// The differentiable arguments come to apply() one by one, which makes them the node's inputs
// (apply() sees no tensor inside a struct); forward() reads them from `a`, which holds the same.
constexpr size_t kDifferentiable = 6;  // x, weight, bias, scale, bn_weight, bn_bias
// The linked op's beside them: prev_h, prev_bias, prev_scale, prev_bn_weight, prev_bn_bias.
constexpr size_t kPrevDifferentiable = 5;

// What a training forward keeps for its backward: `key` in saved_data with its version (take).
// `alias`: a detached alias of t, for the linked op's h, its own differentiable output, whose
// grad_fn (this node), held here, would make a reference cycle; the alias shares the version
// counter. Not for the others: a detach costs host time on every call.
void keep(AutogradContext* ctx, std::string const& key, at::Tensor const& t, bool alias = false) {
  ctx->saved_data[key] = alias ? t.detach() : t;
  ctx->saved_data[key + "_version"] = static_cast<int64_t>(t._version());
}

// h (or mean, invstd, the linked op's prev_h) for the backward. Unless the graph is kept for another
// backward (retain_graph=True), the context lets go of it here, so that it is freed as soon as dh
// is made and the dX and dW GEMMs run without it: the peak memory of a training step is then one
// batch-by-features tensor less, as in torch.compile's backward (issue 7; docs/decisions.md,
// "Backward"), and without the fp64 mean and invstd (2n doubles, which left the peak 0.125 MiB
// over compile's at 8192 features; v0.14).
at::Tensor take(AutogradContext* ctx, at::Tensor const& saved, std::string const& key) {
  if (saved.defined()) return saved;  // under saved-tensor hooks
  at::Tensor t = ctx->saved_data[key].toTensor();
  int64_t version = ctx->saved_data[key + "_version"].toInt();
  // What save_for_backward would check: an in-place change after the forward.
  TORCH_CHECK(t._version() == version,
              "one of the variables needed for gradient computation has been modified by an inplace operation: "
              "the ", key, " tensor saved by cutlass_fused's training op is at version ", t._version(),
              "; expected version ", version, " instead.");
  if (!torch::autograd::get_current_graph_task_keep_graph()) ctx->saved_data.erase(key);
  return t;
}

// Whether any of the previous layer's five tensors (prev_h, prev_bias, prev_scale, prev_bn_weight,
// prev_bn_bias, from need[at] on) needs a gradient: false without a previous layer, whose absent
// tensors need none. Then nothing of it is kept, and its backward is not run.
bool prev_needs(std::vector<bool> const& need, size_t at) {
  return std::any_of(need.begin() + at, need.begin() + at + kPrevDifferentiable, [](bool b) { return b; });
}

// What the backward of a layer after a linked one keeps of the previous layer (prev_backward), appended
// to `vars`: prev_h, prev_mean and prev_invstd (under hooks; else kept, see take), prev_scale,
// prev_bn_weight and prev_bn_bias (that one for the activation's derivative alone).
void save_prev(AutogradContext* ctx, std::vector<at::Tensor>& vars, LinkArgs const& prev, bool hooks) {
  at::Tensor none;
  bool act = activation_of(prev.activation) != Activation::none;
  for (auto const* t : {&prev.h, &prev.mean, &prev.invstd}) vars.push_back(hooks ? **t : none);
  vars.insert(vars.end(), {saved(prev.scale), saved(prev.bn_weight), act ? saved(prev.bn_bias) : none});
  if (!hooks) {
    keep(ctx, "prev_h", *prev.h);
    keep(ctx, "prev_mean", *prev.mean);
    keep(ctx, "prev_invstd", *prev.invstd);
  }
  ctx->saved_data["prev_eps"] = prev.eps;
  ctx->saved_data["prev_activation"] = std::string(prev.activation);
  ctx->saved_data["prev_negative_slope"] = prev.negative_slope;
  ctx->saved_data["prev_dtypes"] = c10::List<int64_t>({dtype_of(prev.bias), dtype_of(prev.bn_bias)});
}

// The previous layer's BN backward from dz, the gradient of this layer's product with `weight` (dz
// weight is that layer's dy), from save_prev's tensors at s[first..first+5]: in one op,
// batch_norm_backward_linear, whose dX GEMM makes that layer's sums where the plan has a kernel for
// it; fp32 (and a layer of another dtype than the one before) as unlinked layers run it: dx(dz),
// then batch_norm_backward. The gradients of prev_h, prev_bias, prev_scale, prev_bn_weight and
// prev_bn_bias go to out[at..at+4] where need[at..at+4] asks.
template <class DX>
void prev_backward(AutogradContext* ctx, variable_list& s, size_t first, at::Tensor const& dz,
                   at::Tensor const& weight, std::vector<bool> const& need, size_t at, variable_list& out, DX dx) {
  static auto fused = op_handle<BackwardLinearSig>("cutlass_fused::batch_norm_backward_linear");
  static auto plain = op_handle<BackwardSig>("cutlass_fused::batch_norm_backward");
  at::Tensor h = take(ctx, s[first], "prev_h"), mean = take(ctx, s[first + 1], "prev_mean"),
             invstd = take(ctx, s[first + 2], "prev_invstd");
  s[first] = s[first + 1] = s[first + 2] = at::Tensor();
  auto const &scale = s[first + 3], &bn_weight = s[first + 4], &bn_bias = s[first + 5];
  auto dtypes = ctx->saved_data["prev_dtypes"].toIntList();
  c10::optional<at::ScalarType> bias_dt;
  if (need[at + 1]) bias_dt = static_cast<at::ScalarType>(dtypes.get(0));
  double eps = ctx->saved_data["prev_eps"].toDouble(), slope = ctx->saved_data["prev_negative_slope"].toDouble();
  auto const& act = ctx->saved_data["prev_activation"].toStringRef();
  auto dt = h.scalar_type();
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> r;
  if (dt != at::kFloat && dz.scalar_type() == dt && weight.scalar_type() == dt) {
    r = fused.call(dz, weight, h, mean, invstd, optional(scale), optional(bn_weight), eps, optional(bn_bias), act,
                   slope, bias_dt, ctx->saved_data["family"].toStringRef());
  } else {
    at::Tensor dy = dx(dz);
    if (dy.scalar_type() != dt && dy.scalar_type() != at::kFloat) dy = dy.to(at::kFloat);
    r = plain.call(dy, h, mean, invstd, optional(scale), optional(bn_weight), eps, optional(bn_bias), act, slope,
                   bias_dt);
  }
  auto& [dprev_h, dscale, dgamma, dbeta, dbias] = r;
  if (need[at]) out[at] = dprev_h;
  if (need[at + 1]) out[at + 1] = dbias;
  if (need[at + 2]) out[at + 2] = scale.dim() == 0 ? dscale.sum().to(scale.scalar_type()) : dscale;
  if (need[at + 3]) out[at + 3] = dgamma;
  if (need[at + 4]) out[at + 4] = as_dtype(dbeta, dtypes[1]);
}

// The training forward of both Functions, saved variables 0-7: x (for dW), the GEMM's weight (for
// dX, or for the linked op's batch_norm_backward_linear: `keep_weight`), h, mean and invstd under
// saved-tensor hooks, scale, bn_weight, bn_bias. `linked` (the linked op): h stays differentiable;
// with `prev` (the previous layer's backward is this one's), 8-13: prev_h, prev_mean and
// prev_invstd under hooks, prev_scale, prev_bn_weight, prev_bn_bias.
variable_list train_forward(AutogradContext* ctx, at::Tensor const& x, at::Tensor const& weight,
                            OptTensor const& bias, OptTensor const& scale, OptTensor const& bn_weight,
                            OptTensor const& bn_bias, LayerArgs const& a, bool keep_weight, bool linked,
                            LinkArgs const* prev) {
  ctx->saved_data["dtypes"] = c10::List<int64_t>({dtype_of(bias), dtype_of(bn_bias)});
  // Below Autograd only, so that ADInplaceOrView (in_place below) counts the
  // running stats' update.
  at::AutoDispatchBelowAutograd below;
  // Autocast's casts of x, the weight and the bias, left to us (autocast.cpp), by cached_cast's
  // rule of which tensors it casts (autocast_casts), in one op (cast_linear_inputs): one launch on
  // CUDA, and under torch.compile one call in Inductor's wrapper, not a Triton kernel each. The
  // backward gives their gradients in their own dtypes: dW from the GEMM in fp32, dX cast back
  // as autocast's recorded cast would. Not cached_cast itself: it would cache this cast, made
  // below Autograd with no history, for a leaf weight, and hand it to any other op on that weight
  // in the same autocast region, whose gradient would then never reach the weight.
  at::Tensor gemm_x = x, gemm_weight = weight;
  OptTensor gemm_bias = bias;
  if (auto dt = std::exchange(deferred_linear_cast(), c10::nullopt)) {
    static auto cast_op = op_handle<CastSig>("cutlass_fused::cast_linear_inputs");
    auto [x16, weight16, bias16] = cast_op.call(x, weight, bias, *dt);
    if (autocast_casts(x, *dt)) {
      gemm_x = x16;
      ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    }
    if (autocast_casts(weight, *dt)) gemm_weight = weight16;
    if (bias.has_value() && autocast_casts(*bias, *dt)) gemm_bias = bias16;
    ctx->saved_data["wide_dw"] = true;
  }
  auto [y, h, stats, mean, invstd] = call_train(a.with_operands(gemm_x, gemm_weight, gemm_bias, scale));
  // The activation's derivative needs BN(z), recomputed from h with the BN bias.
  bool act = activation_of(a.activation) != Activation::none;
  // h, mean and invstd are held outside the saved variables, so that the backward
  // can free them once dh exists (see take), unless saved-tensor hooks (activation
  // offload, checkpointing) are to see them.
  bool hooks = saved_tensor_hooks_set(at::SavedTensorDefaultHooks::get_hooks());
  at::Tensor none;
  // x only for dW and the weight (its autocast cast) only for dX, as torch's own linear saves: a
  // first layer's input needs no gradient, and its 16-bit weight cast is then freed here. At
  // amp-bf16 4096x4096x4 that is 32 MiB off the step's peak, which holds every block's saved
  // tensors (docs/decisions.md, "Training step").
  std::vector<at::Tensor> vars{weight.requires_grad() ? gemm_x : none, keep_weight ? gemm_weight : none,
                               hooks ? h : none, hooks ? mean : none, hooks ? invstd : none, saved(scale),
                               saved(bn_weight), act ? saved(bn_bias) : none};
  if (!hooks) {
    keep(ctx, "h", h, linked);
    keep(ctx, "mean", mean);
    keep(ctx, "invstd", invstd);
  }
  if (prev != nullptr) save_prev(ctx, vars, *prev, hooks);
  ctx->save_for_backward(vars);
  ctx->saved_data["eps"] = a.eps;
  ctx->saved_data["family"] = std::string(a.family);
  ctx->saved_data["activation"] = std::string(a.activation);
  ctx->saved_data["negative_slope"] = a.negative_slope;
  if (linked) {
    ctx->mark_non_differentiable({stats, mean, invstd});
  } else {
    ctx->mark_non_differentiable({h, stats, mean, invstd});
  }
  // Their gradients are always undefined (h's, but for the linked op's); materializing them costs
  // four fills a step.
  ctx->set_materialize_grads(false);
  return {y, h, stats, mean, invstd};
}

// The BN part of the training backward: dh from dy, with the gradients of the linear bias, scale,
// bn_weight and bn_bias into out[2..5] where needed. h, mean and invstd are let go (take) before
// the GEMMs that follow allocate. dy by value: the caller moves its only reference in, so that dy
// is freed once dh is made (one batch-by-features tensor off the step's peak: 32 MiB of 528 at
// amp-bf16 4096x4096x4, where the peak is the last layer's fp32 dW GEMM).
at::Tensor bn_backward(AutogradContext* ctx, variable_list& s, at::Tensor dy, std::vector<bool> const& need,
                       variable_list& out) {
  static auto op = op_handle<BackwardSig>("cutlass_fused::batch_norm_backward");
  auto const& scale = s[5];
  auto dtypes = ctx->saved_data["dtypes"].toIntList();
  at::Tensor h = take(ctx, s[2], "h"), mean = take(ctx, s[3], "mean"), invstd = take(ctx, s[4], "invstd");
  s[2] = s[3] = s[4] = at::Tensor();
  // The kernels take dy in h's (x's) dtype or fp32; a y of another requested dtype
  // (output_dtype) is a cast of one of those.
  if (dy.scalar_type() != h.scalar_type() && dy.scalar_type() != at::kFloat) dy = dy.to(at::kFloat);
  // The linear bias's gradient is exactly zero, but NaN in a column whose statistics, scale,
  // bn_weight or dy are not finite (dscale, w invstd^3 eps sum dy (h - mean), then is NaN or
  // Inf), where PyTorch's sum of dh is NaN: the op writes 0 x dscale beside dscale, so that no
  // kernel is launched for it here (nor a Triton one under torch.compile, whose constant folder
  // had also turned a product with an integer 0 into zeros, and so NaN into 0, in torch 2.13).
  c10::optional<at::ScalarType> bias_dt;
  if (need[2]) bias_dt = static_cast<at::ScalarType>(dtypes.get(0));
  auto [dh, dscale, dgamma, dbeta, dbias] = op.call(dy, h, mean, invstd, optional(scale), optional(s[6]),
                                                    ctx->saved_data["eps"].toDouble(), optional(s[7]),
                                                    ctx->saved_data["activation"].toStringRef(),
                                                    ctx->saved_data["negative_slope"].toDouble(), bias_dt);
  if (need[2]) out[2] = dbias;
  if (need[3]) out[3] = scale.dim() == 0 ? dscale.sum().to(scale.scalar_type()) : dscale;  // a value a column
  if (need[4]) out[4] = dgamma;
  if (need[5]) out[5] = as_dtype(dbeta, dtypes[1]);
  return dh;
}

// x's gradient in x's own dtype where the forward cast it (x is then its cast).
void x_in_its_dtype(AutogradContext* ctx, variable_list& out) {
  auto x_dtype = ctx->saved_data.find("x_dtype");
  if (out[0].defined() && x_dtype != ctx->saved_data.end())
    out[0] = out[0].to(static_cast<at::ScalarType>(x_dtype->second.toInt()));
}

struct TrainFunction : torch::autograd::Function<TrainFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor const& x, at::Tensor const& weight,
                               OptTensor const& bias, OptTensor const& scale, OptTensor const& bn_weight,
                               OptTensor const& bn_bias, LayerArgs const& a) {
    save_needs(ctx, {x.requires_grad(), weight.requires_grad(), requires_grad(bias), requires_grad(scale),
                     requires_grad(bn_weight), requires_grad(bn_bias)});
    return train_forward(ctx, x, weight, bias, scale, bn_weight, bn_bias, a, x.requires_grad(), false, nullptr);
  }

  // grads by reference: CppNode::apply passes its own list (torch's custom_function.h), so that
  // moving dy out of it leaves our local the only owner (see bn_backward).
  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    no_double_backward();
    variable_list out(kDifferentiable + 1);  // one per argument of apply()
    at::Tensor dy = std::move(grads[0]);
    if (!dy.defined()) return out;  // y did not reach the loss
    auto s = ctx->get_saved_variables();
    auto need = needs(ctx);
    at::Tensor dh = bn_backward(ctx, s, std::move(dy), need, out);
    linear_grads(dh, s[0], s[1], need[0], need[1], ctx, out);
    x_in_its_dtype(ctx, out);
    return out;
  }
};

// The linked op (csrc/ops.cpp has its contract): the training forward, and a backward whose dh, from
// y's gradient and h's (the next layer's), goes through this layer's weight into the previous
// layer's BN backward in one op, batch_norm_backward_linear, where the previous layer's x gets dX.
struct LinkedFunction : torch::autograd::Function<LinkedFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor const& x, at::Tensor const& weight,
                               OptTensor const& bias, OptTensor const& scale, OptTensor const& bn_weight,
                               OptTensor const& bn_bias, OptTensor const& prev_h, OptTensor const& prev_bias,
                               OptTensor const& prev_scale, OptTensor const& prev_bn_weight,
                               OptTensor const& prev_bn_bias, LayerArgs const& a, LinkArgs const& p) {
    check_link_args(x, p.h, p.mean, p.invstd);
    bool prev = p.h.has_value();
    std::vector<bool> need{x.requires_grad() && !prev, weight.requires_grad(), requires_grad(bias),
                           requires_grad(scale), requires_grad(bn_weight), requires_grad(bn_bias),
                           requires_grad(prev_h), requires_grad(prev_bias), requires_grad(prev_scale),
                           requires_grad(prev_bn_weight), requires_grad(prev_bn_bias)};
    save_needs(ctx, need);
    bool prev_needed = prev_needs(need, kDifferentiable);
    bool keep_weight = need[0] || prev_needed;
    return train_forward(ctx, x, weight, bias, scale, bn_weight, bn_bias, a, keep_weight, true,
                         prev_needed ? &p : nullptr);
  }

  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    no_double_backward();
    variable_list out(kDifferentiable + kPrevDifferentiable + 2);  // one per argument of apply()
    at::Tensor dy = std::move(grads[0]), dh_next = std::move(grads[1]);
    if (!dy.defined() && !dh_next.defined()) return out;  // neither y nor h reached the loss
    auto s = ctx->get_saved_variables();
    auto need = needs(ctx);
    at::Tensor dh;
    if (dy.defined()) {
      dh = bn_backward(ctx, s, std::move(dy), need, out);
    } else {  // y reached the loss only through the next layer, whose linked op ran this BN's backward
      take(ctx, s[2], "h");
      take(ctx, s[3], "mean");
      take(ctx, s[4], "invstd");
      s[2] = s[3] = s[4] = at::Tensor();
    }
    if (dh_next.defined()) dh = dh.defined() ? dh.add_(dh_next) : std::move(dh_next);
    // The previous layer's first: its h goes before dW is allocated, so that the step's peak holds
    // no more than the unlinked backward's (dh, g, the previous dh and h here; there dh, dX, dW and
    // the previous h).
    if (prev_needs(need, kDifferentiable)) {
      prev_backward(ctx, s, 8, dh, s[1], need, kDifferentiable, out, [&](at::Tensor const& dz) {
        variable_list dx(2);
        linear_grads(dz, at::Tensor(), s[1], true, false, ctx, dx);
        return dx[0];
      });
    }
    linear_grads(dh, s[0], s[1], need[0], need[1], ctx, out);
    x_in_its_dtype(ctx, out);
    return out;
  }
};

TrainOut linked_autograd(LayerArgs const& a, LinkArgs const& p) {
  auto out = LinkedFunction::apply(a.x, a.weight, a.bias, a.scale, a.bn_weight, a.bn_bias, p.h, p.bias, p.scale,
                                  p.bn_weight, p.bn_bias, a, p);
  return {out[0], out[1], out[2], out[3], out[4]};
}

// Below Autograd (inference_mode, or a caller that skipped it): the training op, no backward to run.
TrainOut linked_below_autograd(LayerArgs const& a, LinkArgs const& p) {
  check_link_args(a.x, p.h, p.mean, p.invstd);
  return call_train(a);
}

// linear_linked: F.linear(x, weight, bias) for a plain Linear after a linked layer; its backward runs
// that layer's BN backward (prev_backward) and gives weight and bias F.linear's gradients, x none.
struct LinkedLinearFunction : torch::autograd::Function<LinkedLinearFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor const& x, at::Tensor const& weight,
                               OptTensor const& bias, OptTensor const& prev_h, OptTensor const& prev_bias,
                               OptTensor const& prev_scale, OptTensor const& prev_bn_weight,
                               OptTensor const& prev_bn_bias, LinkArgs const& p, c10::string_view family) {
    check_link_args(x, p.h, p.mean, p.invstd);
    std::vector<bool> need{false, weight.requires_grad(), requires_grad(bias), requires_grad(prev_h),
                           requires_grad(prev_bias), requires_grad(prev_scale), requires_grad(prev_bn_weight),
                           requires_grad(prev_bn_bias)};
    save_needs(ctx, need);
    at::AutoDispatchBelowAutograd below;
    auto y = at::linear(x, weight, bias);
    bool hooks = saved_tensor_hooks_set(at::SavedTensorDefaultHooks::get_hooks());
    std::vector<at::Tensor> vars{weight.requires_grad() ? x : at::Tensor(), weight};
    if (prev_needs(need, 3)) save_prev(ctx, vars, p, hooks);
    ctx->save_for_backward(vars);
    ctx->saved_data["family"] = std::string(family);
    ctx->set_materialize_grads(false);
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    no_double_backward();
    variable_list out(8 + 2);  // one per argument of apply()
    at::Tensor dz = std::move(grads[0]);
    if (!dz.defined()) return out;
    auto s = ctx->get_saved_variables();
    auto need = needs(ctx);
    auto const &x = s[0], &weight = s[1];
    // The previous layer's first, as in LinkedFunction's backward; dX as F.linear's backward.
    if (prev_needs(need, 3))
      prev_backward(ctx, s, 2, dz, weight, need, 3, out, [&](at::Tensor const& d) { return at::mm(d, weight); });
    if (need[1]) out[1] = at::mm(dz.t(), x);
    if (need[2]) out[2] = dz.sum(0);
    return out;
  }
};

at::Tensor linear_linked_autograd(at::Tensor const& x, at::Tensor const& weight, OptTensor const& bias,
                                  LinkArgs const& p, c10::string_view family) {
  return LinkedLinearFunction::apply(x, weight, bias, p.h, p.bias, p.scale, p.bn_weight, p.bn_bias, p, family)[0];
}

at::Tensor linear_linked_below_autograd(at::Tensor const& x, at::Tensor const& weight, OptTensor const& bias,
                                        LinkArgs const& p, c10::string_view /*family*/) {
  check_link_args(x, p.h, p.mean, p.invstd);
  return at::linear(x, weight, bias);
}

struct EvalFunction : torch::autograd::Function<EvalFunction> {
  static variable_list forward(AutogradContext* ctx, at::Tensor const& x, at::Tensor const& weight,
                               OptTensor const& bias, OptTensor const& scale, OptTensor const& bn_weight,
                               OptTensor const& bn_bias, LayerArgs const& a) {
    save_needs(ctx, {x.requires_grad(), weight.requires_grad(), requires_grad(bias), requires_grad(scale),
                     requires_grad(bn_weight), requires_grad(bn_bias)});
    at::AutoDispatchBelowADInplaceOrView below;
    auto y = call_eval(a);
    // relu's and leaky_relu's derivatives are taken from the sign of y itself (PyTorch's relu saves
    // its result too): BN(z) recomputed from h in another precision than the epilogue's may fall on
    // the other side of 0 than the y the forward returned.
    Activation act = activation_of(a.activation);
    bool by_sign = act == Activation::relu || (act == Activation::leaky_relu && a.negative_slope >= 0);
    ctx->save_for_backward({x, weight, saved(bias), saved(scale), saved(bn_weight), *a.running_mean,
                            *a.running_var, saved(bn_bias), by_sign ? y : at::Tensor()});
    ctx->saved_data["eps"] = a.eps;
    ctx->saved_data["activation"] = std::string(a.activation);
    ctx->saved_data["negative_slope"] = a.negative_slope;
    ctx->saved_data["family"] = std::string(a.family);
    ctx->saved_data["dtypes"] = c10::List<int64_t>({dtype_of(bn_bias)});
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    no_double_backward();
    variable_list out(kDifferentiable + 1);  // one per argument of apply()
    auto s = ctx->get_saved_variables();
    auto const &x = s[0], &weight = s[1], &bias = s[2], &scale = s[3], &bn_weight = s[4];
    auto const &running_mean = s[5], &running_var = s[6], &bn_bias = s[7], &y = s[8];
    Activation act = activation_of(ctx->saved_data["activation"].toStringRef());
    auto need = needs(ctx);
    // fp32 arithmetic, or fp64 where any input is fp64: a float64 layer's
    // gradients must not pass through fp32.
    auto acc = at::kFloat;
    std::initializer_list<at::Tensor const*> inputs{&x, &scale, &running_mean, &running_var, &bn_weight, &grads[0]};
    for (at::Tensor const* t : inputs) {
      if (t->defined()) acc = at::promote_types(acc, t->scalar_type());
    }
    at::Tensor dyf = grads[0].to(acc);
    auto invstd = (running_var.to(acc) + ctx->saved_data["eps"].toDouble()).rsqrt();
    auto g = bn_weight.defined() ? invstd * bn_weight.to(acc) : invstd;
    // h is not kept by the eval forward; it is recomputed only when asked for, or for the
    // activation's derivative at BN(z) = (h scale - running_mean) g + bn_bias (z = h without a scale).
    at::Tensor h;
    auto recompute_h = [&] {
      if (h.defined()) return;
      h = at::mm(x, weight.t()).to(acc);
      if (bias.defined()) h = h + bias.to(acc);
    };
    auto z = [&] { return scale.defined() ? h * scale.to(acc) : h; };
    double slope = ctx->saved_data["negative_slope"].toDouble();
    if (y.defined()) {
      // By y's sign (see the forward); for leaky_relu, y > 0 exactly where its input is.
      auto ya = y.to(acc);
      dyf = act == Activation::relu ? at::threshold_backward(dyf, ya, 0)
                                    : at::leaky_relu_backward(dyf, ya, slope, /*self_is_result=*/true);
    } else if (act != Activation::none) {
      recompute_h();
      auto pre = (z() - running_mean.to(acc)) * g;
      if (bn_bias.defined()) pre = pre + bn_bias.to(acc);
      dyf = activation_backward(dyf, pre, act, slope);
    }
    // dh in x's dtype, for the GEMMs with x and weight (y may be wider: see output_dtype).
    auto dh = (dyf * (scale.defined() ? scale.to(acc) * g : g)).to(x.scalar_type());
    linear_grads(dh, x, weight, need[0], need[1], ctx, out);
    if (need[2]) out[2] = dh.to(acc).sum(0).to(bias.scalar_type());
    if (need[3] || need[4]) {
      recompute_h();
      if (need[3]) out[3] = ((dyf * h).sum(0) * g).sum_to_size(scale.sizes()).to(scale.scalar_type());
      if (need[4]) {
        out[4] = ((dyf * (z() - running_mean.to(acc))).sum(0) * invstd).to(bn_weight.scalar_type());
      }
    }
    if (need[5]) out[5] = as_dtype(dyf.sum(0), ctx->saved_data["dtypes"].toIntList()[0]);
    return out;
  }
};

TrainOut train_autograd(LayerArgs const& a) {
  auto out = TrainFunction::apply(a.x, a.weight, a.bias, a.scale, a.bn_weight, a.bn_bias, a);
  return {out[0], out[1], out[2], out[3], out[4]};
}

at::Tensor eval_autograd(LayerArgs const& a) {
  return EvalFunction::apply(a.x, a.weight, a.bias, a.scale, a.bn_weight, a.bn_bias, a)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(cutlass_fused, ADInplaceOrView, m) {
  m.impl("linear_scale_batch_norm_train", torch::CppFunction::makeFromBoxedFunction<&bump_written_versions>());
  m.impl("linear_scale_batch_norm_train_linked",
         torch::CppFunction::makeFromBoxedFunction<&bump_written_versions>());
  m.impl("update_running_stats", torch::CppFunction::makeFromBoxedFunction<&bump_written_versions>());
  m.impl("linear_scale_batch_norm_train_fp8", torch::CppFunction::makeFromBoxedFunction<&bump_written_versions>());
  m.impl("fp8_record", torch::CppFunction::makeFromBoxedFunction<&bump_written_versions>());
  m.impl("fp8_delayed_operands", torch::CppFunction::makeFromBoxedFunction<&bump_written_versions>());
}

TORCH_LIBRARY_IMPL(cutlass_fused, Autograd, m) {
  m.impl("linear_scale_batch_norm_train", &train_op<&train_autograd>);
  m.impl("linear_scale_batch_norm_eval", &eval_op<&eval_autograd>);
  m.impl("linear_scale_batch_norm_train_linked", &train_linked_op<&linked_autograd>);
  m.impl("linear_linked", &linear_linked_op<&linear_linked_autograd>);
}

TORCH_LIBRARY_IMPL(cutlass_fused, CompositeExplicitAutograd, m) {
  m.impl("linear_scale_batch_norm_train_linked", &train_linked_op<&linked_below_autograd>);
  m.impl("linear_linked", &linear_linked_op<&linear_linked_below_autograd>);
}

}  // namespace cutlass_fused
