// What the C++ autograd of the ops shares (csrc/autograd.cpp: the training and eval ops;
// csrc/fp8_autograd.cpp: the e4m3 training op).
#pragma once

#include <vector>

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>
#include <torch/version.h>

#include "op_handles.h"

namespace cutlass_fused {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Backward runs with grad mode on only when create_graph=True was asked for.
inline void no_double_backward() {
  TORCH_CHECK(!at::GradMode::is_enabled(),
              "cutlass_fused: double backward (create_graph=True) is not supported");
}

inline bool requires_grad(OptTensor const& t) { return t.has_value() && t->requires_grad(); }

inline at::Tensor saved(OptTensor const& t) { return t.has_value() ? *t : at::Tensor(); }

inline OptTensor optional(at::Tensor const& t) { return t.defined() ? OptTensor(t) : c10::nullopt; }

// The flags of which inputs need a gradient, as ctx.needs_input_grad gives them
// in Python; stored at forward time because torch 2.4's C++ context lacks it.
inline void save_needs(AutogradContext* ctx, std::vector<bool> const& needs) {
  c10::List<bool> list;
  for (bool b : needs) list.push_back(b);
  ctx->saved_data["needs"] = list;
}

inline std::vector<bool> needs(AutogradContext* ctx) {
  std::vector<bool> out;
  for (bool b : ctx->saved_data["needs"].toBoolList()) out.push_back(b);
  return out;
}

// a b in fp32 from 16-bit a and b: cuBLAS's fp32 output (mm's out_dtype, CUDA), so the product is
// rounded once, to fp32, where the unfused model's went through 16 bits and then a cast; elsewhere
// that same product and cast. torch >= 2.10: mm.dtype came in 2.8, but the meta kernel of 2.8 and
// 2.9 (meta_mm in torch/_meta_registrations.py) takes no out_dtype, so torch.compile could not
// trace this backward there (pytorch issues 159023, 163275).
inline at::Tensor mm_to_fp32(at::Tensor const& a, at::Tensor const& b) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10)
  if (a.is_cuda()) return at::mm(a, b, at::kFloat);
#endif
  return at::mm(a, b).to(at::kFloat);
}

// The ops that update running stats bump the versions of what they write (the schema's
// Tensor(a!) arguments), as nn.BatchNorm1d's in-place update does (also under inference_mode,
// which skips Autograd but not this key): a graph that saved them (an eval forward's) then
// refuses to backward through stale values, and a fold kept inside frozen_weights()
// (derived_cache.h) is made anew. Boxed, so that it reads the schema and no signature.
inline void bump_written_versions(c10::OperatorHandle const& op, torch::jit::Stack* stack) {
  auto const& args = op.schema().arguments();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue const& v = (*stack)[stack->size() - args.size() + i];
    if (args[i].alias_info() != nullptr && args[i].alias_info()->isWrite() && v.isTensor())
      written.push_back(v.toTensor());
  }
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.callBoxed(stack);
  }
  for (auto const& t : written) {
    if (!t.is_inference()) torch::autograd::impl::bump_version(t);
  }
}

}  // namespace cutlass_fused
