// The sm90a dX GEMM of the Linear after a BatchNorm layer, with that layer's backward sums in its
// epilogue (mode "grad" of codegen/kernels.py). Swapped as the statistics GEMM is
// (sm90_stats.cuh), so that a feature of the layer is a row of the kernel's tile and its sums over
// the batch are column reductions in registers: the kernel computes W2^T dz^T, features x batch,
// stored column-major, which is g row-major. A is the next Linear's weight W2 (k x features,
// row-major) read as features x k, column-major; B is dz (batch x k, K-contiguous). The tree is
// codegen/epilogues.py's grad_sums (csrc/generated/evt_sm90_grad_<dtype>.h): g = dy times the
// activation's derivative, and per CTA and feature the sums of g and g (h - mean_h), laid out as
// the statistics GEMM's (ceil(batch / tile_n), round_up(features, tile_m)), which
// batch_norm_backward_partials (bn_backward.cu) adds up in a fixed order.
#pragma once

#include "kernels/gemm/sm90_kernel.cuh"

namespace cutlass_fused::gemm::sm90_grad {

template <class Dtype, template <class, class, class> class Evt, class TileShape, class ClusterShape,
          class EpilogueTile, class Schedule>
using Gemm = Sm90Gemm<Dtype, Evt, cute::Stride<cute::_1, int64_t, cute::_0>,  // W2^T dz^T column-major: g
                      TileShape, ClusterShape, EpilogueTile, Schedule, cutlass::layout::ColumnMajor>;

}  // namespace cutlass_fused::gemm::sm90_grad
