// Autocast for the layer's ops: under torch.autocast the GEMM runs in the
// autocast dtype, as F.linear does in the unfused model, and everything after
// it as the unfused model computes it.
//
// The unfused model under autocast: linear casts x, W and b to the autocast
// dtype (bf16/f16) and returns h in it; h * scale with an fp32 scale promotes
// to fp32, and batch_norm runs in fp32. So only x, weight and bias are cast
// here; scale and the BN parameters keep their dtype, the statistics stay
// fp64/fp32, and y comes out in h * scale's promoted dtype (output_dtype in
// ops.h). The casts are autocast's own cached_cast, which autograd records
// (this key sits above Autograd), so gradients reach fp32 parameters in fp32.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include "op_handles.h"

namespace cutlass_fused {
namespace {

template <c10::DeviceType device>
TrainOut train_autocast(at::Tensor const& x, at::Tensor const& weight, OptTensor const& bias, at::Tensor const& scale,
                        OptTensor const& bn_weight, OptTensor const& bn_bias, OptTensor const& running_mean,
                        OptTensor const& running_var, OptTensor const& num_batches_tracked,
                        c10::optional<double> momentum, double eps, c10::string_view family, bool cache) {
  static auto op = op_handle<TrainSig>("cutlass_fused::linear_scale_batch_norm_train");
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device));
  auto dt = at::autocast::get_autocast_dtype(device);
  return op.call(at::autocast::cached_cast(dt, x, device), at::autocast::cached_cast(dt, weight, device),
                 at::autocast::cached_cast(dt, bias, device), scale, bn_weight, bn_bias, running_mean, running_var,
                 num_batches_tracked, momentum, eps, family, cache);
}

template <c10::DeviceType device>
at::Tensor eval_autocast(at::Tensor const& x, at::Tensor const& weight, OptTensor const& bias, at::Tensor const& scale,
                         OptTensor const& bn_weight, OptTensor const& bn_bias, at::Tensor const& running_mean,
                         at::Tensor const& running_var, double eps, c10::string_view family, bool cache) {
  static auto op = op_handle<EvalSig>("cutlass_fused::linear_scale_batch_norm_eval");
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device));
  auto dt = at::autocast::get_autocast_dtype(device);
  return op.call(at::autocast::cached_cast(dt, x, device), at::autocast::cached_cast(dt, weight, device),
                 at::autocast::cached_cast(dt, bias, device), scale, bn_weight, bn_bias, running_mean, running_var, eps,
                 family, cache);
}

}  // namespace

TORCH_LIBRARY_IMPL(cutlass_fused, AutocastCUDA, m) {
  m.impl("linear_scale_batch_norm_train", &train_autocast<c10::DeviceType::CUDA>);
  m.impl("linear_scale_batch_norm_eval", &eval_autocast<c10::DeviceType::CUDA>);
}

TORCH_LIBRARY_IMPL(cutlass_fused, AutocastCPU, m) {
  m.impl("linear_scale_batch_norm_train", &train_autocast<c10::DeviceType::CPU>);
  m.impl("linear_scale_batch_norm_eval", &eval_autocast<c10::DeviceType::CPU>);
}

}  // namespace cutlass_fused
