// The BatchNorm kernels' shape limits and row chunking: shared by the kernels' launchers
// (bn_*.cu), which rely on them, and the plan (plan.cpp), which picks kernels by them.
// Free of CUDA headers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace cutlass_fused::limits {

constexpr unsigned blocks(int64_t work, int per_block) {
  return static_cast<unsigned>((work + per_block - 1) / per_block);
}

// Whether data of `bytes`-byte elements with row stride ld at these pointers is 16-byte aligned:
// every row start is. The binding tells the plan (Problem::aligned).
inline bool aligned16(int bytes, int64_t ld, std::initializer_list<void const*> ptrs) {
  bool ok = ld % (16 / bytes) == 0;
  for (void const* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  return ok;
}

// Whether a row of n `bytes`-byte elements is a whole number of 16-byte groups (not unaligned
// sizes such as 769 columns).
constexpr bool whole_groups16(int bytes, int64_t n) { return n % (16 / bytes) == 0; }

// A statistics GEMM's per-CTA partials: the row stride, features rounded up to whole tiles of
// `tile` (sm90's feature tile; sm80's batch tile, so that it is tile times the row reduction's M
// stride: gemm/sm80_nodes.cuh). The plan sizes the workspace by it (StatsLayout).
constexpr int64_t partials_ld(int64_t features, int tile) { return (features + tile - 1) / tile * tile; }

// Op::backward_linear's BatchNorm scratch after the grad GEMM's partials: the reduced sums (2 x n
// fp64), then the GEMM's three fp32 column vectors (batch_norm.h, grad_gemm_columns).
constexpr size_t grad_linear_workspace(int64_t n) { return static_cast<size_t>(2 * n * 8 + 3 * n * 4); }

// Whether m x n data of `bytes`-byte elements can be read in 16-byte groups: aligned, and n
// whole groups. The launchers pick their vector width by it; the plan asks the same of its
// problem (groups16 in plan.cpp), whose alignment the binding found with aligned16.
inline bool groups16(int bytes, int64_t n, int64_t ld, std::initializer_list<void const*> ptrs) {
  return whole_groups16(bytes, n) && aligned16(bytes, ld, ptrs);
}

// Column reductions: chunks of rows, 32 column groups x 8 row lanes a block; each lane walks
// its rows of a chunk in order and the lanes are combined in order, then the chunks are added
// in order, so results are bitwise stable. The chunk size depends on m only: at most 32
// chunks, which bounds the fp64 partials at 64 n doubles, of at least 64 rows, or 16 for
// m <= 256, where there are few blocks and each lane's rows are latency.
constexpr int stat_rows(int m) { return std::max(m <= 256 ? 16 : 64, (m + 32 * 8 - 1) / (32 * 8) * 8); }
constexpr int stat_chunks(int m) { return (m + stat_rows(m) - 1) / stat_rows(m); }

// The small tail where it measured faster: 16-bit h, at most 128 rows (8 chunks of 16: 4
// column groups a block, 64 bytes of a row; 2 rows a thread). The cooperative kernel was faster
// at 256 rows (2 groups a block), with TF32 h, and on sm80 at 8 rows a thread
// (docs/decisions.md, "Training tails"). Its row pieces are 32-64 bytes where the cooperative
// kernel's are 512. With 2 rows a thread it holds at most 256 rows (16 a chunk).
constexpr int kSmallRows = 128, kSmallRowsPerThread = 2, kSmallRowsMax = 256;

// Slabs of at most 64 KiB, so that three blocks fit an SM (227 KiB on Hopper, 163 on A100).
constexpr int kSlabBytes = 64 * 1024;

// The slab kernels where they measured faster: 16-bit h, more rows than the small kernel takes
// and at most 512, rows of at least 64 bytes (4 pieces) in a grid that fills the GPU. Not taken,
// slower than the cooperative kernel (or the small one at 128 rows): 32-byte rows (4096 columns),
// 1024 rows (both at the speed of a copy of h), 2048 rows, 128 rows and fp32 h
// (docs/decisions.md, "Training tails").
constexpr int kSlabRows = 512;

// Blocks a multiprocessor the backward's chunks fill in one wave (grad_rows): its column partials
// hold 2 with an activation (relu's 96 registers); more blocks of fewer rows lost without one.
constexpr int kGradBlocksPerSm = 2;

// The backward's chunks (its column sums of g and g h, g the BN output's gradient)
// over `groups` column groups: past the slab kernel's rows, as many as give one wave of
// kGradBlocksPerSm blocks a multiprocessor, where stat_chunks' 32 left each lane 16 rows of a 4096-row batch and
// the grid two waves: the column sums measured faster in fewer chunks at 4096^2, 16384 x 4096 and
// 1024 x 8192, with and without relu, and 2048^2 (8 groups) keeps its 32, faster there than 8
// (docs/decisions.md, "Backward"). Never more chunks than stat_chunks (the
// workspace's bound), and stat_rows up to kSlabRows rows. Every backward kernel sums in these
// chunks, so all share their bits, which follow the SM count past 512 rows: one GPU model's.
constexpr int grad_rows(int m, int groups, int sm_count) {
  if (m <= kSlabRows || sm_count <= 0 || groups <= 0) return stat_rows(m);
  int chunks = std::clamp(kGradBlocksPerSm * sm_count / groups, 1, stat_chunks(m));
  return ((m + chunks - 1) / chunks + 7) / 8 * 8;
}
constexpr int grad_chunks(int m, int groups, int sm_count) {
  return (m + grad_rows(m, groups, sm_count) - 1) / grad_rows(m, groups, sm_count);
}

// Pieces of a slab row: the widest of 8, 4 and 2 (128 to 32 bytes, whole sectors) whose slabs
// (one an input) fit and whose grid of n / (pieces * v) blocks fills every SM (any grid where a
// slab kernel is asked for); 0: none.
constexpr int slab_pieces(int m, int n, int v, int inputs, int sm_count, bool any_grid) {
  for (int p : {8, 4, 2}) {
    bool fits = int64_t{m} * p * 16 * inputs <= kSlabBytes;
    if (fits && (any_grid || static_cast<int64_t>(blocks(n, p * v)) >= sm_count)) return p;
  }
  return 0;
}

// Blocks an SM of the cooperative backward kernel (its __launch_bounds__), with or without an
// activation: the chunks' own wave (kGradBlocksPerSm), so that each block takes one item and
// keeps its first rows in the shared memory two blocks leave (bn_backward.cu). Under three blocks'
// 80 registers the derivative spilled (bf16 relu 10 / 10 STL / LDL, gelu 37 / 65), and so did the
// kernel without an activation once it kept rows (6 / 9, one LDL a row).
constexpr int kCooperativeBackwardBlocksPerSm = kGradBlocksPerSm;

// Workspace bytes: column_stats' fp64 partials; the training tail's partials and one flag byte
// a column (the GEMM-statistics path); the backward's partials and its two fp64 sums a column.
constexpr size_t column_stats_workspace(int m, int n) {
  return 2 * sizeof(double) * static_cast<size_t>(stat_chunks(m)) * n;
}
constexpr size_t train_workspace(int m, int n) { return column_stats_workspace(m, n) + n; }
constexpr size_t backward_workspace(int m, int n) {
  return column_stats_workspace(m, n) + 2 * sizeof(double) * static_cast<size_t>(n);
}

}  // namespace cutlass_fused::limits
