// What the BatchNorm kernels share (bn_finalize.cu, bn_train.cu, bn_backward.cu): element
// access, the ordered column sums, the per-column statistics and constants that every kernel
// derives the same way (so all write the same bits), the slab machinery and the launch helpers.
// Everything is in an anonymous namespace: each of those files compiles its own copy, and a
// kernel template is instantiated only where it is launched.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/activation.cuh"
#include "kernels/batch_norm.h"
#include "kernels/check.h"
#include "kernels/dispatch.cuh"
#include "kernels/eval_fold.cuh"
#include "kernels/limits.h"

namespace cutlass_fused {
namespace {

template <class T> __device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <class T> __device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half(v); }

// Arithmetic type of the elementwise passes: fp32 data gets fp64, so that the
// one rounding is the store's; bf16/f16 get fp32, whose error is far below theirs.
template <class T> using Acc = std::conditional_t<std::is_same_v<T, float>, double, float>;

// T and a second dtype that is either T or fp32: the (h, y) and (h, dy) pairs.
template <class F>
void dispatch_pair(DType dt, DType dt2, F&& f) {
  if (dt2 != dt && dt2 != DType::f32) throw std::runtime_error("cutlass_fused: unsupported dtype pair");
  dispatch(dt, [&](auto t) {
    if (dt2 == dt)
      f(t, t);
    else
      f(t, float{});
  });
}

// std::true_type where an activation is set: the kernels' Act flag (normalized, bn_grad), so that
// those without one carry none of its code.
template <class F>
void dispatch_act(Activation act, F&& f) {
  if (act == Activation::none)
    f(std::false_type{});
  else
    f(std::true_type{});
}

// sum g (h - mean) from sum g and sum g h, in one rounding: every backward kernel (and
// reduce_partials for the two passes) centers its totals here, so all give the same bits.
__device__ __forceinline__ double centered(double sum_g, double sum_gh, double mean) {
  return __fma_rn(-mean, sum_g, sum_gh);
}

// Calls f with a value of dt's element type: dispatch's device twin, for the column stores.
template <class F>
__device__ __forceinline__ void with_element(DType dt, F&& f) {
  switch (dt) {
    case DType::bf16: f(__nv_bfloat16{}); break;
    case DType::f16: f(__half{}); break;
    default: f(float{});
  }
}

// Stores through fp32, as PyTorch computes these vectors in fp32 and rounds once more.
__device__ __forceinline__ void store(ColOut v, int c, double x) {
  float f = static_cast<float>(x);
  with_element(v.dt, [&](auto t) {
    using T = decltype(t);
    static_cast<T*>(v.p)[c] = from_float<T>(f);
  });
}

// x as store leaves it in dt, read back as fp32.
__device__ __forceinline__ float as_stored(DType dt, double x) {
  float f = static_cast<float>(x);
  with_element(dt, [&](auto t) {
    using T = decltype(t);
    f = to_float(from_float<T>(f));
  });
  return f;
}

struct NoSums {};  // a tag for P = void (batch_norm_train_kernel)

using limits::blocks;
using limits::stat_chunks;
using limits::stat_rows;

// A group of V consecutive elements, moved as one 16-byte access when that is
// its size (the launchers pick V so that every such access is aligned).
template <class T, int V>
struct alignas(sizeof(T) * V) Group {
  T v[V];
};

// Groups of whole 16-byte pieces move as such: an fp32 y or dy beside 16-bit h is 32 bytes a
// group, and element-wise accesses of it made the fp32-output training tail far slower than its
// bf16 twin for twice the bytes (issue 31; decisions.md, "Training step").
template <class T, int V>
constexpr bool kWholePieces = sizeof(Group<T, V>) % 16 == 0;

template <class T, int V>
__device__ __forceinline__ Group<T, V> load_group(T const* p) {
  Group<T, V> g;
  if constexpr (kWholePieces<T, V>) {
#pragma unroll
    for (int i = 0; i < int{sizeof(g) / 16}; ++i)
      reinterpret_cast<uint4*>(&g)[i] = reinterpret_cast<uint4 const*>(p)[i];
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) g.v[v] = p[v];
  }
  return g;
}

template <class T, int V>
__device__ __forceinline__ void store_group(T* p, Group<T, V> const& g) {
  if constexpr (kWholePieces<T, V>) {
#pragma unroll
    for (int i = 0; i < int{sizeof(g) / 16}; ++i)
      reinterpret_cast<uint4*>(p)[i] = reinterpret_cast<uint4 const*>(&g)[i];
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) p[v] = g.v[v];
  }
}

// y is written once, evict-first (st.global.cs), to leave L2 to the lines of h the GEMM wrote
// last: a little faster in the pipelined tail at small h, level at larger h (docs/decisions.md, "Row passes").
template <class T, int V>
__device__ __forceinline__ void store_group_once(T* p, Group<T, V> const& g) {
  if constexpr (kWholePieces<T, V>) {
#pragma unroll
    for (int i = 0; i < int{sizeof(g) / 16}; ++i)
      __stcs(reinterpret_cast<uint4*>(p) + i, reinterpret_cast<uint4 const*>(&g)[i]);
  } else {
    store_group<T, V>(p, g);
  }
}

