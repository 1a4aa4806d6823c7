// The training-mode BatchNorm backward: two passes, the slab kernel or one cooperative kernel
// (batch_norm.h, BackwardArgs; the plan picks one).
#include "kernels/bn_common.cuh"

namespace cutlass_fused {
namespace {

// The forward's Column of c, with column_of's bits: the activation's derivative is taken at the
// very value the forward activated.
template <class A>
__device__ Column<A> forward_column(BackwardArgs const& g, int c) {
  uint32_t scale = load_bits(g.scale, c), weight = load_bits(g.weight, c), bias = load_bits(g.bias, c);
  double s = static_cast<float>(from_bits(g.scale, scale, 1.0));
  double w = static_cast<float>(from_bits(g.weight, weight, 1.0));
  return {static_cast<A>(g.mean_h[c]), static_cast<A>(s * g.invstd[c] * w),
          static_cast<A>(double{static_cast<float>(from_bits(g.bias, bias, 0.0))})};
}

// The gradient of BN(z) at one element: dy, times the activation K's derivative there.
template <Activation K, class T, class TY, class A>
__device__ __forceinline__ A bn_grad(Column<A> const& fwd, TY dy, T h, float slope) {
  A d = A(to_float(dy));
  if constexpr (K == Activation::none) return d;
  return d * activation_grad(pre_activation(fwd, h), K, slope);
}

// Which activations a kernel takes (ActSet, types.h). A template value, so that the kernels
// without an activation hold no forward constants in registers (the cooperative kernel already
// spills under its 80), and relu's kernels are not sized by the transcendental arms: with all five
// in one kernel, each chosen once a group, the column partials took 168 registers (1 block an SM)
// and the cooperative kernel's spills doubled, both slower (docs/decisions.md, "Training step").
template <class F>
void dispatch_act_set(Activation act, F&& f) {
  switch (act_set(act)) {
    case ActSet::none: f(std::integral_constant<ActSet, ActSet::none>{}); break;
    case ActSet::select: f(std::integral_constant<ActSet, ActSet::select>{}); break;
    default: f(std::integral_constant<ActSet, ActSet::smooth>{});
  }
}

// f(K) for g's activation K, chosen once a group of elements by uniform ifs (with_activation's
// reason: a runtime act tested per element compiled to jump tables), among Set's.
// The select set has one arm, leaky_relu's, which is relu's with slope 0 (grad_slope): the same
// bits (dy times 1 or 0), where relu's and leaky_relu's arms, chosen once a group, were both
// issued, predicated (sm_90 SASS of the column partials).
template <ActSet Set, class F>
__device__ __forceinline__ decltype(auto) per_activation(BackwardArgs const& g, F&& f) {
  using K = Activation;
  if constexpr (Set == ActSet::none) {
    return f(std::integral_constant<K, K::none>{});
  } else if constexpr (Set == ActSet::select) {
    return f(std::integral_constant<K, K::leaky_relu>{});
  } else {
    if (g.act == K::gelu) return f(std::integral_constant<K, K::gelu>{});
    if (g.act == K::gelu_tanh) return f(std::integral_constant<K, K::gelu_tanh>{});
    return f(std::integral_constant<K, K::silu>{});
  }
}

// The negative slope per_activation's select arm takes: 0 for relu.
__device__ __forceinline__ float grad_slope(BackwardArgs const& g) {
  return g.act == Activation::relu ? 0.f : g.slope;
}

// (dy, h) -> (g, g h): the backward's sums, g = bn_grad(dy), uncentered; the reductions then
// take mean_h out once a column (centered). A row costs one fp64 add and one fma a column, where
// g (h - mean_h) cost two adds and a multiply.
template <class T, class TY, ActSet Act>
struct GradSums {
  using A = Acc<T>;
  using Center = Column<A>;  // BN(z)'s constants where there is an activation
  BackwardArgs args;  // a copy: the two-pass path hands GradSums to a kernel by value
  TY const* dy; T const* h;
  __device__ Center center(int c) const { return Act != ActSet::none ? forward_column<A>(args, c) : Column<A>{}; }
  static constexpr bool kPipelined = sizeof(TY) == sizeof(T);  // dy's groups are 16 bytes too
  static constexpr int kInputs = 2;
  __device__ void const* input(int k, int64_t r, int c0) const {
    return k == 0 ? static_cast<void const*>(dy + r * args.n + c0) : static_cast<void const*>(h + r * args.ldh + c0);
  }
  template <int V, class Load>
  __device__ void add(int64_t r, int c0, Center const (&mu)[V], double (&a)[V], double (&b)[V], Load const& load) const {
    auto d = load(0, dy + r * args.n + c0);
    auto x = load(1, h + r * args.ldh + c0);
    float slope = grad_slope(args);
    per_activation<Act>(args, [&](auto k) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        double e = bn_grad<decltype(k)::value>(mu[v], d.v[v], x.v[v], slope);
        a[v] += e;
        b[v] = __fma_rn(e, static_cast<double>(to_float(x.v[v])), b[v]);
      }
    });
  }
};

