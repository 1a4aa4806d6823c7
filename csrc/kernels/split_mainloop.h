// The sm90 mainloop for fp32 without TF32 that splits x itself (kernel table
// mode "split"): 3xTF32 with x read once, raw, instead of a split copy.
//
// The promoted mainloop (promoted_mainloop.h) runs over x and W split and
// concatenated along K in memory: a split pass over x first, and every k-tile
// of work streams three A tiles and three B tiles through L2, which holds the
// GEMM back at M = 1024 (ncu: L2-bound; benchmarks/NOTES.md v0.11). Here a
// stage holds one raw x tile and the three parts of W's tile (W's split is
// cached: big, again and small are the batch mode of an N x K x 3 tensor).
// Each consumer thread loads its x fragment from shared memory into registers
// and splits it there (tf32_split.cuh) into big, small and again (big, or 0 at
// a non-finite x), which feed register-sourced (RS) wgmmas: per k-block
// small·again_W + again·small_W + big·big_W. (Splitting in shared memory
// instead measured 1.6x slower than the promoted kernel: the proxy fence that
// makes generic writes visible to wgmma waits for the wgmmas in flight.)
//
// The tensor cores add products with truncation, so they go into a second
// accumulator promoted into the first with fp32 adds (CUTLASS's
// GmmaFP8Accumulation) every `mma_promotion_interval` MMAs (one k-tile's). The
// small products go first, into the freshly zeroed accumulator, so they sum at
// their own scale. Two register sets: the next k-tile's x is loaded and split
// while this one's wgmmas run.
#pragma once

#include "cutlass/arch/barrier.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/fp8_accumulation.hpp"
#include "kernels/tf32_split.cuh"

namespace cutlass_fused {

// The split with the hardware's TF32 rounding (cvt.rna: ties away from zero,
// one instruction), a finite x that rounds up to infinity truncated instead.
// Fewer dependent instructions than tf32_split.cuh's: the consumer warps issue
// the split between their wgmmas.
__device__ __forceinline__ float tf32_rna(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}

__device__ __forceinline__ Parts split_rna(float x) {
  bool finite = isfinite(x);
  float big = tf32_rna(x);
  big = finite && !isfinite(big) ? __uint_as_float(__float_as_uint(x) & 0xffffe000u) : big;
  return {big, finite ? tf32_rna(x - big) : 0.f, finite ? big : 0.f};
}

// M: the TF32 SS mainloop CollectiveBuilder chose for the tile; its tile,
// shared-memory atoms and TMA copies are reused. A stage holds four tiles
// (x and W's three parts) where M's held two, so by default it gets half M's
// stages, which CollectiveBuilder sized to the shared memory the epilogue leaves.
template <class M, int Stages_ = M::DispatchPolicy::Stages / 2>
struct SplitMainloop {
  using DispatchPolicy = cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedFP8<
      Stages_, typename M::DispatchPolicy::ClusterShape, typename M::DispatchPolicy::Schedule>;
  using TileShape = typename M::TileShape;
  using ClusterShape = typename DispatchPolicy::ClusterShape;
  using ElementA = float;
  using StrideA = typename M::StrideA;
  using ElementB = float;
  using StrideB = typename M::StrideB;  // its batch stride separates W's three parts
  // M's MMA (64x128 per warpgroup, two warpgroups along M), with A from registers.
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<cutlass::tfloat32_t, cutlass::tfloat32_t, float, TileShape>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  static_assert(cute::size(typename M::TiledMma{}) == cute::size(TiledMma{}), "a cooperative (2-warpgroup) mainloop");
  using ElementAccumulator = typename TiledMma::ValTypeC;
  using GmemTiledCopyA = typename M::GmemTiledCopyA;
  using GmemTiledCopyB = typename M::GmemTiledCopyB;
  using SmemLayoutAtomA = typename M::SmemLayoutAtomA;
  using SmemLayoutAtomB = typename M::SmemLayoutAtomB;
  using SmemCopyAtomA = void;  // x's fragments are loaded element by element
  using SmemCopyAtomB = void;
  using TransformA = cute::identity;
  using TransformB = cute::identity;
  using ArchTag = typename DispatchPolicy::ArchTag;
  using MainloopPipeline = cutlass::PipelineTmaAsync<DispatchPolicy::Stages>;
  using PipelineState = cutlass::PipelineState<DispatchPolicy::Stages>;
  using PipelineParams = typename MainloopPipeline::Params;
  static constexpr int NumProducerThreadEvents = 1;
  static constexpr int Stages = DispatchPolicy::Stages;
  static constexpr int kParts = 3;  // W's big, again and small parts