// A row's 32 groups of a warp, lane i (threadIdx.x, blockDim.x = 32) holding the row's group i of
// the warp's 32 V columns, stored (Once: evict-first, as store_group_once). A 32-byte group (fp32
// y beside 16-bit h) as two 16-byte stores a lane leaves each store instruction only half of
// every 32-byte sector it touches, which measured much slower than instructions that each cover
// 512 contiguous bytes (decisions.md, "Training step"). So where the warp is whole (all 32
// lanes live and converged: `whole`, uniform over the warp), store s writes elements [128 s,
// 128 s + 128) of the warp's 256, lane t the 4 at 128 s + 4 t, which lane 16 s + t / 2 holds in
// its half t % 2. Other groups go as they are.
template <class T, int V, bool Once>
__device__ __forceinline__ void store_warp_row(T* p, Group<T, V> const& g, bool whole) {
  if constexpr (sizeof(T) == 4 && V == 8) {
    if (whole) {
      int lane = threadIdx.x;
      T* warp_row = p - lane * V;
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        int src = 16 * s + lane / 2;
        Group<T, 4> lo, hi;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          lo.v[k] = __shfl_sync(0xffffffffu, g.v[k], src);
          hi.v[k] = __shfl_sync(0xffffffffu, g.v[k + 4], src);
        }
        uint4 piece = reinterpret_cast<uint4 const&>(lane % 2 ? hi : lo);
        auto* dst = reinterpret_cast<uint4*>(warp_row + 128 * s + 4 * lane);
        if constexpr (Once) {
          __stcs(dst, piece);
        } else {
          *dst = piece;
        }
      }
      return;
    }
  }
  if constexpr (Once) {
    store_group_once<T, V>(p, g);
  } else {
    store_group<T, V>(p, g);
  }
}

// Whether the warp of a thread whose group starts at column c0 (store_warp_row's layout) has all
// 32 groups inside the n columns.
template <int V>
__device__ __forceinline__ bool whole_warp_row(int c0, int n) {
  return c0 - static_cast<int>(threadIdx.x) * V + 32 * V <= n;
}

// 16 bytes from global to shared memory, bypassing L1 (cp.async.cg).
__device__ __forceinline__ void copy_async(uint4* dst, void const* src) {
  unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}

// A thread's rows through a cp.async pipeline: row j (0 <= j < count) is K 16-byte pieces
// (one a tensor it reads), fetched S - 1 rows ahead into slot(j, k), this thread's own, then
// handed to use(j, piece) in order. A row's slots must not be those of rows j - S + 1 .. j - 1
// (in flight or in use). Loads in flight live in shared memory, not registers: the row passes run
// under 64-96 registers a thread, where two rows in registers left too few bytes in flight to reach
// a copy's bandwidth (docs/decisions.md, "Row passes"). Only the issuing thread reads a slot, so
// wait_group alone orders it. start(), if given, runs once the first S - 1 rows are in flight:
// loads it issues overlap theirs.
struct NoStart {
  __device__ void operator()() const {}
};

