// The fused GEMM's torch-free interface: raw pointers, sizes and a stream.
//
//   out = ((x @ w^T) + b) * a + c          per-column b (input dtype), a, c (fp32); null b, c read 0, null a 1
//   f16 eval kernels: out = f16(f16((x @ w^T) + b) * s) * a + c, with s (fp32) null read as 1:
//   h and z = h * scale round (and overflow) as the unfused model's do
//   train kernels also add each column's sum and sum of squares of `out`
//   (before rounding to the output dtype) into col_sum / col_sumsq, in fp64.
//   stats kernels swap the operands (x is the weight, w the input: out is
//   W x^T, column-major, i.e. h row-major with ldo its row stride) and leave
//   per-CTA sums of u = h - shift and u^2 per feature in u_sum / u_sumsq
//   (fp32; fp64 for f32x3, see KernelInfo::stats).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "generated/kernels.inc"

namespace cutlass_fused {

struct GemmEvtArgs {
  int m = 0, n = 0, k = 0;
  void const* x = nullptr;  int64_t ldx = 0;  // M x K, row-major
  void const* w = nullptr;  int64_t ldw = 0;  // N x K, row-major (nn.Linear weight)
  void const* b = nullptr;                    // N, in the input dtype (fp32 for tf32/f32x3), or nullptr for zero
  float const* a = nullptr;                   // N, or nullptr for one
  float const* c = nullptr;                   // N, or nullptr for zero
  float const* s = nullptr;                   // f16 eval kernels: N, or nullptr for one (see below)
  void* out = nullptr;      int64_t ldo = 0;  // M x N, row-major
  double* col_sum = nullptr;                  // train kernels only; see KernelInfo::stats
  double* col_sumsq = nullptr;
  float const* shift = nullptr;               // stats kernels: per feature, or nullptr for zero
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

// What a row of codegen/kernels.py is, as the X-macro of generated/kernels.inc
// spells it (so the enumerators are the generator's words).
enum class Family { sm90, sm80 };
// The GEMM's math: tf32 is fp32 data with TF32 math; f32x3 is fp32 without TF32 (3xTF32).
enum class KernelDtype { bf16, f16, tf32, f32x3 };
enum class Mode { train, eval, stats };
// Where a kernel leaves its column statistics:
//   train: partial (col_sum/col_sumsq are ceil(m/tile_m) x round_up(n, tile_n) fp64 partials)
//          or atomic (fp64 n-vectors);
//   stats: partial (fp32 u_sum/u_sumsq) or partial64 (fp64);
//   eval:  none.
enum class Stats { none, partial, partial64, atomic };

char const* to_string(Family f);
char const* to_string(KernelDtype d);
char const* to_string(Mode m);

enum class KernelId {
#define CUTLASS_FUSED_ID(name, ...) name,
  CUTLASS_FUSED_KERNELS(CUTLASS_FUSED_ID)
#undef CUTLASS_FUSED_ID
};

struct KernelInfo {
  KernelId id;
  char const* name;
  Family family;
  KernelDtype dtype;
  Mode mode;
  Stats stats;
  int tile_m, tile_n, tile_k;
  KernelEntry const& (*entry)();
};

template <KernelId id>
KernelEntry const& kernel_entry();

// The kernels this build contains (a family is left out when its archs were not built).
KernelInfo const* kernels_begin();
KernelInfo const* kernels_end();

// The built kernel for (family, dtype, mode) and an m x n x k problem on a GPU
// with sm_count SMs, or nullptr (see registry.cpp for the rule).
KernelInfo const* find_kernel(Family family, KernelDtype dtype, Mode mode, int m, int n, int k, int sm_count);

// The tiles (CTAs, before any persistent scheduling) of an m x n problem.
int64_t cta_count(KernelInfo const& info, int64_t m, int64_t n);

// Where a stats kernel (Mode::stats) leaves u_sum and u_sumsq for a problem of
// `features` x `batch` (its m x n): `tiles` rows, one per batch tile, of `ld`
// values (features rounded up to whole tiles), `bytes` each (4, or 8 for partial64).
struct StatsLayout {
  int tiles;
  int64_t ld;
  int bytes;
};
StatsLayout stats_layout(KernelInfo const& info, int64_t features, int64_t batch);

// Sets p.swizzle and p.raster for `info` on p's problem (see registry.cpp).
void choose_tile_order(KernelInfo const& info, GemmEvtArgs& p);

// x, w and out rows (and their base pointers) must be 16-byte aligned.
constexpr int kAlignBytes = 16;

}  // namespace cutlass_fused
