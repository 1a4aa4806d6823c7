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

#include "kernels/batch_norm.h"
#include "kernels/check.h"

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

template <class F>
void dispatch(DType dt, F&& f) {
  switch (dt) {
    case DType::bf16: f(__nv_bfloat16{}); break;
    case DType::f16: f(__half{}); break;
    case DType::f32: f(float{}); break;
  }
}

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

// Element c of a per-column vector as fp64; `none` where the vector is absent.
__device__ __forceinline__ double load(ColVec v, int c, double none) {
  if (v.p == nullptr) return none;
  switch (v.dt) {
    case DType::bf16: return __bfloat162float(static_cast<__nv_bfloat16 const*>(v.p)[c]);
    case DType::f16: return __half2float(static_cast<__half const*>(v.p)[c]);
    default: return static_cast<float const*>(v.p)[c];
  }
}

// Stores through fp32, as PyTorch computes these vectors in fp32 and rounds once more.
__device__ __forceinline__ void store(ColOut v, int c, double x) {
  float f = static_cast<float>(x);
  switch (v.dt) {
    case DType::bf16: static_cast<__nv_bfloat16*>(v.p)[c] = __float2bfloat16(f); break;
    case DType::f16: static_cast<__half*>(v.p)[c] = __float2half(f); break;
    default: static_cast<float*>(v.p)[c] = f;
  }
}

struct NoSums {};  // a tag for P = void (batch_norm_train_kernel)

unsigned blocks(int64_t work, int per_block) { return static_cast<unsigned>((work + per_block - 1) / per_block); }

__global__ void reduce_partials_kernel(double const* __restrict__ psum, double const* __restrict__ psumsq, int rows,
                                       int64_t ld, int n, double* __restrict__ stats) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= n) return;
  double s = 0, q = 0;
  for (int r = 0; r < rows; ++r) {
    s += psum[r * ld + c];
    q += psumsq[r * ld + c];
  }
  stats[c] = s;
  stats[n + c] = q;
}

// A group of V consecutive elements, moved as one 16-byte access when that is
// its size (the launchers pick V so that every such access is aligned).
template <class T, int V>
struct alignas(sizeof(T) * V) Group {
  T v[V];
};

template <class T, int V>
__device__ __forceinline__ Group<T, V> load_group(T const* p) {
  Group<T, V> g;
  if constexpr (sizeof(g) == 16) {
    *reinterpret_cast<uint4*>(&g) = *reinterpret_cast<uint4 const*>(p);
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) g.v[v] = p[v];
  }
  return g;
}

template <class T, int V>
__device__ __forceinline__ void store_group(T* p, Group<T, V> const& g) {
  if constexpr (sizeof(g) == 16) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<uint4 const*>(&g);
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) p[v] = g.v[v];
  }
}

// y is written once, evict-first (st.global.cs), to leave L2 to the lines of h the GEMM wrote
// last: 0.2-1.1 us less in the pipelined tail at 1024 x 8192^2, level at larger h (NOTES.md v0.14).
template <class T, int V>
__device__ __forceinline__ void store_group_once(T* p, Group<T, V> const& g) {
  if constexpr (sizeof(g) == 16) {
    __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<uint4 const*>(&g));
  } else {
    store_group<T, V>(p, g);
  }
}

// 16 bytes from global to shared memory, bypassing L1 (cp.async.cg).
__device__ __forceinline__ void copy_async(uint4* dst, void const* src) {
  unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}

