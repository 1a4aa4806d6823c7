// The sm80 training GEMM with the BatchNorm statistics in its epilogue (mode "stats" of
// codegen/kernels.py, family sm80; issue 32). The eval kernel's mainloop (sm80_eval.cuh), not
// swapped: x is A, the batch is M and the features are N, so a feature's sum over the CTA's rows
// is CUTLASS 2.x's row reduction (VisitorRowReduction: registers, then one pass through shared
// memory). Besides h it leaves, per CTA row of tiles and feature, the sums of h and h^2 over the
// CTA's rows, in the layout the training tail reads (batch_norm.h's u_sum: row t holds batch tile
// t's sums, u_ld apart): the sm90 statistics kernels' contract, so the tail is the same.
//
// CUTLASS's row reduction ends in an atomic add of each CTA's sums into one N-vector (fp32, not
// deterministic, zeroed first). Here its "atomic" functor is a plain store, and its output's M
// stride is u_ld / tile_m, so that a CTA's row 0 (m = t * tile_m, the only row the reduction
// writes) lands on row t of the partials: each CTA writes its own sums, no atomics, no zeroing,
// and the tail adds them in a fixed order, as for sm90.
#pragma once

#include "kernels/gemm/sm80_eval.cuh"

namespace cutlass_fused::gemm::sm80_stats {
namespace visitor = cutlass::epilogue::threadblock;

// The "atomic" reduction of CUTLASS's row reduction, as a store: each CTA row of tiles owns its
// row of partials.
template <class T>
struct store_partial {
  CUTLASS_DEVICE void operator()(T* ptr, T const& value) const { *ptr = value; }
};

// A per-feature fp32 sum over the CTA's batch rows, stored as that CTA's partial.
template <class Map>
using FeatureSum = visitor::VisitorRowReduction<cutlass::plus, store_partial, Map, float, float,
                                                cutlass::FloatRoundStyle::round_to_nearest,
                                                cute::Stride<int64_t, cute::_1, cute::_0>>;

// The partials' row stride: features rounded up to whole batch tiles (plan.cpp's StatsLayout for
// sm80), so that it is tile_m times the output's M stride.
template <int TileM>
constexpr int64_t partials_ld(int features) {
  return (int64_t{features} + TileM - 1) / TileM * TileM;
}

// h = acc + b, rounded to the output type where that is 16-bit (stored<Element>::plus), so that
// the sums are of the h the kernel stores, as sm90_stats.cuh's; its sum, h^2 and its sum; then
// the store of h. The nodes in topological order, each with the indices of its inputs:
//   0 h, 1 sum(h) (a reduction passes its input on), 2 h^2 = h * h, 3 sum(h^2), 4 store(h).
template <class Dtype, class Map>
struct Evt {
  using Element = typename Dtype::Element;
  static_assert(cute::is_same_v<typename Dtype::StatsCompute, float>,
                "sm80 statistics kernels keep fp32 partials (bf16, f16, tf32)");
  using B = sm80_eval::RowBroadcast<Map, Element>;
  using H = visitor::Sm80EVT<sm80_eval::Sm80Op<stored<Element>::template plus>, visitor::VisitorAccFetch, B>;
  using Square = sm80_eval::Sm80Op<cutlass::multiplies>;
  using Store = visitor::VisitorAuxStore<Map, Element, cutlass::FloatRoundStyle::round_to_nearest,
                                         cute::Stride<int64_t, cute::_1, cute::_0>>;
  using Tree = visitor::Sm80TopologicalVisitor<
      float, cute::tuple<cute::seq<>, cute::seq<0>, cute::seq<1, 1>, cute::seq<2>, cute::seq<1>>,
      H, FeatureSum<Map>, Square, FeatureSum<Map>, Store>;

  static typename Tree::Arguments args(GemmEvtArgs const& p) {
    constexpr int kTileM = decltype(cute::size<0>(typename Map::CtaShapeMNL{}))::value;
    int64_t stride_m = partials_ld<kTileM>(p.n) / kTileM;
    return {{{}, {static_cast<Element const*>(p.b)}, {}},
            {static_cast<float*>(p.u_sum), 0.f, {stride_m, cute::_1{}, cute::_0{}}},
            {},
            {static_cast<float*>(p.u_sumsq), 0.f, {stride_m, cute::_1{}, cute::_0{}}},
            {static_cast<Element*>(p.out), {p.ldo, cute::_1{}, cute::_0{}}}};
  }
};

template <class Dtype, class ThreadblockShape, class WarpShape, int Stages>
using Gemm = sm80_eval::Gemm<Dtype, ThreadblockShape, WarpShape, Stages, Evt>;

}  // namespace cutlass_fused::gemm::sm80_stats
