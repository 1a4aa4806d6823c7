// The eval fold: the two (fp16: three) per-column vectors the eval GEMM's
// epilogue reads, made from scale, the batch norm's affine parameters and its
// running stats by one small kernel before the GEMM (kept between calls only
// inside frozen_weights(): derived_cache.h), where the sm90 eval epilogue does
// not make them itself (Plan::fold_in_epilogue; eval_fold_inputs).
#include "eval_fold_cuda.h"

#include <ATen/cuda/CUDAContext.h>

#include "derived_cache.h"
#include "kernels/batch_norm.h"

namespace cutlass_fused {
namespace {

using OptTensor = c10::optional<at::Tensor>;

// A 0-dim tensor (the FP8 ops' scale beside a layer without one) is one value for every column.
ColVec col(OptTensor const& t) {
  if (!t.has_value()) return {};
  auto dt = t->scalar_type() == at::kBFloat16 ? DType::bf16 : t->scalar_type() == at::kHalf ? DType::f16 : DType::f32;
  return {t->data_ptr(), dt, t->dim() == 0};
}

}  // namespace

EvalFold eval_fold_inputs(OptTensor const& scale, OptTensor const& bn_weight, OptTensor const& bn_bias,
                          at::Tensor const& running_mean, at::Tensor const& running_var, double eps) {
  return {col(scale), col(bn_weight), col(bn_bias), col(running_mean), col(running_var), eps,
          static_cast<int>(running_mean.size(0))};
}

at::Tensor eval_fold(OptTensor const& scale, OptTensor const& bn_weight, OptTensor const& bn_bias,
                     at::Tensor const& running_mean, at::Tensor const& running_var, double eps, int64_t kn,
                     bool cache, bool scale_apart) {
  auto make = [&] {
    auto fold = at::empty({scale_apart ? 3 : 2, kn}, running_mean.options().dtype(at::kFloat));
    fold_eval(eval_fold_inputs(scale, bn_weight, bn_bias, running_mean, running_var, eps), static_cast<int>(kn),
              fold[0].data_ptr<float>(), fold[1].data_ptr<float>(), scale_apart ? fold[2].data_ptr<float>() : nullptr,
              at::cuda::getCurrentCUDAStream().stream());
    return fold;
  };
  return derived(Derived::eval_fold, {scale, bn_weight, bn_bias, running_mean, running_var},
                 {eps, static_cast<double>(kn), scale_apart ? 1.0 : 0.0}, cache, make);
}

bool eval_fold_kept(OptTensor const& scale, OptTensor const& bn_weight, OptTensor const& bn_bias,
                    at::Tensor const& running_mean, at::Tensor const& running_var, bool cache) {
  return keeps(cache, {scale, bn_weight, bn_bias, running_mean, running_var});
}

}  // namespace cutlass_fused