// A thread's rows through a cp.async pipeline: row j (0 <= j < count) is K 16-byte pieces
// (one a tensor it reads), fetched S - 1 rows ahead into this thread's own slots of `stage`
// (S * K * 256 slots: blocks of 32 x 8 threads), then handed to use(j, piece) in order. Loads in
// flight live in shared memory, not registers: the row passes run under 64-96 registers a thread,
// where two rows in registers reached ~2.3-2.6 TB/s at 16384 x 4096 and a copy ~2.9 (H100,
// NOTES.md v0.14). Only the issuing thread reads a slot, so wait_group alone orders it.
template <int S, int K, class Addr, class Use>
__device__ __forceinline__ void pipelined_rows(int count, uint4* stage, Addr&& addr, Use&& use) {
  int tid = threadIdx.y * 32 + threadIdx.x;
  auto slot = [&](int j, int k) { return stage + ((j % S) * K + k) * 256 + tid; };
  auto issue = [&](int j) {
    if (j < count) {
#pragma unroll
      for (int k = 0; k < K; ++k) copy_async(slot(j, k), addr(j, k));
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
#pragma unroll
  for (int j = 0; j < S - 1; ++j) issue(j);
  for (int j = 0; j < count; ++j) {
    issue(j + S - 1);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 1) : "memory");
    use(j, [&](int k) { return slot(j, k); });
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
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

// V for 16-byte groups of `bytes`-byte elements when n, the row strides and every pointer
// allow it; 1 otherwise (unaligned sizes such as 769 columns).
bool can_vectorize_bytes(int bytes, int n, int64_t ld, std::initializer_list<void const*> ptrs) {
  int v = 16 / bytes;
  bool ok = n % v == 0 && ld % v == 0;
  for (void const* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  return ok;
}

template <class T>
bool can_vectorize(int n, int64_t ld, std::initializer_list<void const*> ptrs) {
  return can_vectorize_bytes(sizeof(T), n, ld, ptrs);
}

// Column reductions: chunks of rows, 32 column groups x 8 row lanes a block;
// each lane walks its rows of a chunk in order and the lanes are combined in
// order, then reduce_partials adds the chunks in order, so results are
// bitwise stable. The chunk size depends on m only: at most 32 chunks, which
// bounds the fp64 partials at 64 n doubles, of at least 64 rows, or 16 for
// m <= 256, where there are few blocks and each lane's rows are latency.
int stat_rows(int m) { return std::max(m <= 256 ? 16 : 64, (m + 32 * 8 - 1) / (32 * 8) * 8); }
int stat_chunks(int m) { return (m + stat_rows(m) - 1) / stat_rows(m); }

// h -> (h, h^2): the forward statistics. With `scale` (an fp16 y, so the unfused model rounds
// z = h * scale to fp16), an element whose z overflows counts as +-inf, as the unfused model's
// infinite z makes its column's mean infinite and its variance NaN. Only fp16: bf16 shares
// fp32's range (z overflows bf16 only past 3.39e38), and the check's registers made the bf16
// kernel spill (benchmarks/NOTES.md v0.8).
template <class T>
struct SumSquares {
  T const* h; int64_t ldh;
  ColVec scale{};
  static constexpr bool kOverflow = std::is_same_v<T, __half>;
  __device__ double center(int c) const { return kOverflow ? load(scale, c, 1.0) : 0.0; }  // the column's scale
  static constexpr bool kPipelined = true;  // one 16-byte piece a row when V > 1
  static constexpr int kInputs = 1;
  __device__ void const* input(int, int64_t r, int c0) const { return h + r * ldh + c0; }
  template <int V, class Load>
  __device__ void add(int64_t r, int c0, double const (&s)[V], double (&a)[V], double (&b)[V], Load const& load) const {
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

// (dy, h) -> (dy, dy (h - mean_h)): the backward's sums.
template <class T, class TY>
struct GradSums {
  TY const* dy; T const* h; int64_t ldh; int n; double const* mean_h;
  __device__ double center(int c) const { return mean_h[c]; }
  static constexpr bool kPipelined = sizeof(TY) == sizeof(T);  // dy's groups are 16 bytes too
  static constexpr int kInputs = 2;
  __device__ void const* input(int k, int64_t r, int c0) const {
    return k == 0 ? static_cast<void const*>(dy + r * n + c0) : static_cast<void const*>(h + r * ldh + c0);
  }
  template <int V, class Load>
  __device__ void add(int64_t r, int c0, double const (&mu)[V], double (&a)[V], double (&b)[V], Load const& load) const {
    auto g = load(0, dy + r * n + c0);
    auto x = load(1, h + r * ldh + c0);
#pragma unroll
    for (int v = 0; v < V; ++v) {
      double d = to_float(g.v[v]);
      a[v] += d;
      b[v] += d * (static_cast<double>(to_float(x.v[v])) - mu[v]);
    }
  }
};

// The partial sums of column group `group` (32 V columns) over row chunk
// `chunk`, into row `chunk` of pa and pb. Every thread of the block calls it.
template <int V>
using PartialsShared = double[2][8][32 * V];

// Stages of the pipelined two-tensor passes (column sums, grad_input): 32 KiB of slots a block
// for dy and h. H100, bf16 16384 x 4096: column sums 118.1 -> 105.8 us, grad_input 153.6
// -> 142.0 (two runs, NOTES.md v0.14).
constexpr int kSumStages = 4;

template <class Terms, int V>
constexpr bool pipelined_sums() { return V > 1 && Terms::kPipelined; }

// Shared memory chunk_partials needs: its pipeline's slots, then the lanes' sums (one buffer).
template <class Terms, int V>
constexpr int partials_scratch() {
  return std::max<int>(sizeof(PartialsShared<V>), pipelined_sums<Terms, V>() ? kSumStages * Terms::kInputs * 4096 : 0);
}

template <class Terms, int V>
__device__ void chunk_partials(Terms const& terms, int m, int n, int rows, int group, int chunk,
                               double* __restrict__ pa, double* __restrict__ pb, uint4* scratch) {
  int c0 = (group * 32 + threadIdx.x) * V;  // n % V == 0 when V > 1: groups are whole
  int r0 = chunk * rows;
  int r1 = min(m, r0 + rows);
  double a[V] = {}, b[V] = {}, mu[V];
  bool live = c0 < n;
  if (live) {
#pragma unroll
    for (int v = 0; v < V; ++v) mu[v] = terms.center(c0 + v);
  }
  // Each lane adds its rows in order either way: the same bits.
  if constexpr (pipelined_sums<Terms, V>()) {
    int first = r0 + threadIdx.y;
    int count = live && first < r1 ? (r1 - first + 7) / 8 : 0;
    pipelined_rows<kSumStages, Terms::kInputs>(
        count, scratch, [&](int j, int k) { return terms.input(k, first + 8 * j, c0); },
        [&](int j, auto piece) {
          terms.template add<V>(first + 8 * j, c0, mu, a, b, LoadStaged<V, decltype(piece)>{piece});
        });
    __syncthreads();  // the slots are `sh` below
  } else if (live) {
#pragma unroll 4
    for (int r = r0 + threadIdx.y; r < r1; r += 8) terms.template add<V>(r, c0, mu, a, b, LoadGlobal<V>{});
  }
  auto& sh = *reinterpret_cast<PartialsShared<V>*>(scratch);
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
  __syncthreads();  // before a caller's next item may overwrite `sh`
}

template <class Terms, int V>
__global__ void column_partials_kernel(Terms terms, int m, int n, int rows, double* __restrict__ pa,
                                       double* __restrict__ pb) {
  __shared__ uint4 scratch[partials_scratch<Terms, V>() / sizeof(uint4)];
  chunk_partials<Terms, V>(terms, m, n, rows, blockIdx.x, blockIdx.y, pa, pb, scratch);
}

// Both sums of `terms` over all m rows into out[0:n], out[n:2n], through
// 2 x stat_chunks(m) x n doubles of workspace. ld and ptrs: the strides and
// pointers `terms` reads, which decide whether it may read 16-byte groups.
template <class T, class Terms>
void column_sums(Terms const& terms, int m, int n, int64_t ld, std::initializer_list<void const*> ptrs, double* out,
                 double* workspace, cudaStream_t stream) {
  int rows = stat_rows(m), chunks = stat_chunks(m);
  double* pb = workspace + static_cast<int64_t>(chunks) * n;
  constexpr int V = 16 / sizeof(T);
  if (can_vectorize<T>(n, ld, ptrs)) {
    column_partials_kernel<Terms, V><<<dim3(blocks(n, 32 * V), chunks), dim3(32, 8), 0, stream>>>(
        terms, m, n, rows, workspace, pb);
  } else {
    column_partials_kernel<Terms, 1><<<dim3(blocks(n, 32), chunks), dim3(32, 8), 0, stream>>>(terms, m, n, rows,
                                                                                            workspace, pb);
  }
  check_cuda(cudaGetLastError(), "column_partials");
  reduce_partials(workspace, pb, chunks, n, n, out, stream);
}

// Column c's statistics of z = h * scale, in fp64 (var is biased, as BN normalizes).
struct Moments {
  double mean_h, mean_z, var_z;
};

// A column's vectors besides its sums, loaded together before any of the column's stores. Loaded
// where each was used, after stores that may alias them for all the compiler knows, each took its
// own memory round trip while the rest of the block waited (ncu). With the small tail's per-chunk
// sums: that tail 9.5 -> 8.9 us at bf16 128 x 8192; the cooperative tail level (H100,
// benchmarks/NOTES.md v0.17). Held in fp32, exact for every vector dtype (fp32, bf16, fp16),
// to spare registers.
struct ColumnInputs {
  float scale = 1, weight = 1, bias = 0, running_mean = 0, running_var = 0;
};

__device__ ColumnInputs column_inputs(FinalizeArgs const& a, ColOut rm, ColOut rv, int c) {
  auto f = [](double x) { return static_cast<float>(x); };
  return {f(load(a.scale, c, 1.0)), f(load(a.weight, c, 1.0)), f(load(a.bias, c, 0.0)), f(load({rm.p, rm.dt}, c, 0.0)),
          f(load({rv.p, rv.dt}, c, 0.0))};
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

// 1 / sqrt(var_z + eps), the same bits in every kernel (see moments).
__device__ double inverse_std(double var_z, double eps) { return __ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(var_z, eps))); }

// Per-column constants of y = (h - mean_h) * mul + b, rounded once to A.
template <class A>
struct Column {
  A mean_h, mul, b;
};

// One element of y: every training tail and finalize writes y through this, so all get the same bits.
template <class TO, class T, class A>
__device__ __forceinline__ TO normalized(Column<A> const& col, T h) {
  return from_float<TO>((A(to_float(h)) - col.mean_h) * col.mul + col.b);
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

__global__ void update_running_kernel(int n, double const* __restrict__ stats, ColVec scale, double count, ColOut rm,
                                      ColOut rv, int64_t const* nbt, double momentum) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= n) return;
  double m = nbt ? 1.0 / static_cast<double>(*nbt) : momentum;
  double old_mean = load({rm.p, rm.dt}, c, 0.0), old_var = load({rv.p, rv.dt}, c, 0.0);
  update_running(moments(stats[c], stats[n + c], load(scale, c, 1.0), count), count, m, old_mean, old_var, rm, rv, c);
}

// The per-column constants of a block's 32 V columns: each computed once, by
// one of the block's 256 threads (fp64 division and square root are slow
// enough that all 8 row lanes computing them cost more than the data pass),
// then shared. Every thread of the block must call it.
template <int V, class Col, class Make>
__device__ void block_columns(int n, int group, Col (&col)[V], Make&& make) {
  __shared__ Col shared[32 * V];
  int base = group * 32 * V;
  for (int i = threadIdx.y * 32 + threadIdx.x; i < 32 * V; i += 256) {
    if (base + i < n) shared[i] = make(base + i);
  }
  __syncthreads();
#pragma unroll
  for (int v = 0; v < V; ++v) col[v] = shared[threadIdx.x * V + v];
  __syncthreads();  // before a caller's next group may overwrite `shared`
}

// Block: 32 column groups of V columns x 8 row lanes; each lane takes R rows
// at a time, 8 apart, issuing their loads before any of their math.
// y = (h - mean_h) * mul + b for rows [begin, end) of columns c0 .. c0 + V,
// this thread's row lane taking R rows at a time, 8 apart, `step` rows per round.
template <class T, class TO, int V, int R, class A>
__device__ void normalize_round(FinalizeArgs const& a, int c0, Column<A> const (&col)[V], int64_t r0, int64_t end) {
  auto const* h = static_cast<T const*>(a.h);
  auto* y = static_cast<TO*>(a.y);
  {
    Group<T, V> in[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (r0 + 8 * i < end) in[i] = load_group<T, V>(h + (r0 + 8 * i) * a.ldh + c0);
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (r0 + 8 * i >= end) break;
      Group<TO, V> out;
#pragma unroll
      for (int v = 0; v < V; ++v)
        out.v[v] = normalized<TO>(col[v], in[i].v[v]);
      store_group<TO, V>(y + (r0 + 8 * i) * a.n + c0, out);
    }
  }
}

// Rows [begin, end) of columns c0 .. c0 + V, last rows first, through pipelined_rows.
template <class T, class TO, int V, int S, class A>
__device__ void normalize_rows_pipelined(FinalizeArgs const& a, int c0, Column<A> const (&col)[V], int64_t begin,
                                         int64_t end, uint4* stage) {
  static_assert(sizeof(Group<T, V>) == 16, "16-byte groups only");
  auto const* h = static_cast<T const*>(a.h);
  auto* y = static_cast<TO*>(a.y);
  int64_t first = begin + threadIdx.y;
  int count = first < end ? static_cast<int>((end - first + 7) / 8) : 0;
  auto row = [&](int j) { return first + 8 * static_cast<int64_t>(count - 1 - j); };
  pipelined_rows<S, 1>(
      count, stage, [&](int j, int) { return h + row(j) * a.ldh + c0; },
      [&](int j, auto piece) {
        auto in = *reinterpret_cast<Group<T, V> const*>(piece(0));
        Group<TO, V> out;
#pragma unroll
        for (int v = 0; v < V; ++v)
          out.v[v] = normalized<TO>(col[v], in.v[v]);
        store_group_once<TO, V>(y + row(j) * a.n + c0, out);
      });
}

template <class T, class TO, int V, int R, class A>
__device__ void normalize_rows(FinalizeArgs const& a, int c0, Column<A> const (&col)[V], int64_t begin, int64_t end,
                               int64_t step) {
  for (int64_t r0 = begin + threadIdx.y; r0 < end; r0 += step) normalize_round<T, TO, V, R>(a, c0, col, r0, end);
}

template <class T, class TO, int V, int R>
__global__ void finalize_normalize_kernel(FinalizeArgs a) {
  using A = Acc<T>;
  Column<A> col[V];
  block_columns<V>(a.n, blockIdx.x, col, [&](int c) { return column<A>(a, c); });
  int c0 = (blockIdx.x * 32 + threadIdx.x) * V;  // n % V == 0 when V > 1: groups are whole
  if (c0 >= a.n) return;
  normalize_rows<T, TO, V, R>(a, c0, col, blockIdx.y * 8 * R, a.m, int64_t{gridDim.y} * 8 * R);
}

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

// Where the unfused model rounds z = h * scale to T and it can overflow there (SumSquares).
template <class T, class TO>
constexpr bool kZOverflows = std::is_same_v<T, __half> && std::is_same_v<T, TO>;

// Work items are (column group, row chunk), column groups fastest so that the
// blocks in flight read neighbouring columns of the same rows; each block
// takes the same items in both phases, so phase 2 mostly re-reads h from L2.
// P: the type of the GEMM's tile sums (float or double), or void where the
// statistics are the exact pass's alone.
template <class T, class TO, int V, int R, class P>
__global__ void __launch_bounds__(256, 4) batch_norm_train_kernel(TrainArgs a, int rows, int chunks, int groups) {
  using A = Acc<T>;
  constexpr bool FromGemm = !std::is_void_v<P>;
  FinalizeArgs const& f = a.norm;
  auto* pa = static_cast<double*>(a.workspace);
  auto* pb = pa + static_cast<int64_t>(chunks) * f.n;
  auto* exact = reinterpret_cast<unsigned char*>(pb + static_cast<int64_t>(chunks) * f.n);  // FromGemm only
  int items = groups * chunks;
  // One buffer for the three phases: phase 0's lane sums, phase 1's slots and partials, phase 2's
  // slots (separate arrays exceeded the 48 KiB of static shared memory). 6 stages in phase 2:
  // tail 98.1 us against 99.8 with 4 and 98.7 with 8 (bf16 16384 x 4096^2, H100).
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
    // blocks waited at the barrier cost 0.6-2.6 us more at 16384 rows (64 tiles), ~1 us less at
    // 1024-4096 rows (4-16 tiles; H100, NOTES.md v0.14).
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
        exact[c] = !gemm_sums_trusted<P, kZOverflows<T, TO>>(s, q, f.count, load(f.scale, c, 1.0));
        a.stats[c] = s;
        a.stats[f.n + c] = q;
      }
      __syncthreads();  // before the next slice overwrites `lanes`
    }
    if (a.num_batches_tracked != nullptr && blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0)
      *a.num_batches_tracked += 1;  // before the barrier: the second one may be skipped
    cooperative_groups::this_grid().sync();
  }
  // z = h * scale is rounded to T where y is T (see SumSquares: fp16 only).
  SumSquares<T> terms{static_cast<T const*>(f.h), f.ldh, std::is_same_v<T, TO> ? f.scale : ColVec{}};
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    int group = item % groups;
    if constexpr (FromGemm) {  // only column groups with a column to redo; uniform over the block
      int c0 = (group * 32 + threadIdx.x) * V;
      bool need = false;
      // No early exit, which made each flag's load wait on the last (ncu: ~11% of the tail's
      // samples at bf16 256 x 8192; level in wall time, H100).
#pragma unroll
      for (int v = 0; v < V; ++v) need |= c0 + v < f.n && exact[c0 + v];
      if (!__syncthreads_or(need)) continue;
    }
    chunk_partials<SumSquares<T>, V>(terms, f.m, f.n, rows, group, item / groups, pa, pb, stage);
  }
  if (!FromGemm && a.num_batches_tracked != nullptr && blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0)
    *a.num_batches_tracked += 1;  // read by every block after the barrier (cumulative momentum)
  // With the GEMM's sums, phase 2 needs this barrier only for the exact partials of flagged
  // columns. Every block reads all the flags, so all take the same branch (else: deadlock).
  bool any_exact = !FromGemm;
  if constexpr (FromGemm) {
    // Independent word loads (exact is 8-byte aligned; its bytes are 0 or 1): with an early
    // exit, each load waited on the last, ~3 us at 8192 columns (H100).
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
        // loads, which come from L2 at ~1 us each, are in flight together.
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
    // L2 when h exceeds it (2.5% less time at 16384 x 4096, H100).
    if constexpr (kPipelined) {
      if (c0 < f.n) normalize_rows_pipelined<T, TO, V, kStages>(f, c0, col, begin, end, stage);
    } else if (c0 < f.n) {
      for (int64_t k = (end - begin - 1) / (8 * R); k >= 0; --k)
        normalize_round<T, TO, V, R>(f, c0, col, begin + k * 8 * R + threadIdx.y, end);
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
template <class T, class TO, int V, int K>
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
  // z = h * scale is rounded to T where y is T (see SumSquares: fp16 only).
  SumSquares<T> terms{static_cast<T const*>(f.h), f.ldh, std::is_same_v<T, TO> ? f.scale : ColVec{}};
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
    Group<TO, V> out;
#pragma unroll
    for (int v = 0; v < V; ++v) out.v[v] = normalized<TO>(cols[g * V + v], held[k].v[v]);
    store_group_once<TO, V>(y + (r0 + 8 * k) * f.n + c0, out);
  }
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
    double mu[H];
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

// The training tail where a block holds every row of its columns in shared memory: a slab of
// m rows x `pieces` 16-byte pieces (W = pieces x V columns), all fetched at once. A block needs
// no other block's data, so there is no grid barrier: the column constants come from the GEMM's
// tile sums while the slab is in flight, and h is read once. Columns those sums cannot be
// trusted with, and batches without them, take the exact sums from the slab. The sums follow
// batch_norm_train_kernel's orders (phase 0's for tile sums; chunk_partials' and reduce_partials'
// for exact ones), so both kernels write the same bits. num_batches_tracked is only incremented
// (momentum given: no block reads it). Shared memory: slab_smem.
template <class T, class TO, class P>
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
      exact = !gemm_sums_trusted<P, kZOverflows<T, TO>>(s, q, f.count, in.scale);
    }
  }
  // The exact sums, where a column of the block needs them (uniform over the block).
  if (__syncthreads_or(owner && exact)) {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();  // other threads' pieces
    // z = h * scale is rounded to T where y is T (see SumSquares: fp16 only).
    SumSquares<T> terms{h, f.ldh, std::is_same_v<T, TO> ? f.scale : ColVec{}};
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
      Group<TO, V> out;
#pragma unroll
      for (int v = 0; v < V; ++v) out.v[v] = normalized<TO>(col[v], in.v[v]);
      store_group_once<TO, V>(y + static_cast<int64_t>(r) * f.n + c0, out);
    });
  }
}