template <int S, int K, class Slot, class Addr, class Use, class Start = NoStart>
__device__ __forceinline__ void pipelined_rows_in(int count, Slot&& slot, Addr&& addr, Use&& use, Start&& start = {}) {
  auto issue = [&](int j) {
    if (j < count) {
#pragma unroll
      for (int k = 0; k < K; ++k) copy_async(slot(j, k), addr(j, k));
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
#pragma unroll
  for (int j = 0; j < S - 1; ++j) issue(j);
  start();
  for (int j = 0; j < count; ++j) {
    issue(j + S - 1);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 1) : "memory");
    use(j, [&](int k) { return slot(j, k); });
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// This thread's slot for piece k of row j in a ring of S rows of `stage` (S * K * 256 slots:
// blocks of 32 x 8 threads).
template <int S, int K>
__device__ __forceinline__ uint4* ring_slot(uint4* stage, int j, int k) {
  int tid = threadIdx.y * 32 + threadIdx.x;
  return stage + ((j % S) * K + k) * 256 + tid;
}

// pipelined_rows_in through a ring of S rows of `stage`.
template <int S, int K, class Addr, class Use, class Start = NoStart>
__device__ __forceinline__ void pipelined_rows(int count, uint4* stage, Addr&& addr, Use&& use, Start&& start = {}) {
  pipelined_rows_in<S, K>(count, [&](int j, int k) { return ring_slot<S, K>(stage, j, k); }, addr, use, start);
}

// Loaders for the Terms below: straight from memory, or a pipelined row's pieces.
template <int V>
struct LoadGlobal {
  template <class U>
  __device__ Group<U, V> operator()(int, U const* p) const { return load_group<U, V>(p); }
};

template <int V, class Piece>
struct LoadStaged {
  Piece piece;
  template <class U>
  __device__ Group<U, V> operator()(int k, U const*) const { return *reinterpret_cast<Group<U, V> const*>(piece(k)); }
};

// A row a thread already holds.
template <class T, int V>
struct LoadHeld {
  Group<T, V> const& g;
  __device__ Group<T, V> operator()(int, T const*) const { return g; }
};

template <class T>
bool can_vectorize(int n, int64_t ld, std::initializer_list<void const*> ptrs) {
  return limits::groups16(sizeof(T), n, ld, ptrs);
}

// h -> (h, h^2): the forward statistics. With `scale` (an fp16 y, so the unfused model rounds
// z = h * scale to fp16), an element whose z overflows counts as +-inf, as the unfused model's
// infinite z makes its column's mean infinite and its variance NaN. Only fp16: bf16 shares
// fp32's range (z overflows bf16 only past 3.39e38), and the check's registers made the bf16
// kernel spill (docs/decisions.md, "Training tails").
template <class T>
struct SumSquares {
  T const* h; int64_t ldh;
  ColVec scale{};
  static constexpr bool kOverflow = std::is_same_v<T, __half>;
  using Center = double;  // what add() takes of each column (Terms' interface)
  __device__ double center(int c) const { return kOverflow ? load(scale, c, 1.0) : 0.0; }  // the column's scale
  static constexpr bool kPipelined = true;  // one 16-byte piece a row when V > 1
  static constexpr int kInputs = 1;
  __device__ void const* input(int, int64_t r, int c0) const { return h + r * ldh + c0; }
  template <int V, class Load>
  __device__ void add(int64_t r, int c0, Center const (&s)[V], double (&a)[V], double (&b)[V], Load const& load) const {
    auto x = load(0, h + r * ldh + c0);
#pragma unroll
    for (int v = 0; v < V; ++v) {
      float f = to_float(x.v[v]);
      if constexpr (kOverflow) {
        bool z_inf = scale.p != nullptr && isinf(to_float(from_float<T>(f * static_cast<float>(s[v]))));
        if (z_inf) f = copysignf(INFINITY, f);
      }
      double e = f;
      a[v] += e;
      b[v] += e * e;
    }
  }
};

// chunk_partials' shared sums: [sum][warp][slot] (partial_slot).
template <int V>
using PartialsShared = double[2][8][32 * V];

// Where lane `lane`'s sum of its column v sits in a row of PartialsShared: its V columns in
// pairs (16 bytes), the pairs' order rotated by lane, so that each quarter-warp's 16-byte stores
// of one pair hit 8 distinct 16-byte bank groups; in lane order they were 64 bytes apart, 4
// lanes a bank group. Read back one thread a column, a half-warp's 16 columns are two lanes'
// 64 bytes, 128 contiguous bytes: conflict-free too.
template <int V>
__device__ __forceinline__ int partial_slot(int lane, int v) {
  static_assert(V <= 16, "a quarter-warp's 8 lanes rotate through the pairs");
  if constexpr (V < 4) {
    return lane * V + v;
  } else {
    constexpr int kPairs = V / 2;
    int rotation = (lane / (8 / kPairs)) % kPairs;
    return lane * V + 2 * ((v / 2) ^ rotation) + v % 2;
  }
}

// chunk_partials' sums of a block's 8 warps, a[] and b[] of each thread's V columns, added in
// warp order into row `chunk` of pa and pb: one thread a column, so that every warp reduces and
// stores at once (warp 0 alone had added them, in the same order: the same bits), through
// partial_slot's conflict-free layout.
template <int V>
__device__ __forceinline__ void every_warp_partials(PartialsShared<V>& sh, double const (&a)[V], double const (&b)[V],
                                                    int n, int group, int chunk, double* __restrict__ pa,
                                                    double* __restrict__ pb) {
#pragma unroll
  for (int v = 0; v < V; v += V < 4 ? 1 : 2) {
    int at = partial_slot<V>(threadIdx.x, v);
    if constexpr (V < 4) {
      sh[0][threadIdx.y][at] = a[v];
      sh[1][threadIdx.y][at] = b[v];
    } else {
      *reinterpret_cast<double2*>(&sh[0][threadIdx.y][at]) = make_double2(a[v], a[v + 1]);
      *reinterpret_cast<double2*>(&sh[1][threadIdx.y][at]) = make_double2(b[v], b[v + 1]);
    }
  }
  __syncthreads();
  int base = group * 32 * V;
  for (int i = threadIdx.y * 32 + threadIdx.x; i < 32 * V; i += 256) {
    if (base + i >= n) break;
    int at = partial_slot<V>(i / V, i % V);
    double sa = sh[0][0][at], sb = sh[1][0][at];
#pragma unroll
    for (int w = 1; w < 8; ++w) {
      sa += sh[0][w][at];
      sb += sh[1][w][at];
    }
    pa[chunk * static_cast<int64_t>(n) + base + i] = sa;
    pb[chunk * static_cast<int64_t>(n) + base + i] = sb;
  }
}

// Stages of the pipelined two-tensor passes (column sums, grad_input): 32 KiB of slots a block
// for dy and h; both passes measured faster so (docs/decisions.md, "Row passes").
constexpr int kSumStages = 4;

template <class Terms, int V>
constexpr bool pipelined_sums() { return V > 1 && Terms::kPipelined; }

// Shared memory chunk_partials needs: its pipeline's slots, then the lanes' sums (one buffer).
template <class Terms, int V>
constexpr int partials_scratch() {
  return std::max<int>(sizeof(PartialsShared<V>), pipelined_sums<Terms, V>() ? kSumStages * Terms::kInputs * 4096 : 0);
}

// Rows a thread keeps in shared memory past the pipeline that read them (the cooperative
// backward's, read again after its grid barrier): its first `rows` rows, piece k of row j in
// slot(j, k) (K pieces a row).
template <int K>
struct Kept {
  uint4* slots = nullptr;
  int rows = 0;
  __device__ uint4* slot(int j, int k) const { return slots + (j * K + k) * 256 + threadIdx.y * 32 + threadIdx.x; }
};

// The partial sums of column group `group` (32 V columns) over row chunk `chunk`, into row
// `chunk` of pa and pb. Every thread of the block calls it.
// kOneWarp: warp 0 adds the 8 warps' sums alone, in lane order (the forward tails' cooperative
// kernel, whose spills under its 64 registers the every-warp reduction moved, some down, some up;
// not timed there: docs/decisions.md, "Backward"). The same bits either way.
template <class Terms, int V, bool kKeeps = false, bool kOneWarp = false>
__device__ void chunk_partials(Terms const& terms, int m, int n, int rows, int group, int chunk,
                               double* __restrict__ pa, double* __restrict__ pb, uint4* scratch,
                               Kept<Terms::kInputs> kept = {}) {
  int c0 = (group * 32 + threadIdx.x) * V;  // n % V == 0 when V > 1: groups are whole
  int r0 = chunk * rows;
  int r1 = min(m, r0 + rows);
  double a[V] = {}, b[V] = {};
  typename Terms::Center mu[V];
  bool live = c0 < n;
  auto centers = [&] {
    if (live) {
#pragma unroll
      for (int v = 0; v < V; ++v) mu[v] = terms.center(c0 + v);
    }
  };
  // Each lane adds its rows in order either way: the same bits.
  if constexpr (pipelined_sums<Terms, V>()) {
    int first = r0 + threadIdx.y;
    int count = live && first < r1 ? (r1 - first + 7) / 8 : 0;
    auto addr = [&](int j, int k) { return terms.input(k, first + 8 * j, c0); };
    auto use = [&](int j, auto piece) {
      terms.template add<V>(first + 8 * j, c0, mu, a, b, LoadStaged<V, decltype(piece)>{piece});
    };
    // The centers (an activation's forward constants: 5 loads a column) load once the first rows
    // are in flight, not before them.
    if constexpr (kKeeps) {
      pipelined_rows_in<kSumStages, Terms::kInputs>(
          count,
          [&](int j, int k) {
            return j < kept.rows ? kept.slot(j, k) : ring_slot<kSumStages, Terms::kInputs>(scratch, j, k);
          },
          addr, use, centers);
    } else {
      pipelined_rows<kSumStages, Terms::kInputs>(count, scratch, addr, use, centers);
    }
    __syncthreads();  // the slots are `sh` below
  } else if (live) {
    centers();
#pragma unroll 4
    for (int r = r0 + threadIdx.y; r < r1; r += 8) terms.template add<V>(r, c0, mu, a, b, LoadGlobal<V>{});
  }
  auto& sh = *reinterpret_cast<PartialsShared<V>*>(scratch);
  if constexpr (kOneWarp) {
#pragma unroll
    for (int v = 0; v < V; ++v) {
      sh[0][threadIdx.y][threadIdx.x * V + v] = a[v];
      sh[1][threadIdx.y][threadIdx.x * V + v] = b[v];
    }
    __syncthreads();
    if (threadIdx.y == 0 && live) {
      for (int i = 1; i < 8; ++i) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          a[v] += sh[0][i][threadIdx.x * V + v];
          b[v] += sh[1][i][threadIdx.x * V + v];
        }
      }
#pragma unroll
      for (int v = 0; v < V; ++v) {
        pa[chunk * static_cast<int64_t>(n) + c0 + v] = a[v];
        pb[chunk * static_cast<int64_t>(n) + c0 + v] = b[v];
      }
    }
  } else {
    every_warp_partials<V>(sh, a, b, n, group, chunk, pa, pb);
  }
  __syncthreads();  // before a caller's next item may overwrite `sh`
}

