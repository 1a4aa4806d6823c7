// The plan (plan.h): every kernel choice, in one function, make_plan.
#include "kernels/plan.h"

#include <algorithm>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "kernels/limits.h"

namespace cutlass_fused {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

int bytes_of(DType d) { return d == DType::f32 ? 4 : 2; }

// --- options -----------------------------------------------------------------------------

template <class E, size_t N>
E parse_choice(char const* option, std::string const& value, std::pair<char const*, E> const (&choices)[N]) {
  std::string names;
  for (size_t i = 0; i < N; ++i) {
    if (value == choices[i].first) return choices[i].second;
    names += std::string(i == 0 ? "'" : i + 1 == N ? " or '" : ", '") + choices[i].first + "'";
  }
  throw std::invalid_argument(std::string("cutlass_fused: expected ") + option + " to be " + names + ", but got '" +
                              value + "'");
}

// --- the GEMM ----------------------------------------------------------------------------

int64_t cta_count(KernelInfo const& info, int64_t m, int64_t n) {
  return ceil_div(m, info.tile_m) * ceil_div(n, info.tile_n);
}

// Kernels measured faster than find_kernel's rule on one GEMM problem (stats kernels: m
// features, n batch rows; eval kernels the reverse), with python -m cutlass_fused.tune
// --rounds 3 on an H100 (docs/decisions.md, "Kernel table").
struct TunedKernel {
  KernelId kernel;
  int64_t m, n, k;
};
// Each row measured faster than the rule's kernel at its one problem, and lost elsewhere, so no rule
// (decisions.md, "Tuned exceptions").
constexpr TunedKernel kTunedKernels[] = {
    // The 16-bit training GEMM at 1024 and 512 x 8192^2: no cluster.
    {KernelId::sm90_bf16_stats_128x256x64_c1x1x1, 8192, 1024, 8192},
    {KernelId::sm90_f16_stats_128x256x64_c1x1x1, 8192, 1024, 8192},
    {KernelId::sm90_bf16_stats_128x256x64_c1x1x1, 8192, 512, 8192},
    {KernelId::sm90_f16_stats_128x256x64_c1x1x1, 8192, 512, 8192},
    // bf16 eval at 256 x 8192^2: the CTA pair along the batch (sharing W's tile).
    {KernelId::sm90_bf16_eval_128x128x64_c2x1x1, 256, 8192, 8192},
    // bf16 eval at 512 x 8192^2: no cluster.
    {KernelId::sm90_bf16_eval_128x256x64_c1x1x1, 512, 8192, 8192},
    // 16-bit training GEMMs where the rule's tiles leave a partial last tile or wave (640 rows in
    // 192-row tiles, the last a third full; 192 CTAs of 128x256 at 1024 x 6144^2): 128x128, which
    // slot_use leaves out (at 3072^3 it lost).
    {KernelId::sm90_bf16_stats_128x128x64_c1x1x1, 8192, 640, 8192},
    {KernelId::sm90_bf16_stats_128x128x64_c1x1x1, 6144, 1024, 6144},
    {KernelId::sm90_f16_stats_128x128x64_c1x1x1, 8192, 640, 8192},
    {KernelId::sm90_f16_stats_128x128x64_c1x1x1, 6144, 1024, 6144},
};

// The share of the SMs' tile slots that does useful work: the problem's m x n over the waves of
// tiles the kernel runs (its CTAs over the SMs, rounded up) times a wave's tile area. Padding and a
// partial last wave both lower it: 384 batch rows in 256-row tiles, or 192 tiles on 132 SMs, 0.73.
double slot_use(KernelInfo const& info, int64_t m, int64_t n, int sm_count) {
  int64_t waves = ceil_div(cta_count(info, m, n), sm_count);
  return double(m) * double(n) / (double(waves) * sm_count * info.tile_m * info.tile_n);
}

// The kernel for (family, math, mode) and an m x n x k problem: the override where it serves the
// problem, else a row kTunedKernels names for it, else the table's default row for it
// (is_default) where its tiles give at least half the SMs a CTA; but the row that fills half the SMs
// too and uses the SMs' tile slots (slot_use) best, if 10% better, takes its place. Its tile is at
// least 3/4 of the default's: the 192-wide tiles, where the 256-wide pad or leave a partial wave.
// Where every CTA of the default's pads alike and is at most half padding, 3/4 of its useful area
// a CTA is enough: 128 rows in 256-row tiles take 128x128. Smaller tiles are left out: the slot
// count does not see their lower arithmetic intensity. When the default's tiles give fewer CTAs
// than half the SMs (a small batch), the row with the largest tile that reaches that many is taken
// instead, among those within 10% of the best slot use (so not 128x192 at 256 rows, a third of it
// padding), or, if none reaches it, the one with the most CTAs (decisions.md, "Small batches").
// nullptr: the table has no such row.
KernelInfo const* find_kernel(Family family, KernelDtype math, Mode mode, int64_t m, int64_t n, int64_t k,
                              int sm_count, KernelInfo const* forced) {
  auto serves = [&](KernelInfo const* row) {
    return row->family == family && row->dtype == math && row->mode == mode;
  };
  if (forced != nullptr && serves(forced)) return forced;
  for (auto const& t : kTunedKernels) {
    if (t.m != m || t.n != n || t.k != k) continue;
    for (auto const* row = kernels_begin(); row != kernels_end(); ++row) {
      if (row->id == t.kernel && serves(row)) return row;
    }
  }
  auto ctas = [&](KernelInfo const* row) { return cta_count(*row, m, n); };
  auto use = [&](KernelInfo const* row) { return slot_use(*row, m, n, sm_count); };
  auto area = [](KernelInfo const* row) { return int64_t{row->tile_m} * row->tile_n; };
  int64_t enough = std::max(1, sm_count / 2);
  KernelInfo const* first = nullptr;  // the default row (codegen/kernels.py's default=True)
  for (auto const* row = kernels_begin(); row != kernels_end() && first == nullptr; ++row) {
    if (serves(row) && row->is_default) first = row;
  }
  if (first == nullptr) return nullptr;
  if (ctas(first) >= enough) {
    // The smallest tile admitted: 3/4 of the default's, or of its useful area a CTA (its tile less
    // the padding) where every CTA pads alike (each side of the problem a multiple of the tile's or
    // within one tile) and that area is at least half the tile. A padded last row or column of
    // tiles alone is what slot_use counts; a smaller tile would pay its lower intensity in every CTA.
    auto alike = [](int64_t size, int tile) { return size <= tile || size % tile == 0; };
    double useful = double(m) * double(n) / double(ctas(first));
    bool uniform = alike(m, first->tile_m) && alike(n, first->tile_n);
    double least = 0.75 * (uniform && 2 * useful >= area(first) ? useful : area(first));
    KernelInfo const* pick = first;
    for (auto const* row = kernels_begin(); row != kernels_end(); ++row) {
      if (serves(row) && ctas(row) >= enough && area(row) >= least && use(row) > 1.1 * use(first) &&
          use(row) > use(pick))
        pick = row;
    }
    return pick;
  }
  double best_use = 0;  // among the rows that fill half the SMs
  for (auto const* row = kernels_begin(); row != kernels_end(); ++row) {
    if (serves(row) && ctas(row) >= enough) best_use = std::max(best_use, use(row));
  }
  auto fills = [&](KernelInfo const* row) { return ctas(row) >= enough && 1.1 * use(row) >= best_use; };
  KernelInfo const* best = first;
  for (auto const* row = kernels_begin(); row != kernels_end(); ++row) {
    if (!serves(row)) continue;
    if (fills(row) ? (!fills(best) || area(row) > area(best)) : (!fills(best) && ctas(row) > ctas(best))) best = row;
  }
  return best;
}

// Operand rows (of A and B together) that one wave of `ctas` CTAs reads, when tiles are visited
// as CUTLASS's persistent scheduler visits them: along the raster direction (CUTLASS's
// heuristic: along M when there are more N tiles, else along N), `swizzle` tiles wide across
// it. No reuse between waves is assumed: it is what a wave costs once neither operand stays in
// L2.
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

// Swizzles measured better than the rule in tile_order, by kernel and GEMM problem (stats
// kernels: m features, n batch rows), with python -m cutlass_fused.tune --rounds 3 on an H100
// (docs/decisions.md, "Tile order").
struct TunedOrder {
  KernelId kernel;
  int64_t m, n;
  int swizzle;
};
constexpr TunedOrder kTunedOrders[] = {
    // KernelBench level 2 problem 39 (16384 x 4096^2, fp32): training forward 0.535 -> 0.494 x
    // torch.mm (tune), GEMM 5070 -> 4755 us (benchmarks/kernels.py stats_ab).
    {KernelId::sm90_f32x3_stats_128x128x32_c1x2x1_p8, 4096, 16384, 8},
    // The same shape with TF32 allowed: 1.105 -> 1.081 x torch.mm (tune, 3 rounds).
    {KernelId::sm90_tf32_stats_128x256x32_c2x1x1, 4096, 16384, 8},
};

// The sm90 persistent scheduler's tile order for `info` on its m x n problem. CUTLASS's own (no
// swizzle) sweeps the whole of one operand in every wave; where a wave 8 (or 4, 2) tiles wide
// across the raster reads at most 0.65 of those operand rows, the swizzle is taken (bf16: faster
// where it cut the rows that far, level where it cut them less; docs/decisions.md, "Tile order").
// kTunedOrders names measured exceptions.
// The swizzle must divide both tile counts twice over (clusters are at most 2 wide), or CUTLASS
// pads the grid with empty tiles that still run (much slower; docs/decisions.md, "Tile order").
// sm80 kernels ignore it.
void tile_order(KernelInfo const& info, int64_t m, int64_t n, int sm_count, Overrides const& o, GemmPlan& g) {
  g.swizzle = 1;
  g.raster = 0;
  if (info.family == Family::sm90) {
    int64_t tiles_m = ceil_div(m, info.tile_m), tiles_n = ceil_div(n, info.tile_n);
    // The rule is measured on the bf16 kernels, and fp16's move the same bytes through the same
    // mainloop; the f32x3 ones broke it both ways (H100, swizzle 8 against none: the statistics
    // GEMM 16% slower at 8192 x 8192^2 and 8% faster at 16384 x 4096^2; eval 7% faster and 6%
    // slower), so they take the table's entries alone.
    bool sixteen_bit = info.dtype == KernelDtype::bf16 || info.dtype == KernelDtype::f16;
    if (sixteen_bit && sm_count > 0) {
      double base = wave_rows(tiles_m, tiles_n, info.tile_m, info.tile_n, 1, sm_count), best = base;
      for (int s : {2, 4, 8}) {
        if (tiles_m % (2 * s) != 0 || tiles_n % (2 * s) != 0) continue;
        double rows = wave_rows(tiles_m, tiles_n, info.tile_m, info.tile_n, s, sm_count);
        if (rows <= 0.65 * base && rows < best) {
          best = rows;
          g.swizzle = s;
        }
      }
    }
    for (auto const& t : kTunedOrders) {
      if (m == t.m && n == t.n && info.id == t.kernel) g.swizzle = t.swizzle;
    }
  }
  if (o.swizzle != 0) g.swizzle = o.swizzle;
  if (o.raster != 0) g.raster = o.raster;
}

KernelInfo const& require(KernelInfo const* info, Family family, KernelDtype math, Mode mode) {
  if (info == nullptr)
    throw std::runtime_error(std::string("cutlass_fused: the kernel table has no ") + to_string(family) + " " +
                             to_string(math) + " " + to_string(mode) + " kernel");
  return *info;
}

// The GEMM h = x W^T + b (eval kernel; the epilogue's vectors are the caller's) for m x n x k.
GemmPlan eval_gemm(Problem const& p, Family family, KernelDtype math, int64_t kn) {
  GemmPlan g;
  g.kernel = &require(find_kernel(family, math, Mode::eval, p.m, p.n, p.k, p.sm_count, p.overrides.kernel), family,
                      math, Mode::eval);
  g.kn = kn;
  g.split = family == Family::sm90 && math == KernelDtype::f32x3;
  g.inf_fix = family == Family::sm80 && math == KernelDtype::f32x3;
  tile_order(*g.kernel, p.m, kn, p.sm_count, p.overrides, g);
  return g;
}

// The statistics GEMM ("stats" kernels): h and each batch tile's sums of h and h^2, so that
// the training tail reads h once. Taken where one is in the table and its tiles fill half the
// GPU (smaller problems keep the eval kernel's smaller tiles and the tail's exact sums).
// sm90's swap the operands (features are the kernel's M, the batch its N); sm80's do not (the
// batch is M), and their partials' row stride is a whole number of batch tiles
// (csrc/kernels/gemm/sm80_stats.cuh).
bool stats_gemm(Problem const& p, Family family, KernelDtype math, int64_t kn, GemmPlan& g) {
  if (!p.overrides.stats_gemm) return false;
  bool swapped = family == Family::sm90;
  int64_t km = swapped ? kn : p.m, kb = swapped ? p.m : kn;
  auto const* info = find_kernel(family, math, Mode::stats, km, kb, p.k, p.sm_count, p.overrides.kernel);
  // e4m3 has no eval kernel to fall back on: its statistics GEMM runs whatever the grid.
  if (info == nullptr || (!is_e4m3(math) && cta_count(*info, km, kb) < std::max(1, p.sm_count / 2)))
    return false;
  g.kernel = info;
  g.kn = kn;
  g.swapped = swapped;
  g.split = family == Family::sm90 && math == KernelDtype::f32x3;
  // Each operand's split writes its remainder alone (decisions.md, "fp32 on sm90"); an infinite
  // entry then meets the other's remainder, so its row's outputs are rewritten after the GEMM.
  g.remainder = g.inf_fix = g.split;
  int bytes = info->stats == Stats::partial64 ? 8 : 4;
  int batch_tile = swapped ? info->tile_n : info->tile_m;
  g.sums = {static_cast<int>(ceil_div(p.m, batch_tile)), limits::partials_ld(kn, info->tile_m), bytes};
  tile_order(*info, km, kb, p.sm_count, p.overrides, g);
  return true;
}

// The next Linear's dX GEMM with the layer's backward sums ("grad" kernels; Op::backward_linear):
// sm90, 16-bit, dz in h's dtype, an activation whose derivative is a select, and 16-byte rows for
// the GEMM's operands and D (n and k whole groups: the kernel computes no padding), none of them
// empty. Swapped as the statistics GEMM (features are the kernel's M, the batch its N). false:
// torch.mm, then the backward op's kernels.
bool grad_gemm(Problem const& p, Family family, KernelDtype math, GemmPlan& g) {
  bool sixteen_bit = math == KernelDtype::bf16 || math == KernelDtype::f16;
  bool shapes = p.m > 0 && p.n > 0 && p.k > 0 && p.n % 8 == 0 && p.k % 8 == 0;
  if (!p.overrides.stats_gemm || family != Family::sm90 || !sixteen_bit || p.y_wider || !p.aligned || !shapes ||
      act_set(p.act) == ActSet::smooth)
    return false;
  auto const* info = find_kernel(family, math, Mode::grad, p.n, p.m, p.k, p.sm_count, p.overrides.kernel);
  if (info == nullptr) return false;
  g.kernel = info;
  g.kn = p.n;
  g.swapped = true;
  g.sums = {static_cast<int>(ceil_div(p.m, info->tile_n)), limits::partials_ld(p.n, info->tile_m), 4};
  tile_order(*info, p.n, p.m, p.sm_count, p.overrides, g);
  return true;
}

// --- the BatchNorm kernels ---------------------------------------------------------------

// The call's data can be read in 16-byte groups (the launchers' vector width: limits::groups16):
// aligned, and n a whole number of groups (not 769 columns).
bool groups16(Problem const& p) { return p.aligned && limits::whole_groups16(bytes_of(p.x), p.n); }

// The training tail and its slab pieces; throws where an override cannot run.
Tail pick_tail(Problem const& p, int* pieces) {
  Tail forced = p.overrides.tail;
  int bytes = bytes_of(p.x), m = static_cast<int>(p.m), n = static_cast<int>(p.n);
  bool small = bytes == 2 && !p.cumulative && m <= (forced == Tail::small ? limits::kSmallRowsMax : limits::kSmallRows);
  *pieces = groups16(p) && !p.cumulative
                ? limits::slab_pieces(m, n, 16 / bytes, 1, p.sm_count, forced == Tail::slab)
                : 0;
  switch (forced) {
    case Tail::automatic:
      if (small) return Tail::small;
      return bytes == 2 && m <= limits::kSlabRows && *pieces >= 4 ? Tail::slab : Tail::cooperative;
    case Tail::small:
      if (!small)
        throw std::runtime_error("cutlass_fused: the small training tail needs 16-bit h, at most " +
                                 std::to_string(limits::kSmallRowsMax) + " rows and a momentum");
      return Tail::small;
    case Tail::slab:
      if (*pieces == 0)
        throw std::runtime_error("cutlass_fused: the slab training tail needs 16-byte aligned columns, a "
                                 "momentum, and at most " + std::to_string(limits::kSlabBytes / 32) +
                                 " rows of 32 bytes");
      return Tail::slab;
    default: return Tail::cooperative;
  }
}

// The backward's kernels and the slab kernel's pieces; throws where an override cannot run. The
// slab kernel where it measured faster: as the training tail's (kSlabRows), with dy in h's
// dtype. Past that the cooperative kernel (dy in h's dtype, 16-byte groups) where every block
// takes one item a phase (with two or more it lost), at 2 blocks an SM
// (limits::kCooperativeBackwardBlocksPerSm), where it does not spill with any activation; its
// blocks keep their first rows in shared memory, so wider layers (more items) take the passes.
// fp32 alike, every activation too, since their arithmetic is fp32 (activation.cuh). It won at
// every shape measured (decisions.md, "Backward").
BackwardKernels pick_backward(Problem const& p, int* pieces) {
  BackwardKernels forced = p.overrides.backward;
  int bytes = bytes_of(p.x), m = static_cast<int>(p.m), n = static_cast<int>(p.n);
  bool streams = !p.y_wider && groups16(p);
  *pieces = streams ? limits::slab_pieces(m, n, 16 / bytes, 2, p.sm_count, forced == BackwardKernels::slab) : 0;
  int groups = static_cast<int>(limits::blocks(n, 32 * (16 / bytes)));
  int64_t items = int64_t{groups} * limits::grad_chunks(m, groups, p.sm_count);
  switch (forced) {
    case BackwardKernels::automatic:
      if (bytes == 2 && m <= limits::kSlabRows && *pieces >= 4) return BackwardKernels::slab;
      return streams && m > limits::kSlabRows &&
                     items <= int64_t{limits::kCooperativeBackwardBlocksPerSm} * p.sm_count
                 ? BackwardKernels::cooperative
                 : BackwardKernels::passes;
    case BackwardKernels::slab:
      if (*pieces == 0)
        throw std::runtime_error("cutlass_fused: the slab backward needs dy in h's dtype, 16-byte aligned columns "
                                 "and at most " + std::to_string(limits::kSlabBytes / 64) + " rows of 32 bytes");
      return BackwardKernels::slab;
    case BackwardKernels::cooperative:
      if (!streams)
        throw std::runtime_error("cutlass_fused: the cooperative backward needs dy in h's dtype and 16-byte "
                                 "aligned columns");
      return BackwardKernels::cooperative;
    default: return BackwardKernels::passes;
  }
}

}  // namespace