// Per-column constants of dh = a dy + b (h - mean_h) + c.
template <class A>
struct GradColumn {
  A mean_h, a, b, c;
};

// From column c's sums of dy and dy (h - mean_h); with `outputs` (one thread a column), also
// its dscale, dweight and dbias.
template <class A>
__device__ GradColumn<A> grad_column(BackwardArgs const& g, double sdy, double q, int c, bool outputs) {
  double count = g.m;
  double s = load(g.scale, c, 1.0), istd = g.invstd[c];
  double w = load(g.weight, c, 1.0);
  double a = s * w * istd;
  if (outputs) {
    store(g.dbias, c, sdy);
    store(g.dweight, c, istd * s * q);
    // sum_i dz_i h_i = w istd q (1 - istd^2 var(z)) = w istd q eps istd^2: BN is
    // invariant to scale but for eps, and this form has no cancellation.
    store(g.dscale, c, w * istd * q * g.eps * istd * istd);
  }
  return {static_cast<A>(g.mean_h[c]), static_cast<A>(a), static_cast<A>(-a * s * s * istd * istd * q / count),
          static_cast<A>(-a * sdy / count)};
}

template <class T, class TY, int V, class A>
__device__ __forceinline__ Group<T, V> grad_input(GradColumn<A> const (&col)[V], Group<TY, V> const& dy,
                                                  Group<T, V> const& h) {
  Group<T, V> out;
#pragma unroll
  for (int v = 0; v < V; ++v) {
    GradColumn<A> const& k = col[v];
    out.v[v] = from_float<T>(k.a * A(to_float(dy.v[v])) + k.b * (A(to_float(h.v[v])) - k.mean_h) + k.c);
  }
  return out;
}