template <class Terms, int V>
__global__ void column_partials_kernel(Terms terms, int m, int n, int rows, double* __restrict__ pa,
                                       double* __restrict__ pb) {
  __shared__ uint4 scratch[partials_scratch<Terms, V>() / sizeof(uint4)];
  chunk_partials<Terms, V>(terms, m, n, rows, blockIdx.x, blockIdx.y, pa, pb, scratch);
}

// Both sums of `terms` over all m rows into out[0:n], out[n:2n], in chunks of rows_of(m, groups)
// rows (groups: of 32 V columns, V as the launch reads them), through 2 x chunks x n doubles of
// workspace; the second sum centered on `center` where given (reduce_partials). ld and ptrs: the
// strides and pointers `terms` reads, which decide whether it may read 16-byte groups.
template <class T, class Terms, class Rows>
void column_sums(Terms const& terms, int m, int n, int64_t ld, std::initializer_list<void const*> ptrs, double* out,
                 double* workspace, double const* center, cudaStream_t stream, Rows&& rows_of) {
  constexpr int V = 16 / sizeof(T);
  bool vec = can_vectorize<T>(n, ld, ptrs);
  unsigned groups = blocks(n, 32 * (vec ? V : 1));
  int rows = rows_of(m, static_cast<int>(groups)), chunks = (m + rows - 1) / rows;
  double* pb = workspace + static_cast<int64_t>(chunks) * n;
  if (vec) {
    column_partials_kernel<Terms, V><<<dim3(groups, chunks), dim3(32, 8), 0, stream>>>(terms, m, n, rows, workspace,
                                                                                      pb);
  } else {
    column_partials_kernel<Terms, 1><<<dim3(groups, chunks), dim3(32, 8), 0, stream>>>(terms, m, n, rows, workspace,
                                                                                      pb);
  }
  check_cuda(cudaGetLastError(), "column_partials");
  reduce_partials(workspace, pb, chunks, n, n, out, stream, center);
}

