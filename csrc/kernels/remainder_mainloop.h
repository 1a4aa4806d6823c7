// The sm90 3xTF32 statistics GEMM's mainloop with each operand read from two tensors: the fp32
// operand itself, and its remainder r = TF32(v - tf32(v)), where tf32(v) is v with its low 13 bits
// dropped, as the tensor cores read an fp32 operand. So no pass writes an operand's big part (or the
// copy of it that a second segment meets): the pass over each operand writes r alone
// (csrc/kernels/tf32x3.h, tf32_remainder_rows), 8 bytes an element moved against 16
// (docs/decisions.md, "fp32 on sm90").
//
// K' = 3 S with S a whole number of K tiles, T = S / tile K. K tile t of A (the weight, in the
// swapped kernel) reads w (t < T), r_w (T <= t < 2T) and w again; B's (x) reads r_x, then x twice:
// w r_x + r_w x + w x, the small products first (tf32x3.h, SplitOrder). An infinite v has r = 0,
// which meets the other operand's infinity or its zero remainder as NaN, or as either sign: the
// binding rewrites what a row holding an infinity reaches afterwards (inf_fix.h), and the tail's
// exact pass sums those columns. The rest is the promoted mainloop (promoted_mainloop.h), the MMA
// side untouched.
#pragma once

#include "kernels/promoted_mainloop.h"

namespace cutlass_fused {

template <class M>
struct RemainderMainloop : PromotedMainloop<M> {
  using Base = PromotedMainloop<M>;
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::TileShape;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  using typename Base::GmemTiledCopyA;
  using typename Base::SmemLayoutA;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;

  // Base's, and the remainders' base pointers (each with its operand's stride) and the operands'
  // K extents (their padded row lengths, at most S: TMA reads zeros past them).
  struct Arguments {
    ElementA const* ptr_A;
    StrideA dA;
    ElementB const* ptr_B;
    StrideB dB;
    uint32_t mma_promotion_interval = 4;
    ElementA const* ptr_A_rest = nullptr;
    ElementB const* ptr_B_rest = nullptr;
    int k_a = 0, k_b = 0;
  };

  struct Params : Base::Params {
    typename Base::Params::TMA_A tma_load_a_rest;
    typename Base::Params::TMA_B tma_load_b_rest;
  };

  template <class ProblemShape>
  static auto tma_a(ProblemShape const& problem_shape, ElementA const* ptr, StrideA const& stride, int k_a) {
    using namespace cute;
    auto [m, n, k, l] = append<4>(problem_shape, 1);
    Tensor t = make_tensor(ptr, make_layout(make_shape(m, k_a, l), stride));
    return make_tma_copy_A_sm90(GmemTiledCopyA{}, t, SmemLayoutA{}(_, _, Int<0>{}), TileShape{}, ClusterShape{});
  }

  template <class ProblemShape>
  static auto tma_b(ProblemShape const& problem_shape, ElementB const* ptr, StrideB const& stride, int k_b) {
    using namespace cute;
    auto [m, n, k, l] = append<4>(problem_shape, 1);
    Tensor t = make_tensor(ptr, make_layout(make_shape(n, k_b, l), stride));
    return make_tma_copy_B_sm90(typename Base::GmemTiledCopyB{}, t, typename Base::SmemLayoutB{}(_, _, Int<0>{}),
                                TileShape{}, ClusterShape{});
  }

  // Base's, but each operand's descriptors span its own K (k_a, k_b), not the problem's 3 segments.
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void*) {
    using namespace cute;
    Params p{};
    p.tma_load_a = tma_a(problem_shape, args.ptr_A, args.dA, args.k_a);
    p.tma_load_a_rest = tma_a(problem_shape, args.ptr_A_rest, args.dA, args.k_a);
    p.tma_load_b = tma_b(problem_shape, args.ptr_B, args.dB, args.k_b);
    p.tma_load_b_rest = tma_b(problem_shape, args.ptr_B_rest, args.dB, args.k_b);
    p.tma_transaction_bytes = Base::TmaTransactionBytes;
    p.tma_transaction_bytes_mk = Base::TmaTransactionBytesMK;
    p.tma_transaction_bytes_nk = Base::TmaTransactionBytesNK;
    p.mma_promotion_interval = args.mma_promotion_interval;
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [m, n, k, l] = cute::append<4>(problem_shape, 1);
    constexpr int tile_k = cute::size<2>(TileShape{});
    typename Base::Arguments base{args.ptr_A, args.dA, args.ptr_B, args.dB, args.mma_promotion_interval};
    return args.ptr_A_rest != nullptr && args.ptr_B_rest != nullptr && k % (3 * tile_k) == 0 && args.k_a > 0 &&
           args.k_a <= k / 3 && args.k_b > 0 && args.k_b <= k / 3 && Base::can_implement(problem_shape, base);
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    cute::prefetch_tma_descriptor(params.tma_load_a_rest.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_b_rest.get_tma_descriptor());
  }

  // Base's producer loop, with each operand's K tile and descriptor taken by segment.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using namespace cute;
    if (!cute::elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
    constexpr uint32_t cluster_x = get<0>(ClusterShape());
    uint2 local = {block_rank_in_cluster % cluster_x, block_rank_in_cluster / cluster_x};
    Tensor gA_mkl = get<0>(load_inputs);
    Tensor gB_nkl = get<1>(load_inputs);
    auto block_tma_a = params.tma_load_a.get_slice(local.y);
    auto block_tma_b = params.tma_load_b.get_slice(local.x);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor tAgA = block_tma_a.partition_S(gA_mkl(_, _, m_coord, _, l_coord));
    Tensor tAsA = block_tma_a.partition_D(sA);
    Tensor tBgB = block_tma_b.partition_S(gB_nkl(_, _, n_coord, _, l_coord));
    Tensor tBsB = block_tma_b.partition_D(sB);
    uint16_t mcast_a = 0, mcast_b = 0;
    auto block_layout = Layout<ClusterShape>{};
    if constexpr (cute::is_same_v<GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      for (int n = 0; n < size<1>(block_layout); ++n) mcast_a |= uint16_t(1) << block_layout(local.x, n, Int<0>{});
    }
    if constexpr (cute::is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < size<0>(block_layout); ++m) mcast_b |= uint16_t(1) << block_layout(m, local.y, Int<0>{});
    }
    int segment = size<3>(gA_mkl) / 3;  // T: K tiles a segment
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      int stage = smem_pipe_write.index();
      int t = *k_tile_iter;
      int s = t / segment, local = t - s * segment;
      auto const& tma_a = s == 1 ? params.tma_load_a_rest : params.tma_load_a;
      auto const& tma_b = s == 0 ? params.tma_load_b_rest : params.tma_load_b;
      copy(tma_a.with(*barrier, mcast_a), tAgA(_, _, _, local), tAsA(_, _, _, stage));
      copy(tma_b.with(*barrier, mcast_b), tBgB(_, _, _, local), tBsB(_, _, _, stage));
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }
};

}  // namespace cutlass_fused
