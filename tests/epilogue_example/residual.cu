// docs/epilogues.md's worked example: the sm90 bf16 eval GEMM around codegen/epilogues.py's
// evaluate_residual, which tests/test_epilogue_example.py traces into evt_example.h, the header this
// includes. The tile, cluster and schedule are bf16 eval's default row (codegen/kernels.py).
#include "evt_example.h"
#include "kernels/gemm/sm90_eval.cuh"

namespace example {
using Gemm = cutlass_fused::gemm::sm90_eval::Gemm<
    cutlass_fused::gemm::dtype::bf16, cutlass_fused::gen::evt::sm90_eval_residual_bf16,
    cute::Shape<cute::_256, cute::_128, cute::_64>, cute::Shape<cute::_1, cute::_2, cute::_1>,
    cutlass::epilogue::collective::EpilogueTileAuto, cutlass_fused::gemm::Cooperative>;
struct Kernel : Gemm::GemmKernel {};
inline char const* name() { return "sm90_bf16_eval_residual_256x128x64_c1x2x1"; }
using Launch = cutlass_fused::sm90::Launch<Kernel, &Gemm::fusion_args, &name>;
}  // namespace example

size_t residual_workspace_size(cutlass_fused::GemmEvtArgs const& p) { return example::Launch::workspace_size(p); }
void residual_run(cutlass_fused::GemmEvtArgs const& p, cudaStream_t stream) { example::Launch::run(p, stream); }