// Column c's statistics of z = h * scale, in fp64 (var is biased, as BN normalizes).
struct Moments {
  double mean_h, mean_z, var_z;
};

// A column's vectors besides its sums, loaded together before any of the column's stores. Loaded
// where each was used, after stores that may alias them for all the compiler knows, each took its
// own memory round trip while the rest of the block waited (ncu). With the small tail's per-chunk
// sums that tail measured faster, the cooperative tail level (docs/decisions.md, "Training tails").
// Held in fp32, exact for every vector dtype (fp32, bf16, fp16), to spare registers.
struct ColumnInputs {
  float scale = 1, weight = 1, bias = 0, running_mean = 0, running_var = 0;
};

__device__ ColumnInputs column_inputs(FinalizeArgs const& a, ColOut rm, ColOut rv, int c) {
  ColVec mean{rm.p, rm.dt}, var{rv.p, rv.dt};
  uint32_t bits[5] = {load_bits(a.scale, c), load_bits(a.weight, c), load_bits(a.bias, c), load_bits(mean, c),
                      load_bits(var, c)};  // every load before any conversion (load_bits)
  auto f = [](double x) { return static_cast<float>(x); };
  return {f(from_bits(a.scale, bits[0], 1.0)), f(from_bits(a.weight, bits[1], 1.0)), f(from_bits(a.bias, bits[2], 0.0)),
          f(from_bits(mean, bits[3], 0.0)), f(from_bits(var, bits[4], 0.0))};
}

// From column c's sum and sum of squares of h, and its scale s. Explicitly rounded operations:
// the fused training kernel and the split ops must get the same bits, and
// whether nvcc contracts a * b - c into an fma depends on the inlining context.
__device__ Moments moments(double sum, double sumsq, double s, double count) {
  double mean_h = __ddiv_rn(sum, count);
  // Clamped at 0 against cancellation, but NaN kept (fmax(NaN, 0) is 0): a column with a NaN or
  // an Inf has a NaN variance, as in PyTorch, and so do y and running_var.
  double var_h = __dsub_rn(__ddiv_rn(sumsq, count), __dmul_rn(mean_h, mean_h));
  var_h = var_h < 0.0 ? 0.0 : var_h;
  return {mean_h, __dmul_rn(s, mean_h), __dmul_rn(__dmul_rn(s, s), var_h)};
}

// 1 / sqrt(var_z + eps), the same bits in every kernel (see moments); 0 where var_z and eps are
// both 0, as PyTorch's InvStd (torch versions that take eps = 0 in training).
__device__ double inverse_std(double var_z, double eps) {
  if (var_z == 0.0 && eps == 0.0) return 0.0;
  return __ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(var_z, eps)));
}

// Per-column constants of y = (h - mean_h) * mul + b, rounded once to A.
template <class A>
struct Column {
  A mean_h, mul, b;
};

// BN(z) for one element, before the activation: the forward's value, which the backward
// recomputes with the same bits for the activation's derivative.
template <class T, class A>
__device__ __forceinline__ A pre_activation(Column<A> const& col, T h) {
  return (A(to_float(h)) - col.mean_h) * col.mul + col.b;
}

// A group of y from h's group and its columns (col[v]): every training tail and finalize writes y
// through this, so all get the same bits. Act: whether an activation may be set. The kernels
// without one compile without it: inside the element loop, its gelu and silu arms left the
// fp32 -> fp32 tail 10/20 spilled STL/LDL (2/2 without; sm_90). With one, it is chosen once a group
// (with_activation). A wider y beside 16-bit h runs the Act kernel all the same (batch_norm_train).
template <class TO, bool Act, int V, class T, class Cols>
__device__ __forceinline__ Group<TO, V> normalized(Cols const& col, Group<T, V> const& h, Activation act, float slope) {
  auto each = [&](auto k) {
    Group<TO, V> out;
#pragma unroll
    for (int v = 0; v < V; ++v) out.v[v] = from_float<TO>(activate(pre_activation(col[v], h.v[v]), decltype(k)::value, slope));
    return out;
  };
  if constexpr (Act) return with_activation(act, each);
  else return each(std::integral_constant<Activation, Activation::none>{});
}

// Column c's constants from its moments and 1 / std: finalize and both training tails build
// them here, so all normalize with the same bits.
template <class A>
__device__ Column<A> column_of(Moments const& mo, double invstd, ColumnInputs const& in) {
  return {static_cast<A>(mo.mean_h), static_cast<A>(double{in.scale} * invstd * double{in.weight}),
          static_cast<A>(double{in.bias})};
}

