// The activations after BatchNorm (types.h's Activation) and their derivatives, in one place for
// every kernel that applies them: the training tails and the BN backward (bn_common.cuh) and the
// eval GEMMs' epilogue (evt_extra.h).
#pragma once

#include <cmath>
#include <type_traits>

#include "kernels/types.h"

namespace cutlass_fused {

// GELU's tanh form, 0.5 v (1 + tanh(beta (v + kappa v^3))): PyTorch's constants, beta = sqrt(2 / pi).
constexpr double kGeluTanhBeta = M_SQRT2 * M_2_SQRTPI * 0.5, kGeluTanhKappa = 0.044715;

// GELU (erf or tanh form) and SiLU at v, and their derivatives, in fp32 whatever the caller's
// arithmetic: PyTorch's fp32 ops compute them in fp32 from the rounded BN output, which v rounded
// to fp32 is (at least as closely as PyTorch's own fp32 BatchNorm gets it). Their fp64 forms (erf,
// exp, tanh) had made the fp32 passes arithmetic-bound: the fp32 BN backward's passes took far longer
// with gelu than with relu, and close to relu's in fp32 (docs/decisions.md, "Backward").
__device__ __forceinline__ float smooth_value(float v, Activation act) {
  switch (act) {
    case Activation::gelu: return 0.5f * v * (1.0f + erff(v * float(M_SQRT1_2)));
    case Activation::gelu_tanh: {
      float inner = float(kGeluTanhBeta) * (v + float(kGeluTanhKappa) * v * v * v);
      return 0.5f * v * (1.0f + tanhf(inner));
    }
    default: return v / (1.0f + expf(-v));  // silu
  }
}

// GeluBackward's and silu_backward's formulas.
__device__ __forceinline__ float smooth_grad(float v, Activation act) {
  switch (act) {
    case Activation::gelu: {
      float cdf = 0.5f * (1.0f + erff(v * float(M_SQRT1_2)));
      float pdf = expf(-0.5f * v * v) * float(M_2_SQRTPI * M_SQRT1_2 * 0.5);
      return cdf + v * pdf;
    }
    case Activation::gelu_tanh: {
      float t = tanhf(float(kGeluTanhBeta) * (v + float(kGeluTanhKappa) * v * v * v));
      return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * float(kGeluTanhBeta) *
                                     (1.0f + float(3 * kGeluTanhKappa) * v * v);
    }
    default: {  // silu
      float s = 1.0f / (1.0f + expf(-v));
      return s * (1.0f + v * (1.0f - s));
    }
  }
}

// The activation (types.h) at BN(z) = v, in y's arithmetic A, as PyTorch's own ops compute it
// (torch.relu keeps a NaN; F.leaky_relu is v > 0 ? v : v * slope).
template <class A>
__device__ __forceinline__ A activate(A v, Activation act, float slope) {
  switch (act) {
    case Activation::none: return v;
    case Activation::relu: return v > A(0) || v != v ? v : A(0);
    case Activation::leaky_relu: return v > A(0) ? v : v * A(slope);
    default: return A(smooth_value(static_cast<float>(v), act));
  }
}

// d act / d v, as PyTorch's backward formulas: relu's and leaky_relu's masks test v > 0
// (threshold_backward on the output, leaky_relu_backward on the input), GELU's and SiLU's are
// GeluBackward's and silu_backward's.
template <class A>
__device__ __forceinline__ A activation_grad(A v, Activation act, float slope) {
  switch (act) {
    case Activation::none: return A(1);
    case Activation::relu: return v > A(0) ? A(1) : A(0);
    case Activation::leaky_relu: return v > A(0) ? A(1) : A(slope);
    default: return A(smooth_grad(static_cast<float>(v), act));
  }
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
