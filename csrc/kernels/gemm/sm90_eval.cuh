// The sm90a eval GEMM (mode "eval" of codegen/kernels.py): inference's Linear, BatchNorm and
// activation in one kernel, y = act((x W^T + b) * a + c) per column, stored row-major. The
// tree is codegen/epilogues.py's evaluate (fp16: evaluate_rounded), traced into
// csrc/generated/evt_sm90_eval_<dtype>.h; its fold vectors a, c (s, g) are made in the epilogue
// (sm90_fold.cuh) or read as the fold kernel kept them inside frozen_weights()
// (eval_fold_cuda.cpp).
//
// A row of the kernel table instantiates Gemm with its dtype (dtype.cuh), tree, CTA tile,
// cluster, epilogue tile and schedule (csrc/generated/sm90_*_eval_*.cu).
#pragma once

#include "kernels/gemm/sm90_kernel.cuh"

namespace cutlass_fused::gemm::sm90_eval {

template <class Dtype, template <class, class, class> class Evt, class TileShape, class ClusterShape,
          class EpilogueTile, class Schedule>
using Gemm = Sm90Gemm<Dtype, Evt, cute::Stride<int64_t, cute::_1, cute::_0>,  // y row-major
                      TileShape, ClusterShape, EpilogueTile, Schedule>;

}  // namespace cutlass_fused::gemm::sm90_eval
