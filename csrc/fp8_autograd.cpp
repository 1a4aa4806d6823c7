// The e4m3 training op (linear_scale_batch_norm_train_e4m3, issue 33) and its autograd, in C++
// for the reason autograd.cpp gives: the Python autograd.Function it replaces issued ~30 small
// torch ops a call from Python, and its host time (1317 us a forward and backward at 4096^3
// against 676 for the bf16 layer, H200) exceeded the GPU's work there.
//
// Forward: x and W rounded to e4m3 under current scaling (quantize_e4m3, which keeps a frozen
// W8 where `cache` allows) or under a delayed state's scales (in training fp8_delayed_operands:
// quantize_with_scale's casts, fp8_record's step of the state and the operand scales in one op),
// then the FP8 training op over them with bias / alpha and scale * alpha
// (alpha = 1 / (s_x s_w), fp8_operand_scales): y is the emulated path's (cutlass_fused/fp8.py). Its BN
// backward gives dh' = alpha dh and dscale' = dscale / alpha, so the powers of two move onto the
// operands' dequantize passes: dX = dh' (W8 s_x), dW = dh'^T (x8 s_w), exact while nothing leaves
// fp32's and bf16's normal range. backward "e5m2": dh' rounded to e5m2 under its own scale s_g and dX, dW as
// FP8 GEMMs (_scaled_mm, cuBLASLt on CUDA): dX = (dh8 W8) s_x / s_g, dW = (dh8^T x8) s_w / s_g,
// whose K-major operands (W8^T, dh8^T, x8^T) the quantize passes write beside the values
// (quantize_transposed): torch's strided copies of them took 878 of 2694 us at 16384 x 4096^2.
#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "autograd_util.h"
#include "op_handles.h"

