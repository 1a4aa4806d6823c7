// The sm80 training GEMM with the BatchNorm statistics in its epilogue (mode "stats" of
// codegen/kernels.py, family sm80; issue 32). The eval kernel's mainloop (sm80_eval.cuh), not
// swapped: x is A, the batch is M and the features are N, so a feature's sum over the CTA's rows
// is CUTLASS 2.x's row reduction (VisitorRowReduction: registers, then one pass through shared
// memory). The tree is codegen/epilogues.py's stats_unswapped, traced into
// csrc/generated/evt_sm80_stats_<dtype>.h: besides h it leaves, per CTA row of tiles and feature,
// the sums of h and h^2 over the CTA's rows, in the layout the training tail reads (batch_norm.h's
// u_sum: row t holds batch tile t's sums, u_ld apart): the sm90 statistics kernels' contract, so
// the tail is the same. Its reductions store each CTA's sums at its row of the partials
// (sm80_nodes.cuh's store_partial and partials_stride): no atomics, no zeroing, and the tail adds
// them in a fixed order, as for sm90.
#pragma once

#include "kernels/gemm/sm80_eval.cuh"

namespace cutlass_fused::gemm::sm80_stats {

template <class Dtype, template <class> class Evt, class ThreadblockShape, class WarpShape, int Stages>
struct Gemm : sm80_eval::Gemm<Dtype, Evt, ThreadblockShape, WarpShape, Stages> {
  static_assert(cute::is_same_v<typename Dtype::StatsCompute, float>,
                "sm80 statistics kernels keep fp32 partials (bf16, f16, tf32)");
};

}  // namespace cutlass_fused::gemm::sm80_stats
