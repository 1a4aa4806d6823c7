// Shared by the binding files: argument checks and the padded-row contract.
#pragma once

#include <limits>

#include <ATen/ATen.h>

#include "kernels/plan.h"

namespace cutlass_fused {

// Rows of h are padded to 16 bytes so the TMA/vector paths can use them:
// h is (M, N) with stride (round_up(N, 16 / itemsize), 1). The fake in
// cutlass_fused/ops.py states the same contract.
inline int64_t padded_ld(int64_t n, at::ScalarType dt) {
  int64_t a = std::max<int64_t>(1, 16 / static_cast<int64_t>(c10::elementSize(dt)));
  return (n + a - 1) / a * a;
}

// An (M, N) view of fresh (M, padded_ld(N)) storage, so kernels may write
// whole padded rows.
inline at::Tensor empty_padded(int64_t m, int64_t n, at::TensorOptions opts) {
  return at::empty({m, padded_ld(n, opts.dtype().toScalarType())}, opts).narrow(1, 0, n);
}

// The dtype of z = h * scale and so of y, as PyTorch types `h * scale` in the unfused model
// (at::result_type): a per-column scale promotes (bf16 h and an fp32 scale give fp32, as under
// autocast); without a scale z is h, and a 0-dim scale leaves h's dtype, as a 0-dim operand of the
// same kind does.
inline at::ScalarType output_dtype(at::ScalarType h, c10::optional<at::Tensor> const& scale) {
  if (!scale.has_value() || scale->dim() == 0) return h;
  return at::promote_types(h, scale->scalar_type());
}


// The dtype the ops return y in: `requested` (their output_dtype argument) where given, else
// output_dtype's. It must be a floating-point dtype. The training kernels write h's dtype or fp32
// from their fp32 value (under autocast with an fp32 scale, the unfused model's y, rounded once);
// any other is a cast of y in h * scale's dtype.
at::ScalarType y_dtype(at::ScalarType x, c10::optional<at::Tensor> const& scale,
                       c10::optional<at::ScalarType> requested);

// The activation the ops apply to BN(z): the `activation` argument's name, parsed (ValueError
// naming the valid ones otherwise).
Activation activation_of(c10::string_view name);

// act(y) in y's dtype, as PyTorch's own op computes it (the paths that activate after a kernel).
at::Tensor activated(at::Tensor const& y, Activation act, double slope);
// grad times act's derivative at `pre` (the activation's input), by PyTorch's backward formulas.
at::Tensor activation_backward(at::Tensor const& grad, at::Tensor const& pre, Activation act, double slope);

using TrainOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Whether autocast casts t to `dtype` (at::autocast::cached_cast's rule): a floating-point tensor
// other than fp64, not already of that dtype. cast_linear_inputs casts by it, and the training
// op's Autograd kernel reads which of its operands were cast by it.
inline bool autocast_casts(at::Tensor const& t, at::ScalarType dtype) {
  return t.defined() && t.is_floating_point() && t.scalar_type() != at::kDouble && t.scalar_type() != dtype;
}
// cast_linear_inputs' x, weight and bias in `dtype` where autocast_casts them, else empty.
using CastOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
// Its dtype: the 16-bit dtypes autocast runs a Linear in (bf16, f16).
void check_cast_dtype(at::ScalarType dtype);

void check_linear_args(at::Tensor const& x, at::Tensor const& weight, c10::optional<at::Tensor> const& bias,
                       c10::optional<at::Tensor> const& scale);
void check_vector(c10::optional<at::Tensor> const& t, char const* name, int64_t n);
// scale: None, 0-dim, or n elements (check_vector's words otherwise).
void check_scale(c10::optional<at::Tensor> const& scale, int64_t n);
// running_mean and running_var: n elements each, in dtype z (h * scale's) or float32 for a 16-bit z,
// as PyTorch's batch norm takes them; any floating dtype where z is not known (the split update).
void check_running_stats(at::Tensor const& running_mean, at::Tensor const& running_var, int64_t n,
                         c10::optional<at::ScalarType> z);
// The kernels' element type for t; `name` names the argument in the error for any other dtype.
DType dtype_of(at::ScalarType t, char const* name);

// Tells the plan the dtype y is asked in: one the kernels know, or y_other (a cast after them).
void ask_y(Problem& p, at::ScalarType y);

// Whether outputs start as NaN (tests; cutlass_fused.overrides(poison=True)). The overrides of the
// plan's choices in force are the plan's (current_overrides, kernels/plan.h).
bool poison_outputs();

// Tests turn poisoning on (cutlass_fused.overrides(poison=True), or $CUTLASS_FUSED_POISON=1 at
// import) so that every output of a CUDA kernel starts as NaN and an element it forgot to write
// cannot pass as a plausible value.
inline void poison(at::Tensor& t) {
  if (poison_outputs()) t.fill_(std::numeric_limits<double>::quiet_NaN());
}

// "auto", "sm90" or "sm80": checked on every device, so that the CPU path refuses what CUDA does.
void check_family(c10::string_view family);
// Training needs a batch of at least two rows (count rows behind n columns).
void check_batch(int64_t count, int64_t n);
// Column sums (2 x n fp64, contiguous: sum and sum of squares, or the backward's two) named `name`.
void check_sums(at::Tensor const& sums, char const* name, int64_t n);
// batch_norm_backward_linear's dz (batch x k), next_weight (k x n) and h (batch x n), dz and
// next_weight in h's dtype.
void check_backward_linear(at::Tensor const& dz, at::Tensor const& next_weight, at::Tensor const& h);
// linear_scale_batch_norm_train_linked's prev_h (x's shape), prev_mean and prev_invstd (fp64
// vectors), all given or none.
void check_link_args(at::Tensor const& x, c10::optional<at::Tensor> const& prev_h,
                      c10::optional<at::Tensor> const& prev_mean, c10::optional<at::Tensor> const& prev_invstd);
// SyncBatchNorm's batch count: one fp64 element (on the device, where the ranks merged it).
void check_count(at::Tensor const& count);
// sync_batch_norm_row's arguments: linear_stats' sums (2 x n, n > 0) and a row count >= 0.
void check_sync_row_args(at::Tensor const& stats, int64_t count);
// SyncBatchNorm's gathered rows (world x (2n + 1) fp64, contiguous); n < 0: any n.
void check_rows(at::Tensor const& rows, int64_t n);
// sync_batch_norm_grads' arguments: local and sums 2 x n, row 2n + 1, count one element, the
// forward's mean and invstd n fp64, scale and weight n.
void check_sync_grads_args(at::Tensor const& local, at::Tensor const& sums, at::Tensor const& row,
                           at::Tensor const& count, at::Tensor const& mean, at::Tensor const& invstd,
                           c10::optional<at::Tensor> const& scale, c10::optional<at::Tensor> const& weight);
// The training op's running-statistics arguments, as nn.BatchNorm1d pairs them:
// both running stats or neither; momentum=None (cumulative) needs num_batches_tracked.
void check_running_args(c10::optional<at::Tensor> const& running_mean, c10::optional<at::Tensor> const& running_var,
                        c10::optional<at::Tensor> const& num_batches_tracked, c10::optional<double> momentum);
// quantize_transposed's t (2-D) and dtype (float8_e4m3fn or float8_e5m2).
void check_quantize_transposed(at::Tensor const& t, at::ScalarType dtype);
// dequantize's t8 (float8_e4m3fn or float8_e5m2), scale (None or one fp32 element on t8's device)
// and dtype (bf16, f16 or f32).
void check_dequantize(at::Tensor const& t8, c10::optional<at::Tensor> const& scale, at::ScalarType dtype);
// One float32 element on `device` (a scale or an amax), named `name`.
void check_fp32_element(at::Tensor const& t, char const* name, c10::Device device);
// quantize_with_scale's arguments: 2-D t and float8_e4m3fn or float8_e5m2 where transposed, else
// float8_e4m3fn (CUDA's flat cast is e4m3's); scale one fp32 element on t's device.
void check_quantize_with_scale(at::Tensor const& t, at::Tensor const& scale, at::ScalarType dtype, bool transposed);
// fp8_operand_scales': s_x and s_w one fp32 element each, bias (if any) and scale bf16, f16 or
// f32, all on scale's device.
void check_fp8_operand_scales(at::Tensor const& s_x, at::Tensor const& s_w, c10::optional<at::Tensor> const& bias,
                              c10::optional<at::Tensor> const& scale);
// fp8_backward_scales': s_x, s_w and s_g (if any) one fp32 element each on dsc's device; dsc and
// the dtypes bf16, f16 or f32.
void check_fp8_backward_scales(at::Tensor const& dsc, at::Tensor const& s_x, at::Tensor const& s_w,
                               c10::optional<at::Tensor> const& s_g, c10::optional<at::ScalarType> bias_dtype,
                               at::ScalarType scale_dtype);
// fp8_record's: amax_history (length x 2 fp32, contiguous), scale (2 fp32), the amaxes (one fp32
// element each) on its device, and the algorithm ("max" or "most_recent").
void check_fp8_record(at::Tensor const& amax_history, at::Tensor const& scale, at::Tensor const& amax_x,
                      at::Tensor const& amax_w, c10::string_view amax_compute_algo);
// Its state's part: amax_history, scale (named scale_name) and the algorithm.
void check_fp8_state(at::Tensor const& amax_history, at::Tensor const& scale, c10::string_view amax_compute_algo,
                     char const* scale_name);
// fp8_delayed_operands' own: its state (as check_fp8_state, the scale named fp8_scale) and x and
// weight 2-D; the casts and the operand scales check the rest.
void check_fp8_delayed_operands(at::Tensor const& x, at::Tensor const& weight, at::Tensor const& amax_history,
                                at::Tensor const& fp8_scale, c10::string_view amax_compute_algo);

}  // namespace cutlass_fused