// The unpipelined rows: R at a time in registers (single columns, or a wider dy).
template <class T, class TY, int V, int R, class A>
__device__ void grad_input_rows(BackwardArgs const& g, GradColumn<A> const (&col)[V], int c0, TY const* dy, T const* h,
                                T* dh) {
  for (int64_t r0 = blockIdx.y * 8 * R + threadIdx.y; r0 < g.m; r0 += int64_t{gridDim.y} * 8 * R) {
    Group<TY, V> in_dy[R];
    Group<T, V> in_h[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      int64_t r = r0 + 8 * i;
      if (r < g.m) {
        in_dy[i] = load_group<TY, V>(dy + r * g.n + c0);
        in_h[i] = load_group<T, V>(h + r * g.ldh + c0);
      }
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (r0 + 8 * i >= g.m) break;
      store_group<T, V>(dh + (r0 + 8 * i) * g.n + c0, grad_input<T, TY, V>(col, in_dy[i], in_h[i]));
    }
  }
}

template <class T, class TY, int V, int R>
__global__ void grad_input_kernel(BackwardArgs g, double const* __restrict__ sums) {
  using A = Acc<T>;
  // dy and h of kSumStages rows a thread in flight (pipelined_rows), read as the column sums
  // read them (GradSums), where both come in 16-byte groups.
  using Terms = GradSums<T, TY>;
  constexpr bool kPipelined = pipelined_sums<Terms, V>();
  __shared__ uint4 stage[kPipelined ? kSumStages * Terms::kInputs * 256 : 1];
  GradColumn<A> col[V];
  block_columns<V>(g.n, blockIdx.x, col, [&](int c) { return grad_column<A>(g, sums[c], sums[g.n + c], c, blockIdx.y == 0); });
  int c0 = (blockIdx.x * 32 + threadIdx.x) * V;
  if (c0 >= g.n) return;
  auto const* dy = static_cast<TY const*>(g.dy);
  auto const* h = static_cast<T const*>(g.h);
  auto* dh = static_cast<T*>(g.dh);
  if constexpr (kPipelined) {
    Terms terms{dy, h, g.ldh, g.n, g.mean_h};
    int64_t first = blockIdx.y * 8 + threadIdx.y, step = int64_t{gridDim.y} * 8;
    int count = first < g.m ? static_cast<int>((g.m - first + step - 1) / step) : 0;
    pipelined_rows<kSumStages, Terms::kInputs>(
        count, stage, [&](int j, int k) { return terms.input(k, first + j * step, c0); },
        [&](int j, auto piece) {
          auto const& d = *reinterpret_cast<Group<TY, V> const*>(piece(0));
          auto const& x = *reinterpret_cast<Group<T, V> const*>(piece(1));
          store_group<T, V>(dh + (first + j * step) * g.n + c0, grad_input<T, TY, V>(col, d, x));
        });
  } else {
    grad_input_rows<T, TY, V, R>(g, col, c0, dy, h, dh);
  }
}

