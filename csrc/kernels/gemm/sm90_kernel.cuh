// The sm90a kernel around an epilogue visitor tree (EVT): CUTLASS 3.x's collective
// builders for a TMA warp-specialized schedule, fp32 accumulation, A row-major (or, grad
// kernels, column-major) and B column-major (x and the nn.Linear weight, both K-contiguous), no C operand, and D
// stored by the collective epilogue with the EVT's output as its value.
// The EVT is a traced tree (csrc/generated/evt_sm90_*.h); sm90_eval.cuh and sm90_stats.cuh give
// D's layout.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "kernels/gemm/dtype.cuh"
#include "kernels/promoted_mainloop.h"
#include "kernels/remainder_mainloop.h"
#include "kernels/sm90_launch.cuh"

namespace cutlass_fused::gemm {

// An EVT compute node: Fn over its inputs in ElementCompute, its value converted to
// ElementOutput.
template <template <class> class Fn, class ElementOutput = float, class ElementCompute = float>
using Sm90Op = cutlass::epilogue::fusion::Sm90Compute<Fn, ElementOutput, ElementCompute,
                                                      cutlass::FloatRoundStyle::round_to_nearest>;

// The kernel table's sm90 `schedule`: the mainloop's and the epilogue's schedule.
// Ping-pong's epilogue schedule is the plain warp-specialized one.
struct Cooperative {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};
// FP8 operands: Cooperative's schedule builds CUTLASS's promoted FP8 mainloop (a second fp32
// accumulator the MMAs' sums are added into every mma_promotion_interval k-steps); this one
// accumulates in the tensor cores alone (fast accumulation), which the issue takes only where
// measured safe.
struct CooperativeFP8FastAccum {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
struct PingpongFP8FastAccum {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};

// The mainloop CollectiveBuilder chose, as the kernel runs it. 3xTF32 runs the TF32
// mainloop (over operands the binding split, K tripled) with accumulator promotion:
// see kernels/promoted_mainloop.h for why. The statistics kernels' (RemainderA) read each
// operand as itself beside its remainder (kernels/remainder_mainloop.h).
template <class Dtype, class Mainloop, bool RemainderA>
struct Sm90Mainloop {
  using type = Mainloop;
};
template <class Mainloop>
struct Sm90Mainloop<dtype::f32x3, Mainloop, false> {
  using type = PromotedMainloop<Mainloop>;
};
template <class Mainloop>
struct Sm90Mainloop<dtype::f32x3, Mainloop, true> {
  using type = RemainderMainloop<Mainloop>;
};

// TileShape: the CTA tile (M, N, K), cute::Shape of static ints. EpilogueTile: the
// epilogue's subtile or EpilogueTileAuto. StrideD: D's stride, row-major
// (int64_t, _1, _0) or column-major (_1, int64_t, _0). Evt: the fusion, whose
// broadcasts and reductions take the same CTA tile (each CTA's nodes cover its own
// tile, not its cluster's). LayoutA: row-major (K-contiguous), or column-major for the grad
// kernels' A, the next Linear's weight read transposed (sm90_grad.cuh). RemainderA: the
// statistics kernels' (Sm90Mainloop).
template <class Dtype, class TileShape, class ClusterShape, class EpilogueTile, class Schedule, class StrideD,
          class Evt, class LayoutA = cutlass::layout::RowMajor, bool RemainderA = false>
struct Sm90Kernel {
  using Element = typename Dtype::Element;
  using Operand = typename Dtype::Operand;
  static constexpr int Alignment = kAlignment<Dtype>;
  static constexpr int OperandAlignment = kOperandAlignment<Dtype>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      TileShape, ClusterShape, EpilogueTile,
      float, float,                  // accumulator, epilogue compute
      void, StrideD, Alignment,      // no C: the EVT reads what it needs itself
      Element, StrideD, Alignment,   // D
      typename Schedule::Epilogue,
      Evt>::CollectiveOp;

  // The mainloop takes the shared memory the epilogue leaves (its stage count).
  using CollectiveMainloop = typename Sm90Mainloop<
      Dtype, typename cutlass::gemm::collective::CollectiveBuilder<
                 cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
                 Operand, LayoutA, OperandAlignment,
                 Operand, cutlass::layout::ColumnMajor, OperandAlignment,
                 float,
                 TileShape, ClusterShape,
                 cutlass::gemm::collective::StageCountAutoCarveout<
                     static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
                 typename Schedule::Kernel>::CollectiveOp, RemainderA>::type;

  // Problem shape (M, N, K, L); void: the default (persistent) tile scheduler.
  using type = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                    CollectiveEpilogue, void>;
};

// The row's GEMM around a traced tree: Evt, the generated struct (csrc/generated/evt_sm90_*.h),
// templated on the CTA tile, epilogue tile and epilogue schedule, with its Tree and
// args(GemmEvtArgs). sm90_eval.cuh and sm90_stats.cuh name it with their D layouts.
template <class Dtype, template <class, class, class> class Evt, class StrideD, class TileShape, class ClusterShape,
          class EpilogueTile, class Schedule, class LayoutA = cutlass::layout::RowMajor, bool RemainderA = false>
struct Sm90Gemm {
  using Epilogue = Evt<TileShape, EpilogueTile, typename Schedule::Epilogue>;
  using GemmKernel = typename Sm90Kernel<Dtype, TileShape, ClusterShape, EpilogueTile, Schedule, StrideD,
                                         typename Epilogue::Tree, LayoutA, RemainderA>::type;

  static sm90::Fusion<GemmKernel> fusion_args(GemmEvtArgs const& p) { return Epilogue::args(p); }
};

}  // namespace cutlass_fused::gemm
