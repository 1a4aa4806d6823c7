// The layer ops' arguments, written once. The training and eval ops, their fp8 twins and the e4m3
// ops share most of their schemas (csrc/ops.cpp); each kernel of theirs (CPU, CUDA, Autograd, the
// e4m3 composite) takes one LayerArgs (E4M3Args for the e4m3 ops), and the templates below unpack
// the dispatcher's arguments into it, in the schemas' order. op_handles.h takes the typed handles'
// signatures from these templates and calls the ops with a LayerArgs.
#pragma once

#include <type_traits>

#include <ATen/ATen.h>

#include "ops.h"

namespace cutlass_fused {

using OptTensor = c10::optional<at::Tensor>;

// References to the caller's arguments: valid for the length of its call.
struct LayerArgs {
  at::Tensor const& x;
  at::Tensor const& weight;
  OptTensor const& bias;
  OptTensor const& scale;
  OptTensor const& bn_weight;
  OptTensor const& bn_bias;
  // Training: the running stats it updates where given. Eval: the ones it reads, always given.
  OptTensor const& running_mean;
  OptTensor const& running_var;
  OptTensor const& num_batches_tracked;  // training only
  c10::optional<double> momentum;        // training only
  double eps;
  c10::string_view family;
  bool cache;
  c10::string_view activation;
  double negative_slope;
  c10::optional<at::ScalarType> output_dtype;
  bool fp8 = false;         // the fp8 ops: x and W in e4m3, scaled by the caller
  bool fast_accum = false;  // theirs and the e4m3 ops'