// Per-column constants of dh = a g + b (h - mean_h) + c, g = bn_grad(dy): fwd holds mean_h for
// both (once: a register a column), and BN(z)'s other constants where there is an activation.
template <class A>
struct GradColumn {
  Column<A> fwd;
  A a, b, c;
};

// From column c's sums of g and g (h - mean_h) over `count` rows; with `outputs` (one thread a
// column), also its dscale, dweight and dbias.
template <class A, ActSet Act>
__device__ GradColumn<A> grad_column(BackwardArgs const& g, double sdy, double q, double count, int c, bool outputs) {
  uint32_t scale = load_bits(g.scale, c), weight = load_bits(g.weight, c);
  double s = from_bits(g.scale, scale, 1.0), istd = g.invstd[c];
  double w = from_bits(g.weight, weight, 1.0);
  double a = s * w * istd;
  if (outputs) {
    store(g.dbias, c, sdy);
    store(g.dweight, c, istd * s * q);
    // sum_i dz_i h_i = w istd q (1 - istd^2 var(z)) = w istd q eps istd^2: BN is
    // invariant to scale but for eps, and this form has no cancellation.
    double dscale = w * istd * q * g.eps * istd * istd;
    if (g.dscale.p != nullptr) store(g.dscale, c, dscale);  // none without a per-column scale
    // The bits of dscale (as stored) times 0.0 in scale's dtype, which the autograd computed before.
    if (g.dlinear_bias.p != nullptr) store(g.dlinear_bias, c, 0.0f * as_stored(g.dscale.dt, dscale));
  }
  Column<A> fwd{static_cast<A>(g.mean_h[c]), A(0), A(0)};
  if constexpr (Act != ActSet::none) fwd = forward_column<A>(g, c);
  return {fwd, static_cast<A>(a), static_cast<A>(-a * s * s * istd * istd * q / count),
          static_cast<A>(-a * sdy / count)};
}

template <class T, class TY, int V, ActSet Act, class A>
__device__ __forceinline__ Group<T, V> grad_input(BackwardArgs const& g, GradColumn<A> const (&col)[V],
                                                  Group<TY, V> const& dy, Group<T, V> const& h) {
  float slope = grad_slope(g);
  return per_activation<Act>(g, [&](auto act) {
    Group<T, V> out;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      GradColumn<A> const& k = col[v];
      A d = bn_grad<decltype(act)::value>(k.fwd, dy.v[v], h.v[v], slope);
      out.v[v] = from_float<T>(k.a * d + k.b * (A(to_float(h.v[v])) - k.fwd.mean_h) + k.c);
    }
    return out;
  });
}

// The unpipelined rows: R at a time in registers (single columns, or a wider dy).
template <class T, class TY, int V, int R, ActSet Act, class A>
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
      store_group<T, V>(dh + (r0 + 8 * i) * g.n + c0, grad_input<T, TY, V, Act>(g, col, in_dy[i], in_h[i]));
    }
  }
}

// Which rows a block of the dh pass takes, in which order: `portion` rows of one of the sum
// pass's chunks (`rows` a chunk; blockIdx.y = part x chunks + chunk), walked last-first, so that
// the first wave of blocks re-reads the rows the sum pass read last, which are still in L2 (that
// pass's lanes walk each chunk first-to-last, all chunks at once). portion 0: every row, strided.
struct RowOrder {
  int rows = 0, portion = 0;
};