template <class A>
__device__ Column<A> column(FinalizeArgs const& a, int c) {
  ColumnInputs in = column_inputs(a, {}, {}, c);
  Moments mo = moments(a.stats[c], a.stats[a.n + c], in.scale, a.count);
  double invstd = inverse_std(mo.var_z, a.eps);
  Column<A> col = column_of<A>(mo, invstd, in);
  if (blockIdx.y == 0) {  // one thread a column (block_columns)
    a.save_mean[c] = mo.mean_h;
    a.save_invstd[c] = invstd;
  }
  return col;
}

// running = (1 - m) running + m batch; the variance unbiased, as nn.BatchNorm1d keeps it.
// old_mean, old_var: the running stats' values before this batch (column_inputs).
__device__ void update_running(Moments mo, double count, double m, double old_mean, double old_var, ColOut rm,
                               ColOut rv, int c) {
  double unbiased = __ddiv_rn(__dmul_rn(mo.var_z, count), count - 1);  // explicit: see moments
  store(rm, c, __dadd_rn(__dmul_rn(1 - m, old_mean), __dmul_rn(m, mo.mean_z)));
  store(rv, c, __dadd_rn(__dmul_rn(1 - m, old_var), __dmul_rn(m, unbiased)));
}

// Column c's constants from its sums s and q of h. With `outputs` (one thread a column), also
// its saved mean and 1 / std, its running stats, and, with `sums`, s and q themselves: every
// training tail finishes a column here, so all write the same bits.
template <class A>
__device__ Column<A> finish_column(TrainArgs const& a, int c, double s, double q, ColumnInputs const& in, bool outputs,
                                   bool sums = true) {
  FinalizeArgs const& f = a.norm;
  Moments mo = moments(s, q, in.scale, f.count);
  double invstd = inverse_std(mo.var_z, f.eps);
  if (outputs) {
    if (sums) {
      a.stats[c] = s;
      a.stats[f.n + c] = q;
    }
    f.save_mean[c] = mo.mean_h;
    f.save_invstd[c] = invstd;
    if (a.running_mean.p != nullptr) {
      double m = a.cumulative ? 1.0 / static_cast<double>(*a.num_batches_tracked) : a.momentum;
      update_running(mo, f.count, m, in.running_mean, in.running_var, a.running_mean, a.running_var, c);
    }
  }
  return column_of<A>(mo, invstd, in);
}

// The per-column constants of a block's 32 V columns: each computed once, by
// one of the block's 256 threads (fp64 division and square root are slow
// enough that all 8 row lanes computing them cost more than the data pass),
// then shared. Every thread of the block must call it.
// Spread: in shared memory as words, a lane's V columns an odd number of words after the lane
// before's, so that the 32 lanes, each reading its columns' k-th word, meet 32 banks. As an
// array of Col, a lane's columns are V W words apart (W: a column's words), a multiple of 8:
// 8-way conflicts or worse, eight warps over. The backward's dh and cooperative kernels take it:
// dh measured slower with a 6-word GradColumn (48 words a lane, 16-way) than with 7 words (56,
// 8-way), and fastest spread. Not the forward tails: their kernels, at their register bounds,
// spilled (docs/decisions.md, "Backward").
template <int V, bool Spread = false, class Col, class Make>
__device__ void block_columns(int n, int group, Col (&col)[V], Make&& make) {
  int base = group * 32 * V;
  if constexpr (!Spread) {
    __shared__ Col shared[32 * V];
    for (int i = threadIdx.y * 32 + threadIdx.x; i < 32 * V; i += 256) {
      if (base + i < n) shared[i] = make(base + i);
    }
    __syncthreads();
#pragma unroll
    for (int v = 0; v < V; ++v) col[v] = shared[threadIdx.x * V + v];
  } else {
    static_assert(sizeof(Col) % 4 == 0, "columns of whole words");
    constexpr int W = sizeof(Col) / 4, kLane = (V * W) | 1;
    __shared__ uint32_t shared[32 * kLane];
    for (int i = threadIdx.y * 32 + threadIdx.x; i < 32 * V; i += 256) {
      if (base + i < n) {
        Col c = make(base + i);
#pragma unroll
        for (int w = 0; w < W; ++w) shared[i / V * kLane + i % V * W + w] = reinterpret_cast<uint32_t const*>(&c)[w];
      }
    }
    __syncthreads();
#pragma unroll
    for (int v = 0; v < V; ++v) {
#pragma unroll
      for (int w = 0; w < W; ++w) reinterpret_cast<uint32_t*>(&col[v])[w] = shared[threadIdx.x * kLane + v * W + w];
    }
  }
  __syncthreads();  // before a caller's next group may overwrite `shared`
}

// Block: 32 column groups of V columns x 8 row lanes; each lane takes R rows
// at a time, 8 apart, issuing their loads before any of their math.
// y = (h - mean_h) * mul + b for rows [begin, end) of columns c0 .. c0 + V,
// this thread's row lane taking R rows at a time, 8 apart, `step` rows per round.
template <class T, class TO, bool Act, int V, int R, class A>
__device__ void normalize_round(FinalizeArgs const& a, int c0, Column<A> const (&col)[V], int64_t r0, int64_t end) {
  auto const* h = static_cast<T const*>(a.h);
  auto* y = static_cast<TO*>(a.y);
  bool whole = whole_warp_row<V>(c0, a.n);
  {
    Group<T, V> in[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (r0 + 8 * i < end) in[i] = load_group<T, V>(h + (r0 + 8 * i) * a.ldh + c0);
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (r0 + 8 * i >= end) break;
      store_warp_row<TO, V, false>(y + (r0 + 8 * i) * a.n + c0, normalized<TO, Act>(col, in[i], a.act, a.slope), whole);
    }
  }
}

