// A tensor's identity and contents as its version counter sees them: the key
// of the values derived from parameters (derived_cache.h). A stamp matches
// while the tensor is the same live TensorImpl with the same storage, layout
// and version; in-place updates (optimizer steps, load_state_dict, copy_, our
// running-stat updates) bump the version. Writes through `.data` bypass the
// version counter, as they bypass autograd, and are not seen: that is why
// values are kept only inside frozen_weights().
#pragma once

#include <vector>

#include <ATen/ATen.h>

namespace cutlass_fused {

struct TensorStamp {
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  c10::optional<Weak> owner;  // none: an absent optional argument, which matches only absence
  int64_t version = 0;
  void const* data = nullptr;
  std::vector<int64_t> sizes, strides;

  // Inference tensors have no version counter: nothing derived from them is cached.
  static bool stampable(c10::optional<at::Tensor> const& t) { return !t.has_value() || !t->is_inference(); }

  static TensorStamp of(c10::optional<at::Tensor> const& t) {
    if (!t.has_value()) return {};
    return {Weak(t->getIntrusivePtr()), t->_version(), t->data_ptr(), t->sizes().vec(), t->strides().vec()};
  }

  // Whether this is the live tensor t, unchanged.
  bool matches(c10::optional<at::Tensor> const& t) const {
    if (!t.has_value() || !owner.has_value()) return t.has_value() == owner.has_value();
    return is(*t) && version == t->_version() && data == t->data_ptr() && sizes == t->sizes().vec() &&
           strides == t->strides().vec();
  }

  bool is(at::Tensor const& t) const { return owner.has_value() && owner->lock().get() == t.unsafeGetTensorImpl(); }

  bool expired() const { return owner.has_value() && owner->expired(); }
};

}  // namespace cutlass_fused