// count: the batch the sums are over, on the device (SyncBatchNorm's group), or null for this m
// rows, whose dscale, dweight and dbias it then writes too.
template <class T, class TY, int V, int R, ActSet Act>
__global__ void grad_input_kernel(BackwardArgs g, double const* __restrict__ sums, double const* __restrict__ count,
                                  RowOrder order) {
  using A = Acc<T>;
  // dy and h of kSumStages rows a thread in flight (pipelined_rows), read as the column sums
  // read them (GradSums), where both come in 16-byte groups.
  using Terms = GradSums<T, TY, Act>;
  constexpr bool kPipelined = pipelined_sums<Terms, V>();
  __shared__ uint4 stage[kPipelined ? kSumStages * Terms::kInputs * 256 : 1];
  GradColumn<A> col[V];
  double total = count != nullptr ? *count : g.m;
  bool outputs = count == nullptr && blockIdx.y == 0;
  block_columns<V, true>(g.n, blockIdx.x, col,
                         [&](int c) { return grad_column<A, Act>(g, sums[c], sums[g.n + c], total, c, outputs); });
  int c0 = (blockIdx.x * 32 + threadIdx.x) * V;
  if (c0 >= g.n) return;
  auto const* dy = static_cast<TY const*>(g.dy);
  auto const* h = static_cast<T const*>(g.h);
  auto* dh = static_cast<T*>(g.dh);
  if constexpr (kPipelined) {
    Terms terms{g, dy, h};
    auto rows = [&](auto first, auto step, int count) {
      pipelined_rows<kSumStages, Terms::kInputs>(
          count, stage, [&](int j, int k) { return terms.input(k, static_cast<int64_t>(first) + j * step, c0); },
          [&](int j, auto piece) {
            auto const& d = *reinterpret_cast<Group<TY, V> const*>(piece(0));
            auto const& x = *reinterpret_cast<Group<T, V> const*>(piece(1));
            store_group<T, V>(dh + (static_cast<int64_t>(first) + j * step) * g.n + c0,
                              grad_input<T, TY, V, Act>(g, col, d, x));
          });
    };
    if constexpr (Act == ActSet::smooth) {
      // Strided, in int64: these kernels' code as before RowOrder, whose branch, compiled in, cost
      // gelu's dh time though never taken (docs/decisions.md, "Backward").
      int64_t first = blockIdx.y * 8 + threadIdx.y, step = int64_t{gridDim.y} * 8;
      rows(first, step, first < g.m ? static_cast<int>((g.m - first + step - 1) / step) : 0);
    } else if (order.portion > 0) {
      // Rows fit an int (m does), which kept relu's kernel at 76 registers (96 in int64).
      int chunks = (g.m + order.rows - 1) / order.rows, chunk = blockIdx.y % chunks, part = blockIdx.y / chunks;
      int lo = chunk * order.rows, hi = lo + min(order.rows, g.m - lo) - part * order.portion;
      lo = max(lo, hi - order.portion);
      int first = hi - 1 - static_cast<int>(threadIdx.y);
      rows(first, -8, first >= lo ? (first - lo) / 8 + 1 : 0);
    } else {
      int first = blockIdx.y * 8 + threadIdx.y, step = gridDim.y * 8;
      rows(first, step, first < g.m ? (g.m - first + step - 1) / step : 0);
    }
  } else {
    grad_input_rows<T, TY, V, R, Act>(g, col, c0, dy, h, dh);
  }
}

// The backward's BN part in one cooperative launch, for batches past the slab kernel's: the
// column sums' chunk partials (column_partials' items and order), one grid barrier, then each
// item's column totals in reduce_partials' order and dh over its chunk's rows, which the same
// block read before the barrier. The two passes' bits, in one launch instead of three. dy in h's
// dtype, 16-byte groups (the pipelined rows). Blocks an SM: at most
// limits::kCooperativeBackwardBlocksPerSm.
// The re-read after the barrier: a block's first item keeps the first `keep` rows a thread
// (dy's and h's pieces) in dynamic shared memory, and the rest is read last row first, from L2
// where it still is. Those first rows are the ones L2 has lost by then (read first, and
// followed by every block's other rows and by dh's stores): the kernel read far more from memory
// than dy's and h's bytes (ncu). Not for gelu, gelu_tanh and silu, whose dh is bound by its
// arithmetic (RowOrder's reason): kept rows cost them, where without an activation and with relu
// they gained (docs/decisions.md, "Backward").
constexpr int kCooperativeBlocks = limits::kCooperativeBackwardBlocksPerSm;
template <ActSet Act>
constexpr bool kKeepsRows = Act != ActSet::smooth;