// Rows [begin, end) of columns c0 .. c0 + V, last rows first, through pipelined_rows.
template <class T, class TO, bool Act, int V, int S, class A>
__device__ void normalize_rows_pipelined(FinalizeArgs const& a, int c0, Column<A> const (&col)[V], int64_t begin,
                                         int64_t end, uint4* stage) {
  static_assert(sizeof(Group<T, V>) == 16, "16-byte groups only");
  auto const* h = static_cast<T const*>(a.h);
  auto* y = static_cast<TO*>(a.y);
  int64_t first = begin + threadIdx.y;
  int count = first < end ? static_cast<int>((end - first + 7) / 8) : 0;
  auto row = [&](int j) { return first + 8 * static_cast<int64_t>(count - 1 - j); };
  bool whole = whole_warp_row<V>(c0, a.n);
  pipelined_rows<S, 1>(
      count, stage, [&](int j, int) { return h + row(j) * a.ldh + c0; },
      [&](int j, auto piece) {
        auto in = *reinterpret_cast<Group<T, V> const*>(piece(0));
        store_warp_row<TO, V, true>(y + row(j) * a.n + c0, normalized<TO, Act>(col, in, a.act, a.slope), whole);
      });
}

template <class T, class TO, bool Act, int V, int R, class A>
__device__ void normalize_rows(FinalizeArgs const& a, int c0, Column<A> const (&col)[V], int64_t begin, int64_t end,
                               int64_t step) {
  for (int64_t r0 = begin + threadIdx.y; r0 < end; r0 += step) normalize_round<T, TO, Act, V, R>(a, c0, col, r0, end);
}

// Commit groups of the slab's loads: the normalization starts on the first rows while the
// rest are in flight.
constexpr int kSlabGroups = 4;

// Waits until at most n (< kSlabGroups) of this thread's cp.async groups are in flight; n is
// an immediate of the instruction, so callers pass a constant after unrolling.
__device__ __forceinline__ void wait_async_groups(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 3;\n" ::: "memory");
  }
}

// This thread's rows of a slab of `pieces` 16-byte pieces a row (see batch_norm_train_slab_kernel)
// in commit group g: rows tid / pieces + i * 256 / pieces, the i of group g.
template <class Use>
__device__ __forceinline__ void slab_rows(int g, int m, int pieces, Use&& use) {
  int step = 256 / pieces, per_group = (m + step * kSlabGroups - 1) / (step * kSlabGroups);
  for (int i = g * per_group, r = threadIdx.x / pieces + i * step; i < (g + 1) * per_group && r < m; ++i, r += step)
    use(r);
}

// The exact sums of a slab's columns (W = pieces x V from column base; one slab an input of
// Terms, all landed) into sums[0 or 1][chunk][W], in chunk_partials' order: a warp takes one
// piece of 4 chunks at a time, 8 row lanes a chunk, each lane adding its rows in order; the lanes
// are added in lane order through shuffles. Half a piece at a time (the columns' sums are
// independent): a whole piece's fp64 sums spilled under the 80 registers of three blocks an SM.
// Every thread of the block calls it.
template <class Terms, int V>
__device__ void slab_chunk_sums(Terms const& terms, uint4 const* const (&slabs)[Terms::kInputs], int m, int n,
                                int rows, int chunks, int pieces, int base, double* __restrict__ sums) {
  constexpr int H = V / 2;
  int width = pieces * V, warp = threadIdx.x / 32, lane = threadIdx.x % 32, row_lane = lane % 8;
  int p = warp % pieces;
  for (int half = 0; half < 2; ++half) {
    int h0 = base + p * V + half * H;
    if (h0 >= n) break;  // uniform over the warp (n % V == 0: pieces are whole)
    typename Terms::Center mu[H];
#pragma unroll
    for (int v = 0; v < H; ++v) mu[v] = terms.center(h0 + v);
    for (int first = warp / pieces * 4; first < chunks; first += 32 / pieces) {
      int chunk = first + lane / 8;
      double sa[H] = {}, sb[H] = {};
      if (chunk < chunks) {
        int end = min(m, (chunk + 1) * rows);
        for (int r = chunk * rows + row_lane; r < end; r += 8) {
          auto piece = [&](int k) { return reinterpret_cast<char const*>(slabs[k] + r * pieces + p) + half * 8; };
          terms.template add<H>(r, h0, mu, sa, sb, LoadStaged<H, decltype(piece)>{piece});
        }
      }
      for (int i = 1; i < 8; ++i) {
#pragma unroll
        for (int v = 0; v < H; ++v) {
          double oa = __shfl_sync(0xffffffffu, sa[v], lane - row_lane + i);
          double ob = __shfl_sync(0xffffffffu, sb[v], lane - row_lane + i);
          if (row_lane == 0) {
            sa[v] += oa;
            sb[v] += ob;
          }
        }
      }
      if (row_lane == 0 && chunk < chunks) {
#pragma unroll
        for (int v = 0; v < H; ++v) {
          sums[chunk * width + p * V + half * H + v] = sa[v];
          sums[(chunks + chunk) * width + p * V + half * H + v] = sb[v];
        }
      }
    }
  }
}

