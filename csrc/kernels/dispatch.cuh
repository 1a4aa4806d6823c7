// A DType's CUDA element type, for the host launchers of every kernel file (bn_common.cuh's
// BatchNorm kernels, fp8_cast.cu's casts): f(value of that type), chosen by one switch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/types.h"

namespace cutlass_fused {
namespace {

template <class F>
void dispatch(DType dt, F&& f) {
  switch (dt) {
    case DType::bf16: f(__nv_bfloat16{}); break;
    case DType::f16: f(__half{}); break;
    case DType::f32: f(float{}); break;
  }
}

}  // namespace
}  // namespace cutlass_fused