  static_assert(!cutlass::gemm::detail::is_major<0, StrideA>() && !cutlass::gemm::detail::is_major<0, StrideB>(),
                "x and W must be K-major");
  static_assert(std::is_same_v<ElementA, typename M::ElementA> && std::is_same_v<ElementB, typename M::ElementB>,
                "the builder's mainloop must take fp32 operands");

  // Stage is the outermost mode, so a stage's tile is one contiguous block.
  using SmemLayoutA = decltype(cute::tile_to_shape(
      SmemLayoutAtomA{},
      cute::make_shape(cute::shape<0>(TileShape{}), cute::shape<2>(TileShape{}), cute::Int<Stages>{}),
      cute::Step<cute::_1, cute::_2, cute::_3>{}));
  using SmemLayoutB = decltype(cute::tile_to_shape(
      SmemLayoutAtomB{},
      cute::make_shape(cute::shape<1>(TileShape{}), cute::shape<2>(TileShape{}), cute::Int<kParts * Stages>{}),
      cute::Step<cute::_1, cute::_2, cute::_3>{}));
  struct SharedStorage {
    struct TensorStorage : cute::aligned_struct<128, cute::_0> {
      cute::array_aligned<cutlass::tfloat32_t, cute::cosize_v<SmemLayoutA>> smem_A;  // raw fp32 x
      cute::array_aligned<typename TiledMma::ValTypeB, cute::cosize_v<SmemLayoutB>> smem_B;
    } tensors;
    using PipelineStorage = typename MainloopPipeline::SharedStorage;
    PipelineStorage pipeline;
  };
  using TensorStorage = typename SharedStorage::TensorStorage;
  using PipelineStorage = typename SharedStorage::PipelineStorage;

  // MMAs a k-tile issues: three products per k-block of 8 (a TF32 wgmma's K).
  static constexpr int kKBlocks = cute::size<2>(TileShape{}) / 8;
  static constexpr int kMmasPerKTile = kParts * kKBlocks;

  struct Arguments {
    ElementA const* ptr_A;  // x: M x K
    StrideA dA;
    ElementB const* ptr_B;  // W's split: N x K x 3 (big, again, small)
    StrideB dB;
    uint32_t mma_promotion_interval = kMmasPerKTile;
  };

  static constexpr uint32_t TmaTransactionBytes = static_cast<uint32_t>(
      (cute::size<0>(SmemLayoutA{}) * cute::size<1>(SmemLayoutA{}) +
       kParts * cute::size<0>(SmemLayoutB{}) * cute::size<1>(SmemLayoutB{})) * sizeof(float));

  struct Params {
    using TMA_A = decltype(cute::make_tma_copy_A_sm90(
        GmemTiledCopyA{},
        cute::make_tensor(static_cast<ElementA const*>(nullptr), cute::repeat_like(StrideA{}, int32_t(0)), StrideA{}),
        SmemLayoutA{}(cute::_, cute::_, 0), TileShape{}, ClusterShape{}));
    using TMA_B = decltype(cute::make_tma_copy_B_sm90(
        GmemTiledCopyB{},
        cute::make_tensor(static_cast<ElementB const*>(nullptr), cute::repeat_like(StrideB{}, int32_t(0)), StrideB{}),
        SmemLayoutB{}(cute::_, cute::_, 0), TileShape{}, ClusterShape{}));
    TMA_A tma_load_a;
    TMA_B tma_load_b;
    uint32_t tma_transaction_bytes = TmaTransactionBytes;
    uint32_t mma_promotion_interval = kMmasPerKTile;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void*) {
    auto [m, n, k, l] = cute::append<4>(problem_shape, 1);
    auto a = cute::make_tensor(args.ptr_A, cute::make_layout(cute::make_shape(m, k, l), args.dA));
    auto b = cute::make_tensor(args.ptr_B, cute::make_layout(cute::make_shape(n, k, int32_t(kParts)), args.dB));
    return {cute::make_tma_copy_A_sm90(GmemTiledCopyA{}, a, SmemLayoutA{}(cute::_, cute::_, 0), TileShape{},
                                       ClusterShape{}),
            cute::make_tma_copy_B_sm90(GmemTiledCopyB{}, b, SmemLayoutB{}(cute::_, cute::_, 0), TileShape{},
                                       ClusterShape{}),
            TmaTransactionBytes, args.mma_promotion_interval};
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [m, n, k, l] = cute::append<4>(problem_shape, 1);
    constexpr int kAlign = 128 / cutlass::sizeof_bits<float>::value;
    return l == 1 && cutlass::detail::check_alignment<kAlign>(cute::make_shape(m, k, l), StrideA{}) &&
           cutlass::detail::check_alignment<kAlign>(cute::make_shape(n, k, int32_t(kParts)), args.dB) &&
           args.mma_promotion_interval > 0 && args.mma_promotion_interval % kMmasPerKTile == 0;
  }

