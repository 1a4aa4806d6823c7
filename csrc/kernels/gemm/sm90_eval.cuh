// The sm90a eval GEMM (mode "eval" of codegen/kernels.py): inference's Linear,
// BatchNorm and activation in one kernel, y = act((x W^T + b) * a + c) per column, where the fold
// gives a = scale * gamma * invstd, c = beta - mean * a: made in this epilogue (sm90_fold.cuh), or
// read as the fold kernel kept it inside frozen_weights() (eval_fold_cuda.cpp).
// b is added before the scale, in PyTorch's order of operations, so that nothing
// is ever divided by scale or gamma. Null b and c read 0, null a 1 (linear_h: b alone).
//
// A row of the kernel table instantiates Gemm with its dtype (dtype.cuh), CTA tile,
// cluster, epilogue tile and schedule (csrc/generated/sm90_*_eval_*.cu).
#pragma once

#include "kernels/evt_extra.h"
#include "kernels/gemm/sm90_fold.cuh"
#include "kernels/gemm/sm90_kernel.cuh"

namespace cutlass_fused::gemm::sm90_eval {
namespace fusion = cutlass::epilogue::fusion;

// A per-column vector of y (M x N, one value a column): CUTLASS's row broadcast, read in
// its own type. A null pointer reads the value its Arguments give (EnableNullptr).
template <class TileShape, class T>
using RowBroadcast =
    fusion::Sm90RowBroadcast<0 /* Stages */, TileShape, T, T, cute::Stride<cute::_0, cute::_1, cute::_0>>;

// y = act((acc + b) * a + c) in fp32, rounded once to the output type: bf16, TF32 and 3xTF32.
// b is in the input dtype, as the layer holds it (no cast per call); a and c are fp32; the
// activation is a runtime value (evt_extra.h's activated).
template <class Dtype, class TileShape>
struct Evt {
  using Element = typename Dtype::Element;
  using A = Sm90FoldBroadcast<TileShape, FoldPart::a>;
  using B = RowBroadcast<TileShape, Element>;
  using C = Sm90FoldBroadcast<TileShape, FoldPart::c>;

  using H = fusion::Sm90EVT<Sm90Op<cutlass::plus>, fusion::Sm90AccFetch, B>;  // acc + b
  using Z = fusion::Sm90EVT<Sm90Op<cutlass::multiplies>, H, A>;              // h * a
  using Y = fusion::Sm90EVT<Sm90Op<plus_activated, Element>, Z, C>;          // act(z + c), stored as D

  // An EVT node's Arguments are {children..., its own}; compute nodes and the
  // accumulator take {}, but Y its activation; a fold node {its pointer's, the fold}.
  static typename Y::Arguments args(GemmEvtArgs const& p) {
    return {{{{}, {static_cast<Element const*>(p.b)}, {}}, {{p.a, 1.f}, p.fold}, {}},
            {{p.c}, p.fold},
            {p.act, p.slope}};
  }
};

// fp16: y = act(f16(f16(acc + b) * s) * a + c). The unfused model rounds h = x W^T + b and
// then z = h * scale to fp16, and either can overflow to inf before the BatchNorm, so
// this kernel rounds (and overflows) at the same two places; the fold then passes
// s = scale and a = gamma * invstd (gemm_evt.h: GemmEvtArgs::s). With s and a null (1)
// and c null (0) it is h alone. (rounded_to, evt_extra.h: the node computes in fp32
// and rounds its result to fp16 and back, keeping the DAG's values fp32.)
template <class TileShape>
struct Evt<dtype::f16, TileShape> {
  using Element = dtype::f16::Element;
  using A = Sm90FoldBroadcast<TileShape, FoldPart::g>;
  using B = RowBroadcast<TileShape, Element>;
  using C = Sm90FoldBroadcast<TileShape, FoldPart::c>;
  using S = Sm90FoldBroadcast<TileShape, FoldPart::s>;

  using H = fusion::Sm90EVT<Sm90Op<plus_rounded_to_f16>, fusion::Sm90AccFetch, B>;  // f16(acc + b)
  using Z = fusion::Sm90EVT<Sm90Op<multiplies_rounded_to_f16>, H, S>;               // f16(h * s)
  using Y = fusion::Sm90EVT<Sm90Op<multiply_add_activated, Element>, Z, A, C>;      // act(z * a + c)

  static typename Y::Arguments args(GemmEvtArgs const& p) {
    return {{{{}, {static_cast<Element const*>(p.b)}, {}}, {{p.s, 1.f}, p.fold}, {}},
            {{p.a, 1.f}, p.fold},
            {{p.c}, p.fold},
            {p.act, p.slope}};
  }
};

template <class Dtype, class TileShape, class ClusterShape, class EpilogueTile, class Schedule>
struct Gemm {
  using Epilogue = Evt<Dtype, TileShape>;
  using GemmKernel = typename Sm90Kernel<Dtype, TileShape, ClusterShape, EpilogueTile, Schedule,
                                         cute::Stride<int64_t, cute::_1, cute::_0>,  // y row-major
                                         typename Epilogue::Y>::type;

  static sm90::Fusion<GemmKernel> fusion_args(GemmEvtArgs const& p) { return Epilogue::args(p); }
};

}  // namespace cutlass_fused::gemm::sm90_eval
