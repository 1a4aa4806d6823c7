// The activations after BatchNorm (types.h's Activation) and their derivatives, in one place for
// every kernel that applies them: the training tails and the BN backward (bn_common.cuh) and the
// eval GEMMs' epilogue (evt_extra.h).
#pragma once

#include <cmath>
#include <type_traits>

#include "kernels/types.h"

namespace cutlass_fused {

// The activation (types.h) at BN(z) = v, in y's arithmetic A, as PyTorch's own ops compute it
// (torch.relu keeps a NaN; F.leaky_relu is v > 0 ? v : v * slope).
template <class A>
__device__ __forceinline__ A activate(A v, Activation act, float slope) {
  constexpr bool D = std::is_same_v<A, double>;
  switch (act) {
    case Activation::none: return v;
    case Activation::relu: return v > A(0) || v != v ? v : A(0);
    case Activation::leaky_relu: return v > A(0) ? v : v * A(slope);
    case Activation::gelu: return A(0.5) * v * (A(1) + (D ? erf(v * A(M_SQRT1_2)) : erff(v * A(M_SQRT1_2))));
    case Activation::gelu_tanh: {
      A inner = A(M_SQRT2 * M_2_SQRTPI * 0.5) * (v + A(0.044715) * v * v * v);
      return A(0.5) * v * (A(1) + (D ? tanh(inner) : tanhf(inner)));
    }
    case Activation::silu: return v / (A(1) + (D ? exp(-v) : expf(-v)));
  }
  return v;
}

// d act / d v, as PyTorch's backward formulas: relu's and leaky_relu's masks test v > 0
// (threshold_backward on the output, leaky_relu_backward on the input), GELU's and SiLU's are
// GeluBackward's and silu_backward's.
template <class A>
__device__ __forceinline__ A activation_grad(A v, Activation act, float slope) {
  constexpr bool D = std::is_same_v<A, double>;
  switch (act) {
    case Activation::none: return A(1);
    case Activation::relu: return v > A(0) ? A(1) : A(0);
    case Activation::leaky_relu: return v > A(0) ? A(1) : A(slope);
    case Activation::gelu: {
      A cdf = A(0.5) * (A(1) + (D ? erf(v * A(M_SQRT1_2)) : erff(v * A(M_SQRT1_2))));
      A pdf = (D ? exp(A(-0.5) * v * v) : expf(A(-0.5) * v * v)) * A(M_2_SQRTPI * M_SQRT1_2 * 0.5);
      return cdf + v * pdf;
    }
    case Activation::gelu_tanh: {
      constexpr double kBeta = M_SQRT2 * M_2_SQRTPI * 0.5, kKappa = 0.044715;
      A t = D ? tanh(A(kBeta) * (v + A(kKappa) * v * v * v)) : tanhf(A(kBeta) * (v + A(kKappa) * v * v * v));
      return A(0.5) * (A(1) + t) + A(0.5) * v * (A(1) - t * t) * A(kBeta) * (A(1) + A(3 * kKappa) * v * v);
    }
    case Activation::silu: {
      A s = A(1) / (A(1) + (D ? exp(-v) : expf(-v)));
      return s * (A(1) + v * (A(1) - s));
    }
  }
  return A(1);
}

// f(std::integral_constant<Activation, K>{}) for the K that act is, so that f's loop over a group
// of elements runs with the activation a constant (activate's and activation_grad's switches then
// fold away). Uniform ifs, not a switch: a runtime act tested per element inside the loops compiled
// to jump tables (sm_90 SASS: 22-24 BRX in the bf16 backward's kernels with an activation, 128 in
// the slab tail's), as in the eval epilogue (evt_extra.h, `activated`).
template <class F>
__device__ __forceinline__ decltype(auto) with_activation(Activation act, F&& f) {
  using K = Activation;
  if (act == K::relu) return f(std::integral_constant<K, K::relu>{});
  if (act == K::leaky_relu) return f(std::integral_constant<K, K::leaky_relu>{});
  if (act == K::gelu) return f(std::integral_constant<K, K::gelu>{});
  if (act == K::gelu_tanh) return f(std::integral_constant<K, K::gelu_tanh>{});
  if (act == K::silu) return f(std::integral_constant<K, K::silu>{});
  return f(std::integral_constant<K, K::none>{});
}

}  // namespace cutlass_fused
