// The training forward after the GEMM, in one kernel: the cooperative, small and slab tails
// (batch_norm.h, TrainArgs; the plan picks one).
#include "kernels/bn_common.cuh"

namespace cutlass_fused {
namespace {

// Whether a column's statistics may come from the GEMM's tile sums: s and q, its sums of h and h^2
// added in fp64 (the statistics GEMMs run with a null shift). fp32 partials err by ~2^-20 of the
// sum of squares, so var = q/m - mean^2 is trusted only where mean^2 <= 64 var (relative error
// <= ~65 2^-20, far below bf16's, fp16's and TF32's); fp64 partials (fp32 h) are as exact as the
// pass. A NaN or an Inf is never trusted (an fp16 h that overflowed is summed as stored: inf).
// Overflow (fp16 h and y, see SumSquares): the unfused model rounds z = h * scale to fp16, where
// an element past 65504 becomes inf. Every |h| <= sqrt(q), so a column is trusted only where
// sqrt(q) |scale| (1 + 2^-10) < 65504; the fp32 tile sums' error is far inside that margin, and
// the exact pass emulates the overflow everywhere else.
template <class P, bool Overflow>
__device__ bool gemm_sums_trusted(double s, double q, double count, double scale) {
  constexpr double kTrust = std::is_same_v<P, double> ? INFINITY : 64;
  double mean = s / count, var = q / count - mean * mean;
  bool trusted = isfinite(s) && isfinite(q) && (kTrust == INFINITY || mean * mean <= kTrust * var);
  if constexpr (Overflow) trusted = trusted && sqrt(q) * fabs(scale) * (1 + 0x1p-10) < 65504.0;
  return trusted;
}

// Where the unfused model may round z = h * scale to T and it can overflow there (SumSquares):
// fp16 h, whatever y's dtype (FinalizeArgs::z_rounded says at run time whether z is rounded; the
// trust rule's extra test only sends more columns to the exact pass).
template <class T>
constexpr bool kZOverflows = std::is_same_v<T, __half>;

// Work items are (column group, row chunk), column groups fastest so that the
// blocks in flight read neighbouring columns of the same rows; each block
// takes the same items in both phases, so phase 2 mostly re-reads h from L2.
// P: the type of the GEMM's tile sums (float or double), or void where the
// statistics are the exact pass's alone.
template <class T, class TO, bool Act, int V, int R, class P>
__global__ void __launch_bounds__(256, 4) batch_norm_train_kernel(TrainArgs a, int rows, int chunks, int groups) {
  using A = Acc<T>;
  constexpr bool FromGemm = !std::is_void_v<P>;
  FinalizeArgs const& f = a.norm;
  auto* pa = static_cast<double*>(a.workspace);
  auto* pb = pa + static_cast<int64_t>(chunks) * f.n;
  auto* exact = reinterpret_cast<unsigned char*>(pb + static_cast<int64_t>(chunks) * f.n);  // FromGemm only
  int items = groups * chunks;
  // One buffer for the three phases: phase 0's lane sums, phase 1's slots and partials, phase 2's
  // slots (separate arrays exceeded the 48 KiB of static shared memory). 6 stages in phase 2,
  // which measured faster than 4 or 8 (docs/decisions.md, "Row passes").
  constexpr int kStages = 6;
  // Phase 2's slots only where it pipelines (16-byte groups): single columns (V = 1) need phase
  // 0's and 1's 4 KiB, not 24.
  constexpr bool kPipelined = sizeof(Group<T, V>) == 16;
  constexpr int kScratch = std::max<int>(partials_scratch<SumSquares<T>, V>(), kPipelined ? kStages * 4096 : 0);
  __shared__ uint4 stage[kScratch / sizeof(uint4)];
  if constexpr (FromGemm) {
    // Phase 0: each column's sums from the GEMM's partials, in fp64. A block takes 32 columns;
    // its 8 row lanes each add every 8th tile, then the lanes are added in lane order (a fixed
    // order: bitwise stable). One thread a column walking all u_tiles tiles while the other
    // blocks waited at the barrier cost more at 16384 rows (64 tiles), a little less at 1024-4096
    // rows (4-16 tiles; docs/decisions.md, "Row passes").
    // Columns gemm_sums_trusted refuses take the exact pass below.
    auto const* us = static_cast<P const*>(a.u_sum);
    auto const* uq = static_cast<P const*>(a.u_sumsq);
    auto& lanes = *reinterpret_cast<double(*)[2][8][32]>(stage);
    for (int slice = blockIdx.x; slice * 32 < f.n; slice += gridDim.x) {
      int c = slice * 32 + threadIdx.x;
      double s = 0, q = 0;
      if (c < f.n) {
#pragma unroll 4
        for (int t = threadIdx.y; t < a.u_tiles; t += 8) {
          s += us[t * a.u_ld + c];
          q += uq[t * a.u_ld + c];
        }
      }
      lanes[0][threadIdx.y][threadIdx.x] = s;
      lanes[1][threadIdx.y][threadIdx.x] = q;
      __syncthreads();
      if (threadIdx.y == 0 && c < f.n) {
        s = lanes[0][0][threadIdx.x];
        q = lanes[1][0][threadIdx.x];
        for (int i = 1; i < 8; ++i) {
          s += lanes[0][i][threadIdx.x];
          q += lanes[1][i][threadIdx.x];
        }
        exact[c] = !gemm_sums_trusted<P, kZOverflows<T>>(s, q, f.count, load(f.scale, c, 1.0));
        a.stats[c] = s;
        a.stats[f.n + c] = q;
      }
      __syncthreads();  // before the next slice overwrites `lanes`
    }
    if (a.num_batches_tracked != nullptr && blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0)
      *a.num_batches_tracked += 1;  // before the barrier: the second one may be skipped
    cooperative_groups::this_grid().sync();
  }
  // z = h * scale is rounded to T where the scale is 16-bit too (see SumSquares: fp16 only).
  SumSquares<T> terms{static_cast<T const*>(f.h), f.ldh, f.z_rounded ? f.scale : ColVec{}};
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    int group = item % groups;
    if constexpr (FromGemm) {  // only column groups with a column to redo; uniform over the block
      int c0 = (group * 32 + threadIdx.x) * V;
      bool need = false;
      // No early exit, which made each flag's load wait on the last (ncu's stall samples; level
      // in wall time; docs/decisions.md, "Training tails").
#pragma unroll
      for (int v = 0; v < V; ++v) need |= c0 + v < f.n && exact[c0 + v];
      if (!__syncthreads_or(need)) continue;
    }
    chunk_partials<SumSquares<T>, V, false, true>(terms, f.m, f.n, rows, group, item / groups, pa, pb, stage);
  }
  if (!FromGemm && a.num_batches_tracked != nullptr && blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0)
    *a.num_batches_tracked += 1;  // read by every block after the barrier (cumulative momentum)
  // With the GEMM's sums, phase 2 needs this barrier only for the exact partials of flagged
  // columns. Every block reads all the flags, so all take the same branch (else: deadlock).
  bool any_exact = !FromGemm;
  if constexpr (FromGemm) {
    // Independent word loads (exact is 8-byte aligned; its bytes are 0 or 1): with an early
    // exit, each load waited on the last (docs/decisions.md, "Training tails").
    auto const* words = reinterpret_cast<unsigned const*>(exact);
    int tid = threadIdx.y * 32 + threadIdx.x;
    unsigned flagged = 0;
    for (int i = tid; i < f.n / 4; i += 256) flagged |= words[i];
    for (int c = f.n / 4 * 4 + tid; c < f.n; c += 256) flagged |= exact[c];
    any_exact = __syncthreads_or(flagged != 0);
  }
  if (any_exact) cooperative_groups::this_grid().sync();

  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    int group = item % groups, chunk = item / groups;
    Column<A> col[V];
    block_columns<V>(f.n, group, col, [&](int c) {
      bool first = chunk == 0;  // the chunk whose blocks write the column's statistics
      ColumnInputs in = column_inputs(f, first ? a.running_mean : ColOut{}, first ? a.running_var : ColOut{}, c);
      bool from_gemm = FromGemm && !exact[c];
      double s = 0, q = 0;
      if (from_gemm) {
        s = a.stats[c];
        q = a.stats[f.n + c];
      } else {
        // In chunk order, as reduce_partials adds them; unrolled so that the
        // loads, each a round trip to L2, are in flight together (docs/decisions.md, "Training tails").
#pragma unroll 8
        for (int r = 0; r < chunks; ++r) {
          s += pa[r * static_cast<int64_t>(f.n) + c];
          q += pb[r * static_cast<int64_t>(f.n) + c];
        }
      }
      // Phase 0 wrote the GEMM-summed columns' sums, which other blocks read now.
      return finish_column<A>(a, c, s, q, in, first, !from_gemm);
    });
    int c0 = (group * 32 + threadIdx.x) * V;
    int64_t begin = static_cast<int64_t>(chunk) * rows, end = begin + rows;
    if (end > f.m) end = f.m;
    // Last rows first (both paths): phase 1 read them last, so more of them are still in
    // L2 when h exceeds it (docs/decisions.md, "Training tails").
    if constexpr (kPipelined) {
      if (c0 < f.n) normalize_rows_pipelined<T, TO, Act, V, kStages>(f, c0, col, begin, end, stage);
    } else if (c0 < f.n) {
      for (int64_t k = (end - begin - 1) / (8 * R); k >= 0; --k)
        normalize_round<T, TO, Act, V, R>(f, c0, col, begin + k * 8 * R + threadIdx.y, end);
    }
  }
}

