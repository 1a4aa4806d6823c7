// The vocabulary of the kernel layer, free of CUDA and torch headers so that the
// plan (plan.h) and its CPU unit tests compile on any machine.
#pragma once

namespace cutlass_fused {

// Element types of the BatchNorm kernels' data (h, y, dy) and per-column vectors.
enum class DType { bf16, f16, f32 };

// A per-column vector (scale, BN weight and bias, running stats, gradients) in
// its own dtype. Kernels read and write these in place, so that no step casts
// parameters on the host: each cast is a kernel launch plus host time, and a
// model cast whole to bf16 has seven of them a training step. p == nullptr
// reads as the vector's neutral value (1 for multipliers, 0 for offsets): a layer
// without a scale passes none. `broadcast`: one value for every column, as `h * scale`
// broadcasts a 0-dim scale (the FP8 ops' alpha beside a layer without a scale).
struct ColVec {
  void const* p = nullptr;
  DType dt = DType::f32;
  bool broadcast = false;
};

// The eval fold's inputs: the layer's scale, BatchNorm weight and bias, running stats and eps,
// over its n columns (eval_fold.cuh). n == 0: no fold (the eval kernels' vectors are read as
// given, the fold kernel's or none).
struct EvalFold {
  ColVec scale, weight, bias, mean, var;
  double eps = 0;
  int n = 0;
};

// What a row of codegen/kernels.py is, as the X-macro of generated/kernels.inc spells it
// (so the enumerators are the generator's words).
enum class Family { sm90, sm80 };
// The GEMM's math: tf32 is fp32 data with TF32 math; f32x3 is fp32 without TF32 (3xTF32); e4m3
// is FP8 operands with promoted fp32 accumulation, e4m3_fast the same operands accumulated in the
// tensor cores alone (Float8Recipe(fast_accum=True)).
enum class KernelDtype { bf16, f16, tf32, f32x3, e4m3, e4m3_fast };

constexpr bool is_e4m3(KernelDtype d) { return d == KernelDtype::e4m3 || d == KernelDtype::e4m3_fast; }
// eval: out = ((x W^T) + b) * a + c. stats: the operands swapped (W x^T, i.e. h row-major),
// plus per-CTA sums of h and h^2 for the training tail. grad: the next Linear's dX GEMM, swapped,
// with the BN backward's per-CTA sums (gemm_evt.h).
enum class Mode { eval, stats, grad };
// Where a kernel leaves its column statistics: stats kernels fp32 ("partial") or fp64
// ("partial64") per-CTA sums; eval kernels none.
enum class Stats { none, partial, partial64 };

// The training forward's kernel after the GEMM (batch_norm.h, batch_norm_train):
// - cooperative: column sums, one grid-wide barrier, then normalization. Any shape.
// - slab: a block holds all rows of its columns in shared memory; one read of h.
// - small: a block holds its columns' rows in registers (16-bit h, few rows).
// automatic: the plan picks by shape; the others are overrides (tests compare their bits).
enum class Tail { automatic, cooperative, slab, small };

// The BatchNorm backward's kernels: two passes (sums, then dh), the slab kernel, or one
// cooperative kernel; automatic as for Tail.
enum class BackwardKernels { automatic, passes, slab, cooperative };

// The activation applied to the BatchNorm's output (as torch.relu, F.leaky_relu, F.gelu with
// approximate='none' or 'tanh', F.silu compute it), before y's one rounding; the backward
// recomputes its derivative from h and the saved statistics.
enum class Activation { none, relu, leaky_relu, gelu, gelu_tanh, silu };

// The BatchNorm backward's kernels by activation set (bn_backward.cu's reason): none; relu and
// leaky_relu, whose derivative is a select; or gelu, gelu_tanh and silu. The plan reads it too:
// the sets' kernels differ in registers, so in which shapes they win.
enum class ActSet { none, select, smooth };

constexpr ActSet act_set(Activation a) {
  return a == Activation::none ? ActSet::none
         : a == Activation::relu || a == Activation::leaky_relu ? ActSet::select
                                                                : ActSet::smooth;
}

char const* to_string(Family f);
char const* to_string(KernelDtype d);
char const* to_string(Mode m);
char const* to_string(Tail t);
char const* to_string(BackwardKernels b);
char const* to_string(Activation a);

}  // namespace cutlass_fused
