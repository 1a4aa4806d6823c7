// The table of compiled kernels. A family's rows exist only when CMake built
// it (CUTLASS_FUSED_WITH_SM90 / _SM80), so lookups never reach a missing symbol.
#include <cstdlib>
#include <cstring>

#include "kernels/gemm_evt.h"

namespace cutlass_fused {
namespace {

#if defined(CUTLASS_FUSED_WITH_SM90)
#define CUTLASS_FUSED_IF_sm90(...) __VA_ARGS__
#else
#define CUTLASS_FUSED_IF_sm90(...)
#endif
#if defined(CUTLASS_FUSED_WITH_SM80)
#define CUTLASS_FUSED_IF_sm80(...) __VA_ARGS__
#else
#define CUTLASS_FUSED_IF_sm80(...)
#endif

#define CUTLASS_FUSED_ROW(name, family, dtype, mode, stats, tm, tn, tk) \
  CUTLASS_FUSED_IF_##family(                                             \
      {#name, #family, #dtype, #mode, #stats, tm, tn, tk, &kernel_entry<KernelId::name>},)

KernelInfo const kTable[] = {
    CUTLASS_FUSED_KERNELS(CUTLASS_FUSED_ROW)
    {nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, 0, nullptr},  // keeps the array non-empty
};

}  // namespace

KernelInfo const* kernels_begin() { return kTable; }
KernelInfo const* kernels_end() { return kTable + sizeof(kTable) / sizeof(kTable[0]) - 1; }

// The first row of the table for (family, dtype, mode), or the one that
// $CUTLASS_FUSED_KERNEL names among them (python -m cutlass_fused.tune
// measures each candidate that way; read on every call so it can switch).
KernelInfo const* find_kernel(char const* family, char const* dtype, char const* mode, int, int, int) {
  char const* forced = std::getenv("CUTLASS_FUSED_KERNEL");
  KernelInfo const* first = nullptr;
  for (auto const* k = kernels_begin(); k != kernels_end(); ++k) {
    if (std::strcmp(k->family, family) || std::strcmp(k->dtype, dtype) || std::strcmp(k->mode, mode)) continue;
    if (forced != nullptr && !std::strcmp(k->name, forced)) return k;
    if (first == nullptr) first = k;
  }
  return first;
}

}  // namespace cutlass_fused