namespace {
std::mutex overrides_mutex;
Overrides overrides_now;
}  // namespace

Overrides current_overrides() {
  std::lock_guard<std::mutex> lock(overrides_mutex);
  return overrides_now;
}

void set_current_overrides(Overrides const& o) {
  std::lock_guard<std::mutex> lock(overrides_mutex);
  overrides_now = o;
}

Overrides parse_overrides(std::string const& kernel, std::string const& tail, std::string const& backward,
                          int64_t swizzle, std::string const& raster, bool stats_gemm) {
  static constexpr std::pair<char const*, Tail> kTails[] = {
      {"auto", Tail::automatic}, {"cooperative", Tail::cooperative}, {"slab", Tail::slab}, {"small", Tail::small}};
  static constexpr std::pair<char const*, BackwardKernels> kBackward[] = {
      {"auto", BackwardKernels::automatic}, {"passes", BackwardKernels::passes},
      {"slab", BackwardKernels::slab}, {"cooperative", BackwardKernels::cooperative}};
  static constexpr std::pair<char const*, int> kRasters[] = {{"auto", 0}, {"m", 1}, {"n", 2}};
  Overrides o;
  if (!kernel.empty() && kernel != "auto") {
    o.kernel = find_row(kernel.c_str());
    if (o.kernel == nullptr) {
      std::string names;
      for (auto const* row = kernels_begin(); row != kernels_end(); ++row) names += std::string(" ") + row->name;
      throw std::invalid_argument("cutlass_fused: expected kernel to be 'auto' or a row of the kernel table, but got '" +
                                  kernel + "'; the rows:" + names);
    }
  }
  o.tail = parse_choice("tail", tail.empty() ? "auto" : tail, kTails);
  o.backward = parse_choice("backward", backward.empty() ? "auto" : backward, kBackward);
  if (swizzle != 0 && swizzle != 1 && swizzle != 2 && swizzle != 4 && swizzle != 8)
    throw std::invalid_argument("cutlass_fused: expected swizzle to be 0 (auto), 1, 2, 4 or 8, but got " +
                                std::to_string(swizzle));
  o.swizzle = static_cast<int>(swizzle);
  o.raster = parse_choice("raster", raster.empty() ? "auto" : raster, kRasters);
  o.stats_gemm = stats_gemm;
  return o;
}

