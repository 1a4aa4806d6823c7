// Host launcher for the sm90a TMA warp-specialized kernels (CUTLASS 3.x API).
#pragma once

#include <type_traits>

#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "kernels/cutlass_check.h"
#include "kernels/evt_extra.h"
#include "kernels/gemm_evt.h"

namespace cutlass_fused::sm90 {

template <class Kernel>
using Fusion = typename Kernel::CollectiveEpilogue::FusionCallbacks::Arguments;

// A 2-D stride's leading dimension: the non-unit one, (ld, 1) for row-major, (1, ld) for
// column-major.
template <class Stride>
void set_ld(Stride& stride, int64_t ld) {
  if constexpr (cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<0>(stride))>>) {
    cute::get<1>(stride) = ld;
  } else {
    cute::get<0>(stride) = ld;
  }
}

// The statistics kernels' 3xTF32 mainloop takes each operand's remainder beside it
// (kernels/remainder_mainloop.h).
template <class Arguments, class = void>
struct TakesRemainder : std::false_type {};
template <class Arguments>
struct TakesRemainder<Arguments, std::void_t<decltype(Arguments::ptr_A_rest)>> : std::true_type {};

// PromotionInterval: for the promoted mainloops (f32x3's, e4m3's), the MMAs between
// promotions (codegen/kernels.py `promote`); 0 keeps the mainloop's default.
template <class Kernel, Fusion<Kernel> (*fusion_args)(GemmEvtArgs const&), char const* (*name)(),
          int PromotionInterval = 0>
struct Launch {
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using ElementA = typename Kernel::ElementA;
  using ElementB = typename Kernel::ElementB;
  using ElementD = typename Kernel::CollectiveEpilogue::ElementD;

  static typename Gemm::Arguments arguments(GemmEvtArgs const& p) {
    typename Kernel::StrideA stride_x{};
    typename Kernel::StrideB stride_w{};
    typename Kernel::StrideD stride_out{};
    set_ld(stride_x, p.ldx);  // row-major x; column-major for the grad kernels' W2^T
    cute::get<0>(stride_w) = p.ldw;
    set_ld(stride_out, p.ldo);  // row-major h or y; column-major for the stats kernels' W x^T
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {p.m, p.n, p.k, 1};
    args.mainloop = {static_cast<ElementA const*>(p.x), stride_x, static_cast<ElementB const*>(p.w), stride_w};
    // No C operand (ElementC = void); D is the EVT's output.
    args.epilogue = {fusion_args(p), nullptr, stride_out, static_cast<ElementD*>(p.out), stride_out};
    if constexpr (PromotionInterval > 0) args.mainloop.mma_promotion_interval = PromotionInterval;
    if constexpr (TakesRemainder<typename Kernel::CollectiveMainloop::Arguments>::value) {
      args.mainloop.ptr_A_rest = static_cast<ElementA const*>(p.x_rest);
      args.mainloop.ptr_B_rest = static_cast<ElementB const*>(p.w_rest);
      args.mainloop.k_a = p.k_x;
      args.mainloop.k_b = p.k_w;
    }
    using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.max_swizzle_size = p.swizzle;
    args.scheduler.raster_order = p.raster == 1 ? Raster::AlongM : p.raster == 2 ? Raster::AlongN : Raster::Heuristic;
    args.hw_info.device_id = p.device;
    args.hw_info.sm_count = p.sm_count;
    return args;
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

}  // namespace cutlass_fused::sm90