template <class T, int V, ActSet Act>
__global__ void __launch_bounds__(256, kCooperativeBlocks) batch_norm_backward_kernel(BackwardArgs g, int rows,
                                                                                          int chunks, int groups,
                                                                                          int keep) {
  using A = Acc<T>;
  using Terms = GradSums<T, T, Act>;
  static_assert(pipelined_sums<Terms, V>(), "the cooperative backward streams 16-byte groups of dy and h");
  auto* pa = static_cast<double*>(g.workspace) + 2 * static_cast<int64_t>(g.n);  // batch_norm_backward's layout
  auto* pb = pa + static_cast<int64_t>(chunks) * g.n;
  __shared__ uint4 stage[partials_scratch<Terms, V>() / sizeof(uint4)];
  extern __shared__ uint4 kept_slots[];
  Terms terms{g, static_cast<T const*>(g.dy), static_cast<T const*>(g.h)};
  int items = groups * chunks;
  for (int item = blockIdx.x; item < items; item += gridDim.x)
    chunk_partials<Terms, V, kKeepsRows<Act>>(terms, g.m, g.n, rows, item % groups, item / groups, pa, pb, stage,
                                              {kept_slots, kKeepsRows<Act> && item == blockIdx.x ? keep : 0});
  cooperative_groups::this_grid().sync();
  auto* dh = static_cast<T*>(g.dh);
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    int group = item % groups, chunk = item / groups;
    GradColumn<A> col[V];
    block_columns<V, true>(g.n, group, col, [&](int c) {
      double sdy = 0, q = 0;
#pragma unroll 8
      for (int r = 0; r < chunks; ++r) {
        sdy += pa[r * static_cast<int64_t>(g.n) + c];
        q += pb[r * static_cast<int64_t>(g.n) + c];
      }
      return grad_column<A, Act>(g, sdy, centered(sdy, q, g.mean_h[c]), g.m, c, chunk == 0);
    });
    int c0 = (group * 32 + threadIdx.x) * V;
    int64_t first = static_cast<int64_t>(chunk) * rows + threadIdx.y;
    int64_t end = std::min<int64_t>(g.m, static_cast<int64_t>(chunk + 1) * rows);
    int count = c0 < g.n && first < end ? static_cast<int>((end - first + 7) / 8) : 0;
    Kept<Terms::kInputs> kept{kept_slots, kKeepsRows<Act> && item == blockIdx.x ? min(keep, count) : 0};
    // Row i of this thread's at j = count - 1 - i: last-first, as RowOrder's reason; the kept rows
    // (i < kept.rows) come last.
    auto row = [&](int j) { return first + 8 * (count - 1 - j); };
    auto use = [&](int j, auto piece) {
      auto const& d = *reinterpret_cast<Group<T, V> const*>(piece(0));
      auto const& x = *reinterpret_cast<Group<T, V> const*>(piece(1));
      store_group<T, V>(dh + row(j) * g.n + c0, grad_input<T, T, V, Act>(g, col, d, x));
    };
    pipelined_rows<kSumStages, Terms::kInputs>(
        count - kept.rows, stage, [&](int j, int k) { return terms.input(k, row(j), c0); }, use);
    for (int j = count - kept.rows; j < count; ++j) use(j, [&](int k) { return kept.slot(count - 1 - j, k); });
  }
}

// The static shared memory of a kernel, in bytes.
template <class Kernel>
int static_shared_bytes(Kernel kernel) {
  cudaFuncAttributes attr{};
  check_cuda(cudaFuncGetAttributes(&attr, kernel), "batch_norm_backward");
  return static_cast<int>(attr.sharedSizeBytes);
}