// The training tail for a small batch (batch_norm_train's rule): a block holds all m rows of
// its columns in registers, so it needs no grid barrier (nor a cooperative launch) and reads h
// once; the GEMM's tile sums would save nothing here. Its threads are (row chunk, row lane)
// pairs, the chunks and lanes of chunk_partials, `groups` column groups of V columns a block;
// the sums are added in the order of chunk_partials and reduce_partials, so they, the
// statistics and y have the split ops' bits.
// K: rows a thread holds (stat_rows(m) / 8 at most). num_batches_tracked is only incremented
// (momentum given: no block reads it).
template <class T, class TO, bool Act, int V, int K>
__global__ void __launch_bounds__(256) batch_norm_train_small_kernel(TrainArgs a, int rows, int chunks, int groups) {
  using A = Acc<T>;
  FinalizeArgs const& f = a.norm;
  int pairs = chunks * 8, pair = threadIdx.x % pairs, g = threadIdx.x / pairs;
  int lane = pair % 8, c0 = (blockIdx.x * groups + g) * V;
  int64_t r0 = static_cast<int64_t>(pair / 8) * rows + lane, r1 = (pair / 8 + 1) * int64_t{rows};
  if (r1 > f.m) r1 = f.m;
  bool live = g < groups && c0 < f.n;  // n % V == 0 when V > 1: groups are whole
  // Thread i < groups V finishes the block's column i (after the first barrier): its inputs
  // are loaded with h.
  int owned = groups * V, col_c = blockIdx.x * owned + threadIdx.x;
  bool owner = threadIdx.x < owned && col_c < f.n;
  // z = h * scale is rounded to T where the scale is 16-bit too (see SumSquares: fp16 only).
  SumSquares<T> terms{static_cast<T const*>(f.h), f.ldh, f.z_rounded ? f.scale : ColVec{}};
  Group<T, V> held[K];
  double s[V] = {}, q[V] = {}, mu[V];
  if (live) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (r0 + 8 * k < r1) held[k] = load_group<T, V>(terms.h + (r0 + 8 * k) * f.ldh + c0);
    }
  }
  ColumnInputs in{};
  if (owner) in = column_inputs(f, a.running_mean, a.running_var, col_c);
  if (live) {
#pragma unroll
    for (int v = 0; v < V; ++v) mu[v] = terms.center(c0 + v);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (r0 + 8 * k < r1) terms.template add<V>(r0 + 8 * k, c0, mu, s, q, LoadHeld<T, V>{held[k]});
    }
  }
  __shared__ double sums[2][256][V];
  __shared__ double chunk_sums[2][256 / 8 * V];  // chunk * owned + i: owned * chunks <= 32 V
  __shared__ Column<A> cols[256 / 8 * V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    sums[0][threadIdx.x][v] = s[v];
    sums[1][threadIdx.x][v] = q[v];
  }
  if (a.num_batches_tracked != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *a.num_batches_tracked += 1;
  __syncthreads();
  // Each chunk's lanes in lane order, a thread a (column, chunk); then, below, the chunks in order.
  if (int i = threadIdx.x % owned, chunk = threadIdx.x / owned; chunk < chunks && blockIdx.x * owned + i < f.n) {
    int first = i / V * pairs + chunk * 8, v = i % V;
    double cs = sums[0][first][v], cq = sums[1][first][v];
#pragma unroll
    for (int l = 1; l < 8; ++l) {
      cs += sums[0][first + l][v];
      cq += sums[1][first + l][v];
    }
    chunk_sums[0][chunk * owned + i] = cs;
    chunk_sums[1][chunk * owned + i] = cq;
  }
  __syncthreads();
  if (owner) {
    int i = threadIdx.x, c = col_c;
    double sum = 0, sumsq = 0;
    for (int chunk = 0; chunk < chunks; ++chunk) {
      sum += chunk_sums[0][chunk * owned + i];
      sumsq += chunk_sums[1][chunk * owned + i];
    }
    cols[i] = finish_column<A>(a, c, sum, sumsq, in, true);
  }
  __syncthreads();
  if (!live) return;
  auto* y = static_cast<TO*>(f.y);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (r0 + 8 * k >= r1) break;
    store_group_once<TO, V>(y + (r0 + 8 * k) * f.n + c0, normalized<TO, Act>(cols + g * V, held[k], f.act, f.slope));
  }
}

