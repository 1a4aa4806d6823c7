// EVT compute functors that CUTLASS does not ship: the named operations of codegen/trace.py,
// which codegen/epilogues.py calls.
#pragma once

#include "cutlass/array.h"
#include "cutlass/cutlass.h"
#include "cutlass/functional.h"
#include "cutlass/numeric_conversion.h"

#include "kernels/activation.cuh"

namespace cutlass_fused {

// D = take_last(Zsq, 0, Z) = Z. The stats epilogue's D must be a compute node over
// the DAG (the tracer will not store Z while Z feeds the sums; codegen/epilogues.py's stats);
// returning Z itself, rather than multiply_add(Zsq, 0, Z), keeps D exact even where Z*Z overflows.
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

// The eval epilogue's activation, a runtime value: Arguments of the node that forms y (CUTLASS's
// Sm90Compute hands a compute functor its own Arguments; sm80_nodes.cuh's node does the same).
struct ActivationArgs {
  Activation act = Activation::none;
  float slope = 0.f;
};

// act(Op(inputs)) in fp32, before y's one rounding: the value the training tails write
// (bn_common.cuh's normalized), so that eval and training round an activated y alike.
// Without an activation the node costs one uniform branch a fragment.
// The scalar form is only asked for its Arguments (Sm90Compute and VisitorComputeWithArgs take
// them from Fn<ElementCompute>); the nodes compute on fragments, the Array form below.
template <template <class> class Op, class T>
struct activated {
  using Arguments = ActivationArgs;
};

template <template <class> class Op, class E, int N>
struct activated<Op, cutlass::Array<E, N>> {
  using T = cutlass::Array<E, N>;
  using Arguments = ActivationArgs;
  CUTLASS_DEVICE T operator()(T const& a, T const& b, Arguments const& p) const {
    return apply(Op<T>{}(a, b), p);
  }
  CUTLASS_DEVICE T operator()(T const& a, T const& b, T const& c, Arguments const& p) const {
    return apply(Op<T>{}(a, b, c), p);
  }
  // The choice is made once a fragment, never per element, and by uniform ifs rather than a
  // switch (a jump table: BRX). With activate's own switch per element (nvcc did not hoist it;
  // 256 BRX in the sm90 kernel), relu in the epilogue ran far slower than the eval GEMM and then
  // ATen's relu (decisions.md, "Training step"). relu and leaky_relu are selects with no
  // branch; the transcendental ones an unrolled loop each. Not with_activation: its five ifs
  // compiled to a jump table here (sm80 eval kernel: 32 BRX, none with these arms; cuobjdump).
  CUTLASS_DEVICE static T apply(T v, Arguments const& p) {
    if (p.act == Activation::none) return v;
    if (p.act == Activation::relu || p.act == Activation::leaky_relu) {
      bool relu = p.act == Activation::relu;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) {
        E x = v[i];
        // activate()'s values: relu keeps a NaN and gives +0 (not x * 0, which is -0 for x < 0)
        E neg = relu ? (x != x ? x : E(0)) : x * E(p.slope);
        v[i] = x > E(0) ? x : neg;
      }
      return v;
    }
    if (p.act == Activation::gelu) return each<Activation::gelu>(v, p.slope);
    if (p.act == Activation::gelu_tanh) return each<Activation::gelu_tanh>(v, p.slope);
    return each<Activation::silu>(v, p.slope);
  }
  template <Activation Act>
  CUTLASS_DEVICE static T each(T v, float slope) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) v[i] = activate(v[i], Act, slope);
    return v;
  }
};

template <class T> using plus_activated = activated<cutlass::plus, T>;
template <class T> using multiply_add_activated = activated<cutlass::multiply_add, T>;

// grad_sums' g (codegen/epilogues.py): dy = accum rounded to R (as torch.mm stores the next
// Linear's input gradient), times the activation's derivative at the forward's BN(z) =
// fma(h - shift, mul, beta) (bn_common.cuh, pre_activation), rounded to R again (as the unfused
// model's activation backward stores it) and widened back. Only none, relu and leaky_relu: the
// plan takes this kernel for those alone. Chosen once a fragment, as `activated` is.
template <class R, class T>
struct bn_grad_to {
  using Arguments = ActivationArgs;
};

template <class R, class E, int N>
struct bn_grad_to<R, cutlass::Array<E, N>> {
  using T = cutlass::Array<E, N>;
  using Arguments = ActivationArgs;
  CUTLASS_DEVICE T operator()(T const& acc, T const& h, T const& shift, T const& mul, T const& beta,
                              Arguments const& p) const {
    cutlass::NumericArrayConverter<R, E, N> down;
    cutlass::NumericArrayConverter<E, R, N> up;
    T dy = up(down(acc));
    if (p.act == Activation::none) return dy;
    E slope = p.act == Activation::relu ? E(0) : E(p.slope);
    T g;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) {
      E z = __fmaf_rn(h[i] - shift[i], mul[i], beta[i]);
      g[i] = dy[i] * (z > E(0) ? E(1) : slope);  // bn_backward.cu's bn_grad: dy times the derivative
    }
    return up(down(g));
  }
};

template <class T> using bn_grad_bf16 = bn_grad_to<cutlass::bfloat16_t, T>;
template <class T> using bn_grad_f16 = bn_grad_to<cutlass::half_t, T>;

// g (h - shift): grad_sums' centered product.
template <class T>
struct times_centered {
  CUTLASS_HOST_DEVICE T operator()(T const& g, T const& h, T const& shift) const {
    return cutlass::multiplies<T>{}(g, cutlass::minus<T>{}(h, shift));
  }
};

}  // namespace cutlass_fused
