// EVT compute functors that CUTLASS does not ship.
#pragma once

#include "cutlass/array.h"
#include "cutlass/cutlass.h"
#include "cutlass/functional.h"
#include "cutlass/numeric_conversion.h"

namespace cutlass_fused {

// D = take_last(Zsq, 0, Z) = Z. The stats epilogue's D must be a compute node over
// the DAG (as cutlass_cppgen's tracer built it; csrc/kernels/gemm/sm90_stats.cuh); returning Z itself, rather than
// multiply_add(Zsq, 0, Z), keeps D exact even where Z*Z overflows.
template <class T>
struct take_last {
  CUTLASS_HOST_DEVICE T operator()(T const&, T const&, T const& last) const { return last; }
};

// op(a, b), rounded once to R and widened back. The node forming the stored
// output uses it, so the statistics are those of the output as stored in R,
// exactly what the finalize reads; fp16 eval rounds h and z = h * scale so
// that they overflow where the unfused model's do.
// (Giving the node R as its output type instead breaks Sm90RowReduction, which
// cannot convert a 16-bit Array element proxy to double.)
template <class R, template <class> class Op, class T>
struct rounded_to {
  CUTLASS_HOST_DEVICE T operator()(T const& a, T const& b) const { return T(R(Op<T>{}(a, b))); }
};

template <class R, template <class> class Op, class E, int N>
struct rounded_to<R, Op, cutlass::Array<E, N>> {
  using T = cutlass::Array<E, N>;
  CUTLASS_HOST_DEVICE T operator()(T const& a, T const& b) const {
    cutlass::NumericArrayConverter<R, E, N> down;
    cutlass::NumericArrayConverter<E, R, N> up;
    return up(down(Op<T>{}(a, b)));
  }
};

template <class T> using plus_rounded_to_bf16 = rounded_to<cutlass::bfloat16_t, cutlass::plus, T>;
template <class T> using plus_rounded_to_f16 = rounded_to<cutlass::half_t, cutlass::plus, T>;
template <class T> using multiplies_rounded_to_f16 = rounded_to<cutlass::half_t, cutlass::multiplies, T>;

// The plus of the node that forms a kernel's stored output, for an output of Element:
// rounded to a 16-bit Element (above), plain for fp32, which stores it as computed. The
// kernel templates of csrc/kernels/gemm/ name it.
template <class Element>
struct stored {
  template <class T> using plus = cutlass::plus<T>;
};
template <>
struct stored<cutlass::bfloat16_t> {
  template <class T> using plus = plus_rounded_to_bf16<T>;
};
template <>
struct stored<cutlass::half_t> {
  template <class T> using plus = plus_rounded_to_f16<T>;
};

}  // namespace cutlass_fused