Activation parse_activation(std::string const& name) {
  static constexpr std::pair<char const*, Activation> kActivations[] = {
      {"none", Activation::none}, {"relu", Activation::relu},           {"leaky_relu", Activation::leaky_relu},
      {"gelu", Activation::gelu}, {"gelu_tanh", Activation::gelu_tanh}, {"silu", Activation::silu}};
  return parse_choice("activation", name, kActivations);
}

Op parse_op(std::string const& name) {
  static constexpr std::pair<char const*, Op> kOps[] = {{"train", Op::train},   {"linear", Op::linear},
                                                        {"eval", Op::eval},     {"matmul", Op::matmul},
                                                        {"backward", Op::backward},
                                                        {"backward_linear", Op::backward_linear}};
  return parse_choice("op", name, kOps);
}

void check_family_name(std::string const& family) {
  if (family != "auto" && family != "sm90" && family != "sm80")
    throw std::runtime_error("cutlass_fused: expected family to be 'auto', 'sm90' or 'sm80', but got '" + family +
                             "'");
}

// sm90a code runs on compute capability 9.0 only; "auto" takes it there and the sm80 family
// (sm80-sm89, and newer GPUs through its compute_80 PTX) elsewhere.
Family resolve_family(std::string const& requested, int capability, int device_index, char const* device_name) {
  check_family_name(requested);
  bool ampere = capability >= 80, sm90_runs = requested != "sm90" || capability == 90;
  if (!ampere || !sm90_runs) {  // the message only here: no string is built on the hot path
    std::string cc = std::to_string(capability / 10) + "." + std::to_string(capability % 10);
    std::string gpu = device_index < 0 ? std::string("the GPU")
                                       : "cuda:" + std::to_string(device_index) + " (" + device_name + ")";
    if (!ampere)
      throw std::runtime_error("cutlass_fused: needs an Ampere (compute capability 8.0) or newer GPU, but " + gpu +
                               " has compute capability " + cc);
    throw std::runtime_error("cutlass_fused: family 'sm90' needs compute capability 9.0, but " + gpu + " has " + cc);
  }
  if (requested == "sm80") return Family::sm80;
  return requested == "sm90" || capability == 90 ? Family::sm90 : Family::sm80;
}