// The backward's BN part in one cooperative launch, for batches past the slab kernel's: the
// column sums' chunk partials (column_partials' items and order), one grid barrier, then each
// item's column totals in reduce_partials' order and dh over its chunk's rows, which the same
// block read before the barrier (from L2 where dy and h fit there). The two passes' bits, in one
// launch instead of three. dy in h's dtype, 16-byte groups (the pipelined rows). 80 registers
// (kBackwardBlocksPerSm blocks an SM; ptxas: 72-92 bytes of spill stores for 16-bit h on sm_90).
constexpr int kBackwardBlocksPerSm = 3;

template <class T, int V>
__global__ void __launch_bounds__(256, kBackwardBlocksPerSm) batch_norm_backward_kernel(BackwardArgs g, int rows,
                                                                                        int chunks, int groups) {
  using A = Acc<T>;
  using Terms = GradSums<T, T>;
  static_assert(pipelined_sums<Terms, V>(), "the cooperative backward streams 16-byte groups of dy and h");
  auto* pa = static_cast<double*>(g.workspace) + 2 * static_cast<int64_t>(g.n);  // batch_norm_backward's layout
  auto* pb = pa + static_cast<int64_t>(chunks) * g.n;
  __shared__ uint4 stage[partials_scratch<Terms, V>() / sizeof(uint4)];
  Terms terms{static_cast<T const*>(g.dy), static_cast<T const*>(g.h), g.ldh, g.n, g.mean_h};
  int items = groups * chunks;
  for (int item = blockIdx.x; item < items; item += gridDim.x)
    chunk_partials<Terms, V>(terms, g.m, g.n, rows, item % groups, item / groups, pa, pb, stage);
  cooperative_groups::this_grid().sync();
  auto* dh = static_cast<T*>(g.dh);
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    int group = item % groups, chunk = item / groups;
    GradColumn<A> col[V];
    block_columns<V>(g.n, group, col, [&](int c) {
      double sdy = 0, q = 0;
#pragma unroll 8
      for (int r = 0; r < chunks; ++r) {
        sdy += pa[r * static_cast<int64_t>(g.n) + c];
        q += pb[r * static_cast<int64_t>(g.n) + c];
      }
      return grad_column<A>(g, sdy, q, c, chunk == 0);
    });
    int c0 = (group * 32 + threadIdx.x) * V;
    int64_t first = static_cast<int64_t>(chunk) * rows + threadIdx.y;
    int64_t end = std::min<int64_t>(g.m, static_cast<int64_t>(chunk + 1) * rows);
    int count = c0 < g.n && first < end ? static_cast<int>((end - first + 7) / 8) : 0;
    pipelined_rows<kSumStages, Terms::kInputs>(
        count, stage, [&](int j, int k) { return terms.input(k, first + 8 * j, c0); },
        [&](int j, auto piece) {
          auto const& d = *reinterpret_cast<Group<T, V> const*>(piece(0));
          auto const& x = *reinterpret_cast<Group<T, V> const*>(piece(1));
          store_group<T, V>(dh + (first + 8 * j) * g.n + c0, grad_input<T, T, V>(col, d, x));
        });
  }
}

