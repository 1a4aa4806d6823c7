// CUDA status checks that turn failures into exceptions the binding layer
// reports as RuntimeError, naming the step that failed.
#pragma once

#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

namespace cutlass_fused {

inline void check_cuda(cudaError_t err, char const* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("cutlass_fused: ") + what + ": " + cudaGetErrorString(err));
  }
}

}  // namespace cutlass_fused
