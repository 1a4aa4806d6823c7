// Autocast's casts of a Linear's fp32 operands (x, the weight, the bias) to its 16-bit dtype, up
// to three contiguous buffers in one launch, torch-free. The training op's Autograd kernel made
// them as one at::to each; under torch.compile each was a Triton launch from Inductor's wrapper.
// One launch for all three costs a host-bound step less (docs/decisions.md, "Autocast").
//
// Each value rounds to nearest even, as torch's CUDA copy rounds it (c10's BFloat16 and Half
// take the same CUDA intrinsics), so the GEMM sees the bits a cast by torch would give it.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/types.h"

namespace cutlass_fused {

// n contiguous fp32 values at in, rounded to the target dtype at out; n == 0: nothing.
struct CastSpan {
  float const* in = nullptr;
  void* out = nullptr;
  int64_t n = 0;
};

constexpr int kCastSpans = 3;

// Every span of spans, rounded to `out` (DType::bf16 or DType::f16), in one launch.
void cast_to_16(CastSpan const (&spans)[kCastSpans], DType out, cudaStream_t stream);

}  // namespace cutlass_fused
