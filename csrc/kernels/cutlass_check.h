// CUTLASS status checks, for the GEMM launchers.
#pragma once

#include <stdexcept>
#include <string>

#include "cutlass/cutlass.h"
#include "kernels/check.h"

namespace cutlass_fused {

inline void check(cutlass::Status status, char const* kernel, char const* step) {
  if (status != cutlass::Status::kSuccess) {
    throw std::runtime_error(std::string("cutlass_fused: ") + kernel + ": " + step + " failed: " +
                             cutlassGetStatusString(status));
  }
}

}  // namespace cutlass_fused
