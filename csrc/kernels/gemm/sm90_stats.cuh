// The sm90a training GEMM with the BatchNorm statistics in its epilogue (mode "stats" of
// codegen/kernels.py). The operands are swapped: the kernel computes W x^T, features x batch,
// stored column-major, which is h = x W^T + b row-major (GemmEvtArgs: x is the weight, w the
// input, ldo h's row stride). A feature is then a row of the kernel's tile, so its sums over
// the batch are column reductions, which CUTLASS does in registers and warp shuffles with no
// shared-memory pass (a row reduction, the unswapped form, needs one). The tree is
// codegen/epilogues.py's stats, traced into csrc/generated/evt_sm90_stats_<dtype>.h: besides h it
// leaves, per CTA and feature, the sums of u = h - shift and u^2 over the CTA's batch rows
// (ceil(batch / tile_n) x round_up(features, tile_m), in dtype.cuh's StatsCompute; gemm_evt.h),
// which the training tail (bn_train.cu) adds up in a fixed order.
//
// 3xTF32's read x and the weight as themselves beside their remainders (kernels/remainder_mainloop.h).
//
// A row of the kernel table instantiates Gemm with its dtype (dtype.cuh), tree, CTA tile
// (features, batch, K), cluster, epilogue tile and schedule (csrc/generated/sm90_*_stats_*.cu).
#pragma once

#include "kernels/gemm/sm90_kernel.cuh"

namespace cutlass_fused::gemm::sm90_stats {

template <class Dtype, template <class, class, class> class Evt, class TileShape, class ClusterShape,
          class EpilogueTile, class Schedule>
using Gemm = Sm90Gemm<Dtype, Evt, cute::Stride<cute::_1, int64_t, cute::_0>,  // W x^T column-major: h
                      TileShape, ClusterShape, EpilogueTile, Schedule, cutlass::layout::RowMajor,
                      std::is_same_v<Dtype, dtype::f32x3>>;

}  // namespace cutlass_fused::gemm::sm90_stats
