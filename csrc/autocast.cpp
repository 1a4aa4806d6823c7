// Autocast for the layer's ops: under torch.autocast the GEMM runs in the
// autocast dtype, as F.linear does in the unfused model, and everything after
// it as the unfused model computes it.
//
// The unfused model under autocast: linear casts x, W and b to the autocast
// dtype (bf16/f16) and returns h in it; h * scale with an fp32 scale promotes
// to fp32, and batch_norm runs in fp32. So only x, weight and bias (each op's
// first three arguments) are cast here; scale and the BN parameters keep their
// dtype, the statistics stay fp64/fp32, and y comes out in h * scale's promoted
// dtype (output_dtype in ops.h). The casts are autocast's own cached_cast, which
// autograd records (this key sits above Autograd), so gradients reach fp32
// parameters in fp32.
//
// The training op's operands, where autograd records the call with an fp32 weight, are not cast
// here but by its Autograd kernel (deferred_linear_cast, autograd.cpp), x, weight and bias in one
// op (cast_linear_inputs), whose backward then gives dW in fp32 directly: through autocast's
// recorded cast, dW came out in 16 bits and then took an unvectorized 16 -> 32-bit copy, ~50 us a
// 4096 x 4096 weight (docs/decisions.md, "Autocast"). Without a recording (no_grad,
// inference_mode, a frozen weight) the casts stay autocast's, cache and all.
//
// One boxed kernel serves the four ops: it reads no signature but the schema's, so
// the ops' signatures stay written once (csrc/ops.cpp, layer_args.h).
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "op_handles.h"

namespace cutlass_fused {
namespace {

constexpr size_t kCastArguments = 3;  // x, weight, bias

}  // namespace

c10::optional<at::ScalarType>& deferred_linear_cast() {
  thread_local c10::optional<at::ScalarType> dtype;
  return dtype;
}

namespace {

// Clears the deferral however the call ends, so that it never reaches another call.
struct DeferCast {
  explicit DeferCast(c10::optional<at::ScalarType> dt) { deferred_linear_cast() = dt; }
  ~DeferCast() { deferred_linear_cast() = c10::nullopt; }
};

// Deferrable: the training op, whose Autograd kernel takes the deferral.
template <c10::DeviceType device, bool Deferrable>
void autocast_linear_inputs(c10::OperatorHandle const& op, torch::jit::Stack* stack) {
  size_t n = op.schema().arguments().size();
  auto dt = at::autocast::get_autocast_dtype(device);
  c10::IValue const& weight = (*stack)[stack->size() - n + 1];
  bool defer = Deferrable && at::GradMode::is_enabled() && !c10::InferenceMode::is_enabled() &&
               weight.isTensor() && weight.toTensor().requires_grad() && weight.toTensor().scalar_type() == at::kFloat;
  for (size_t i = 0; i < (defer ? 0 : kCastArguments); ++i) {
    c10::IValue& v = (*stack)[stack->size() - n + i];
    if (v.isTensor()) v = at::autocast::cached_cast(dt, v.toTensor(), device);
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device));
  DeferCast deferral(defer ? c10::optional<at::ScalarType>(dt) : c10::nullopt);
  op.callBoxed(stack);
}

template <c10::DeviceType device>
void register_autocast(torch::Library& m) {
  m.impl("linear_scale_batch_norm_train",
         torch::CppFunction::makeFromBoxedFunction<&autocast_linear_inputs<device, true>>());
  m.impl("linear_scale_batch_norm_train_linked",
         torch::CppFunction::makeFromBoxedFunction<&autocast_linear_inputs<device, true>>());
  m.impl("linear_scale_batch_norm_eval",
         torch::CppFunction::makeFromBoxedFunction<&autocast_linear_inputs<device, false>>());
  m.impl("linear_linked", torch::CppFunction::makeFromBoxedFunction<&autocast_linear_inputs<device, false>>());
}

}  // namespace

TORCH_LIBRARY_IMPL(cutlass_fused, AutocastCUDA, m) { register_autocast<c10::DeviceType::CUDA>(m); }

TORCH_LIBRARY_IMPL(cutlass_fused, AutocastCPU, m) { register_autocast<c10::DeviceType::CPU>(m); }

}  // namespace cutlass_fused