// The training tail where a block holds every row of its columns in shared memory: a slab of
// m rows x `pieces` 16-byte pieces (W = pieces x V columns), all fetched at once. A block needs
// no other block's data, so there is no grid barrier: the column constants come from the GEMM's
// tile sums while the slab is in flight, and h is read once. Columns those sums cannot be
// trusted with, and batches without them, take the exact sums from the slab. The sums follow
// batch_norm_train_kernel's orders (phase 0's for tile sums; chunk_partials' and reduce_partials'
// for exact ones), so both kernels write the same bits. num_batches_tracked is only incremented
// (momentum given: no block reads it). Shared memory: slab_smem.
template <class T, class TO, bool Act, class P>
__global__ void __launch_bounds__(256, 3) batch_norm_train_slab_kernel(TrainArgs a, int rows, int chunks, int pieces) {
  using A = Acc<T>;
  constexpr int V = 16 / sizeof(T);
  constexpr bool FromGemm = !std::is_void_v<P>;
  FinalizeArgs const& f = a.norm;
  int tid = threadIdx.x, width = pieces * V, base = blockIdx.x * width;
  extern __shared__ uint4 smem[];
  uint4* slab = smem;  // row r's piece p at r * pieces + p
  auto* sums = reinterpret_cast<double*>(slab + f.m * pieces);  // [2][max(chunks, 8)][width]
  auto* cols = reinterpret_cast<Column<A>*>(sums + 2 * max(chunks, 8) * width);
  // The piece of every row this thread fetches and normalizes (256 % pieces == 0).
  int piece = tid % pieces, c0 = base + piece * V;
  bool live = c0 < f.n;  // n % V == 0: groups are whole
  auto const* h = static_cast<T const*>(f.h);
  // This thread's rows in kSlabGroups commit groups, normalized group by group as they land.
  for (int g = 0; g < kSlabGroups; ++g) {
    if (live) slab_rows(g, f.m, pieces, [&](int r) { copy_async(slab + r * pieces + piece, h + r * f.ldh + c0); });
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  // Thread j < W finishes the block's column j.
  int j = tid, c = base + tid;
  bool owner = j < width && c < f.n;
  ColumnInputs in{};
  if (owner) in = column_inputs(f, a.running_mean, a.running_var, c);
  double s = 0, q = 0;
  bool exact = !FromGemm;
  if constexpr (FromGemm) {
    // Phase 0's order and trust rule (batch_norm_train_kernel): 8 lanes each add every 8th
    // tile, then the lanes are added in lane order.
    auto const* us = static_cast<P const*>(a.u_sum);
    auto const* uq = static_cast<P const*>(a.u_sumsq);
    for (int i = tid; i < 8 * width; i += 256) {
      int lane = i / width, k = i % width;
      double ls = 0, lq = 0;
      if (base + k < f.n) {
        for (int t = lane; t < a.u_tiles; t += 8) {
          ls += us[t * a.u_ld + base + k];
          lq += uq[t * a.u_ld + base + k];
        }
      }
      sums[lane * width + k] = ls;
      sums[(8 + lane) * width + k] = lq;
    }
    __syncthreads();
    if (owner) {
      s = sums[j];
      q = sums[8 * width + j];
      for (int l = 1; l < 8; ++l) {
        s += sums[l * width + j];
        q += sums[(8 + l) * width + j];
      }
      exact = !gemm_sums_trusted<P, kZOverflows<T>>(s, q, f.count, in.scale);
    }
  }
  // The exact sums, where a column of the block needs them (uniform over the block).
  if (__syncthreads_or(owner && exact)) {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();  // other threads' pieces
    // z = h * scale is rounded to T where the scale is 16-bit too (see SumSquares: fp16 only).
    SumSquares<T> terms{h, f.ldh, f.z_rounded ? f.scale : ColVec{}};
    slab_chunk_sums<SumSquares<T>, V>(terms, {slab}, f.m, f.n, rows, chunks, pieces, base, sums);
    __syncthreads();
    if (owner && exact) slab_totals(sums, chunks, width, j, s, q);
  }
  if (owner) cols[j] = finish_column<A>(a, c, s, q, in, true);
  if (a.num_batches_tracked != nullptr && blockIdx.x == 0 && tid == 0) *a.num_batches_tracked += 1;
  __syncthreads();
  if (!live) return;
  Column<A> col[V];
  piece_columns(cols, piece, col);
  auto* y = static_cast<TO*>(f.y);
#pragma unroll
  for (int g = 0; g < kSlabGroups; ++g) {
    wait_async_groups(kSlabGroups - 1 - g);  // this thread's own pieces: no barrier
    slab_rows(g, f.m, pieces, [&](int r) {
      auto const& in = *reinterpret_cast<Group<T, V> const*>(slab + r * pieces + piece);
      store_group_once<TO, V>(y + static_cast<int64_t>(r) * f.n + c0, normalized<TO, Act>(col, in, f.act, f.slope));
    });
  }
}

}  // namespace

