// The fused GEMM's torch-free interface: raw pointers, sizes and a stream.
//
//   out = act(((x @ w^T) + b) * a + c)     per-column b (input dtype), a, c (fp32); null b, c read 0, null a 1
//   f16 eval kernels: out = act(f16(f16((x @ w^T) + b) * s) * a + c), with s (fp32) null read as 1:
//   h and z = h * scale round (and overflow) as the unfused model's do
//   stats kernels swap the operands (x is the weight, w the input: out is
//   W x^T, column-major, i.e. h row-major with ldo its row stride) and leave
//   per-CTA sums of u = h - shift and u^2 per feature in u_sum / u_sumsq
//   (fp32; fp64 for f32x3, see KernelInfo::stats). shift is always null (0): the node stays in
//   the kernels' epilogue so that their code is unchanged.
//   grad kernels (the next Linear's dX GEMM, swapped: x is that Linear's weight W2 (k x n,
//   column-major A: ldx its row stride), w its output gradient dz (m x k), out g = dy times the
//   activation's derivative, column-major as h) read h (r, ldr) and leave per-CTA sums of g and
//   g (h - shift) in u_sum / u_sumsq (codegen/epilogues.py, grad_sums).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/table.h"

namespace cutlass_fused {

struct GemmEvtArgs {
  int m = 0, n = 0, k = 0;
  void const* x = nullptr;  int64_t ldx = 0;  // M x K, row-major
  void const* w = nullptr;  int64_t ldw = 0;  // N x K, row-major (nn.Linear weight)
  void const* x_rest = nullptr;               // sm90 f32x3 stats kernels: x and w (there the weight and x) unsplit,
  void const* w_rest = nullptr;               //   these their remainders (ldx, ldw too), k_x and k_w their K; k is
  int k_x = 0, k_w = 0;                       //   3 S, S their K padded to the K tile (remainder_mainloop.h)
  void const* b = nullptr;                    // N, in the input dtype (fp32 for tf32/f32x3), or nullptr for zero
  float const* a = nullptr;                   // N, or nullptr for one
  float const* c = nullptr;                   // N, or nullptr for zero
  float const* s = nullptr;                   // f16 eval kernels: N, or nullptr for one (see below)
  EvalFold fold;                              // sm90 eval kernels, fold.n > 0: a, c and s made in the
                                              //   epilogue from these (sm90_fold.cuh), the three above unread
  Activation act = Activation::none;          // eval kernels: y = act(...) before y's rounding
  float slope = 0.f;                          //   leaky_relu's negative slope
  void* out = nullptr;      int64_t ldo = 0;  // M x N, row-major
  void const* r = nullptr;  int64_t ldr = 0;  // M x N, row-major, in out's dtype: a tree that reads a tensor of
                                              //   y's shape (docs/epilogues.md's residual); no kernel row does
  float const* shift = nullptr;               // stats kernels: per feature, or nullptr for zero; grad: mean_h
  float const* mul = nullptr;                 // grad kernels: per feature, scale * invstd * gamma (fp32)
  float const* beta = nullptr;                //   and the BN bias, as the forward's BN(z) takes them
  void* u_sum = nullptr;                      // stats kernels: (ceil(batch / tile_n), round_up(features, tile_m)),
  void* u_sumsq = nullptr;                    // fp32 ("partial") or fp64 ("partial64", f32x3)
  void* workspace = nullptr;                  // workspace_size() bytes, 16-byte aligned
  // sm90 tile order (the persistent scheduler's launch arguments; sm80 ignores them):
  // tiles are grouped `swizzle` (1, 2, 4 or 8) wide across the raster direction,
  // which CUTLASS picks (raster 0), or is along M (1) or along N (2).
  int swizzle = 1;
  int raster = 0;
  int device = 0;                             // the device the pointers live on
  int sm_count = 0;
};

// One compiled kernel. run() throws std::runtime_error with CUTLASS's or
// CUDA's words on any failure; it never synchronizes the stream.
struct KernelEntry {
  size_t (*workspace_size)(GemmEvtArgs const&);
  void (*run)(GemmEvtArgs const&, cudaStream_t);
};

// x, w and out rows (and their base pointers) must be 16-byte aligned.
constexpr int kAlignBytes = 16;

}  // namespace cutlass_fused
