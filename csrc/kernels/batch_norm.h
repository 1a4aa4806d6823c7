// BatchNorm kernels around the fused GEMM; torch-free: raw pointers, sizes, a stream.
//
// The GEMM leaves h = x W^T + b; the layer normalizes z = h * scale. Statistics
// travel as fp64 column sums of h: stats[0:n] = sum h, stats[n:2n] = sum h^2,
// from which mean(z) = scale mean(h) and var(z) = scale^2 var(h), with no
// division by scale.
// Sums (not mean/M2) keep the cross-rank reduction of SyncBatchNorm a plain
// all-reduce between statistics and finalize; fp64 keeps them exact enough
// that sum/sum-of-squares does not cancel (see README, "Statistics").
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/types.h"

namespace cutlass_fused {

// A per-column vector written in its own dtype (ColVec, types.h, the read one).
struct ColOut {
  void* p = nullptr;
  DType dt = DType::f32;
};

// stats[c] = sum_r partials[r * ld + c], in a fixed order, for both halves:
// partials holds `rows` rows of sums then `rows` rows of sums of squares (or, in the backward,
// of sums of g h, which `center` (mean_h) turns into sums of g (h - mean_h); see centered).
void reduce_partials(double const* partial_sum, double const* partial_sumsq, int rows, int64_t ld, int n,
                     double* stats, cudaStream_t stream, double const* center = nullptr);

// Deterministic column sums of h (m x n, row stride ldz) into stats, through
// `workspace` (limits::column_stats_workspace(m, n) bytes, kernels/limits.h).
void column_stats(DType dt, void const* z, int m, int n, int64_t ldz, double* stats, void* workspace,
                  cudaStream_t stream);

struct FinalizeArgs {
  DType dt;                       // of h
  DType dt_y;                     // of y: dt, or f32 (PyTorch promotes bf16/f16 h times an fp32 scale to fp32)
  void const* h;  int64_t ldh;    // m x n
  void* y;                        // m x n, contiguous
  int m, n;
  double const* stats;            // 2 x n, sums of h
  ColVec scale;
  double count;                   // rows behind stats (all ranks' for SyncBN)
  ColVec weight;                  // or none (1)
  ColVec bias;                    // or none (0)
  double eps;
  // fp64: at small batches the backward's h - mean_h cancels, and an fp32
  // mean_h alone costs more than PyTorch's whole error (batch 2, fp32).
  double* save_mean;              // n: mean(h)
  double* save_invstd;            // n: 1 / sqrt(var(z) + eps)
  // Whether the unfused model rounds z = h * scale to h's dtype (a 16-bit scale): only then
  // can an fp16 z overflow (SumSquares). y's dtype alone does not say: output_dtype may
  // narrow an fp32 z's y.
  bool z_rounded = false;
  Activation act = Activation::none;  // applied to BN(z) before y's rounding
  float slope = 0.01f;            // leaky_relu's negative slope
};

// mean/invstd from stats and y = (h - mean(h)) * (scale * invstd * w) + b = BN(z).
void finalize_normalize(FinalizeArgs const& a, cudaStream_t stream);

// The training forward after the GEMM, in one kernel (one launch instead of five: at
// 1024 x 8192 the four small kernels and the nbt add cost more than their work). Three
// kernels, each writing every output with the same bits (kernels/types.h, Tail; the plan picks
// one, kernels/plan.h):
// - cooperative: the column sums of h (per row chunk, in column_stats's order), one grid-wide
//   barrier, then each block takes its columns' statistics from the partials (in
//   reduce_partials's order), normalizes its rows, and, for the first row chunk, writes stats,
//   the saved mean/invstd and the running stats. Any shape.
// - slab: a block holds all m rows of its columns in shared memory; no barrier, one read of h.
//   16-byte aligned columns, momentum given, m x 32 bytes of a slab in 64 KiB.
// - small: a block holds its columns' rows in registers. 16-bit h, at most 256 rows, momentum
//   given.
// With the statistics GEMM's tile sums, the cooperative and slab kernels take trusted columns'
// statistics from them; the small kernel does not need them.
struct TrainArgs {
  FinalizeArgs norm;              // norm.stats is unused: the sums go to `stats`
  double* stats;                  // 2 x n, out
  ColOut running_mean, running_var;  // p == nullptr: not tracked
  int64_t* num_batches_tracked;   // or nullptr; incremented by one
  double momentum;                // of the running stats, unless cumulative
  bool cumulative;                // momentum = 1 / num_batches_tracked (after its increment)
  void* workspace;                // limits::train_workspace(m, n) bytes
  int sm_count;                   // of the device: the grid must be co-resident
  // Optional: the statistics GEMM's per-CTA sums of h and h^2 (u_sum[t * u_ld + c],
  // t < u_tiles), fp32 or (u_fp64) fp64. Columns whose sums are trustworthy take them;
  // the rest (non-finite, or for fp32 sums a mean so large against the spread that
  // they lost bits) take the exact pass.
  void const* u_sum = nullptr;
  void const* u_sumsq = nullptr;
  bool u_fp64 = false;
  int u_tiles = 0;
  int64_t u_ld = 0;
  Tail tail = Tail::automatic;    // the plan's (never automatic here)
  int pieces = 0;                 // the slab tail's, from the plan
};
void batch_norm_train(TrainArgs const& a, cudaStream_t stream);

// running = (1 - m) running + m batch, for z's mean and unbiased variance;
// m = 1 / *num_batches_tracked when that is given (PyTorch's momentum=None).
void update_running_stats(int n, double const* stats, ColVec scale, double count, ColOut running_mean,
                          ColOut running_var, int64_t const* num_batches_tracked, double momentum,
                          cudaStream_t stream);

struct BackwardArgs {
  DType dt;                       // of h and dh
  DType dt_dy;                    // of dy: dt, or f32 (y's dtype, see FinalizeArgs::dt_y)
  void const* dy;                 // m x n, contiguous
  void const* h;  int64_t ldh;    // m x n
  void* dh;                       // m x n, contiguous
  int m, n;
  double const* mean_h;           // n, from the forward
  double const* invstd;           // n, from the forward
  ColVec scale;
  ColVec weight;                  // or none (1)
  double eps;
  ColOut dscale, dweight, dbias;  // n each; dscale none where there is no per-column scale
  ColOut dlinear_bias;            // n, or none: 0 x dscale as stored (0, or NaN where it is not finite)
  // With an activation, dy is the gradient of act(BN(z)): the kernels recompute BN(z) from h,
  // the saved statistics and the BN bias, as the forward computed it, for act's derivative.
  ColVec bias;                    // the BN bias, or none (0)
  Activation act = Activation::none;
  float slope = 0.01f;
  void* workspace;                // limits::backward_workspace(m, n) bytes
  int sm_count = 0;               // of the device (the slab kernel's grid should fill it, the
                                  // cooperative kernel's must be co-resident; limits::grad_rows)
};

// The training-mode backward of y = BN(h * scale) over the batch: one pass
// reduces sum dy and sum dy h per column (fp64, fixed order; then centered: sum dy (h - mean_h)), then
// one pass writes dh = A dy + B (h - mean_h) + C; dscale, dweight and dbias
// follow from the sums. Nothing divides by scale or weight. fp32 data is
// evaluated in fp64 and rounded once; bf16/f16 in fp32, far below their rounding.
// 16-bit batches of 129-512 rows with dy in h's dtype take one kernel whose blocks hold
// every row of their columns (the slab kernel, see Tail), somewhat larger ones (one block an
// item) one cooperative kernel (both passes with a grid barrier between them): the same sums,
// the same bits.
// `kernels` and the slab kernel's `pieces` are the plan's (kernels/plan.h). (They are not fields of
// BackwardArgs, which the kernels take by value: a larger struct moves their other parameters.)
void batch_norm_backward(BackwardArgs const& a, BackwardKernels kernels, int pieces, cudaStream_t stream);

// SyncBatchNorm's backward, its two passes apart so that the group can all-reduce the sums
// between them. reduce: this rank's fp64 sums (2 x n: sum g, sum g (h - mean_h), g = dy times the
// activation's derivative) into `sums`; a.workspace: limits::column_stats_workspace(m, n) bytes.
// elemt: dh from the group's sums over the group's batch, *count rows (on the device, so that
// no host sync reads it); dscale, dweight and dbias are untouched (they are this rank's, from its
// own sums).
void batch_norm_backward_reduce(BackwardArgs const& a, double* sums, cudaStream_t stream);
void batch_norm_backward_elemt(BackwardArgs const& a, double const* sums, double const* count, cudaStream_t stream);

// The backward of a layer whose y is the input of a Linear, after that Linear's dX GEMM with this
// layer's sums in its epilogue (gemm_evt.h, grad kernels; the plan's Op::backward_linear):
// grad_gemm_columns: the GEMM's fp32 vectors of the forward's BN(z) (forward_column's constants:
//   mean_h, scale * invstd * weight, bias), n each;
// batch_norm_backward_partials: the GEMM's per-CTA sums of g and g (h - shift), `tiles` rows of `ld`
//   floats, added up in tile order into `sums` (2 x n fp64, as batch_norm_backward_reduce leaves
//   them), then the one pass: dh, dscale, dweight, dbias (and dlinear_bias) from g, which a.dy
//   points to (the activation's derivative already applied), and h.
struct GradPartials {
  float const* g = nullptr;
  float const* gu = nullptr;
  int tiles = 0;
  int64_t ld = 0;
  float const* shift = nullptr;   // the GEMM's mean_h, as it centered g (h - shift)
};
void grad_gemm_columns(BackwardArgs const& a, float* shift, float* mul, float* beta, cudaStream_t stream);
void batch_norm_backward_partials(BackwardArgs const& a, GradPartials const& p, double* sums, cudaStream_t stream);

// SyncBatchNorm's column arithmetic between the collectives, a thread a column (sync_stats.h has
// the formulas and what each array holds): this rank's [count, mean, M2] row (2n + 1); the
// merge of `world` such rows into finalize's sums, update_running_stats' sums (2 x n each) and
// the group's count (one element); and this rank's four parameter gradients (4 x n).
void sync_row(int64_t n, double const* stats, double count, double* row, cudaStream_t stream);
void sync_merge(int64_t n, int world, double const* rows, double* stats, double* running, double* count,
                cudaStream_t stream);
void sync_grads(int64_t n, double const* local, double const* sums, double const* row, double const* count,
                double const* mean_h, double const* invstd, ColVec scale, ColVec weight, double* out,
                cudaStream_t stream);

// Eval-mode folding (eval_fold.cuh's fold_value, column by column): out_a = scale * w * invstd,
// out_c = b - running_mean * w * invstd, with invstd = 1 / sqrt(running_var + eps), into fp32
// vectors for the EVT; zero in columns f.n .. kn, the padding the GEMM computes. With out_s (the
// fp16 eval kernels, which round z = h * scale themselves), out_s = scale and out_a = w * invstd.
// The sm90 eval kernels make the same values in their epilogue (gemm/sm90_fold.cuh).
void fold_eval(EvalFold const& f, int kn, float* out_a, float* out_c, float* out_s, cudaStream_t stream);

}  // namespace cutlass_fused