void batch_norm_train(TrainArgs const& a, cudaStream_t stream) {
  FinalizeArgs const& f = a.norm;
  int rows = stat_rows(f.m), chunks = stat_chunks(f.m);
  dispatch_pair(f.dt, f.dt_y, [&](auto t, auto to) {
    dispatch_act(f.act, [&](auto act) {
      using T = decltype(t);
      using TO = decltype(to);
      // A wider y (fp32 beside 16-bit h) always takes the activation's kernels, which write act = none's
      // bits too: without the activation's switch, nvcc's code for it ran slower than with it and relu
      // (both before store_warp_row; docs/decisions.md, "Training step").
      constexpr bool Act = decltype(act)::value || sizeof(TO) > sizeof(T);
      constexpr int V = 16 / sizeof(T);
      bool vec = can_vectorize<T>(f.n, f.ldh, {f.h, f.y});
      Tail tail = a.tail;
      int pieces = a.pieces;
      if (tail == Tail::automatic || (tail == Tail::slab && !vec))
        throw std::runtime_error("cutlass_fused: batch_norm_train runs the plan's tail (csrc/kernels/plan.h)");
      // P: the GEMM's sums' type, void without them.
      auto launch = [&](auto p) {
        using P = std::conditional_t<std::is_same_v<decltype(p), NoSums>, void, decltype(p)>;
        if (tail == Tail::slab) {
          constexpr auto kernel = batch_norm_train_slab_kernel<T, TO, Act, P>;
          allow_slab<kernel>();
          size_t smem = slab_smem<Column<Acc<T>>>(f.m, 1, std::max(chunks, 8), pieces, V);
          kernel<<<blocks(f.n, pieces * V), 256, smem, stream>>>(a, rows, chunks, pieces);
          check_cuda(cudaGetLastError(), "batch_norm_train");
        } else if (vec) {
          // R = 2: with 4 rows in flight the kernel spills under its 64 registers
          // and ran slower (docs/decisions.md, "Training tails").
          launch_cooperative<batch_norm_train_kernel<T, TO, Act, V, 2, P>>(a, f.n, a.sm_count, rows, chunks, V, stream,
                                                                       "batch_norm_train");
        } else {
          launch_cooperative<batch_norm_train_kernel<T, TO, Act, 1, 2, P>>(a, f.n, a.sm_count, rows, chunks, 1, stream,
                                                                       "batch_norm_train");
        }
      };
      if constexpr (sizeof(T) == 2) {
        if (tail == Tail::small) {
          int groups = 256 / (8 * chunks);
          auto small = [&](auto kernel, int v) {
            kernel<<<blocks(f.n, groups * v), 256, 0, stream>>>(a, rows, chunks, groups);
            check_cuda(cudaGetLastError(), "batch_norm_train");
          };
          if (vec) return small(batch_norm_train_small_kernel<T, TO, Act, V, limits::kSmallRowsPerThread>, V);
          return small(batch_norm_train_small_kernel<T, TO, Act, 1, limits::kSmallRowsPerThread>, 1);
        }
      }
      // Statistics GEMMs leave fp32 sums for 16-bit h and TF32, fp64 ones for 3xTF32.
      if (a.u_sum == nullptr) return launch(NoSums{});
      if constexpr (sizeof(T) == 2) {
        if (!a.u_fp64) return launch(float{});
      } else {
        return a.u_fp64 ? launch(double{}) : launch(float{});
      }
      throw std::runtime_error("cutlass_fused: GEMM statistics of 16-bit h are fp32 sums");
    });
  });
}

}  // namespace cutlass_fused
