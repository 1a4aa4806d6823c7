// Each op's C++ signature, written once (the layer ops' in layer_args.h), and typed handles to
// call the ops through the dispatcher (so that autocast, autograd and the backends compose).
// The schemas themselves are in csrc/ops.cpp.
#pragma once

#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "layer_args.h"
#include "ops.h"

namespace cutlass_fused {

using BackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor const&, OptTensor const&, OptTensor const&,
    double, OptTensor const&, c10::string_view, double, c10::optional<at::ScalarType>);
using BackwardLinearSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor const&, OptTensor const&,
    OptTensor const&, double, OptTensor const&, c10::string_view, double, c10::optional<at::ScalarType>,
    c10::string_view);
using MatmulSig = at::Tensor(at::Tensor const&, at::Tensor const&, c10::string_view);
using CastSig = CastOut(at::Tensor const&, at::Tensor const&, OptTensor const&, at::ScalarType);
using QuantizeE4M3Sig = std::tuple<at::Tensor, at::Tensor>(at::Tensor const&, int64_t, bool);
using DequantizeSig = at::Tensor(at::Tensor const&, OptTensor const&, at::ScalarType);
using QuantizeTransposedSig =
    std::tuple<at::Tensor, at::Tensor, at::Tensor>(at::Tensor const&, at::ScalarType, int64_t, bool);
using QuantizeWithScaleSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(at::Tensor const&,
                                                                                        at::Tensor const&,
                                                                                        at::ScalarType, bool);
using Fp8OperandScalesSig = std::tuple<at::Tensor, at::Tensor>(at::Tensor const&, at::Tensor const&, OptTensor const&,
                                                               OptTensor const&);
using Fp8BackwardScalesSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    at::Tensor const&, at::Tensor const&, at::Tensor const&, OptTensor const&, c10::optional<at::ScalarType>,
    at::ScalarType);
using Fp8RecordSig = void(at::Tensor&, at::Tensor&, at::Tensor const&, at::Tensor const&, int64_t, c10::string_view);
using Fp8DelayedOperandsSig =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
        at::Tensor const&, at::Tensor const&, OptTensor const&, OptTensor const&, at::Tensor&, at::Tensor&, int64_t,
        c10::string_view, bool);

// Set by the autocast kernel (autocast.cpp) for the length of its call of the training op: the
// 16-bit dtype its Autograd kernel is to cast x, the fp32 weight and the bias to
// (cast_linear_inputs), which autocast left uncast. Taken (and cleared) by that kernel; empty
// everywhere else.
c10::optional<at::ScalarType>& deferred_linear_cast();

// Looked up on first use; callers keep the handle in a function-local static.
template <class Sig>
c10::TypedOperatorHandle<Sig> op_handle(char const* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The layer ops called through the dispatcher with a LayerArgs (fp8 and fast_accum as the op
// called has them).
inline TrainOut call_train(LayerArgs const& a) {
  static auto op = op_handle<TrainSig>("cutlass_fused::linear_scale_batch_norm_train");
  return op.call(a.x, a.weight, a.bias, a.scale, a.bn_weight, a.bn_bias, a.running_mean, a.running_var,
                 a.num_batches_tracked, a.momentum, a.eps, a.family, a.cache, a.activation, a.negative_slope,
                 a.output_dtype);
}

inline TrainOut call_train_fp8(LayerArgs const& a) {
  static auto op = op_handle<Fp8TrainSig>("cutlass_fused::linear_scale_batch_norm_train_fp8");
  return op.call(a.x, a.weight, a.bias, a.scale, a.bn_weight, a.bn_bias, a.running_mean, a.running_var,
                 a.num_batches_tracked, a.momentum, a.eps, a.family, a.activation, a.negative_slope, a.output_dtype,
                 a.fast_accum);
}

inline at::Tensor call_eval(LayerArgs const& a) {
  static auto op = op_handle<EvalSig>("cutlass_fused::linear_scale_batch_norm_eval");
  return op.call(a.x, a.weight, a.bias, a.scale, a.bn_weight, a.bn_bias, *a.running_mean, *a.running_var, a.eps,
                 a.family, a.cache, a.activation, a.negative_slope, a.output_dtype);
}

inline at::Tensor call_eval_fp8(LayerArgs const& a) {
  static auto op = op_handle<Fp8EvalSig>("cutlass_fused::linear_scale_batch_norm_eval_fp8");
  return op.call(a.x, a.weight, a.bias, a.scale, a.bn_weight, a.bn_bias, *a.running_mean, *a.running_var, a.eps,
                 a.family, a.activation, a.negative_slope, a.output_dtype, a.fast_accum);
}

}  // namespace cutlass_fused
