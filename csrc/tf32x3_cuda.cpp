// fp32 without TF32 (3xTF32): on the sm90 family the operands split for it
// (csrc/kernels/tf32x3.h), on the sm80 family the flags of rows holding an
// infinity (csrc/kernels/inf_fix.h); the weight's are kept between calls only
// inside frozen_weights() (derived_cache.h).
#include "tf32x3_cuda.h"

#include <ATen/cuda/CUDAContext.h>

#include "derived_cache.h"
#include "kernels/inf_fix.h"
#include "kernels/tf32x3.h"

namespace cutlass_fused {

at::Tensor split_tf32x3(at::Tensor const& t, int64_t rows_out, SplitOrder order) {
  // Rows or columns must be unit-stride for the kernel; anything else is copied first.
  auto src = t.stride(1) == 1 || t.stride(0) == 1 ? t : t.contiguous();
  int64_t seg = (src.size(1) + 3) / 4 * 4;
  auto out = at::empty({rows_out, 3 * seg}, src.options());
  split_tf32_rows(src.data_ptr<float>(), src.size(0), src.size(1), src.stride(0), src.stride(1), rows_out, seg, order,
                  out.data_ptr<float>(), at::cuda::getCurrentCUDAStream().stream());
  return out;
}

at::Tensor split_weight_tf32x3(at::Tensor const& w, int64_t rows_out, bool cache) {
  return derived(Derived::weight_split, {w}, {static_cast<double>(rows_out)}, cache,
                 [&] { return split_tf32x3(w, rows_out, SplitOrder::big_small_big); });
}

namespace {

// One allocation, kept as one value where it is kept: the remainder, then the flags' bytes.
at::Tensor remainder_and_flags(at::Tensor const& t) {
  int64_t rows = t.size(0), ld = t.stride(0), elements = rows * ld;
  auto out = at::empty({elements + (rows + 3) / 4}, t.options());
  tf32_remainder_rows(t.data_ptr<float>(), rows, t.size(1), ld, out.data_ptr<float>(),
                      reinterpret_cast<unsigned char*>(out.data_ptr<float>() + elements),
                      at::cuda::getCurrentCUDAStream().stream());
  return out;
}

Remainder unpack(at::Tensor const& both, int64_t rows, int64_t ld) {
  int64_t elements = rows * ld;
  return {both.narrow(0, 0, elements).view({rows, ld}), both.narrow(0, elements, (rows + 3) / 4).view(at::kByte)};
}

}  // namespace

Remainder remainder_tf32x3(at::Tensor const& t) {
  return unpack(remainder_and_flags(t), t.size(0), t.stride(0));
}

Remainder remainder_weight_tf32x3(at::Tensor const& w, at::Tensor const& wa, bool cache) {
  int64_t rows = wa.size(0), ld = wa.stride(0);
  auto both = derived(Derived::weight_remainder, {w}, {static_cast<double>(rows), static_cast<double>(ld)}, cache,
                      [&] { return remainder_and_flags(wa); });
  return unpack(both, rows, ld);
}

at::Tensor inf_rows(at::Tensor const& t) {
  auto src = t.stride(1) == 1 ? t : t.contiguous();
  auto flags = at::empty({src.size(0)}, src.options().dtype(at::kByte));
  flag_inf_rows(src.data_ptr<float>(), src.size(0), src.size(1), src.stride(0), flags.data_ptr<unsigned char>(),
                at::cuda::getCurrentCUDAStream().stream());
  return flags;
}

at::Tensor weight_inf_rows(at::Tensor const& w, bool cache) {
  return derived(Derived::weight_inf_rows, {w}, {}, cache, [&] { return inf_rows(w); });
}

}  // namespace cutlass_fused
