// FP8 current scaling on CUDA: one amax pass and one cast pass over t, no host sync.
#include "fp8_cuda.h"

#include <algorithm>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "derived_cache.h"
#include "kernels/fp8_cast.h"
#include "ops.h"

namespace cutlass_fused {

namespace {

// t's fp8 values and scale in one byte buffer (the values, then the scale 16 bytes on), so that
// the derived cache keeps them as one tensor; views into it.
struct Packed {
  at::Tensor bytes, t8, scale;
};

Packed packed(at::Tensor bytes, at::IntArrayRef sizes, at::ScalarType fp8) {
  int64_t n = c10::multiply_integers(sizes);
  int64_t at_scale = (n + 15) / 16 * 16;
  // select(0, 0), not view({}): torch 2.11's headers take {} as view(ScalarType{}), a Byte view.
  return {bytes, bytes.narrow(0, 0, n).view(fp8).view(sizes), bytes.narrow(0, at_scale, 4).view(at::kFloat).select(0, 0)};
}

Packed quantize(at::Tensor const& t, int64_t margin, Fp8 format) {
  DType dt = dtype_of(t.scalar_type(), "t");
  c10::cuda::CUDAGuard guard(t.device());
  auto src = t.contiguous();
  auto fp8 = format == Fp8::e4m3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
  auto p = packed(at::empty({(src.numel() + 15) / 16 * 16 + 16}, src.options().dtype(at::kByte)), src.sizes(), fp8);
  auto& out = p.t8;
  auto& scale = p.scale;
  poison(out);
  poison(scale);
  auto amax = at::empty({}, src.options().dtype(at::kInt));
  // Past +-252 the exponent saturates at +-126 whatever the margin (fp8.scale_from_amax's clamp),
  // so a clamped margin gives the same scale and fits the kernel's int.
  int m = static_cast<int>(std::clamp<int64_t>(margin, -1000, 1000));
  quantize_fp8(src.data_ptr(), dt, format, src.numel(), m, reinterpret_cast<unsigned*>(amax.data_ptr<int>()),
               scale.data_ptr<float>(), reinterpret_cast<uint8_t*>(out.data_ptr()),
               at::cuda::getCurrentCUDAStream().stream());
  return p;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_e4m3_cuda(at::Tensor const& t, int64_t margin, bool cache) {
  if (!cache) {
    auto p = quantize(t, margin, Fp8::e4m3);
    return {p.t8, p.scale};
  }
  // A frozen weight's W8 and scale, kept between calls as the 3xTF32 split is (derived_cache.h).
  auto bytes = derived(Derived::weight_e4m3, {t}, {static_cast<double>(margin)}, cache,
                       [&] { return quantize(t, margin, Fp8::e4m3).bytes; });
  auto p = packed(bytes, t.sizes(), at::kFloat8_e4m3fn);
  return {p.t8, p.scale};
}

std::tuple<at::Tensor, at::Tensor> quantize_e5m2_cuda(at::Tensor const& t, int64_t margin) {
  auto p = quantize(t, margin, Fp8::e5m2);
  return {p.t8, p.scale};
}

}  // namespace cutlass_fused
