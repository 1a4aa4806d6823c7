// The table of compiled kernels. A family's rows exist only when CMake built
// it (CUTLASS_FUSED_WITH_SM90 / _SM80), so lookups never reach a missing symbol.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/gemm_evt.h"

namespace cutlass_fused {
namespace {

#if defined(CUTLASS_FUSED_WITH_SM90)
#define CUTLASS_FUSED_IF_sm90(...) __VA_ARGS__
#else
#define CUTLASS_FUSED_IF_sm90(...)
#endif
#if defined(CUTLASS_FUSED_WITH_SM80)
#define CUTLASS_FUSED_IF_sm80(...) __VA_ARGS__
#else
#define CUTLASS_FUSED_IF_sm80(...)
#endif

#define CUTLASS_FUSED_ROW(name, family, dtype, mode, stats, tm, tn, tk) \
  CUTLASS_FUSED_IF_##family(                                             \
      {KernelId::name, #name, Family::family, KernelDtype::dtype, Mode::mode, Stats::stats, tm, tn, tk, \
       &kernel_entry<KernelId::name>},)

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

KernelInfo const kTable[] = {
    CUTLASS_FUSED_KERNELS(CUTLASS_FUSED_ROW)
    {KernelId{}, nullptr, Family{}, KernelDtype{}, Mode{}, Stats{}, 0, 0, 0, nullptr},  // keeps the array non-empty
};

}  // namespace

char const* to_string(Family f) { return f == Family::sm90 ? "sm90" : "sm80"; }

char const* to_string(KernelDtype d) {
  switch (d) {
    case KernelDtype::bf16: return "bf16";
    case KernelDtype::f16: return "f16";
    case KernelDtype::tf32: return "tf32";
    case KernelDtype::f32x3: return "f32x3";
  }
  return "?";
}

char const* to_string(Mode m) {
  switch (m) {
    case Mode::train: return "train";
    case Mode::eval: return "eval";
    case Mode::stats: return "stats";
  }
  return "?";
}

KernelInfo const* kernels_begin() { return kTable; }
KernelInfo const* kernels_end() { return kTable + sizeof(kTable) / sizeof(kTable[0]) - 1; }

namespace {

// Kernels measured faster than find_kernel's rule on one GEMM problem (stats kernels: m features,
// n batch rows; eval kernels the reverse), with python -m cutlass_fused.tune --rounds 3 on an
// H100 (benchmarks/NOTES.md v0.19, v0.20).
struct TunedKernel {
  KernelId kernel;
  int m, n, k;
};
constexpr TunedKernel kTunedKernels[] = {
    // The 1024 x 8192^2 training forward without the cluster, train x torch.mm, c2x1 -> c1x1:
    // bf16 1.099 -> 1.079; fp16 1.113 -> 1.067 (and 1.113 -> 1.088 in an earlier run). It lost
    // at 16384 x 4096^2 and 4096^3 in both dtypes (1-3%) and was mixed at 2048 x 8192^2.
    {KernelId::sm90_bf16_stats_128x256x64_c1x1x1, 8192, 1024, 8192},
    {KernelId::sm90_f16_stats_128x256x64_c1x1x1, 8192, 1024, 8192},
    // bf16 eval at 256 x 8192^2 with the CTA pair along the batch, eval x torch.mm c1x2 -> c2x1:
    // 1.080 -> 1.043.
    {KernelId::sm90_bf16_eval_128x128x64_c2x1x1, 256, 8192, 8192},
};

}  // namespace