// The backward for a block that holds every row of its columns, dy's and h's, in shared memory
// (two slabs, as batch_norm_train_slab_kernel holds h): the sums in chunk_partials' and
// reduce_partials' orders, so the two passes' bits, then dh, dscale, dweight and dbias, in one
// launch instead of three. dy in h's dtype. Shared memory: slab_smem.
template <class T, int V>
__global__ void __launch_bounds__(256, 3) batch_norm_backward_slab_kernel(BackwardArgs g, int rows, int chunks,
                                                                          int pieces) {
  using A = Acc<T>;
  int tid = threadIdx.x, width = pieces * V, base = blockIdx.x * width;
  extern __shared__ uint4 smem[];
  uint4* slab_dy = smem;
  uint4* slab_h = slab_dy + g.m * pieces;
  auto* sums = reinterpret_cast<double*>(slab_h + g.m * pieces);  // [2][chunks][width]
  auto* cols = reinterpret_cast<GradColumn<A>*>(sums + 2 * chunks * width);
  int piece = tid % pieces, c0 = base + piece * V;
  bool live = c0 < g.n;
  auto const* dy = static_cast<T const*>(g.dy);
  auto const* h = static_cast<T const*>(g.h);
  if (live) {
    for (int r = tid / pieces; r < g.m; r += 256 / pieces) {
      copy_async(slab_dy + r * pieces + piece, dy + static_cast<int64_t>(r) * g.n + c0);
      copy_async(slab_h + r * pieces + piece, h + r * g.ldh + c0);
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();
  slab_chunk_sums<GradSums<T, T>, V>(GradSums<T, T>{dy, h, g.ldh, g.n, g.mean_h}, {slab_dy, slab_h}, g.m, g.n, rows,
                                     chunks, pieces, base, sums);
  __syncthreads();
  if (int c = base + tid; tid < width && c < g.n) {
    double sdy, q;
    slab_totals(sums, chunks, width, tid, sdy, q);
    cols[tid] = grad_column<A>(g, sdy, q, c, true);
  }
  __syncthreads();
  if (!live) return;
  GradColumn<A> col[V];
  piece_columns(cols, piece, col);
  auto* dh = static_cast<T*>(g.dh);
  for (int r = tid / pieces; r < g.m; r += 256 / pieces) {
    auto const& d = *reinterpret_cast<Group<T, V> const*>(slab_dy + r * pieces + piece);
    auto const& x = *reinterpret_cast<Group<T, V> const*>(slab_h + r * pieces + piece);
    store_group<T, V>(dh + static_cast<int64_t>(r) * g.n + c0, grad_input<T, T, V>(col, d, x));
  }
}

// Launches an elementwise row pass over m x n (see finalize_normalize_kernel)
// with 16-byte groups where can_vectorize allows, else single columns. R rows
// in flight and at most max_blocks blocks: the launchers' choices, measured
// on an H200 (bf16, 1024 x 8192, cold L2): finalize 27 -> 15 us with R = 4 and
// up to 4096 blocks; grad_input was fastest with R = 1 and ~1024 blocks.
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

__global__ void fold_eval_kernel(int n, int kn, ColVec scale, ColVec w, ColVec b, ColVec rm, ColVec rv, double eps,
                                 float* __restrict__ out_a, float* __restrict__ out_c, float* __restrict__ out_s) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= kn) return;
  if (c >= n) {
    out_a[c] = out_c[c] = 0.0f;
    if (out_s != nullptr) out_s[c] = 0.0f;
    return;
  }
  double g = load(w, c, 1.0) / sqrt(load(rv, c, 1.0) + eps);
  if (out_s != nullptr) out_s[c] = static_cast<float>(load(scale, c, 1.0));
  out_a[c] = static_cast<float>(out_s != nullptr ? g : load(scale, c, 1.0) * g);
  out_c[c] = static_cast<float>(load(b, c, 0.0) - load(rm, c, 0.0) * g);
}

}  // namespace

void reduce_partials(double const* partial_sum, double const* partial_sumsq, int rows, int64_t ld, int n,
                     double* stats, cudaStream_t stream) {
  reduce_partials_kernel<<<blocks(n, 256), 256, 0, stream>>>(partial_sum, partial_sumsq, rows, ld, n, stats);
  check_cuda(cudaGetLastError(), "reduce_partials");
}

size_t column_stats_workspace(int m, int n) {
  return 2 * sizeof(double) * static_cast<size_t>(stat_chunks(m)) * n;
}

void column_stats(DType dt, void const* h, int m, int n, int64_t ldh, double* stats, void* workspace,
                  cudaStream_t stream) {
  dispatch(dt, [&](auto t) {
    using T = decltype(t);
    column_sums<T>(SumSquares<T>{static_cast<T const*>(h), ldh}, m, n, ldh, {h}, stats,
                   static_cast<double*>(workspace), stream);
  });
}

