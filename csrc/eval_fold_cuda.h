// The eval epilogue's per-column vectors (csrc/eval_fold_cuda.cpp).
#pragma once

#include <ATen/ATen.h>

namespace cutlass_fused {

// (2, kn) fp32 on scale's device: row 0 a = scale * w * invstd, row 1
// c = b - running_mean * w * invstd (fold_eval in csrc/kernels/batch_norm.h),
// zero in the padded columns n .. kn. With scale_apart, (3, kn): row 0 is
// w * invstd and row 2 scale, for the fp16 eval kernels (gemm_evt.h).
// The vectors are checked by the caller. Kept for the next call only where
// `cache` (the ops' schema argument, csrc/ops.cpp) allows: derived_cache.h.
at::Tensor eval_fold(at::Tensor const& scale, c10::optional<at::Tensor> const& bn_weight,
                     c10::optional<at::Tensor> const& bn_bias, at::Tensor const& running_mean,
                     at::Tensor const& running_var, double eps, int64_t kn, bool cache, bool scale_apart = false);

}  // namespace cutlass_fused
