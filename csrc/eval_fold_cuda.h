// The eval epilogue's per-column vectors (csrc/eval_fold_cuda.cpp), or their inputs for the sm90
// epilogue that makes them itself.
#pragma once

#include <ATen/ATen.h>

#include "kernels/types.h"

namespace cutlass_fused {

// The fold's inputs as the kernels take them (the pointers of the caller's tensors, which must
// outlive the launch; no scale reads 1), over the running stats' columns: the sm90 eval epilogue
// makes the fold from them itself (csrc/kernels/gemm/sm90_fold.cuh).
EvalFold eval_fold_inputs(c10::optional<at::Tensor> const& scale, c10::optional<at::Tensor> const& bn_weight,
                          c10::optional<at::Tensor> const& bn_bias, at::Tensor const& running_mean,
                          at::Tensor const& running_var, double eps);

// (2, kn) fp32 on the running stats' device: row 0 a = scale * w * invstd, row 1
// c = b - running_mean * w * invstd (fold_eval in csrc/kernels/batch_norm.h),
// zero in the padded columns n .. kn. With scale_apart, (3, kn): row 0 is
// w * invstd and row 2 scale, for the fp16 eval kernels (gemm_evt.h).
// The vectors are checked by the caller. Kept for the next call only where
// `cache` (the ops' schema argument, csrc/ops.cpp) allows: derived_cache.h.
at::Tensor eval_fold(c10::optional<at::Tensor> const& scale, c10::optional<at::Tensor> const& bn_weight,
                     c10::optional<at::Tensor> const& bn_bias, at::Tensor const& running_mean,
                     at::Tensor const& running_var, double eps, int64_t kn, bool cache, bool scale_apart = false);

// Whether eval_fold would keep its vectors for the next call (or find them kept): `cache`, and
// neither a CUDA graph capture nor an inference tensor (derived_cache.h, keeps).
bool eval_fold_kept(c10::optional<at::Tensor> const& scale, c10::optional<at::Tensor> const& bn_weight,
                    c10::optional<at::Tensor> const& bn_bias, at::Tensor const& running_mean,
                    at::Tensor const& running_var, bool cache);

}  // namespace cutlass_fused