bool e4m3_runs(std::string const& family, int capability, DType operands) {
  check_family_name(family);
  // resolve_family's sm90, without its refusals: the sm80 family, or any GPU but compute 9.0, has
  // no e4m3 kernel to run.
  if (operands != DType::bf16 || family == "sm80" || capability != 90) return false;
  for (auto const* row = kernels_begin(); row != kernels_end(); ++row) {
    if (row->family == Family::sm90 && is_e4m3(row->dtype) && row->entry != nullptr) return true;
  }
  return false;
}

bool grad_runs(std::string const& family, int capability, DType dtype, Activation act) {
  check_family_name(family);
  // grad_gemm's conditions that no shape changes (resolve_family's sm90, without its refusals).
  bool sixteen_bit = dtype == DType::bf16 || dtype == DType::f16;
  if (!sixteen_bit || family == "sm80" || capability != 90 || act_set(act) == ActSet::smooth ||
      !current_overrides().stats_gemm)
    return false;
  KernelDtype math = dtype == DType::bf16 ? KernelDtype::bf16 : KernelDtype::f16;
  for (auto const* row = kernels_begin(); row != kernels_end(); ++row) {
    if (row->family == Family::sm90 && row->dtype == math && row->mode == Mode::grad && row->entry != nullptr)
      return true;
  }
  return false;
}