void finalize_normalize(FinalizeArgs const& a, cudaStream_t stream) {
  dispatch_pair(a.dt, a.dt_y, [&](auto t, auto to) {
    using T = decltype(t);
    using TO = decltype(to);
    launch_rows<T, 4>(a.m, a.n, a.ldh, {a.h, a.y}, 4096, [&](auto v, dim3 grid) {
      finalize_normalize_kernel<T, TO, decltype(v)::value, 4><<<grid, dim3(32, 8), 0, stream>>>(a);
    });
  });
  check_cuda(cudaGetLastError(), "finalize_normalize");
}

// The partials, then one flag byte a column (the GEMM-statistics path).
size_t batch_norm_train_workspace(int m, int n) { return column_stats_workspace(m, n) + n; }

// The small kernel where it measured faster: 16-bit h, at most 128 rows (8 chunks of 16: 4
// column groups a block, 64 bytes of a row; 2 rows a thread). Tail us, cooperative -> small,
// H100: bf16 128 x 8192 11.7 -> 9.5 (train in graphs 0.0761 -> 0.0739 ms); 256 x 8192 (2
// groups a block) 11.4 -> 16.0; TF32 128 x 8192 10.4 -> 11.1, 256 x 8192 17.4 -> 21.0; sm80
// bf16 1024 x 8192 (8 rows a thread) ~24.6 -> 34.2. Its row pieces are 32-64 bytes where the
// cooperative kernel's are 512. With 2 rows a thread it holds at most 256 rows (16 a chunk).
constexpr int kSmallRows = 128, kSmallRowsPerThread = 2, kSmallRowsMax = 256;

// Slabs of at most 64 KiB, so that three blocks fit an SM (227 KiB on Hopper, 163 on A100).
constexpr int kSlabBytes = 64 * 1024;

// The slab kernel where it measured faster: 16-bit h, more rows than the small kernel takes and
// at most 512, rows of at least 64 bytes (4 pieces) in a grid that fills the GPU. Tail us,
// cooperative -> slab (H100, 3 rounds): bf16 with the GEMM's sums, 8192 columns (256 slabs of
// 32 columns): 256 rows 11.5 -> 8.2, 512 rows 11.1 -> 9.8; fp16 (exact sums) 256 x 8192 20.8 ->
// 17.9, 512 x 8192 18.0 -> 18.2. Not taken: 32-byte rows (4096 columns: bf16 256 rows 12.2 ->
// 16.6, fp16 13.4 -> 16.3), 1024 rows (bf16 16.3 -> 16.8, both at the speed of a copy of h),
// 2048 rows (30.0 -> 40.5), 128 rows (the small kernel: 8.8 -> 11.7) and fp32 h (TF32
// 512 x 4096^2 11.1 -> 15.2, 1024 x 8192^2 29.1 -> 32.5). benchmarks/NOTES.md v0.18.
constexpr int kSlabRows = 512;

// Pieces of a slab row: the widest of 8, 4 and 2 (128 to 32 bytes, whole sectors) whose slabs
// (one an input) fit and whose grid fills every SM (any grid where a slab kernel is asked for);
// 0: none.
int slab_pieces(int m, int n, int v, int inputs, int sm_count, bool any_grid) {
  for (int p : {8, 4, 2}) {
    bool fits = int64_t{m} * p * 16 * inputs <= kSlabBytes;
    if (fits && (any_grid || static_cast<int64_t>(blocks(n, p * v)) >= sm_count)) return p;
  }
  return 0;
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
constexpr size_t kSlabSharedMax = kSlabBytes + (2 * sizeof(double) * 32 + 32) * 64;

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

// Launches a cooperative Kernel(args, rows, chunks, groups) over the (column group of v columns,
// row chunk) items of n columns, 32 x 8 threads a block, all blocks resident at once as its grid
// barrier needs: its grid is at most what the occupancy calculator fits on sm_count SMs.
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
  Args copy = args;
  void* params[] = {&copy, &rows, &chunks, &groups};
  check_cuda(cudaLaunchCooperativeKernel(reinterpret_cast<void const*>(Kernel), dim3(grid), dim3(32, 8), params, 0,
                                         stream),
             what);
}

// The tail for `a` (see TrainArgs::tail), with its slab pieces; throws where a forced tail
// cannot run.
Tail pick_tail(TrainArgs const& a, bool vec, int bytes, int* pieces) {
  FinalizeArgs const& f = a.norm;
  bool small = bytes == 2 && !a.cumulative && f.m <= (a.tail == Tail::small ? kSmallRowsMax : kSmallRows);
  *pieces = vec && !a.cumulative ? slab_pieces(f.m, f.n, 16 / bytes, 1, a.sm_count, a.tail == Tail::slab) : 0;
  switch (a.tail) {
    case Tail::automatic:
      if (small) return Tail::small;
      return bytes == 2 && f.m <= kSlabRows && *pieces >= 4 ? Tail::slab : Tail::cooperative;
    case Tail::small:
      if (!small)
        throw std::runtime_error("cutlass_fused: the small training tail needs 16-bit h, at most 256 rows and "
                                 "a momentum");
      return Tail::small;
    case Tail::slab:
      if (*pieces == 0)
        throw std::runtime_error("cutlass_fused: the slab training tail needs 16-byte aligned columns, a "
                                 "momentum, and at most " + std::to_string(kSlabBytes / 32) + " rows of 32 bytes");
      return Tail::slab;
    default: return Tail::cooperative;
  }
}