  // The same call over other operands: autocast's casts, the e4m3 rounding and its scales.
  LayerArgs with_operands(at::Tensor const& x_, at::Tensor const& weight_, OptTensor const& bias_,
                          OptTensor const& scale_) const {
    return {x_,   weight_,  bias_,      scale_,     bn_weight,      bn_bias,      running_mean, running_var,
            num_batches_tracked, momentum, eps, family, cache, activation, negative_slope, output_dtype,
            fp8,  fast_accum};
  }
};

// The e4m3 ops' own arguments beside the layer's.
struct E4M3Args {
  LayerArgs layer;
  int64_t margin;
  c10::string_view backward;          // training only
  OptTensor const& amax_history;      // training only
  OptTensor const& fp8_scale;
  c10::string_view amax_compute_algo;  // training only
};

// linear_scale_batch_norm_train_linked's arguments beside the layer's: the previous layer's BN,
// whose backward this layer's runs (none given: the first linked layer).
struct LinkArgs {
  OptTensor const& h;
  OptTensor const& mean;
  OptTensor const& invstd;
  OptTensor const& bias;  // the previous Linear's bias: its gradient only
  OptTensor const& scale;
  OptTensor const& bn_weight;
  OptTensor const& bn_bias;
  double eps;
  c10::string_view activation;
  double negative_slope;
};

template <class Out>
using LayerKernel = Out (*)(LayerArgs const&);

// linear_scale_batch_norm_train
template <LayerKernel<TrainOut> F>
TrainOut train_op(at::Tensor const& x, at::Tensor const& weight, OptTensor const& bias, OptTensor const& scale,
                  OptTensor const& bn_weight, OptTensor const& bn_bias, OptTensor const& running_mean,
                  OptTensor const& running_var, OptTensor const& num_batches_tracked, c10::optional<double> momentum,
                  double eps, c10::string_view family, bool cache, c10::string_view activation, double negative_slope,
                  c10::optional<at::ScalarType> output_dtype) {
  return F({x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked, momentum, eps,
            family, cache, activation, negative_slope, output_dtype});
}

// linear_scale_batch_norm_train_linked
template <TrainOut (*F)(LayerArgs const&, LinkArgs const&)>
TrainOut train_linked_op(at::Tensor const& x, at::Tensor const& weight, OptTensor const& bias, OptTensor const& scale,
                        OptTensor const& bn_weight, OptTensor const& bn_bias, OptTensor const& running_mean,
                        OptTensor const& running_var, OptTensor const& num_batches_tracked,
                        c10::optional<double> momentum, double eps, c10::string_view family, bool cache,
                        c10::string_view activation, double negative_slope,
                        c10::optional<at::ScalarType> output_dtype, OptTensor const& prev_h,
                        OptTensor const& prev_mean, OptTensor const& prev_invstd, OptTensor const& prev_bias,
                        OptTensor const& prev_scale, OptTensor const& prev_bn_weight, OptTensor const& prev_bn_bias,
                        double prev_eps, c10::string_view prev_activation, double prev_negative_slope) {
  return F({x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked, momentum, eps,
            family, cache, activation, negative_slope, output_dtype},
           {prev_h, prev_mean, prev_invstd, prev_bias, prev_scale, prev_bn_weight, prev_bn_bias, prev_eps,
            prev_activation, prev_negative_slope});
}

// linear_linked: the Linear's x, weight and bias, the previous layer's LinkArgs, the kernel family.
template <at::Tensor (*F)(at::Tensor const&, at::Tensor const&, OptTensor const&, LinkArgs const&,
                          c10::string_view)>
at::Tensor linear_linked_op(at::Tensor const& x, at::Tensor const& weight, OptTensor const& bias,
                            at::Tensor const& prev_h, at::Tensor const& prev_mean, at::Tensor const& prev_invstd,
                            OptTensor const& prev_bias, OptTensor const& prev_scale, OptTensor const& prev_bn_weight,
                            OptTensor const& prev_bn_bias, double prev_eps, c10::string_view prev_activation,
                            double prev_negative_slope, c10::string_view family) {
  OptTensor const h(prev_h), mean(prev_mean), invstd(prev_invstd);
  return F(x, weight, bias,
           {h, mean, invstd, prev_bias, prev_scale, prev_bn_weight, prev_bn_bias, prev_eps, prev_activation,
            prev_negative_slope},
           family);
}

// linear_scale_batch_norm_train_fp8: no cache (W8 is the caller's), fast_accum.
template <LayerKernel<TrainOut> F>
TrainOut train_fp8_op(at::Tensor const& x, at::Tensor const& weight, OptTensor const& bias, OptTensor const& scale,
                      OptTensor const& bn_weight, OptTensor const& bn_bias, OptTensor const& running_mean,
                      OptTensor const& running_var, OptTensor const& num_batches_tracked,
                      c10::optional<double> momentum, double eps, c10::string_view family,
                      c10::string_view activation, double negative_slope, c10::optional<at::ScalarType> output_dtype,
                      bool fast_accum) {
  return F({x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked, momentum, eps,
            family, false, activation, negative_slope, output_dtype, true, fast_accum});
}

// linear_scale_batch_norm_eval: the running stats given, no momentum.
template <LayerKernel<at::Tensor> F>
at::Tensor eval_op(at::Tensor const& x, at::Tensor const& weight, OptTensor const& bias, OptTensor const& scale,
                   OptTensor const& bn_weight, OptTensor const& bn_bias, at::Tensor const& running_mean,
                   at::Tensor const& running_var, double eps, c10::string_view family, bool cache,
                   c10::string_view activation, double negative_slope, c10::optional<at::ScalarType> output_dtype) {
  OptTensor const mean(running_mean), var(running_var), none;
  return F({x, weight, bias, scale, bn_weight, bn_bias, mean, var, none, c10::nullopt, eps, family, cache, activation,
            negative_slope, output_dtype});
}

// linear_scale_batch_norm_eval_fp8: as eval, with train_fp8's differences.
template <LayerKernel<at::Tensor> F>
at::Tensor eval_fp8_op(at::Tensor const& x, at::Tensor const& weight, OptTensor const& bias, OptTensor const& scale,
                       OptTensor const& bn_weight, OptTensor const& bn_bias, at::Tensor const& running_mean,
                       at::Tensor const& running_var, double eps, c10::string_view family,
                       c10::string_view activation, double negative_slope,
                       c10::optional<at::ScalarType> output_dtype, bool fast_accum) {
  OptTensor const mean(running_mean), var(running_var), none;
  return F({x, weight, bias, scale, bn_weight, bn_bias, mean, var, none, c10::nullopt, eps, family, false, activation,
            negative_slope, output_dtype, true, fast_accum});
}

// linear_scale_batch_norm_train_e4m3
template <at::Tensor (*F)(E4M3Args const&)>
at::Tensor train_e4m3_op(at::Tensor const& x, at::Tensor const& weight, OptTensor const& bias, OptTensor const& scale,
                         OptTensor const& bn_weight, OptTensor const& bn_bias, OptTensor const& running_mean,
                         OptTensor const& running_var, OptTensor const& num_batches_tracked,
                         c10::optional<double> momentum, double eps, c10::string_view family,
                         c10::string_view activation, double negative_slope,
                         c10::optional<at::ScalarType> output_dtype, int64_t margin, c10::string_view backward,
                         bool cache, OptTensor const& amax_history, OptTensor const& fp8_scale,
                         c10::string_view amax_compute_algo, bool fast_accum) {
  return F({{x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked, momentum, eps,
             family, cache, activation, negative_slope, output_dtype, false, fast_accum},
            margin, backward, amax_history, fp8_scale, amax_compute_algo});
}

// linear_scale_batch_norm_eval_e4m3: the state's scales read, not updated.
template <at::Tensor (*F)(E4M3Args const&)>
at::Tensor eval_e4m3_op(at::Tensor const& x, at::Tensor const& weight, OptTensor const& bias, OptTensor const& scale,
                        OptTensor const& bn_weight, OptTensor const& bn_bias, at::Tensor const& running_mean,
                        at::Tensor const& running_var, double eps, c10::string_view family,
                        c10::string_view activation, double negative_slope,
                        c10::optional<at::ScalarType> output_dtype, int64_t margin, bool cache,
                        OptTensor const& fp8_scale, bool fast_accum) {
  OptTensor const mean(running_mean), var(running_var), none;
  return F({{x, weight, bias, scale, bn_weight, bn_bias, mean, var, none, c10::nullopt, eps, family, cache, activation,
             negative_slope, output_dtype, false, fast_accum},
            margin, "bf16", none, fp8_scale, "max"});
}

// The ops' C++ signatures, as the dispatcher's typed handles name them.
using TrainSig = std::remove_pointer_t<decltype(&train_op<nullptr>)>;
using Fp8TrainSig = std::remove_pointer_t<decltype(&train_fp8_op<nullptr>)>;
using EvalSig = std::remove_pointer_t<decltype(&eval_op<nullptr>)>;
using Fp8EvalSig = std::remove_pointer_t<decltype(&eval_fp8_op<nullptr>)>;

}  // namespace cutlass_fused