Plan make_plan(Problem const& p) {
  Plan plan;
  if (p.op != Op::backward) plan.family = resolve_family(p.family, p.capability, p.device, p.device_name);
  // fp32 uses TF32 tensor cores exactly when torch.mm would; without them it is 3xTF32 in both
  // families: in-kernel on sm80 (mma.sync), over split operands through the TF32 kernel on sm90.
  plan.math = p.x == DType::bf16 ? KernelDtype::bf16
              : p.x == DType::f16 ? KernelDtype::f16
              : p.allow_tf32      ? KernelDtype::tf32
                                  : KernelDtype::f32x3;
  if (p.fp8) {
    // e4m3 operands (issue 33): the sm90 statistics GEMMs (training) and the e4m3 eval GEMM, with h
    // (or y) and the tail in bf16.
    if ((p.op != Op::train && p.op != Op::eval) || p.x != DType::bf16)
      throw std::runtime_error("cutlass_fused: e4m3 operands are taken by the training and eval ops only, with h in "
                               "bfloat16");
    if (plan.family != Family::sm90)
      throw std::runtime_error("cutlass_fused: e4m3 operands need the sm90 family (Hopper's FP8 tensor cores)");
    plan.math = p.fast_accum ? KernelDtype::e4m3_fast : KernelDtype::e4m3;
  }
  // Both families need N to be a multiple of 16 bytes (sm80 stores whole vectors, sm90's
  // can_implement rejects D otherwise): the kernel computes kn columns, from zero weight rows,
  // into the padded rows of h.
  int64_t kn = round_up(p.n, 16 / bytes_of(p.x));
  switch (p.op) {
    case Op::train:
      if (!stats_gemm(p, plan.family, plan.math, kn, plan.gemm)) {
        if (p.fp8)
          throw std::runtime_error("cutlass_fused: e4m3 operands need the statistics GEMM (no eval kernel takes them): "
                                   "stats_gemm may not be overridden off, and this build must have an sm90 e4m3 row");
        plan.gemm = eval_gemm(p, plan.family, plan.math, kn);
      }
      plan.tail = pick_tail(p, &plan.pieces);
      if (plan.tail != Tail::slab) plan.pieces = 0;
      plan.y_cast = p.y_other || (p.y != p.x && p.y != DType::f32);
      break;
    case Op::linear: plan.gemm = eval_gemm(p, plan.family, plan.math, kn); break;
    case Op::eval:
      plan.gemm = eval_gemm(p, plan.family, plan.math, kn);
      plan.y_in_x = !p.y_other && p.y == p.x && !(p.x == DType::f16 && p.y_wider);
      plan.eval_in_fp32 = p.y_wider && !plan.y_in_x;
      plan.fold_scale_apart = p.x == DType::f16 && !plan.eval_in_fp32;
      // The fold in the sm90 epilogue adds its latency to every tile a CTA takes; the fold kernel
      // costs a launch a call, none where frozen_weights() keeps its fold. So the epilogue takes it
      // up to two tiles a CTA, unless it is kept (decisions.md, "Eval fold").
      plan.fold_in_epilogue = plan.family == Family::sm90 && !plan.eval_in_fp32 && !p.fold_kept &&
                              cta_count(*plan.gemm.kernel, p.m, kn) <= 2 * int64_t{std::max(1, p.sm_count)};
      plan.act_in_epilogue = !plan.gemm.inf_fix;
      break;
    case Op::matmul:
      // Only the sm90 family's 3xTF32 has its own GEMM here; the rest is torch.mm, whose
      // precision the forward's kernels share.
      if (plan.family == Family::sm90 && plan.math == KernelDtype::f32x3)
        plan.gemm = eval_gemm(p, plan.family, plan.math, kn);
      break;
    case Op::backward:
      plan.backward = pick_backward(p, &plan.pieces);
      if (plan.backward != BackwardKernels::slab) plan.pieces = 0;
      break;
    case Op::backward_linear:
      // The GEMM's route runs the two-pass backward's dh pass; the other route plans the backward op.
      if (grad_gemm(p, plan.family, plan.math, plan.gemm)) plan.backward = BackwardKernels::passes;
      break;
  }
  int m = static_cast<int>(p.m), n = static_cast<int>(p.n);
  size_t sums = size_t{2} * plan.gemm.sums.tiles * plan.gemm.sums.ld * plan.gemm.sums.bytes;
  size_t bn = p.op == Op::train ? limits::train_workspace(m, n)
              : p.op == Op::linear ? limits::column_stats_workspace(m, n)
              : p.op == Op::backward ? limits::backward_workspace(m, n)
              : p.op == Op::backward_linear && plan.gemm.kernel ? limits::grad_linear_workspace(n)
                                     : 0;
  plan.bn_offset = sums == 0 ? 0 : static_cast<size_t>(round_up(static_cast<int64_t>(sums), 256));
  plan.workspace = bn == 0 ? sums : plan.bn_offset + bn;
  return plan;
}