// Launches batch_norm_backward_kernel: as many blocks an SM as the items need (at most its
// bound), each keeping as many rows as the shared memory those blocks leave an SM allows (whole
// rows of the block, at most its chunk's; none for kKeepsRows' exceptions).
template <class T, int V, ActSet Act>
void launch_backward_cooperative(BackwardArgs const& g, int rows, int chunks, cudaStream_t stream) {
  constexpr auto kernel = batch_norm_backward_kernel<T, V, Act>;
  constexpr int kRowBytes = 256 * 2 * 16;  // a row of the block: dy's and h's 16-byte pieces
  static DeviceCache opted{}, layout[kCooperativeBlocks];
  int device = current_device();
  int groups = static_cast<int>(blocks(g.n, 32 * V)), items = groups * chunks;
  int per_sm = std::clamp((items + g.sm_count - 1) / std::max(1, g.sm_count), 1, kCooperativeBlocks);
  int most = once_per_device(opted, device, [&] {
    if (!kKeepsRows<Act>) return 1;  // no rows: + 1 below
    int block_max = 0;
    check_cuda(cudaDeviceGetAttribute(&block_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "smem");
    int bytes = std::max(0, block_max - static_shared_bytes(kernel)) / kRowBytes * kRowBytes;
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
               "batch_norm_backward shared memory");
    return bytes / kRowBytes + 1;  // + 1: a cache's 0 is "not asked yet"
  }) - 1;
  // Once a device and blocks an SM: the kept rows and the blocks an SM that fit with them, as
  // (rows + 1) * 4 + blocks.
  int fits = once_per_device(layout[per_sm - 1], device, [&] {
    int sm_bytes = 0, reserved = 0;
    check_cuda(cudaDeviceGetAttribute(&sm_bytes, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device), "smem");
    check_cuda(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device), "smem");
    int n = std::clamp((sm_bytes / per_sm - reserved - static_shared_bytes(kernel)) / kRowBytes, 0, most);
    int fit = 0;
    // Fewer rows where the occupancy calculator disagrees: the grid barrier needs every block resident.
    for (;; --n) {
      check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, 256, static_cast<size_t>(n) * kRowBytes),
                 "batch_norm_backward");
      if (fit >= per_sm || n == 0) break;
    }
    return (n + 1) * 4 + std::min(fit, 3);
  });
  int keep = std::min(fits / 4 - 1, (rows + 7) / 8), fit = fits % 4;
  int grid = std::max(1, std::min(items, std::min(per_sm, fit) * g.sm_count));
  launch_grid_synced<kernel>(grid, static_cast<size_t>(keep) * kRowBytes, stream, "batch_norm_backward", g, rows,
                             chunks, groups, keep);
}

// The backward for a block that holds every row of its columns, dy's and h's, in shared memory
// (two slabs, as batch_norm_train_slab_kernel holds h): the sums in chunk_partials' and
// reduce_partials' orders, so the two passes' bits, then dh, dscale, dweight and dbias, in one
// launch instead of three. dy in h's dtype. Shared memory: slab_smem.
template <class T, int V, ActSet Act>
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
  slab_chunk_sums<GradSums<T, T, Act>, V>(GradSums<T, T, Act>{g, dy, h}, {slab_dy, slab_h}, g.m, g.n, rows,
                                     chunks, pieces, base, sums);
  __syncthreads();
  if (int c = base + tid; tid < width && c < g.n) {
    double sdy, q;
    slab_totals(sums, chunks, width, tid, sdy, q);
    cols[tid] = grad_column<A, Act>(g, sdy, centered(sdy, q, g.mean_h[c]), g.m, c, true);
  }
  __syncthreads();
  if (!live) return;
  GradColumn<A> col[V];
  piece_columns(cols, piece, col);
  auto* dh = static_cast<T*>(g.dh);
  for (int r = tid / pieces; r < g.m; r += 256 / pieces) {
    auto const& d = *reinterpret_cast<Group<T, V> const*>(slab_dy + r * pieces + piece);
    auto const& x = *reinterpret_cast<Group<T, V> const*>(slab_h + r * pieces + piece);
    store_group<T, V>(dh + static_cast<int64_t>(r) * g.n + c0, grad_input<T, T, V, Act>(g, col, d, x));
  }
}

