// EVT compute functors that CUTLASS does not ship.
#pragma once

#include "cutlass/cutlass.h"

namespace cutlass_fused {

// D = take_last(Zsq, 0, Z) = Z. The tracer needs D to be a compute node over
// the DAG (see codegen/epilogues.py); returning Z itself, rather than
// multiply_add(Zsq, 0, Z), keeps D exact even where Z*Z overflows.
template <class T>
struct take_last {
  CUTLASS_HOST_DEVICE T operator()(T const&, T const&, T const& last) const { return last; }
};

}  // namespace cutlass_fused