void batch_norm_train(TrainArgs const& a, cudaStream_t stream) {
  FinalizeArgs const& f = a.norm;
  int rows = stat_rows(f.m), chunks = stat_chunks(f.m);
  dispatch_pair(f.dt, f.dt_y, [&](auto t, auto to) {
    using T = decltype(t);
    using TO = decltype(to);
    constexpr int V = 16 / sizeof(T);
    bool vec = can_vectorize<T>(f.n, f.ldh, {f.h, f.y});
    int pieces = 0;
    Tail tail = pick_tail(a, vec, sizeof(T), &pieces);
    // P: the GEMM's sums' type, void without them.
    auto launch = [&](auto p) {
      using P = std::conditional_t<std::is_same_v<decltype(p), NoSums>, void, decltype(p)>;
      if (tail == Tail::slab) {
        constexpr auto kernel = batch_norm_train_slab_kernel<T, TO, P>;
        allow_slab<kernel>();
        size_t smem = slab_smem<Column<Acc<T>>>(f.m, 1, std::max(chunks, 8), pieces, V);
        kernel<<<blocks(f.n, pieces * V), 256, smem, stream>>>(a, rows, chunks, pieces);
        check_cuda(cudaGetLastError(), "batch_norm_train");
      } else if (vec) {
        // R = 2: with 4 rows in flight the kernel spills under its 64 registers
        // and ran 30-40% slower (H100, benchmarks/NOTES.md v0.8).
        launch_cooperative<batch_norm_train_kernel<T, TO, V, 2, P>>(a, f.n, a.sm_count, rows, chunks, V, stream,
                                                                     "batch_norm_train");
      } else {
        launch_cooperative<batch_norm_train_kernel<T, TO, 1, 2, P>>(a, f.n, a.sm_count, rows, chunks, 1, stream,
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
        if (vec) return small(batch_norm_train_small_kernel<T, TO, V, kSmallRowsPerThread>, V);
        return small(batch_norm_train_small_kernel<T, TO, 1, kSmallRowsPerThread>, 1);
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
}

size_t batch_norm_backward_workspace(int m, int n) {
  return column_stats_workspace(m, n) + 2 * sizeof(double) * static_cast<size_t>(n);
}

// The backward's kernels for g (see BackwardArgs::kernels), with the slab kernel's pieces; throws
// where a forced kernel cannot run. The slab kernel where it measured faster: as the training
// tail's (kSlabRows), with dy in h's dtype (benchmarks/NOTES.md v0.18). The cooperative kernel
// (dy in h's dtype, 16-byte groups) for 16-bit batches past that where every block takes one
// item a phase. GPU us, passes -> cooperative (H100, benchmarks/NOTES.md v0.19): bf16 768 x 8192
// 34.8 -> 27.3, fp16 32.5 -> 23.8; with two items a block or more it lost: bf16 1024 x 8192 43.7
// -> 54.2, 2048 x 8192 80.3 -> 92.5, 4096 x 4096 76.3 -> 92.3, 16384 x 4096 246.3 -> 306.1.
BackwardKernels pick_backward(BackwardArgs const& g, int bytes, int* pieces) {
  bool streams = g.dt_dy == g.dt && can_vectorize_bytes(bytes, g.n, g.ldh, {g.dy, g.h, g.dh});
  *pieces = streams ? slab_pieces(g.m, g.n, 16 / bytes, 2, g.sm_count, g.kernels == BackwardKernels::slab) : 0;
  int64_t items = int64_t{blocks(g.n, 32 * (16 / bytes))} * stat_chunks(g.m);
  switch (g.kernels) {
    case BackwardKernels::automatic:
      if (bytes != 2) return BackwardKernels::passes;
      if (g.m <= kSlabRows && *pieces >= 4) return BackwardKernels::slab;
      return streams && g.m > kSlabRows && items <= int64_t{kBackwardBlocksPerSm} * g.sm_count
                 ? BackwardKernels::cooperative
                 : BackwardKernels::passes;
    case BackwardKernels::slab:
      if (*pieces == 0)
        throw std::runtime_error("cutlass_fused: the slab backward needs dy in h's dtype, 16-byte aligned columns and "
                                 "at most " + std::to_string(kSlabBytes / 64) + " rows of 32 bytes");
      return BackwardKernels::slab;
    case BackwardKernels::cooperative:
      if (!streams)
        throw std::runtime_error("cutlass_fused: the cooperative backward needs dy in h's dtype and 16-byte aligned "
                                 "columns");
      return BackwardKernels::cooperative;
    default: return BackwardKernels::passes;
  }
}

void batch_norm_backward(BackwardArgs const& g, cudaStream_t stream) {
  auto* sums = static_cast<double*>(g.workspace);
  auto* partials = sums + 2 * static_cast<int64_t>(g.n);
  dispatch_pair(g.dt, g.dt_dy, [&](auto t, auto ty) {
    using T = decltype(t);
    using TY = decltype(ty);
    constexpr int V = 16 / sizeof(T);
    int pieces = 0;
    BackwardKernels kernels = pick_backward(g, sizeof(T), &pieces);
    if constexpr (std::is_same_v<T, TY>) {
      if (kernels == BackwardKernels::slab) {
        constexpr auto kernel = batch_norm_backward_slab_kernel<T, V>;
        allow_slab<kernel>();
        int chunks = stat_chunks(g.m);
        size_t smem = slab_smem<GradColumn<Acc<T>>>(g.m, 2, chunks, pieces, V);
        kernel<<<blocks(g.n, pieces * V), 256, smem, stream>>>(g, stat_rows(g.m), chunks, pieces);
        return;
      }
      if (kernels == BackwardKernels::cooperative) {
        launch_cooperative<batch_norm_backward_kernel<T, V>>(g, g.n, g.sm_count, stat_rows(g.m), stat_chunks(g.m), V,
                                                             stream, "batch_norm_backward");
        return;
      }
    }
    GradSums<T, TY> terms{static_cast<TY const*>(g.dy), static_cast<T const*>(g.h), g.ldh, g.n, g.mean_h};
    column_sums<T>(terms, g.m, g.n, g.ldh, {g.dy, g.h}, sums, partials, stream);
    launch_rows<T, 1>(g.m, g.n, g.ldh, {g.h, g.dy, g.dh}, 1024, [&](auto v, dim3 grid) {
      grad_input_kernel<T, TY, decltype(v)::value, 1><<<grid, dim3(32, 8), 0, stream>>>(g, sums);
    });
  });
  check_cuda(cudaGetLastError(), "batch_norm_backward");
}

void update_running_stats(int n, double const* stats, ColVec scale, double count, ColOut running_mean,
                          ColOut running_var, int64_t const* num_batches_tracked, double momentum,
                          cudaStream_t stream) {
  update_running_kernel<<<blocks(n, 256), 256, 0, stream>>>(n, stats, scale, count, running_mean, running_var,
                                                             num_batches_tracked, momentum);
  check_cuda(cudaGetLastError(), "update_running_stats");
}

void fold_eval(int n, int kn, ColVec scale, ColVec weight, ColVec bias, ColVec running_mean, ColVec running_var,
               double eps, float* out_a, float* out_c, float* out_s, cudaStream_t stream) {
  fold_eval_kernel<<<blocks(kn, 256), 256, 0, stream>>>(n, kn, scale, weight, bias, running_mean, running_var, eps,
                                                        out_a, out_c, out_s);
  check_cuda(cudaGetLastError(), "fold_eval");
}

}  // namespace cutlass_fused