// The two passes: the sums of g and g h, the second centered to g (h - mean_h) by the reduction
// (partials: the column pass's workspace),
// then dh from sums over `count` rows (grad_input_kernel).
template <class T, class TY, ActSet Act>
void sum_pass(BackwardArgs const& g, double* sums, double* partials, cudaStream_t stream) {
  GradSums<T, TY, Act> terms{g, static_cast<TY const*>(g.dy), static_cast<T const*>(g.h)};
  column_sums<T>(terms, g.m, g.n, g.ldh, {g.dy, g.h}, sums, partials, g.mean_h, stream,
                 [&](int m, int groups) { return limits::grad_rows(m, groups, g.sm_count); });
}

// At most ~1024 blocks, and at least kGradInputRows rows a thread: with fewer, its cp.async
// pipeline is mostly filling (4096^2 and 16384 x 4096 kept their grids; docs/decisions.md, "Row passes").
constexpr int kGradInputRows = 8;

template <class T, class TY, ActSet Act>
void input_pass(BackwardArgs const& g, double const* sums, double const* count, cudaStream_t stream) {
  launch_rows<T, kGradInputRows>(g.m, g.n, g.ldh, {g.h, g.dy, g.dh}, 1024, [&](auto v, dim3 grid) {
    constexpr int V = decltype(v)::value;
    RowOrder order;
    // In the sum pass's chunks (sum_pass), parts of at least kGradInputRows rows a lane, about as
    // many blocks as launch_rows gives. Not for gelu, gelu_tanh and silu, whose dh is bound by its
    // arithmetic more than by its bytes: there the order cost time, where without an activation it
    // gained and with relu a little (docs/decisions.md, "Backward").
    int rows = limits::grad_rows(g.m, static_cast<int>(grid.x), g.sm_count);
    if (pipelined_sums<GradSums<T, TY, Act>, V>() && Act != ActSet::smooth && rows >= 8 * kGradInputRows) {
      int chunks = (g.m + rows - 1) / rows;
      int parts = std::max(1, std::min(rows / (8 * kGradInputRows), static_cast<int>(grid.y) / chunks));
      order = {rows, (rows + parts - 1) / parts};
      grid.y = chunks * ((rows + order.portion - 1) / order.portion);
    }
    grad_input_kernel<T, TY, V, 1, Act><<<grid, dim3(32, 8), 0, stream>>>(g, sums, count, order);
  });
}

// forward_column's constants in fp32, a thread a column: the grad GEMM's vectors.
__global__ void grad_gemm_columns_kernel(BackwardArgs g, float* __restrict__ shift, float* __restrict__ mul,
                                         float* __restrict__ beta) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= g.n) return;
  Column<float> col = forward_column<float>(g, c);
  shift[c] = col.mean_h;
  mul[c] = col.mul;
  beta[c] = col.b;
}

// The grad GEMM's per-CTA sums of g and g (h - shift) added up in a fixed order, in fp64, and
// centered on mean_h: sum g (h - mean_h) = sum g (h - shift) + (shift - mean_h) sum g. A block
// takes 32 columns, its 8 warps every 8th tile each (a thread a column per tile), then warp 0 adds
// the 8 warps' sums in order: a thread a column over every tile left most of the GPU idle and ran
// longest at the largest batches (docs/decisions.md, "Backward").
__global__ void __launch_bounds__(256) reduce_grad_partials_kernel(GradPartials p, int n,
                                                                   double const* __restrict__ mean_h,
                                                                   double* __restrict__ sums) {
  __shared__ double part[2][8][32];
  int c = blockIdx.x * 32 + threadIdx.x, w = threadIdx.y;
  double sg = 0, sgu = 0;
  if (c < n) {
    for (int t = w; t < p.tiles; t += 8) {
      sg += p.g[t * p.ld + c];
      sgu += p.gu[t * p.ld + c];
    }
  }
  part[0][w][threadIdx.x] = sg;
  part[1][w][threadIdx.x] = sgu;
  __syncthreads();
  if (w != 0 || c >= n) return;
  sg = 0;
  sgu = 0;
  for (int i = 0; i < 8; ++i) {
    sg += part[0][i][threadIdx.x];
    sgu += part[1][i][threadIdx.x];
  }
  sums[c] = sg;
  sums[n + c] = __fma_rn(static_cast<double>(p.shift[c]) - mean_h[c], sg, sgu);
}

}  // namespace

