// fp32 without TF32 (3xTF32): on the sm90 family the operands split for it
// (csrc/kernels/tf32x3.h), on the sm80 family the flags of rows holding an
// infinity (csrc/kernels/inf_fix.h); what is the weight's is cached.
#include "tf32x3_cuda.h"

#include <algorithm>
#include <mutex>
#include <vector>

#include <ATen/cuda/CUDAContext.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/inf_fix.h"
#include "kernels/tf32x3.h"
#include "tensor_stamp.h"

namespace cutlass_fused {
namespace {

// A forward-only loop (KernelBench's, or inference) multiplies by the same
// weight again and again; what is derived from it (its split, 3x the weight's
// memory; the sm80 family's flags of infinite rows) is then made once, and
// used while the weight's stamp matches (tensor_stamp.h).
enum class Derived { split, inf_rows };

struct Entry {
  TensorStamp weight;
  Derived kind;
  int64_t rows = 0;
  at::Tensor value;
};

constexpr size_t kCacheEntries = 8;
std::mutex cache_mutex;
std::vector<Entry>& entries() {
  static auto* c = new std::vector<Entry>();  // never destroyed: no CUDA frees at process exit
  return *c;
}

template <class Make>
at::Tensor derived(at::Tensor const& w, Derived kind, int64_t rows, bool cache, Make&& make) {
  auto stream = at::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &capture));
  // Training changes the weight every step: caching would only hold memory.
  // Inside a CUDA graph the work must be part of the graph.
  bool cacheable = cache && !c10::GradMode::is_enabled() && !w.is_inference() && capture == cudaStreamCaptureStatusNone;
  if (!cacheable) return make();
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto& c = entries();
  // Values of weights that no longer exist are dropped on every call, so their
  // memory goes back to the allocator at the next call after the model dies.
  c.erase(std::remove_if(c.begin(), c.end(), [](Entry const& e) { return e.weight.expired(); }), c.end());
  for (auto& e : c) {
    if (e.kind == kind && e.rows == rows && e.weight.matches(w)) {
      // It may have been made on another stream: keep the allocator from
      // reusing its memory while this stream still reads it.
      e.value.record_stream(stream);
      return e.value;
    }
  }
  auto value = make();
  c.erase(std::remove_if(c.begin(), c.end(), [&](Entry const& e) { return e.kind == kind && e.weight.is(w); }),
          c.end());
  if (c.size() >= kCacheEntries) c.erase(c.begin());
  c.push_back({TensorStamp::of(w), kind, rows, value});
  return value;
}

}  // namespace

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
  return derived(w, Derived::split, rows_out, cache,
                 [&] { return split_tf32x3(w, rows_out, SplitOrder::big_small_big); });
}

at::Tensor inf_rows(at::Tensor const& t) {
  auto src = t.stride(1) == 1 ? t : t.contiguous();
  auto flags = at::empty({src.size(0)}, src.options().dtype(at::kByte));
  flag_inf_rows(src.data_ptr<float>(), src.size(0), src.size(1), src.stride(0), flags.data_ptr<unsigned char>(),
                at::cuda::getCurrentCUDAStream().stream());
  return flags;
}

at::Tensor weight_inf_rows(at::Tensor const& w, bool cache) {
  return derived(w, Derived::inf_rows, w.size(0), cache, [&] { return inf_rows(w); });
}

}  // namespace cutlass_fused