std::string describe(Plan const& plan) {
  std::ostringstream s;
  GemmPlan const& g = plan.gemm;
  s << "family=" << to_string(plan.family) << "\nmath=" << to_string(plan.math)
    << "\nkernel=" << (g.kernel ? g.kernel->name : "") << "\nswizzle=" << g.swizzle
    << "\nraster=" << (g.raster == 1 ? "m" : g.raster == 2 ? "n" : "auto") << "\nstats_gemm=" << int(g.sums.bytes > 0)
    << "\nsplit=" << int(g.split) << "\nremainder=" << int(g.remainder) << "\ninf_fix=" << int(g.inf_fix) << "\nsum_tiles=" << g.sums.tiles
    << "\nsum_ld=" << g.sums.ld << "\nsum_bytes=" << g.sums.bytes << "\neval_in_fp32=" << int(plan.eval_in_fp32)
    << "\nfold_scale_apart=" << int(plan.fold_scale_apart) << "\nfold_in_epilogue=" << int(plan.fold_in_epilogue)
    << "\ny_cast=" << int(plan.y_cast) << "\ny_in_x=" << int(plan.y_in_x)
    << "\nact_in_epilogue=" << int(plan.act_in_epilogue)
    << "\ntail=" << to_string(plan.tail)
    << "\nbackward=" << to_string(plan.backward) << "\npieces=" << plan.pieces << "\nworkspace=" << plan.workspace;
  return s.str();
}

}  // namespace cutlass_fused
