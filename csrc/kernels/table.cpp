// The kernel table (table.h). Compiled in every build: the entries exist only where CMake built
// the family (CUTLASS_FUSED_WITH_SM90 / _SM80), so nothing reaches a missing symbol.
#include "kernels/table.h"

#include <cstring>

namespace cutlass_fused {
namespace {

#if defined(CUTLASS_FUSED_WITH_SM90)
#define CUTLASS_FUSED_ENTRY_sm90(name) &kernel_entry<KernelId::name>
#else
#define CUTLASS_FUSED_ENTRY_sm90(name) nullptr
#endif
#if defined(CUTLASS_FUSED_WITH_SM80)
#define CUTLASS_FUSED_ENTRY_sm80(name) &kernel_entry<KernelId::name>
#else
#define CUTLASS_FUSED_ENTRY_sm80(name) nullptr
#endif

#define CUTLASS_FUSED_ROW(name, family, math, mode, stats, tm, tn, tk, is_default)                               \
  {KernelId::name, #name, Family::family, KernelDtype::math, Mode::mode, Stats::stats, tm, tn, tk, is_default, \
   CUTLASS_FUSED_ENTRY_##family(name)},

KernelInfo const kTable[] = {CUTLASS_FUSED_KERNELS(CUTLASS_FUSED_ROW)};

}  // namespace

KernelInfo const* kernels_begin() { return kTable; }
KernelInfo const* kernels_end() { return kTable + sizeof(kTable) / sizeof(kTable[0]); }

KernelInfo const* find_row(char const* name) {
  for (auto const* row = kernels_begin(); row != kernels_end(); ++row)
    if (!std::strcmp(row->name, name)) return row;
  return nullptr;
}

char const* to_string(Family f) { return f == Family::sm90 ? "sm90" : "sm80"; }

char const* to_string(KernelDtype d) {
  switch (d) {
    case KernelDtype::bf16: return "bf16";
    case KernelDtype::f16: return "f16";
    case KernelDtype::tf32: return "tf32";
    case KernelDtype::f32x3: return "f32x3";
    case KernelDtype::e4m3: return "e4m3";
    case KernelDtype::e4m3_fast: return "e4m3_fast";
  }
  return "?";
}

char const* to_string(Mode m) { return m == Mode::eval ? "eval" : m == Mode::stats ? "stats" : "grad"; }

char const* to_string(Tail t) {
  switch (t) {
    case Tail::automatic: return "auto";
    case Tail::cooperative: return "cooperative";
    case Tail::slab: return "slab";
    case Tail::small: return "small";
  }
  return "?";
}

char const* to_string(BackwardKernels b) {
  switch (b) {
    case BackwardKernels::automatic: return "auto";
    case BackwardKernels::passes: return "passes";
    case BackwardKernels::slab: return "slab";
    case BackwardKernels::cooperative: return "cooperative";
  }
  return "?";
}

char const* to_string(Activation a) {
  switch (a) {
    case Activation::none: return "none";
    case Activation::relu: return "relu";
    case Activation::leaky_relu: return "leaky_relu";
    case Activation::gelu: return "gelu";
    case Activation::gelu_tanh: return "gelu_tanh";
    case Activation::silu: return "silu";
  }
  return "?";
}

}  // namespace cutlass_fused
