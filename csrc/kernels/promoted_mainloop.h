// The sm90 mainloop with accumulator promotion, for 3xTF32 (dtype f32x3).
//
// Hopper's tensor cores add each wgmma's products into the fp32 accumulator
// with truncation, so a long K loop drifts: TF32 GEMMs over operands split
// for 3xTF32 (ours and cuBLAS's) erred far more than SGEMM at large K
// (docs/decisions.md, "fp32 on sm90"). CUTLASS's FP8 mainloop avoids this by
// accumulating a few k-blocks in the tensor cores and then adding them into a
// separate accumulator with ordinary (round-to-nearest) fp32 adds, every
// `mma_promotion_interval` MMAs (the kernel table's `promote`). Nothing in it
// is specific to FP8: this takes the mainloop that CollectiveBuilder chose and
// swaps in that policy.
#pragma once

#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/sm90_mma_tma_gmma_ss_warpspecialized_fp8.hpp"

namespace cutlass_fused {

template <class M>
using PromotedMainloop = cutlass::gemm::collective::CollectiveMma<
    cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedFP8<M::DispatchPolicy::Stages,
                                                         typename M::DispatchPolicy::ClusterShape,
                                                         typename M::DispatchPolicy::Schedule>,
    typename M::TileShape, typename M::ElementA, typename M::StrideA, typename M::ElementB, typename M::StrideB,
    typename M::TiledMma, typename M::GmemTiledCopyA, typename M::SmemLayoutAtomA, typename M::SmemCopyAtomA,
    typename M::TransformA, typename M::GmemTiledCopyB, typename M::SmemLayoutAtomB, typename M::SmemCopyAtomB,
    typename M::TransformB>;

}  // namespace cutlass_fused
