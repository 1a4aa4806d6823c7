// FP8 current scaling (issue 33), torch-free: a tensor's amax, its power-of-two scale and its
// e4m3 (or e5m2) values, in two passes (the scale needs the whole tensor's amax before any value
// rounds). e5m2 is the FP8 backward's format for dh, with 57344 in place of 448 below.
//
// The scale is cutlass_fused/fp8.py's scale_from_amax, in the same fp32 operations torch runs
// (1 / amax times 448, log2f, floorf, the margin, the clamp to +-126, exp2f), so the CUDA op and the
// emulated path round to the same e4m3 values: 1 where the amax is 0 or not finite. Each value is
// rounded as fp8.quantize does: t * scale in fp32, saturated at +-448, NaN where not finite
// (e4m3fn has no infinity).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/types.h"

namespace cutlass_fused {

enum class Fp8 { e4m3, e5m2 };

// out[i] = e4m3(t[i] * scale) for the n contiguous elements of t (bf16, f16 or f32); *scale
// written as fp32. amax_bits is one 4-byte word of workspace, which this zeroes first. e4m3 only:
// e5m2 (dh) is always wanted transposed too, below.
void quantize_e4m3(void const* t, DType dtype, int64_t n, int margin, unsigned* amax_bits, float* scale,
                   uint8_t* out, cudaStream_t stream);

// The same for t a contiguous rows x cols matrix, also writing its transpose: out_t (cols x rows,
// contiguous) from the same pass, through shared-memory tiles. Hopper's FP8 MMA takes K-major
// operands only, so the FP8 backward's dW = dh^T x needs dh^T and x^T, and dX = dh W needs W^T;
// torch's strided copy of a float8 tensor was slow (decisions.md, "FP8 (issue 33)"). out may be null (only out_t).
void quantize_fp8_transposed(void const* t, DType dtype, Fp8 format, int64_t rows, int64_t cols, int margin,
                             unsigned* amax_bits, float* scale, uint8_t* out, uint8_t* out_t, cudaStream_t stream);

// Delayed scaling (a scale carried from earlier steps): the same casts under the given *scale (a
// power of two, fp32), each measuring t's amax in its own pass into amax_bits (zeroed first; as
// fp32 bits, NaN where t holds one): one read of t, where current scaling takes two. The cast
// also copies *scale to *scale_copy, the value it used, which the caller keeps while the state
// moves on (a cudaMemcpyAsync there cost host time a call;
// decisions.md, "The e4m3 step's host time (run on an H100)").
void quantize_e4m3_with_scale(void const* t, DType dtype, int64_t n, float const* scale, float* scale_copy,
                              unsigned* amax_bits, uint8_t* out, cudaStream_t stream);
void quantize_fp8_transposed_with_scale(void const* t, DType dtype, Fp8 format, int64_t rows, int64_t cols,
                                        float const* scale, float* scale_copy, unsigned* amax_bits, uint8_t* out,
                                        uint8_t* out_t, cudaStream_t stream);

// Delayed scaling's step for a layer's history (len x 2 fp32, columns x and W, row 0 the latest)
// and its two scales: cutlass_fused/fp8.py's DelayedState.record (use_max: amax_compute_algo
// "max", else "most_recent"), in one launch.
void record_amax(float* history, int64_t len, float const* amax_x, float const* amax_w, int margin, bool use_max,
                 float* scale, cudaStream_t stream);

// One operand of delayed_operands: t (rows x cols, contiguous, of dtype) cast to e4m3 into out and,
// where out_t is not null, its transpose into out_t from the same pass.
struct Fp8Operand {
  void const* t;
  DType dtype;
  int64_t rows, cols;
  uint8_t* out;
  uint8_t* out_t;
};

// Delayed scaling's forward step for a layer in four launches, where the calls above take six:
// one memset zeroing amax_bits (two words), x's and W's casts under fp8_scale[0] and [1] (copied to
// *s_x, *s_w), then record_amax's step of history and fp8_scale together with fp8_operand_scales'
// b_out and sc_out from *s_x and *s_w (the scales the casts used). The same values as those calls.
void delayed_operands(Fp8Operand const& x, Fp8Operand const& w, float* history, int64_t len, float* fp8_scale,
                      int margin, bool use_max, unsigned* amax_bits, float* s_x, float* s_w, void const* bias,
                      DType bias_dtype, int64_t nb, void const* scale, DType scale_dtype, int64_t ns, void* b_out,
                      void* sc_out, cudaStream_t stream);

// The FP8 ops' bias and scale for x8 = x s_x and W8 = W s_w (fp8_autograd.cpp): alpha = 1 / (s_x
// s_w), b_out = bias / alpha rounded to bf16 (nb elements; bias and b_out null where nb is 0) and
// sc_out = scale * alpha in scale's dtype (ns elements), the bits of those torch ops, in one launch;
// without a scale (null: a layer without one), sc_out = alpha (ns = 1, fp32).
void fp8_operand_scales(float const* s_x, float const* s_w, void const* bias, DType bias_dtype, int64_t nb,
                        void const* scale, DType scale_dtype, int64_t ns, void* b_out, void* sc_out,
                        cudaStream_t stream);

// The e4m3 op's backward scalars (fp8_backward_scales), from dsc (n elements of dsc_dtype):
// dbias = (dsc * 0) in bias_dtype (skipped where dbias is null), dscale = dsc / (s_x s_w) in
// scale_dtype, and *inv_g = 1 / *s_g (skipped where s_g is null), the bits of those torch ops.
void fp8_backward_scales(void const* dsc, DType dsc_dtype, int64_t n, float const* s_x, float const* s_w,
                         float const* s_g, void* dbias, DType bias_dtype, void* dscale, DType scale_dtype,
                         float* inv_g, cudaStream_t stream);

// out[i] = t8[i] (fp8 of `format`) times *scale (1 where scale is null), rounded once to `dtype`:
// the bf16 FP8 backward's operands, which torch's float8 cast moved slowly (decisions.md, "FP8 (issue 33)").
void dequantize_fp8(uint8_t const* t8, Fp8 format, int64_t n, float const* scale, DType dtype, void* out,
                    cudaStream_t stream);

}  // namespace cutlass_fused
