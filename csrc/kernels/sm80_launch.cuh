// Host launcher for the sm80 mma.sync kernels with an EVT (CUTLASS 2.x API).
#pragma once

// The sm80 visitor headers compile only after CUTLASS's GEMM headers, which the kernel templates
// (csrc/kernels/gemm/sm80_nodes.cuh) include first.
#include "cutlass/epilogue/threadblock/fusion/visitors.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/default_gemm_universal_with_visitor.h"
#include "kernels/cutlass_check.h"
#include "kernels/evt_extra.h"
#include "kernels/gemm_evt.h"

namespace cutlass_fused::sm80 {

template <class Kernel>
using Fusion = typename Kernel::FusionCallbacks::Arguments;

template <class Kernel, Fusion<Kernel> (*fusion_args)(GemmEvtArgs const&), char const* (*name)()>
struct Launch {
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(GemmEvtArgs const& p) {
    // D is stored by the EVT's aux-store node, so the kernel's C and D are unused.
    return typename Gemm::Arguments(cutlass::gemm::GemmUniversalMode::kGemm, {p.m, p.n, p.k},
                                    /*batch_count=*/1, fusion_args(p), p.x, p.w, nullptr, nullptr,
                                    0, 0, 0, 0, p.ldx, p.ldw, 0, 0);
  }

  static size_t workspace_size(GemmEvtArgs const& p) { return Gemm::get_workspace_size(arguments(p)); }

  static void run(GemmEvtArgs const& p, cudaStream_t stream) {
    auto args = arguments(p);
    Gemm gemm;
    check(Gemm::can_implement(args), name(), "can_implement");
    check(gemm.initialize(args, p.workspace, stream), name(), "initialize");
    check(gemm.run(stream), name(), "run");
    check_cuda(cudaGetLastError(), name());
  }

  static KernelEntry const& entry() {
    static KernelEntry const e{&workspace_size, &run};
    return e;
  }
};

}  // namespace cutlass_fused::sm80
