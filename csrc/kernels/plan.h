// The plan: the one place that decides, for a problem, which kernels run and how. Torch-free
// and CUDA-free, so that a CPU unit test can ask it about any problem on any GPU
// (torch.ops.cutlass_fused.plan; tests/test_plan.py). The binding (csrc/ops_cuda.cpp) only
// checks arguments, makes pointers, allocates one workspace and runs what the plan says.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/table.h"
#include "kernels/types.h"

namespace cutlass_fused {

// What one call computes:
//   train    y = BN((x W^T + b) * scale), its statistics and the running stats (the training op);
//   linear   h = x W^T + b and its exact column sums (linear_stats, the split ops for SyncBN);
//   eval     y = the eval fold applied in the GEMM's epilogue;
//   matmul   a @ b for the backward's dX and dW (m x k by k x n);
//   backward dh, dscale, dweight, dbias from dy and h (m x n);
//   backward_linear  the same for a layer whose y is the input of a Linear (k outputs), from that
//            Linear's output gradient dz (m x k) and weight (k x n): its dX GEMM dy = dz W with
//            this layer's sums in the epilogue (grad kernels), then dh in one pass; where no grad
//            kernel takes the problem, torch.mm and the backward op.
enum class Op { train, linear, eval, matmul, backward, backward_linear };

// Overrides of the plan's choices, for tests and python -m cutlass_fused.tune. Parsed once
// (parse_overrides), from the environment at import or from cutlass_fused.overrides().
struct Overrides {
  KernelInfo const* kernel = nullptr;  // taken wherever it serves the GEMM (family, math, mode)
  Tail tail = Tail::automatic;
  BackwardKernels backward = BackwardKernels::automatic;
  int swizzle = 0;                     // 1, 2, 4 or 8; 0: the plan's
  int raster = 0;                      // 1 along M, 2 along N; 0: CUTLASS's heuristic
  bool stats_gemm = true;              // false: training takes the eval GEMM and the tail's exact sums
};

// Throws std::invalid_argument naming the option and listing its valid values. Empty strings
// and "auto" mean the plan's own choice.
Overrides parse_overrides(std::string const& kernel, std::string const& tail, std::string const& backward,
                          int64_t swizzle, std::string const& raster, bool stats_gemm);

// The overrides in force, process-wide: set by cutlass_fused.overrides() (and from the environment
// once, at import), read by every CUDA call, the autograd engine's threads too (under a lock).
Overrides current_overrides();
void set_current_overrides(Overrides const& o);

// The Op called `name` ("train", "linear", "eval", "matmul", "backward"); throws
// std::invalid_argument listing them.
Op parse_op(std::string const& name);
// The ops' `activation` argument ("none", "relu", "leaky_relu", "gelu", "gelu_tanh", "silu");
// std::invalid_argument naming the valid ones otherwise.
Activation parse_activation(std::string const& name);

struct Problem {
  Op op = Op::train;
  int64_t m = 0, n = 0, k = 0;     // batch rows, features (out_features), in_features (backward_linear:
                                   // the next Linear's out_features)
  DType x = DType::bf16;           // of x and W (backward: of h)
  // z = h * scale (train, eval) or dy (backward) has a wider dtype than x (or h): a 16-bit layer
  // with an fp32 scale, as under autocast, where PyTorch promotes h * scale.
  bool y_wider = false;
  // train, eval: the dtype the caller asks y in (the ops' output_dtype, else z's); y_other: a
  // floating dtype no kernel writes (float64), which the binding casts to after them.
  DType y = DType::bf16;
  bool y_other = false;
  bool allow_tf32 = false;         // fp32 may use TF32 tensor cores (as torch.mm would)
  std::string family = "auto";     // "auto", "sm90" or "sm80"
  int capability = 90;             // the GPU's compute capability, major * 10 + minor
  int sm_count = 132;
  bool cumulative = false;         // momentum=None
  Activation act = Activation::none;  // backward: the activation whose derivative it folds in
  bool fp8 = false;  // train, eval: x and W in e4m3 (issue 33); h, y and the BN part in `x` (bf16)
  bool fast_accum = false;  // fp8: the e4m3_fast rows (tensor-core accumulation alone)
  // The call's data (train: h and y; backward: dy, h and dh) has 16-byte aligned base pointers and
  // row strides, as fresh allocations have; the binding says so from its tensors. Whether n allows
  // 16-byte groups too is the plan's (groups16 in plan.cpp).
  bool aligned = true;
  // eval: frozen_weights() keeps this call's eval fold between calls (the binding's fact from its
  // tensors and the capture state: derived_cache.h's keeps()).
  bool fold_kept = false;
  // For messages only ("cuda:0 (NVIDIA H100 80GB HBM3)"); -1: "the GPU".
  int device = -1;
  char const* device_name = "";
  Overrides overrides;
};

// Where a statistics GEMM leaves its per-CTA sums: `tiles` rows, one a batch tile, of `ld` values
// (features rounded up to whole tiles: sm90's feature tiles, sm80's batch tiles), `bytes` each
// (4, or 8 for partial64).
struct StatsLayout {
  int tiles = 0;
  int64_t ld = 0;
  int bytes = 0;
};

struct GemmPlan {
  KernelInfo const* kernel = nullptr;  // nullptr: torch's own mm (matmul, backward_linear) or none (backward)
  int64_t kn = 0;                      // the kernel's columns: features padded to 16 bytes
  bool swapped = false;                // an sm90 stats (grad) kernel: W (W2^T) is its A operand, h^T (g^T) its
                                       // column-major D
  bool split = false;                  // operands split for 3xTF32 through the TF32 kernel (sm90)
  bool remainder = false;              // split, the statistics kernel's: x and W each as itself and its
                                       // remainder, segments of tile_k multiples (remainder_mainloop.h)
  bool inf_fix = false;                // 3xTF32 on sm80, or with remainder: rewrite the outputs infinite rows reach
  int swizzle = 1, raster = 0;         // the sm90 persistent scheduler's tile order
  StatsLayout sums;                    // stats kernels
};

struct Plan {
  Family family = Family::sm90;
  KernelDtype math = KernelDtype::bf16;
  GemmPlan gemm;
  // eval of a 16-bit x with a wider y (autocast, y not asked in x's dtype): h from the GEMM, then
  // y = h * a + c in fp32, as the unfused model stores h in x's dtype and forms z and y in fp32.
  bool eval_in_fp32 = false;
  Tail tail = Tail::automatic;         // train
  BackwardKernels backward = BackwardKernels::automatic;
  int pieces = 0;                      // of a slab kernel's rows (tail or backward)
  // The eval fold's rows for the fp16 eval kernels, which round z = h * scale themselves:
  // (w * invstd, c, scale) instead of (scale * w * invstd, c).
  bool fold_scale_apart = false;
  // sm90 eval: the epilogue makes the fold itself, a CTA once a tile (gemm/sm90_fold.cuh), where
  // the fold kernel's launch would cost more (plan.cpp) and no kept fold saves it; else the fold
  // kernel runs before the GEMM.
  bool fold_in_epilogue = false;
  // train: the kernels write y in z's dtype and the binding casts it to the one asked, which they
  // do not write (they write x's dtype or fp32).
  bool y_cast = false;
  // eval: the epilogue writes y in x's dtype (from its fp32 value), else in z's; an fp16 x with an
  // fp32 z is not x's route: its fold rounds z to fp16 (fold_scale_apart), which an fp32 z never is.
  bool y_in_x = false;
  // eval: the epilogue applies the activation before y's one rounding, except where sm80's 3xTF32
  // infinity fix rewrites outputs after it (inf_fix.h: it knows no activation), when the binding
  // applies it to y as the unfused model does.
  bool act_in_epilogue = true;
  // Bytes of the one workspace: the GEMM's per-CTA sums (at 0), then the BatchNorm kernels'
  // scratch (at bn_offset). The CUTLASS kernel's own workspace is added by the caller.
  size_t bn_offset = 0;
  size_t workspace = 0;
};

// Throws std::runtime_error where the problem cannot run (an unknown family or one the GPU
// lacks, an override that cannot take the problem).
Plan make_plan(Problem const& p);

// "key=value" lines: what make_plan chose, for tests and users.
std::string describe(Plan const& plan);

// The family for `requested` on a GPU of compute capability `capability`; throws as make_plan.
// device_index and device_name name the GPU in the messages (-1: "the GPU").
Family resolve_family(std::string const& requested, int capability, int device_index = -1,
                      char const* device_name = "");
// Throws std::runtime_error unless `family` is "auto", "sm90" or "sm80".
void check_family_name(std::string const& family);

// Whether the e4m3 route (FP8 operands: the training and eval ops' e4m3 GEMMs) runs for `family`
// on a GPU of compute capability `capability`, the operands rounding from `operands` (the dtype
// x and W reach the GEMM in, after autocast): bf16 operands, the sm90 family, and an sm90 e4m3
// row this build has. The layer asks this before it takes the route (cutlass_fused/fp8.py,
// e4m3_kernels), and runs the FP8 rounding emulated on the 16-bit kernels where it is false.
bool e4m3_runs(std::string const& family, int capability, DType operands);

// Whether batch_norm_backward_linear can run its grad GEMM (the sums in the dX GEMM's epilogue) for
// `family` on a GPU of compute capability `capability`, h in `dtype`, the layer's activation `act`:
// grad_gemm's conditions that hold for every shape (16 bits, the sm90 family, a select activation,
// the statistics GEMMs not overridden off) and a grad row this build has. Elsewhere its route is
// torch.mm and the backward op, the unlinked route's, and the layer does not link
// (cutlass_fused/functional.py, links).
bool grad_runs(std::string const& family, int capability, DType dtype, Activation act);

}  // namespace cutlass_fused