  static CUTLASS_DEVICE void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_load_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_b.get_tma_descriptor());
  }

  // gA (BLK_M, BLK_K, m, k, l) and gB (BLK_N, BLK_K, n, k, part); the kernel
  // reads tile counts from modes 2-3 and takes part 0 for its l = 0.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& params) const {
    using X = cute::Underscore;
    auto [m, n, k, l] = problem_shape_MNKL;
    auto mA = params.tma_load_a.get_tma_tensor(cute::make_shape(m, k, l));
    auto mB = params.tma_load_b.get_tma_tensor(cute::make_shape(n, k, int32_t(kParts)));
    auto gA = cute::local_tile(mA, TileShape{}, cute::make_coord(cute::_, cute::_, cute::_), cute::Step<cute::_1, X, cute::_1>{});
    auto gB = cute::local_tile(mB, TileShape{}, cute::make_coord(cute::_, cute::_, cute::_), cute::Step<X, cute::_1, cute::_1>{});
    return cute::make_tuple(gA, gB);
  }

  // Producer: per stage one x tile and W's three parts of the same k-tile.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    using namespace cute;
    if (!elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    constexpr uint32_t cluster_x = size<0>(ClusterShape{});
    uint2 cluster_id = {block_rank_in_cluster % cluster_x, block_rank_in_cluster / cluster_x};
    auto tma_a = params.tma_load_a.get_slice(cluster_id.y);
    auto tma_b = params.tma_load_b.get_slice(cluster_id.x);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor tAgA = tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));  // (TMA, TMA_M, TMA_K, k)
    Tensor tAsA = tma_a.partition_D(sA);                                               // (TMA, TMA_M, TMA_K, PIPE)
    Tensor tBgB = tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, _));         // (TMA, TMA_N, TMA_K, k, part)
    Tensor tBsB = tma_b.partition_D(sB);                                               // (TMA, TMA_N, TMA_K, part x PIPE)

    uint16_t mcast_a = 0, mcast_b = 0;
    auto block_layout = Layout<ClusterShape>{};
    if constexpr (is_same_v<GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      for (int n = 0; n < size<1>(block_layout); ++n) mcast_a |= uint16_t(1) << block_layout(cluster_id.x, n, Int<0>{});
    }
    if constexpr (is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < size<0>(block_layout); ++m) mcast_b |= uint16_t(1) << block_layout(m, cluster_id.y, Int<0>{});
    }
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      int stage = smem_pipe_write.index();
      copy(params.tma_load_a.with(*barrier, mcast_a), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, stage));
      CUTLASS_PRAGMA_UNROLL
      for (int part = 0; part < kParts; ++part) {
        copy(params.tma_load_b.with(*barrier, mcast_b), tBgB(_, _, _, *k_tile_iter, part),
             tBsB(_, _, _, kParts * stage + part));
      }
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  CUTLASS_DEVICE void load_tail(MainloopPipeline pipeline, PipelineState smem_pipe_write) {
    if (cute::elect_one_sync()) pipeline.producer_tail(smem_pipe_write);
  }

  // Consumer: per k-tile, the next stage's x is loaded and split while this
  // one's wgmmas run.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum, int k_tile_count,
                          int thread_idx, TensorStorage& shared_tensors, Params const& params) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});

    constexpr int warp_groups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout warp_group_layout = make_layout(Int<warp_groups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    int warp_group = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_thread_slice(thread_idx);
    auto warp_group_mma = tiled_mma.get_slice(warp_group_layout(warp_group));
    Tensor tCsA = thread_mma.partition_A(sA);                                       // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tCrB = warp_group_mma.make_fragment_B(warp_group_mma.partition_B(sB));   // (MMA, MMA_N, MMA_K, part x PIPE)
    // Two register sets of x's three parts, named statically (the loop below is unrolled by two).
    Tensor big0 = thread_mma.partition_fragment_A(sA(_, _, 0));                     // (MMA, MMA_M, MMA_K)
    Tensor small0 = make_fragment_like(big0), again0 = make_fragment_like(big0);
    Tensor big1 = make_fragment_like(big0), small1 = make_fragment_like(big0), again1 = make_fragment_like(big0);
    constexpr int k_blocks = size<2>(big0);
    static_assert(k_blocks == kKBlocks, "a TF32 wgmma takes K = 8");

    cutlass::gemm::collective::GmmaFP8Accumulation accumulation(accum, params.mma_promotion_interval,
                                                               kMmasPerKTile);
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(accumulation());

    auto fence = [](auto& frag) {
      auto bits = recast<uint32_t>(frag);
      warpgroup_fence_operand(bits);
    };
    auto load_split = [&](auto& big, auto& small, auto& again, int stage) {
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < k_blocks; ++kb) copy(tCsA(_, _, kb, stage), big(_, _, kb));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(big); ++i) {
        Parts x = split_rna(__uint_as_float(big(i).raw()));
        big(i) = cutlass::tfloat32_t::bitcast(__float_as_uint(x.big));
        small(i) = cutlass::tfloat32_t::bitcast(__float_as_uint(x.small));
        again(i) = cutlass::tfloat32_t::bitcast(__float_as_uint(x.again));
      }
    };
    auto issue = [&](auto& big, auto& small, auto& again, int stage) {
      if (accumulation.prepare_if_needed()) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(accumulation());
      fence(big), fence(small), fence(again);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < k_blocks; ++kb) {
        cute::gemm(tiled_mma, small(_, _, kb), tCrB(_, _, kb, kParts * stage + 1), accumulation());
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        cute::gemm(tiled_mma, again(_, _, kb), tCrB(_, _, kb, kParts * stage + 2), accumulation());
      }
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < k_blocks; ++kb) {
        cute::gemm(tiled_mma, big(_, _, kb), tCrB(_, _, kb, kParts * stage), accumulation());
      }
      warpgroup_commit_batch();
    };
    // One k-tile from the `cur` set, loading the next into `nxt`; false when done.
    auto step = [&](auto& big, auto& small, auto& again, auto& nbig, auto& nsmall, auto& nagain) {
      issue(big, small, again, smem_pipe_read.index());
      PipelineState next = smem_pipe_read;
      ++next;
      if (k_tile_count > 1) {
        pipeline.consumer_wait(next, pipeline.consumer_try_wait(next));
        load_split(nbig, nsmall, nagain, next.index());
      }
      warpgroup_wait<0>();  // also frees this set's registers
      warpgroup_fence_operand(accumulation());
      fence(big), fence(small), fence(again);
      accumulation.promote_if_needed();
      pipeline.consumer_release(smem_pipe_read);
      smem_pipe_read = next;
      return --k_tile_count > 0;
    };

    if (k_tile_count > 0) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      load_split(big0, small0, again0, smem_pipe_read.index());
    }
    CUTLASS_PRAGMA_NO_UNROLL
    while (k_tile_count > 0) {
      if (!step(big0, small0, again0, big1, small1, again1)) break;
      step(big1, small1, again1, big0, small0, again0);
    }
    accumulation.promote_residue_if_needed();
    warpgroup_fence_operand(accumulation());
  }

  // mma() released every stage it read.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline, PipelineState, int) { cute::warpgroup_wait<0>(); }
};

}  // namespace cutlass_fused
