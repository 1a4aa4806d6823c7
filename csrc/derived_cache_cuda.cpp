// The one cache of values derived from parameters (derived_cache.h).
#include "derived_cache.h"

#include <algorithm>
#include <mutex>

#include <ATen/cuda/CUDAContext.h>

#include "tensor_stamp.h"

namespace cutlass_fused {
namespace {

struct Entry {
  Derived kind;
  std::vector<TensorStamp> from;
  std::vector<double> key;
  at::Tensor value;

  bool expired() const {
    return std::any_of(from.begin(), from.end(), [](TensorStamp const& s) { return s.expired(); });
  }
  // A value of the same tensors, whatever their versions: it can never match again once one has moved on.
  bool same_tensors(std::initializer_list<c10::optional<at::Tensor>> ts) const {
    size_t i = 0;
    for (auto const& t : ts) {
      auto const& s = from[i++];
      if (t.has_value() != s.owner.has_value() || (t.has_value() && !s.is(*t))) return false;
    }
    return true;
  }
};

// A few layers' worth: each entry may hold 3x a weight's memory (the split).
constexpr size_t kEntries = 8;
std::mutex mutex;
std::vector<Entry>& entries() {
  static auto* c = new std::vector<Entry>();  // never destroyed: no CUDA frees at process exit
  return *c;
}

}  // namespace

bool keeps(bool cache, std::initializer_list<c10::optional<at::Tensor>> from) {
  if (!cache) return false;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream().stream(), &capture));
  return capture == cudaStreamCaptureStatusNone &&
         std::all_of(from.begin(), from.end(), [](auto const& t) { return TensorStamp::stampable(t); });
}

at::Tensor derived(Derived kind, std::initializer_list<c10::optional<at::Tensor>> from, std::vector<double> key,
                   bool cache, std::function<at::Tensor()> const& make) {
  if (!keeps(cache, from)) return make();
  auto stream = at::cuda::getCurrentCUDAStream();
  std::lock_guard<std::mutex> lock(mutex);
  auto& c = entries();
  // Values of tensors that no longer exist go back to the allocator at the next call.
  c.erase(std::remove_if(c.begin(), c.end(), [](Entry const& e) { return e.expired(); }), c.end());
  for (auto& e : c) {
    if (e.kind != kind || e.key != key) continue;
    size_t i = 0;
    bool same = true;
    for (auto const& t : from) same = same && e.from[i++].matches(t);
    if (same) {
      // It may have been made on another stream: keep the allocator from
      // reusing its memory while this stream still reads it.
      e.value.record_stream(stream);
      return e.value;
    }
  }
  Entry e{kind, {}, std::move(key), make()};
  for (auto const& t : from) e.from.push_back(TensorStamp::of(t));
  c.erase(std::remove_if(c.begin(), c.end(), [&](Entry const& old) { return old.kind == kind && old.same_tensors(from); }),
          c.end());
  if (c.size() >= kEntries) c.erase(c.begin());
  c.push_back(e);
  return e.value;
}

void clear_derived() {
  std::lock_guard<std::mutex> lock(mutex);
  entries().clear();
}

}  // namespace cutlass_fused