// The kernel for (family, dtype, mode) and an m x n x k problem: a row kTunedKernels names for
// it, else the first such row of the table, the default; when its tiles would give fewer CTAs
// than half the SMs (a small batch), the row with the largest tile that reaches that many is
// taken instead, or, if none does, the one with the most CTAs. $CUTLASS_FUSED_KERNEL names a
// row to take instead (python -m cutlass_fused.tune measures each candidate that way; read on
// every call).
KernelInfo const* find_kernel(Family family, KernelDtype dtype, Mode mode, int m, int n, int k, int sm_count) {
  char const* forced = std::getenv("CUTLASS_FUSED_KERNEL");
  auto serves = [&](KernelInfo const* row) {
    return row->family == family && row->dtype == dtype && row->mode == mode;
  };
  for (auto const* row = kernels_begin(); forced != nullptr && row != kernels_end(); ++row) {
    if (serves(row) && !std::strcmp(row->name, forced)) return row;
  }
  for (auto const& t : kTunedKernels) {
    if (t.m != m || t.n != n || t.k != k) continue;
    for (auto const* row = kernels_begin(); row != kernels_end(); ++row) {
      if (row->id == t.kernel && serves(row)) return row;
    }
  }
  auto ctas = [&](KernelInfo const* row) { return cta_count(*row, m, n); };
  int64_t enough = std::max(1, sm_count / 2);
  KernelInfo const* first = nullptr;
  KernelInfo const* best = nullptr;
  for (auto const* row = kernels_begin(); row != kernels_end(); ++row) {
    if (!serves(row)) continue;
    if (first == nullptr) first = best = row;
    bool fills = ctas(row) >= enough, best_fills = ctas(best) >= enough;
    int64_t area = int64_t{row->tile_m} * row->tile_n, best_area = int64_t{best->tile_m} * best->tile_n;
    if (fills ? (!best_fills || area > best_area) : (!best_fills && ctas(row) > ctas(best))) best = row;
  }
  if (first != nullptr && ctas(first) >= enough) return first;
  return best;
}

int64_t cta_count(KernelInfo const& info, int64_t m, int64_t n) {
  return ceil_div(m, info.tile_m) * ceil_div(n, info.tile_n);
}

StatsLayout stats_layout(KernelInfo const& info, int64_t features, int64_t batch) {
  return {static_cast<int>(ceil_div(batch, info.tile_n)), ceil_div(features, info.tile_m) * info.tile_m,
          info.stats == Stats::partial64 ? 8 : 4};
}

namespace {

// Operand rows (of A and B together) that one wave of `ctas` CTAs reads, when
// tiles are visited as CUTLASS's persistent scheduler visits them: along the
// raster direction (CUTLASS's heuristic: along M when there are more N tiles,
// else along N), `swizzle` tiles wide across it. No reuse between waves is
// assumed: it is what a wave costs once neither operand stays in L2.
double wave_rows(int64_t tiles_m, int64_t tiles_n, int tile_m, int tile_n, int swizzle, int ctas) {
  bool along_m = tiles_n > tiles_m;
  double along = along_m ? tiles_m : tiles_n, across_tiles = along_m ? tiles_n : tiles_m;
  double along_rows = along_m ? tile_m : tile_n, across_rows = along_m ? tile_n : tile_m;
  double a, b;
  if (double(ctas) / swizzle >= along) {
    a = along;
    b = std::min(across_tiles, ctas / along);
  } else {
    a = double(ctas) / swizzle;
    b = swizzle;
  }
  return a * along_rows + b * across_rows;
}

// Swizzles measured better than the rule in choose_tile_order, by kernel and
// GEMM problem (stats kernels: m features, n batch rows), with python -m
// cutlass_fused.tune --rounds 3 on an H100 (benchmarks/NOTES.md v0.13).
struct TunedOrder {
  KernelId kernel;
  int m, n, swizzle;
};
constexpr TunedOrder kTunedOrders[] = {
    // KernelBench level 2 problem 39 (16384 x 4096^2, fp32): training forward 0.535 -> 0.494 x
    // torch.mm (tune), GEMM 5070 -> 4755 us (benchmarks/stats_ab.py).
    {KernelId::sm90_f32x3_stats_128x128x32_c1x2x1_p8, 4096, 16384, 8},
    // The same shape with TF32 allowed: 1.105 -> 1.081 x torch.mm (tune, 3 rounds).
    {KernelId::sm90_tf32_stats_128x256x32_c2x1x1, 4096, 16384, 8},
};

// $CUTLASS_FUSED_SWIZZLE and $CUTLASS_FUSED_RASTER, where set, replace the chosen order.
void apply_env(GemmEvtArgs& p) {
  if (char const* s = std::getenv("CUTLASS_FUSED_SWIZZLE"); s != nullptr && *s != '\0') {
    std::string v = s;
    if (v != "1" && v != "2" && v != "4" && v != "8")
      throw std::invalid_argument("cutlass_fused: expected $CUTLASS_FUSED_SWIZZLE to be 1, 2, 4 or 8, but got '" + v +
                                  "'");
    p.swizzle = std::stoi(v);
  }
  if (char const* s = std::getenv("CUTLASS_FUSED_RASTER"); s != nullptr && *s != '\0') {
    std::string v = s;
    if (v != "m" && v != "n")
      throw std::invalid_argument("cutlass_fused: expected $CUTLASS_FUSED_RASTER to be m or n, but got '" + v + "'");
    p.raster = v == "m" ? 1 : 2;
  }
}

}  // namespace

