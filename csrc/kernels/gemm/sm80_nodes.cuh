// What the traced sm80 visitor trees (csrc/generated/evt_sm80_*.h) name: CUTLASS 2.x's
// visitors, our compute functors (evt_extra.h) and the two sm80 nodes below, and the
// GemmEvtArgs their Arguments are built from.
#pragma once

#include "cutlass/cutlass.h"
// Before the visitors, which are not self-contained: they use DefaultThreadMapTensorOp
// and gemm::GemmCoord, declared by the 2.x GEMM headers (and in their scope, which has
// `using namespace cute`, an undeclared cutlass::gemm would find the function cute::gemm).
#include "cutlass/gemm/kernel/default_gemm_universal_with_visitor.h"
#include "cutlass/epilogue/threadblock/fusion/visitors.hpp"
#include "kernels/evt_extra.h"
#include "kernels/gemm_evt.h"
#include "kernels/limits.h"

namespace cutlass_fused::gemm {
namespace visitor = cutlass::epilogue::threadblock;

// A compute node whose Fn takes Arguments (the activation), as sm90's Sm90Compute allows and 2.x's
// VisitorCompute does not: Fn(inputs..., arguments) in ElementCompute, converted to ElementOutput.
template <template <class> class Fn, class ElementOutput, class ElementCompute = float>
struct VisitorComputeWithArgs : visitor::VisitorImpl2x<> {
  using Arguments = typename Fn<ElementCompute>::Arguments;
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }

  CUTLASS_HOST_DEVICE VisitorComputeWithArgs() {}
  CUTLASS_HOST_DEVICE VisitorComputeWithArgs(Params const& params, SharedStorage const&) : params(params) {}

  Params params;

  struct Callbacks : visitor::EmptyCallbacks {
    Params const& params;
    CUTLASS_DEVICE explicit Callbacks(Params const& params) : params(params) {}

    template <typename ElementAccumulator, typename... ElementInputs, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementOutput, FragmentSize> visit(
        int, int, int, int, cutlass::Array<ElementAccumulator, FragmentSize> const&,
        cutlass::Array<ElementInputs, FragmentSize> const&... frg_inputs) {
      using Compute = cutlass::Array<ElementCompute, FragmentSize>;
      using ToOutput = cutlass::NumericArrayConverter<ElementOutput, ElementCompute, FragmentSize,
                                                      cutlass::FloatRoundStyle::round_to_nearest>;
      return ToOutput{}(Fn<Compute>{}(
          cutlass::NumericArrayConverter<ElementCompute, ElementInputs, FragmentSize,
                                         cutlass::FloatRoundStyle::round_to_nearest>{}(frg_inputs)...,
          params));
    }
  };

  template <class ProblemShape>
  CUTLASS_DEVICE auto get_callbacks(cutlass::gemm::GemmCoord, int, ProblemShape) {
    return Callbacks(params);
  }
};

// The "atomic" reduction of CUTLASS's row reduction, as a store: CUTLASS's row reduction ends in
// an atomic add of each CTA's sums into one N-vector (fp32, not deterministic, zeroed first);
// with this, each CTA row of tiles writes its own row of partials, which the training tail adds
// in a fixed order, as for sm90 (sm80_stats.cuh).
template <class T>
struct store_partial {
  CUTLASS_DEVICE void operator()(T* ptr, T const& value) const { *ptr = value; }
};

// The row reduction's stride for `features` columns: its output's M stride is the partials' row
// stride (limits::partials_ld, the plan's StatsLayout) over tile_m, so that a CTA's row 0
// (m = t * tile_m, the only row the reduction writes) lands on row t of the partials.
template <class Map>
cute::Stride<int64_t, cute::_1, cute::_0> partials_stride(int features) {
  constexpr int kTileM = decltype(cute::size<0>(typename Map::CtaShapeMNL{}))::value;
  return {limits::partials_ld(features, kTileM) / kTileM, cute::_1{}, cute::_0{}};
}

}  // namespace cutlass_fused::gemm