namespace cutlass_fused {
namespace {

// The FP8 ops' operands: x8, W8 and their scales, and the bias and scale the ops take in their
// place, bias / alpha in bf16 and scale * alpha (alpha = 1 / (s_x s_w)).
struct Operands {
  // x8_t, w8_t: x8 and W8 transposed, made for the e5m2 backward only.
  at::Tensor x8, w8, x8_t, w8_t, s_x, s_w, sc;
  OptTensor b;
};

struct Forward {
  Operands o;
  at::Tensor y, h, mean, invstd;
};

// t in dtype dt, t itself where it is already (aten::to would return its input, which the
// dispatcher's schema check refuses below Autograd).
at::Tensor cast(at::Tensor const& t, at::ScalarType dt) { return t.scalar_type() == dt ? t : t.to(dt); }

void check_backward(c10::string_view backward) {
  TORCH_CHECK_VALUE(backward == "bf16" || backward == "e5m2",
                    "cutlass_fused: expected backward to be 'bf16' or 'e5m2', but got '", backward, "'");
}

// Delayed scaling's state, where the recipe has one (fp8_scale given): the layer's scales, read,
// and with amax_history, updated in place after the casts (training).
struct Delayed {
  OptTensor const& amax_history;
  OptTensor const& fp8_scale;
  c10::string_view algo;
};

// x and W rounded to e4m3: under current scaling (W8 kept where `cache` allows), or under the
// delayed state's scales, whose step then records the amaxes the casts measured. Called below
// autocast (the callers' guard).
Operands e4m3_operands(at::Tensor const& x, at::Tensor const& weight, OptTensor const& bias, OptTensor const& scale,
                       int64_t margin, bool cache, bool transposed, Delayed const& delayed) {
  static auto quantize = op_handle<QuantizeE4M3Sig>("cutlass_fused::quantize_e4m3");
  static auto quantize_t = op_handle<QuantizeTransposedSig>("cutlass_fused::quantize_transposed");
  static auto quantize_s = op_handle<QuantizeWithScaleSig>("cutlass_fused::quantize_with_scale");
  static auto operand_scales = op_handle<Fp8OperandScalesSig>("cutlass_fused::fp8_operand_scales");
  static auto delayed_step = op_handle<Fp8DelayedOperandsSig>("cutlass_fused::fp8_delayed_operands");
  Operands o;
  TORCH_CHECK(!delayed.amax_history.has_value() || delayed.fp8_scale.has_value(),
              "cutlass_fused: amax_history is delayed scaling's, which needs fp8_scale too");
  if (delayed.fp8_scale.has_value()) {
    // sym_: traced with symbolic sizes (torch.compile's dynamic shapes) too.
    TORCH_CHECK(delayed.fp8_scale->dim() == 1 && delayed.fp8_scale->sym_numel() == 2,
                "cutlass_fused: expected fp8_scale to be x's and W's scales, of shape [2], but got ",
                delayed.fp8_scale->sym_sizes());
    // s_x, s_w: the casts' copies of the state's scales, which the step moves on; each its
    // own allocation, as cuBLASLt's FP8 GEMMs (the e5m2 backward's _scaled_mm) refuse a scale
    // that is not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED, H100).
    auto const& state = *delayed.fp8_scale;
    if (delayed.amax_history.has_value()) {  // training: the casts, the step and the operand scales in one op
      at::Tensor history = *delayed.amax_history, scales = state;  // non-const handles: the op writes them
      at::Tensor b;
      std::tie(o.x8, o.x8_t, o.w8, o.w8_t, o.s_x, o.s_w, b, o.sc) =
          delayed_step.call(x, weight, bias, scale, history, scales, margin, delayed.algo, transposed);
      o.b = bias.has_value() ? OptTensor(b) : c10::nullopt;
      return o;
    }
    at::Tensor amax_x, amax_w;
    std::tie(o.x8, o.x8_t, amax_x, o.s_x) = quantize_s.call(x, state.select(0, 0), at::kFloat8_e4m3fn, transposed);
    std::tie(o.w8, o.w8_t, amax_w, o.s_w) =
        quantize_s.call(weight, state.select(0, 1), at::kFloat8_e4m3fn, transposed);
  } else if (transposed) {
    std::tie(o.x8, o.x8_t, o.s_x) = quantize_t.call(x, at::kFloat8_e4m3fn, margin, false);
    std::tie(o.w8, o.w8_t, o.s_w) = quantize_t.call(weight, at::kFloat8_e4m3fn, margin, cache);
  } else {
    std::tie(o.x8, o.s_x) = quantize.call(x, margin, false);
    std::tie(o.w8, o.s_w) = quantize.call(weight, margin, cache);
  }
  at::Tensor b;
  std::tie(b, o.sc) = operand_scales.call(o.s_x, o.s_w, bias, scale);
  o.b = bias.has_value() ? OptTensor(b) : c10::nullopt;
  return o;
}

// transposed: x8 and W8 transposed too (the e5m2 backward's).
Forward e4m3_forward(E4M3Args const& e, bool transposed) {
  LayerArgs const& a = e.layer;
  // Below autocast: this op has no autocast kernel (x and W reach it as the caller has them), and
  // the ops it calls must not be cast either; e4m3 values and a bf16 bias / alpha are exact in the
  // bf16 an autocast would give, so the emulated path's casts change nothing there.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  Forward f;
  f.o = e4m3_operands(a.x, a.weight, a.bias, a.scale, e.margin, a.cache, transposed,
                      {e.amax_history, e.fp8_scale, e.amax_compute_algo});
  at::Tensor stats;
  std::tie(f.y, f.h, stats, f.mean, f.invstd) = call_train_fp8(a.with_operands(f.o.x8, f.o.w8, f.o.b, f.o.sc));
  return f;
}

// t (2-D) with zero rows and columns up to multiples of 16, the sizes cuBLASLt's FP8 GEMMs take
// (zeros change no dot product); an fp8 tensor is padded through its bytes (0 is +0.0).
at::Tensor pad16(at::Tensor const& t) {
  int64_t rows = (16 - t.size(0) % 16) % 16, cols = (16 - t.size(1) % 16) % 16;
  if (rows == 0 && cols == 0) return t;
  bool fp8 = t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2;
  auto padded = at::constant_pad_nd(fp8 ? t.view(at::kByte) : t, {0, cols, 0, rows});
  return fp8 ? padded.view(t.scalar_type()) : padded;
}

// a b with per-tensor scales into out_dtype: at::_scaled_mm, whose signature changed in torch 2.5 (the
// scales became its third and fourth arguments, and its result one tensor where 2.4 gave (out, amax)).
// torch 2.4 has no CPU kernel for it: there the same product in fp32, where the fp8 values and the
// power-of-two scales are exact, rounded once to out_dtype.
at::Tensor scaled_mm(at::Tensor const& a, at::Tensor const& b, at::Tensor const& scale_a, at::Tensor const& scale_b,
                     at::ScalarType out_dtype) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 5
  if (!a.is_cuda()) return (at::mm(a.to(at::kFloat), b.to(at::kFloat)) * (scale_a * scale_b)).to(out_dtype);
  return std::get<0>(at::_scaled_mm(a, b, c10::nullopt, out_dtype, scale_a, scale_b));
#else
  return at::_scaled_mm(a, b, scale_a, scale_b, c10::nullopt, c10::nullopt, out_dtype);
#endif
}

at::Tensor first(at::Tensor const& t, int64_t rows, int64_t cols) {
  auto out = t.narrow(0, 0, rows).narrow(1, 0, cols);
  return out.is_contiguous() ? out : out.contiguous();
}

struct E4M3Function : torch::autograd::Function<E4M3Function> {
  // x to bn_bias one by one for apply(), as autograd.cpp's functions take them; `e` holds the same.
  static variable_list forward(AutogradContext* ctx, at::Tensor const& x, at::Tensor const& weight,
                               OptTensor const& bias, OptTensor const& scale, OptTensor const& bn_weight,
                               OptTensor const& bn_bias, E4M3Args const& e) {
    check_backward(e.backward);
    save_needs(ctx, {x.requires_grad(), weight.requires_grad(), requires_grad(bias), requires_grad(scale),
                     requires_grad(bn_weight), requires_grad(bn_bias)});
    // Below Autograd only, so that ADInplaceOrView counts the inner op's running-stats update.
    at::AutoDispatchBelowAutograd below;
    bool e5m2 = e.backward == "e5m2";
    auto f = e4m3_forward(e, e5m2);
    auto const& o = f.o;
    // The e5m2 backward's GEMMs take x8 and W8 transposed (K-major), the bf16 one's as they are.
    ctx->save_for_backward({e5m2 ? o.x8_t : o.x8, e5m2 ? o.w8_t : o.w8, f.h, f.mean, f.invstd, o.sc, saved(bn_weight),
                            saved(bn_bias), o.s_x, o.s_w});
    ctx->saved_data["eps"] = e.layer.eps;
    ctx->saved_data["activation"] = std::string(e.layer.activation);
    ctx->saved_data["negative_slope"] = e.layer.negative_slope;
    ctx->saved_data["e5m2"] = e5m2;
    ctx->saved_data["dtypes"] = c10::List<int64_t>(
        {static_cast<int64_t>(x.scalar_type()), static_cast<int64_t>(weight.scalar_type()),
         bias.has_value() ? static_cast<int64_t>(bias->scalar_type()) : -1,
         scale.has_value() ? static_cast<int64_t>(scale->scalar_type()) : -1});
    ctx->set_materialize_grads(false);
    return {f.y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    no_double_backward();
    static auto bn_backward = op_handle<BackwardSig>("cutlass_fused::batch_norm_backward");
    static auto quantize_t = op_handle<QuantizeTransposedSig>("cutlass_fused::quantize_transposed");
    static auto dequantize = op_handle<DequantizeSig>("cutlass_fused::dequantize");
    static auto backward_scales = op_handle<Fp8BackwardScalesSig>("cutlass_fused::fp8_backward_scales");
    variable_list out(7);  // one per argument of apply(): x to bn_bias, then `e`
    at::Tensor dy = grads[0];
    if (!dy.defined()) return out;
    auto s = ctx->get_saved_variables();
    auto const &x8 = s[0], &w8 = s[1], &h = s[2], &s_x = s[8], &s_w = s[9];
    auto need = needs(ctx);
    auto dtypes = ctx->saved_data["dtypes"].toIntList();
    auto x_dt = static_cast<at::ScalarType>(dtypes.get(0)), w_dt = static_cast<at::ScalarType>(dtypes.get(1));
    if (dy.scalar_type() != h.scalar_type() && dy.scalar_type() != at::kFloat) dy = cast(dy, at::kFloat);
    // With a scale the linear bias's zero comes from fp8_backward_scales below, with the scale's
    // gradient. Without one the saved sc is alpha alone (0-dim): no scale gradient to make, and
    // the BN backward writes the bias's zero itself, as the training op's does.
    bool scaled = dtypes.get(3) >= 0;
    c10::optional<at::ScalarType> bias_dt;
    if (need[2]) bias_dt = static_cast<at::ScalarType>(dtypes.get(2));
    at::Tensor dh, dsc, dgamma, dbeta, dbias;
    std::tie(dh, dsc, dgamma, dbeta, dbias) =
        bn_backward.call(dy.contiguous(), h, s[3], s[4], optional(s[5]), optional(s[6]),
                         ctx->saved_data["eps"].toDouble(), optional(s[7]), ctx->saved_data["activation"].toStringRef(),
                         ctx->saved_data["negative_slope"].toDouble(),
                         scaled ? c10::nullopt : bias_dt);  // dh' = alpha dh
    bool e5m2 = ctx->saved_data["e5m2"].toBool();
    at::Tensor dh8, dh8_t, s_g;
    if (e5m2) std::tie(dh8, dh8_t, s_g) = quantize_t.call(dh, at::kFloat8_e5m2, 0, false);
    // The bias's gradient is exactly zero (NaN where the column's statistics are not finite, as
    // the training op's), the scale's dsc / (s_x s_w), and e5m2's 1 / s_g (exact: a power of two).
    // Not launched where none of the three is wanted (the bf16 backward of a layer whose bias and
    // scale need no gradient).
    at::Tensor dscale, inv_g;
    if (scaled && (e5m2 || need[2] || need[3])) {
      std::tie(dbias, dscale, inv_g) = backward_scales.call(dsc, s_x, s_w, e5m2 ? OptTensor(s_g) : c10::nullopt,
                                                            bias_dt, static_cast<at::ScalarType>(dtypes.get(3)));
    } else if (e5m2) {
      inv_g = s_g.reciprocal();  // exact: a power of two
    }
    if (e5m2) {
      // x8, w8 hold x8^T (k x m) and W8^T (k x n); .t() of a contiguous one is the column-major
      // second operand cuBLASLt takes.
      int64_t m = x8.size(1), k = x8.size(0), n = w8.size(1);
      if (need[0])
        out[0] = first(scaled_mm(pad16(dh8), pad16(w8).t(), inv_g, s_x, x_dt), m, k);
      if (need[1])
        out[1] = first(scaled_mm(pad16(dh8_t), pad16(x8).t(), inv_g, s_w, w_dt), n, k);
    } else {
      auto h_dt = h.scalar_type();
      if (need[0]) out[0] = cast(at::mm(dh, dequantize.call(w8, s_x, h_dt)), x_dt);
      if (need[1]) {
        // x8 s_w, as W8 s_x above: the power of two rides on the operand's one pass, not on a
        // pass over dW (a broadcast multiply ATen runs unvectorized: 40-80 us at 4096^2, H100/H200).
        auto x16 = dequantize.call(x8, s_w, h_dt);
        // A wider weight (fp32 under autocast): the product rounded once to it, as the training op's.
        auto dw = w_dt != h_dt ? mm_to_fp32(dh.t(), x16) : at::mm(dh.t(), x16);
        out[1] = cast(dw, w_dt);
      }
    }
    if (need[2]) out[2] = dbias;
    if (need[3]) out[3] = dscale;
    if (need[4]) out[4] = dgamma;
    if (need[5]) out[5] = dbeta;
    return out;
  }
};

at::Tensor e4m3_autograd(E4M3Args const& e) {
  LayerArgs const& a = e.layer;
  return E4M3Function::apply(a.x, a.weight, a.bias, a.scale, a.bn_weight, a.bn_bias, e)[0];
}

// Without autograd (inference mode, or below Autograd): the forward alone.
at::Tensor e4m3_plain(E4M3Args const& e) {
  check_backward(e.backward);
  return e4m3_forward(e, false).y;
}

// The e4m3 eval path (linear_scale_batch_norm_eval_e4m3): x and W rounded as the training path
// rounds them (a delayed recipe's scales read, not updated), then the FP8 eval op with bias / alpha
// and scale * alpha, which carries alpha into the fold (a = scale alpha gamma invstd): one e4m3
// GEMM, the emulated path's y. No autograd.
at::Tensor eval_e4m3(E4M3Args const& e) {
  LayerArgs const& a = e.layer;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // as e4m3_forward's
  OptTensor no_history;
  auto o = e4m3_operands(a.x, a.weight, a.bias, a.scale, e.margin, a.cache, false, {no_history, e.fp8_scale, "max"});
  return call_eval_fp8(a.with_operands(o.x8, o.w8, o.b, o.sc));
}

// fp8_delayed_operands as the ops it stands for (the CPU's; CUDA has its own, in fewer launches).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
delayed_operands_ops(at::Tensor const& x, at::Tensor const& weight, OptTensor const& bias, OptTensor const& scale,
                     at::Tensor& amax_history, at::Tensor& fp8_scale, int64_t margin, c10::string_view algo,
                     bool transposed) {
  static auto quantize_s = op_handle<QuantizeWithScaleSig>("cutlass_fused::quantize_with_scale");
  static auto record = op_handle<Fp8RecordSig>("cutlass_fused::fp8_record");
  static auto operand_scales = op_handle<Fp8OperandScalesSig>("cutlass_fused::fp8_operand_scales");
  check_fp8_delayed_operands(x, weight, amax_history, fp8_scale, algo);
  auto [x8, x8_t, amax_x, s_x] = quantize_s.call(x, fp8_scale.select(0, 0), at::kFloat8_e4m3fn, transposed);
  auto [w8, w8_t, amax_w, s_w] = quantize_s.call(weight, fp8_scale.select(0, 1), at::kFloat8_e4m3fn, transposed);
  record.call(amax_history, fp8_scale, amax_x, amax_w, margin, algo);
  auto [b, sc] = operand_scales.call(s_x, s_w, bias, scale);
  return {x8, x8_t, w8, w8_t, s_x, s_w, b, sc};
}

}  // namespace

TORCH_LIBRARY_IMPL(cutlass_fused, CompositeExplicitAutograd, m) {
  m.impl("fp8_delayed_operands", &delayed_operands_ops);
  m.impl("linear_scale_batch_norm_train_e4m3", &train_e4m3_op<&e4m3_plain>);
  m.impl("linear_scale_batch_norm_eval_e4m3", &eval_e4m3_op<&eval_e4m3>);
}

TORCH_LIBRARY_IMPL(cutlass_fused, Autograd, m) {
  m.impl("linear_scale_batch_norm_train_e4m3", &train_e4m3_op<&e4m3_autograd>);
}

}  // namespace cutlass_fused
