// The eval fold, cached: an inference loop calls the layer with the same
// parameters and running stats again and again, and folding them is a
// kernel launch (plus its host time) before every GEMM. With the fold cached
// while all five vectors' stamps (tensor_stamp.h) and eps are unchanged, the
// eval forward is the GEMM alone.
#include "eval_fold_cuda.h"

#include <algorithm>
#include <array>
#include <mutex>
#include <vector>

#include <ATen/cuda/CUDAContext.h>

#include "kernels/batch_norm.h"
#include "tensor_stamp.h"

namespace cutlass_fused {
namespace {

using OptTensor = c10::optional<at::Tensor>;

struct Entry {
  std::array<TensorStamp, 5> stamps;
  double eps = 0;
  int64_t kn = 0;
  bool scale_apart = false;
  at::Tensor fold;

  bool expired() const {
    return std::any_of(stamps.begin(), stamps.end(), [](TensorStamp const& s) { return s.expired(); });
  }
};

constexpr size_t kCacheEntries = 8;
std::mutex cache_mutex;
std::vector<Entry>& entries() {
  static auto* c = new std::vector<Entry>();  // never destroyed: no CUDA frees at process exit
  return *c;
}

ColVec col(OptTensor const& t) {
  if (!t.has_value()) return {};
  auto dt = t->scalar_type() == at::kBFloat16 ? DType::bf16 : t->scalar_type() == at::kHalf ? DType::f16 : DType::f32;
  return {t->data_ptr(), dt};
}

at::Tensor compute(std::array<OptTensor, 5> const& v, double eps, int64_t kn, bool scale_apart, cudaStream_t stream) {
  auto fold = at::empty({scale_apart ? 3 : 2, kn}, v[0]->options().dtype(at::kFloat));
  fold_eval(static_cast<int>(v[0]->size(0)), static_cast<int>(kn), col(v[0]), col(v[1]), col(v[2]), col(v[3]),
            col(v[4]), eps, fold[0].data_ptr<float>(), fold[1].data_ptr<float>(),
            scale_apart ? fold[2].data_ptr<float>() : nullptr, stream);
  return fold;
}

}  // namespace

at::Tensor eval_fold(at::Tensor const& scale, OptTensor const& bn_weight, OptTensor const& bn_bias,
                     at::Tensor const& running_mean, at::Tensor const& running_var, double eps, int64_t kn,
                     bool cache, bool scale_apart) {
  std::array<OptTensor, 5> v{scale, bn_weight, bn_bias, running_mean, running_var};
  auto stream = at::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &capture));
  // Inside a CUDA graph the fold must be part of the graph, which replays
  // it with whatever the vectors hold then.
  bool cacheable = cache && capture == cudaStreamCaptureStatusNone &&
                   std::all_of(v.begin(), v.end(), [](OptTensor const& t) { return TensorStamp::stampable(t); });
  if (!cacheable) return compute(v, eps, kn, scale_apart, stream.stream());
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto& c = entries();
  c.erase(std::remove_if(c.begin(), c.end(), [](Entry const& e) { return e.expired(); }), c.end());
  for (auto& e : c) {
    bool same = e.eps == eps && e.kn == kn && e.scale_apart == scale_apart;
    for (size_t i = 0; same && i < v.size(); ++i) same = e.stamps[i].matches(v[i]);
    if (same) {
      e.fold.record_stream(stream);  // it may have been made on another stream
      return e.fold;
    }
  }
  Entry e{{}, eps, kn, scale_apart, compute(v, eps, kn, scale_apart, stream.stream())};
  for (size_t i = 0; i < v.size(); ++i) e.stamps[i] = TensorStamp::of(v[i]);
  // A layer's older folds can never match again once a vector has moved on.
  auto same_owner = [&](Entry const& old) {
    return old.stamps[0].is(scale) && old.stamps[3].is(running_mean);
  };
  c.erase(std::remove_if(c.begin(), c.end(), same_owner), c.end());
  if (c.size() >= kCacheEntries) c.erase(c.begin());
  c.push_back(e);
  return e.fold;
}

}  // namespace cutlass_fused