// Column j's totals of slab_chunk_sums' output, its chunks added in order (reduce_partials').
__device__ __forceinline__ void slab_totals(double const* sums, int chunks, int width, int j, double& a, double& b) {
  a = 0;
  b = 0;
  for (int k = 0; k < chunks; ++k) {
    a += sums[k * width + j];
    b += sums[(chunks + k) * width + j];
  }
}

// The V columns of this thread's piece, from the block's `cols` (one a slab column).
template <int V, class C>
__device__ __forceinline__ void piece_columns(C const* cols, int piece, C (&col)[V]) {
#pragma unroll
  for (int v = 0; v < V; ++v) col[v] = cols[piece * V + v];
}

// Launches an elementwise row pass over m x n (see finalize_normalize_kernel)
// with 16-byte groups where can_vectorize allows, else single columns. At least R rows a
// thread and at most max_blocks blocks: the launchers' choices, measured (docs/decisions.md, "Row passes"):
// finalize R = 4 (its rows in flight) and up to 4096 blocks; grad_input ~1024 blocks (and R:
// kGradInputRows).
template <class T, int R, class Launch>
void launch_rows(int m, int n, int64_t ld, std::initializer_list<void const*> ptrs, unsigned max_blocks,
                 Launch&& launch) {
  constexpr int V = 16 / sizeof(T);
  bool vec = can_vectorize<T>(n, ld, ptrs);
  unsigned gx = blocks(n, 32 * (vec ? V : 1));
  dim3 grid(gx, std::max(1u, std::min(blocks(m, 8 * R), max_blocks / gx + 1)));
  if (vec)
    launch(std::integral_constant<int, V>{}, grid);
  else
    launch(std::integral_constant<int, 1>{}, grid);
}

// Dynamic shared memory of a slab kernel: its slabs, `sum_rows` rows of sums, its columns.
template <class Column>
size_t slab_smem(int m, int inputs, int sum_rows, int pieces, int v) {
  size_t width = static_cast<size_t>(pieces) * v;
  return static_cast<size_t>(m) * pieces * 16 * inputs + 2 * sizeof(double) * sum_rows * width +
         sizeof(Column) * width;
}

// A bound on every slab kernel's shared memory: at most 32 chunks of sums and 64 columns of at
// most 32 bytes each.
constexpr size_t kSlabSharedMax = limits::kSlabBytes + (2 * sizeof(double) * 32 + 32) * 64;

// cache[device]: ask() (a positive int) on the device's first call, as the CUDA runtime's answers
// about a kernel cost host time on every call and devices of different archs may differ.
using DeviceCache = std::array<std::atomic<int>, 64>;
template <class Ask>
int once_per_device(DeviceCache& cache, int device, Ask&& ask) {
  if (int known = device < 64 ? cache[device].load() : 0; known != 0) return known;
  int v = ask();
  if (device < 64) cache[device] = v;
  return v;
}

// The current device: the launchers' caches are per device.
int current_device() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

// Lets Kernel take kSlabSharedMax bytes of dynamic shared memory on the current device.
template <auto Kernel>
void allow_slab() {
  static DeviceCache done{};
  once_per_device(done, current_device(), [] {
    check_cuda(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSlabSharedMax),
               "slab kernel shared memory");
    return 1;
  });
}

// Kernel(params...) as a cooperative launch of `grid` blocks of 32 x 8 threads with `shared`
// bytes of dynamic shared memory. The parameters are taken by value: the launch reads them
// through pointers, and their types must be the kernel's.
template <auto Kernel, class... Params>
void launch_grid_synced(int grid, size_t shared, cudaStream_t stream, char const* what, Params... params) {
  void* pointers[] = {&params...};
  check_cuda(cudaLaunchCooperativeKernel(reinterpret_cast<void const*>(Kernel), dim3(grid), dim3(32, 8), pointers,
                                         shared, stream),
             what);
}

// Launches a cooperative Kernel(args, rows, chunks, groups) over the (column group of v columns,
// row chunk) items of n columns, all blocks resident at once as its grid barrier needs: its grid is
// at most what the occupancy calculator fits on sm_count SMs.
template <auto Kernel, class Args>
void launch_cooperative(Args const& args, int n, int sm_count, int rows, int chunks, int v, cudaStream_t stream,
                        char const* what) {
  static DeviceCache per_sm{};
  int fit = once_per_device(per_sm, current_device(), [what] {
    int blocks_per_sm = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, Kernel, 256, 0), what);
    return blocks_per_sm;
  });
  int groups = static_cast<int>(blocks(n, 32 * v));
  int grid = std::max(1, std::min(groups * chunks, fit * sm_count));
  launch_grid_synced<Kernel>(grid, 0, stream, what, args, rows, chunks, groups);
}

}  // namespace
}  // namespace cutlass_fused
