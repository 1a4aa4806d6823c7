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
// One boxed kernel serves both ops: it reads no signature but the schema's, so
// the ops' signatures stay written once (csrc/ops.cpp, op_handles.h).
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace cutlass_fused {
namespace {

constexpr size_t kCastArguments = 3;  // x, weight, bias

template <c10::DeviceType device>
void autocast_linear_inputs(c10::OperatorHandle const& op, torch::jit::Stack* stack) {
  size_t n = op.schema().arguments().size();
  auto dt = at::autocast::get_autocast_dtype(device);
  for (size_t i = 0; i < kCastArguments; ++i) {
    c10::IValue& v = (*stack)[stack->size() - n + i];
    if (v.isTensor()) v = at::autocast::cached_cast(dt, v.toTensor(), device);
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device));
  op.callBoxed(stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(cutlass_fused, AutocastCUDA, m) {
  auto cast = [] { return torch::CppFunction::makeFromBoxedFunction<&autocast_linear_inputs<c10::DeviceType::CUDA>>(); };
  m.impl("linear_scale_batch_norm_train", cast());
  m.impl("linear_scale_batch_norm_eval", cast());
}

TORCH_LIBRARY_IMPL(cutlass_fused, AutocastCPU, m) {
  auto cast = [] { return torch::CppFunction::makeFromBoxedFunction<&autocast_linear_inputs<c10::DeviceType::CPU>>(); };
  m.impl("linear_scale_batch_norm_train", cast());
  m.impl("linear_scale_batch_norm_eval", cast());
}

}  // namespace cutlass_fused
