// The sm80 eval GEMM (mode "eval" of codegen/kernels.py, family sm80: mma.sync, runs on
// sm80 and later): y = act((x W^T + b) * a + c) per column, as sm90_eval.cuh computes it
// (see there for the math and the fp16 variant), with CUTLASS 2.x's epilogue visitors.
// Null b and c read 0, null a (and s) 1.
//
// A row of the kernel table instantiates Gemm with its dtype (dtype.cuh), threadblock
// tile, warp tile and stages (csrc/generated/sm80_*_eval_*.cu).
#pragma once

#include "cutlass/cutlass.h"
// Before the visitors, which are not self-contained: they use DefaultThreadMapTensorOp
// and gemm::GemmCoord, declared by the 2.x GEMM headers (and in their scope, which has
// `using namespace cute`, an undeclared cutlass::gemm would find the function cute::gemm).
#include "cutlass/gemm/kernel/default_gemm_universal_with_visitor.h"
#include "cutlass/epilogue/threadblock/fusion/visitors.hpp"
#include "kernels/evt_extra.h"
#include "kernels/gemm/dtype.cuh"
#include "kernels/sm80_launch.cuh"

namespace cutlass_fused::gemm::sm80_eval {
namespace visitor = cutlass::epilogue::threadblock;

// A per-column vector of y, as Map distributes y's tile over the threads: a row broadcast.
// A null pointer reads the value its Arguments give (EnableNullptr).
template <class Map, class T>
using RowBroadcast = visitor::VisitorRowBroadcast<Map, T, cute::Stride<cute::_0, cute::_1, cute::_0>>;

// An EVT compute node: Fn over its inputs in ElementCompute, its value converted to
// ElementOutput.
template <template <class> class Fn, class ElementOutput = float, class ElementCompute = float>
using Sm80Op = visitor::VisitorCompute<Fn, ElementOutput, ElementCompute, cutlass::FloatRoundStyle::round_to_nearest>;

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

// Unlike sm90's collective epilogue, the 2.x kernel does not store D itself: the tree
// ends in a store of y (row-major, stride ldo) to p.out.
template <class Map, class Element, class Y>
using StoreY = visitor::Sm80EVT<
    visitor::VisitorAuxStore<Map, Element, cutlass::FloatRoundStyle::round_to_nearest,
                             cute::Stride<int64_t, cute::_1, cute::_0>>,
    Y>;

// y = act((acc + b) * a + c) in fp32, rounded once to the output type: bf16, TF32 and 3xTF32.
template <class Dtype, class Map>
struct Evt {
  using Element = typename Dtype::Element;
  using A = RowBroadcast<Map, float>;
  using B = RowBroadcast<Map, Element>;
  using C = RowBroadcast<Map, float>;

  using H = visitor::Sm80EVT<Sm80Op<cutlass::plus>, visitor::VisitorAccFetch, B>;  // acc + b
  using Z = visitor::Sm80EVT<Sm80Op<cutlass::multiplies>, H, A>;                  // h * a
  using Y = visitor::Sm80EVT<VisitorComputeWithArgs<plus_activated, Element>, Z, C>;  // act(z + c)
  using Tree = StoreY<Map, Element, Y>;

  // An EVT node's Arguments are {children..., its own}; compute nodes and the
  // accumulator take {}, but Y its activation.
  static typename Tree::Arguments args(GemmEvtArgs const& p) {
    return {{{{{}, {static_cast<Element const*>(p.b)}, {}}, {p.a, 1.f}, {}}, {p.c}, {p.act, p.slope}},
            {static_cast<Element*>(p.out), {p.ldo, cute::_1{}, cute::_0{}}}};
  }
};

// fp16: y = act(f16(f16(acc + b) * s) * a + c), h and z rounded (and overflowing) as the
// unfused model's: see sm90_eval.cuh.
template <class Map>
struct Evt<dtype::f16, Map> {
  using Element = dtype::f16::Element;
  using A = RowBroadcast<Map, float>;
  using B = RowBroadcast<Map, Element>;
  using C = RowBroadcast<Map, float>;
  using S = RowBroadcast<Map, float>;

  using H = visitor::Sm80EVT<Sm80Op<plus_rounded_to_f16>, visitor::VisitorAccFetch, B>;  // f16(acc + b)
  using Z = visitor::Sm80EVT<Sm80Op<multiplies_rounded_to_f16>, H, S>;                  // f16(h * s)
  using Y = visitor::Sm80EVT<VisitorComputeWithArgs<multiply_add_activated, Element>, Z, A, C>;  // act(z * a + c)
  using Tree = StoreY<Map, Element, Y>;

  static typename Tree::Arguments args(GemmEvtArgs const& p) {
    return {{{{{}, {static_cast<Element const*>(p.b)}, {}}, {p.s, 1.f}, {}}, {p.a, 1.f}, {p.c}, {p.act, p.slope}},
            {static_cast<Element*>(p.out), {p.ldo, cute::_1{}, cute::_0{}}}};
  }
};

// The tensor-core math. 3xTF32 runs in the kernel: each fp32 operand split into a TF32
// big and small part, three TF32 MMAs (OpMultiplyAddFastF32).
template <class Dtype>
struct Math {
  using type = cutlass::arch::OpMultiplyAdd;
};
template <>
struct Math<dtype::f32x3> {
  using type = cutlass::arch::OpMultiplyAddFastF32;
};

// EpilogueOf: the tree (Evt here; sm80_stats.cuh's for the training GEMM) for a dtype and the
// epilogue's thread map.
template <class Dtype, class ThreadblockShape, class WarpShape, int Stages,
          template <class, class> class EpilogueOf = Evt>
struct Gemm {
  using Element = typename Dtype::Element;
  static constexpr int Alignment = kAlignment<Dtype>;
  // mma.sync's shape: k = 16 for 16-bit operands, 8 for TF32.
  using InstructionShape = cutlass::gemm::GemmShape<16, 8, 256 / cutlass::sizeof_bits<Element>::value>;
  // How the epilogue's threads cover the tile (1 epilogue stage).
  using Map = visitor::OutputTileThreadLayout<ThreadblockShape, WarpShape, Element, Alignment, 1>;
  using Epilogue = EpilogueOf<Dtype, Map>;

  // A row-major (x), B column-major (the nn.Linear weight), fp32 accumulation and
  // epilogue; C and D are the kernel's but unused (the tree stores y).
  using GemmKernel = typename cutlass::gemm::kernel::DefaultGemmWithVisitor<
      Element, cutlass::layout::RowMajor, cutlass::ComplexTransform::kNone, Alignment,
      Element, cutlass::layout::ColumnMajor, cutlass::ComplexTransform::kNone, Alignment,
      Element, cutlass::layout::RowMajor, Alignment,
      float, float,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      ThreadblockShape, WarpShape, InstructionShape,
      typename Epilogue::Tree,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>,
      Stages,
      typename Math<Dtype>::type,
      1 /* epilogue stages */>::GemmKernel;

  static sm80::Fusion<GemmKernel> fusion_args(GemmEvtArgs const& p) { return Epilogue::args(p); }
};

}  // namespace cutlass_fused::gemm::sm80_eval
