// The table of GEMM kernels, one row a line of codegen/kernels.py (generated/kernels.inc).
// Every row is listed in every build, so that the plan can be tested on a CPU; a row whose
// family this build did not compile has no entry.
#pragma once

#include <cstdint>

#include "generated/kernels.inc"
#include "kernels/types.h"

namespace cutlass_fused {

enum class KernelId {
#define CUTLASS_FUSED_ID(name, ...) name,
  CUTLASS_FUSED_KERNELS(CUTLASS_FUSED_ID)
#undef CUTLASS_FUSED_ID
};

struct KernelEntry;  // gemm_evt.h: the compiled kernel's launcher

template <KernelId id>
KernelEntry const& kernel_entry();

struct KernelInfo {
  KernelId id;
  char const* name;
  Family family;
  KernelDtype dtype;
  Mode mode;
  Stats stats;
  int tile_m, tile_n, tile_k;
  bool is_default;                // the row the plan starts from for its (family, dtype, mode)
  KernelEntry const& (*entry)();  // nullptr where this build lacks the row's family
};

KernelInfo const* kernels_begin();
KernelInfo const* kernels_end();

// The row called `name`, or nullptr.
KernelInfo const* find_row(char const* name);

}  // namespace cutlass_fused