// The sm90 persistent scheduler's tile order. CUTLASS's own (no swizzle)
// sweeps the whole of one operand in every wave; where a wave 8 (or 4, 2)
// tiles wide across the raster reads at most 0.65 of those operand rows, the
// swizzle is taken (bf16, x torch.mm, s1 -> s8: 16384 x 8192^2 statistics GEMM
// 1.148 -> 1.030, eval 1.044 -> 1.002; 8192 x 8192^2 1.099 -> 1.048 and
// 1.021 -> 0.984; at 16384 x 4096^2, where the rows fall to 0.81, level; H100,
// benchmarks/NOTES.md v0.13). kTunedOrders names measured exceptions. The
// swizzle must divide both tile counts twice over (clusters are at most 2
// wide), or CUTLASS pads the grid with empty tiles that still run (1024 x
// 8192^2 f32 stats, swizzle 8: 2.6x slower). $CUTLASS_FUSED_SWIZZLE (1, 2, 4 or
// 8) and $CUTLASS_FUSED_RASTER (m or n) override it; read on every call, so
// that python -m cutlass_fused.tune can measure each order.
void choose_tile_order(KernelInfo const& info, GemmEvtArgs& p) {
  p.swizzle = 1;
  p.raster = 0;
  int64_t tiles_m = ceil_div(p.m, info.tile_m), tiles_n = ceil_div(p.n, info.tile_n);
  if (info.family != Family::sm90) return apply_env(p);
  // The rule is measured on the bf16 kernels, and fp16's move the same bytes through the same
  // mainloop; the f32x3 ones broke it both ways (H100, swizzle 8 against none: the statistics
  // GEMM 16% slower at 8192 x 8192^2 and 8% faster at 16384 x 4096^2; eval 7% faster and 6%
  // slower), so they take the table's entries alone.
  bool sixteen_bit = info.dtype == KernelDtype::bf16 || info.dtype == KernelDtype::f16;
  if (sixteen_bit && p.sm_count > 0) {
    double base = wave_rows(tiles_m, tiles_n, info.tile_m, info.tile_n, 1, p.sm_count), best = base;
    for (int s : {2, 4, 8}) {
      if (tiles_m % (2 * s) != 0 || tiles_n % (2 * s) != 0) continue;
      double rows = wave_rows(tiles_m, tiles_n, info.tile_m, info.tile_n, s, p.sm_count);
      if (rows <= 0.65 * base && rows < best) {
        best = rows;
        p.swizzle = s;
      }
    }
  }
  for (auto const& t : kTunedOrders) {
    if (p.m == t.m && p.n == t.n && info.id == t.kernel) p.swizzle = t.swizzle;
  }
  apply_env(p);
}

}  // namespace cutlass_fused
