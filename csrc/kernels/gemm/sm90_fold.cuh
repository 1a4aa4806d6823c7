// The eval fold inside the sm90 eval epilogue: a per-column vector of y whose values each CTA makes
// for its own tile's columns from the layer's raw vectors (eval_fold.cuh's fold_value), where
// CUTLASS's row broadcast would read a vector the fold kernel wrote. Eval is then one launch with
// nothing kept between calls (ops_cuda.cpp, eval_cuda), which saves the fold kernel's launch a call.
// Its latency (five vector loads, an fp64 divide and square root, the barrier after begin()) is
// paid once a tile, which is why the plan takes it only up to two tiles a CTA (plan.cpp;
// decisions.md, "Eval fold").
// Without a fold (EvalFold::n == 0) the node is the row broadcast of its pointer: the fold kept
// inside frozen_weights() or made by the fold kernel, or null (1 or 0: linear_h's h alone).
#pragma once

#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "kernels/eval_fold.cuh"

namespace cutlass_fused::gemm {

template <class TileShape>
using Sm90FloatRow =
    cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float, float, cute::Stride<cute::_0, cute::_1, cute::_0>>;

template <class TileShape, FoldPart Part>
struct Sm90FoldBroadcast : Sm90FloatRow<TileShape> {
  using Base = Sm90FloatRow<TileShape>;
  using SharedStorage = typename Base::SharedStorage;

  // {the row broadcast's {pointer, null value}, the fold's inputs}
  struct Arguments {
    typename Base::Arguments row;
    EvalFold fold;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE Sm90FoldBroadcast() {}
  CUTLASS_HOST_DEVICE Sm90FoldBroadcast(Params const& params, SharedStorage const& shared_storage)
      : Base(params.row, shared_storage), fold(params.fold) {}

  EvalFold fold;

  CUTLASS_DEVICE bool is_zero() const { return fold.n == 0 && Base::is_zero(); }

  // The row broadcast's callbacks, whose begin() (each thread fills its columns of the tile's
  // shared copy, then the epilogue syncs) makes the values instead of loading them.
  template <class Callbacks>
  struct FoldCallbacks : Callbacks {
    CUTLASS_DEVICE FoldCallbacks(Callbacks const& callbacks, EvalFold const& fold, int n0)
        : Callbacks(callbacks), fold(fold), n0(n0) {}

    EvalFold const& fold;
    int n0;  // the tile's first column

    CUTLASS_DEVICE void begin() {
      if (fold.n == 0) {
        Callbacks::begin();
        return;
      }
      using cute::get;
      auto g_row = cute::filter_zeros(this->tGS_gRow);
      auto s_row = cute::filter_zeros(this->tGS_sRow);
      auto c_row = cute::filter_zeros(this->tGS_cRow, this->tGS_gRow.stride());
      for (int i = 0; i < cute::size(g_row); ++i) {
        int col = get<1>(c_row(i));
        if (col >= cute::size<1>(TileShape{})) continue;  // past the shared copy, as the row broadcast skips it
        s_row(i) = cute::elem_less(c_row(i), this->residue_cRow) ? fold_value(fold, n0 + col, Part) : 0.0f;
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    auto callbacks = Base::template get_consumer_store_callbacks<ReferenceSrc>(args);
    int n0 = static_cast<int>(cute::get<1>(args.tile_coord_mnkl)) * static_cast<int>(cute::size<1>(TileShape{}));
    return FoldCallbacks<decltype(callbacks)>(callbacks, fold, n0);
  }
};

}  // namespace cutlass_fused::gemm
