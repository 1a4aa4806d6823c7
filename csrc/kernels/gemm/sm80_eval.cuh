// The sm80 GEMM (family sm80: mma.sync, runs on sm80 and later) around a traced visitor tree:
// codegen/epilogues.py's evaluate (fp16: evaluate_rounded) for mode "eval", y = act((x W^T + b)
// * a + c) per column as sm90_eval.cuh computes it, or its stats_unswapped for mode "stats"
// (sm80_stats.cuh), traced into csrc/generated/evt_sm80_<mode>_<dtype>.h. Unlike sm90's collective
// epilogue, the 2.x kernel does not store D itself: the tree ends in D's store.
//
// A row of the kernel table instantiates Gemm with its dtype (dtype.cuh), tree, threadblock
// tile, warp tile and stages (csrc/generated/sm80_*_*.cu).
#pragma once

#include "kernels/gemm/dtype.cuh"
#include "kernels/gemm/sm80_nodes.cuh"
#include "kernels/sm80_launch.cuh"

namespace cutlass_fused::gemm::sm80_eval {
namespace visitor = cutlass::epilogue::threadblock;

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

// Evt: the traced tree, templated on the epilogue's thread map, with its Tree and
// args(GemmEvtArgs).
template <class Dtype, template <class> class Evt, class ThreadblockShape, class WarpShape, int Stages>
struct Gemm {
  using Element = typename Dtype::Element;
  static constexpr int Alignment = kAlignment<Dtype>;
  // mma.sync's shape: k = 16 for 16-bit operands, 8 for TF32.
  using InstructionShape = cutlass::gemm::GemmShape<16, 8, 256 / cutlass::sizeof_bits<Element>::value>;
  // How the epilogue's threads cover the tile (1 epilogue stage).
  using Map = visitor::OutputTileThreadLayout<ThreadblockShape, WarpShape, Element, Alignment, 1>;
  using Epilogue = Evt<Map>;

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
