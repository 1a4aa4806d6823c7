// The sm90a training GEMM with the BatchNorm statistics in its epilogue (mode "stats"
// of codegen/kernels.py). The operands are swapped: the kernel computes W x^T, features
// x batch, stored column-major, which is h = x W^T + b row-major (GemmEvtArgs: x is the
// weight, w the input, ldo h's row stride). A feature is then a row of the kernel's
// tile, so its sums over the batch are column reductions, which CUTLASS does in
// registers and warp shuffles with no shared-memory pass (a row reduction, the
// unswapped form, needs one). Besides h it leaves, per CTA and feature, the sums of
// u = h - shift and u^2 over the CTA's batch rows; the training tail
// (bn_train.cu) adds them up in a fixed order.
//
// A row of the kernel table instantiates Gemm with its dtype (dtype.cuh), CTA tile
// (features, batch, K), cluster, epilogue tile and schedule
// (csrc/generated/sm90_*_stats_*.cu).
#pragma once

#include "kernels/evt_extra.h"
#include "kernels/gemm/sm90_kernel.cuh"

namespace cutlass_fused::gemm::sm90_stats {
namespace fusion = cutlass::epilogue::fusion;

// A per-feature vector (one value a row of W x^T): CUTLASS's column broadcast.
template <class TileShape, class T>
using ColBroadcast =
    fusion::Sm90ColBroadcast<0 /* Stages */, TileShape, T, T, cute::Stride<cute::_1, cute::_0, cute::_0>>;

// A per-feature sum over the CTA's batch columns, left as the CTA's partial:
//   - non-final (FinalReduction = false): each CTA writes its own row of partials
//     (ceil(batch / tile_n) x round_up(features, tile_m), in SumCompute; gemm_evt.h's
//     StatsLayout) instead of adding into an N-vector with atomics, so that the sums
//     are deterministic (the tail adds the partials in a fixed order) and the output
//     needs no zeroing first.
//   - GmemReduceFn plus, not atomic_add: CUTLASS static-asserts an atomic reduction to be
//     final.
//   - out-of-bounds checks (VisitCheckOOB, the default) stay on: batch columns past the
//     problem would add b to the sums.
//   - 4: the alignment of the fp32 ElementOutput (the default, spelled out).
template <class TileShape, class SumCompute>
using FeatureSum = fusion::Sm90ColReduction<
    cutlass::plus, cutlass::plus, cutlass::plus, 0 /* Stages */, TileShape, float, SumCompute,
    cutlass::FloatRoundStyle::round_to_nearest, cute::Stride<cute::_1, cute::_0, cute::_0>,
    4 /* Alignment */, true /* EnableNullptr */, false /* FinalReduction */>;

// The statistics EVT. h = acc + b is rounded to the output type where that is 16-bit
// (stored<Element>::plus, evt_extra.h: rounded and widened back, so the DAG still
// carries it in its compute type), so that the sums are of the h the kernel stores,
// which is what the finalize normalizes (PyTorch's BatchNorm sees the rounded tensor
// too).
//
// Its shape is the one cutlass_cppgen traced from codegen's former Python epilogue
// (H = accum + b; U = H - shift; sum(U); Usq = U * (U + 0.0); sum(Usq);
// D = multiply_add(Usq, 0.0, H)), kept node for node so that the kernels keep their SASS:
//   - shift is always null at runtime (it reads 0: u = h), but it stays a node of the
//     DAG, with its Arguments passed as before;
//   - u^2 is u * (u + 0): the tracer merged u * u into one graph edge;
//   - D is a compute node at the end of the DAG, over u^2 as well as h: the tracer
//     would not store h while h also fed the sums. Its op, take_last(u^2, 0, h) = h
//     (evt_extra.h), keeps D exactly h, where multiply_add(u^2, 0, h) would turn an
//     fp32 overflow of u^2 into 0 * inf = NaN.
// SumCompute (dtype.cuh's StatsCompute: fp64 for 3xTF32) is the type of u, u^2, their
// sums, and of the DAG's intermediates (Sm90TopologicalVisitor keeps every node's
// value as an Array of its ElementCompute: with float there, an fp64 u^2 would be
// rounded to fp32 before its sum).
template <class Dtype, class TileShape>
struct Evt {
  using Element = typename Dtype::Element;
  using SumCompute = typename Dtype::StatsCompute;

  using B = ColBroadcast<TileShape, Element>;   // the bias, in the input dtype
  using Shift = ColBroadcast<TileShape, float>;
  using Zero = fusion::Sm90ScalarBroadcast<float, cute::Stride<cute::_0, cute::_0, cute::_0>, 1,
                                           cutlass::multiplies>;

  using H = fusion::Sm90EVT<Sm90Op<stored<Element>::template plus>, fusion::Sm90AccFetch, B>;
  using U = Sm90Op<cutlass::minus, SumCompute, SumCompute>;
  using UPlusZero = Sm90Op<cutlass::plus, SumCompute, SumCompute>;
  using USq = Sm90Op<cutlass::multiplies, SumCompute, SumCompute>;
  using D = Sm90Op<take_last, Element>;

  // The nodes in topological order, each with the indices of its inputs in this order:
  //   0 h, 1 zero, 2 zero, 3 shift, 4 u = h - shift, 5 sum(u) (a reduction passes its input on),
  //   6 u + 0, 7 u^2 = u * (u + 0), 8 sum(u^2), 9 D = take_last(u^2, 0, h).
  using Dag = fusion::Sm90TopologicalVisitor<
      SumCompute,
      cute::tuple<cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<0, 3>, cute::seq<4>,
                  cute::seq<5, 1>, cute::seq<5, 6>, cute::seq<7>, cute::seq<8, 2, 0>>,
      H, Zero, Zero, Shift, U, FeatureSum<TileShape, SumCompute>, UPlusZero, USq,
      FeatureSum<TileShape, SumCompute>, D>;

  // A topological visitor takes its nodes' Arguments in the same order; compute nodes and
  // the accumulator take {}, the zeros {} (0.0).
  static typename Dag::Arguments args(GemmEvtArgs const& p) {
    return {{{}, {static_cast<Element const*>(p.b)}, {}}, {}, {}, {p.shift}, {},
            {p.u_sum}, {}, {}, {p.u_sumsq}, {}};
  }
};

template <class Dtype, class TileShape, class ClusterShape, class EpilogueTile, class Schedule>
struct Gemm {
  using Epilogue = Evt<Dtype, TileShape>;
  using GemmKernel = typename Sm90Kernel<Dtype, TileShape, ClusterShape, EpilogueTile, Schedule,
                                         cute::Stride<cute::_1, int64_t, cute::_0>,  // W x^T column-major: h
                                         typename Epilogue::Dag>::type;

  static sm90::Fusion<GemmKernel> fusion_args(GemmEvtArgs const& p) { return Epilogue::args(p); }
};

}  // namespace cutlass_fused::gemm::sm90_stats
