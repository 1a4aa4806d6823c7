// Grid sizes for grid-strided kernels, whose loops stride over what the grid does not cover.
#pragma once

#include <cstdint>

namespace cutlass_fused {

// Blocks for `work` items, `per_block` a block: at least 1, at most `cap` (a cap that fills any
// current GPU several times over; past it more blocks add launches, not bandwidth).
inline unsigned strided_grid(int64_t work, int64_t per_block, int64_t cap) {
  int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

}  // namespace cutlass_fused