void grad_gemm_columns(BackwardArgs const& g, float* shift, float* mul, float* beta, cudaStream_t stream) {
  if (g.n == 0) return;
  grad_gemm_columns_kernel<<<static_cast<unsigned>(blocks(g.n, 256)), 256, 0, stream>>>(g, shift, mul, beta);
  check_cuda(cudaGetLastError(), "grad_gemm_columns");
}

void batch_norm_backward_partials(BackwardArgs const& g, GradPartials const& p, double* sums, cudaStream_t stream) {
  if (g.n == 0) return;
  reduce_grad_partials_kernel<<<static_cast<unsigned>(blocks(g.n, 32)), dim3(32, 8), 0, stream>>>(p, g.n, g.mean_h,
                                                                                                sums);
  // g.dy holds g, the activation's derivative applied: dh's pass takes it as it is.
  BackwardArgs a = g;
  a.act = Activation::none;
  dispatch_pair(a.dt, a.dt, [&](auto t, auto) {
    input_pass<decltype(t), decltype(t), ActSet::none>(a, sums, nullptr, stream);
  });
  check_cuda(cudaGetLastError(), "batch_norm_backward_partials");
}

void batch_norm_backward(BackwardArgs const& g, BackwardKernels kernels, int pieces, cudaStream_t stream) {
  auto* sums = static_cast<double*>(g.workspace);
  auto* partials = sums + 2 * static_cast<int64_t>(g.n);
  if (kernels == BackwardKernels::automatic)
    throw std::runtime_error("cutlass_fused: batch_norm_backward runs the plan's kernels (csrc/kernels/plan.h)");
  auto run = [&](auto t, auto ty, auto act) {
    using T = decltype(t);
    using TY = decltype(ty);
    constexpr ActSet Act = decltype(act)::value;
    constexpr int V = 16 / sizeof(T);
    if constexpr (std::is_same_v<T, TY>) {
      // Every variant sums in the passes' chunks (limits::grad_rows), so all give the same bits:
      // the reductions center sum g h on mean_h (centered), which cancels, so a sum in another
      // order can round dh 1 ulp apart (a slab forced past its 512 rows did, fp32, mean 500x the
      // spread).
      int groups = static_cast<int>(blocks(g.n, 32 * V));
      int rows = limits::grad_rows(g.m, groups, g.sm_count), chunks = limits::grad_chunks(g.m, groups, g.sm_count);
      if (kernels == BackwardKernels::slab) {
        constexpr auto kernel = batch_norm_backward_slab_kernel<T, V, Act>;
        allow_slab<kernel>();
        size_t smem = slab_smem<GradColumn<Acc<T>>>(g.m, 2, chunks, pieces, V);
        kernel<<<blocks(g.n, pieces * V), 256, smem, stream>>>(g, rows, chunks, pieces);
        return;
      }
      if (kernels == BackwardKernels::cooperative) {
        launch_backward_cooperative<T, V, Act>(g, rows, chunks, stream);
        return;
      }
    }
    sum_pass<T, TY, Act>(g, sums, partials, stream);
    input_pass<T, TY, Act>(g, sums, nullptr, stream);
  };
  dispatch_pair(g.dt, g.dt_dy, [&](auto t, auto ty) { dispatch_act_set(g.act, [&](auto act) { run(t, ty, act); }); });
  check_cuda(cudaGetLastError(), "batch_norm_backward");
}

void batch_norm_backward_reduce(BackwardArgs const& g, double* sums, cudaStream_t stream) {
  dispatch_pair(g.dt, g.dt_dy, [&](auto t, auto ty) {
    dispatch_act_set(g.act, [&](auto act) {
      sum_pass<decltype(t), decltype(ty), decltype(act)::value>(g, sums, static_cast<double*>(g.workspace), stream);
    });
  });
}

void batch_norm_backward_elemt(BackwardArgs const& g, double const* sums, double const* count, cudaStream_t stream) {
  dispatch_pair(g.dt, g.dt_dy, [&](auto t, auto ty) {
    dispatch_act_set(g.act, [&](auto act) {
      input_pass<decltype(t), decltype(ty), decltype(act)::value>(g, sums, count, stream);
    });
  });
  check_cuda(cudaGetLastError(), "batch_norm_backward_elemt");
}

}  // namespace cutlass_fused
