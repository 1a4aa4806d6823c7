// What the CUDA ops derive from a layer's parameters and buffers (the eval
// fold, the weight's 3xTF32 split (or remainder), the sm80 family's flags of the weight's
// infinite rows, the weight's e4m3 values and scale, and their transpose), kept for the next call only inside
// cutlass_fused.frozen_weights(): the ops' `cache` argument (csrc/ops.cpp).
//
// Why only there: a write through `.data` (an EMA teacher, a hand-written
// optimizer) changes a tensor without bumping its version counter, and no key
// that is cheap to read sees it, so a cache kept outside a scope in which the
// user promises no such writes returns stale results silently. Inside the
// scope a value is still made anew when a tensor it came from is another
// tensor, or has other storage, layout or version (tensor_stamp.h); leaving
// the scope drops every value (clear_derived).
#pragma once

#include <functional>
#include <initializer_list>
#include <vector>

#include <ATen/ATen.h>

namespace cutlass_fused {

enum class Derived { eval_fold, weight_split, weight_remainder, weight_inf_rows, weight_e4m3, weight_e4m3_t };

// make()'s value. Where `cache` is set, no CUDA graph is being captured on the
// current stream (a graph must hold the work itself) and none of `from` is an
// inference tensor (those have no version counter), it is the value kept for
// the same kind, `key` and unchanged tensors `from`, made and kept now if
// there is none. `from` are the tensors the value is made of (absent optional
// arguments included, which match only absence); `key` the numbers it also
// depends on (eps, padded sizes).
at::Tensor derived(Derived kind, std::initializer_list<c10::optional<at::Tensor>> from, std::vector<double> key,
                   bool cache, std::function<at::Tensor()> const& make);

// Whether derived() would keep (or find kept) a value of `from`: `cache`, no capture on the
// current stream, no inference tensor. A caller with a route that keeps nothing (the sm90 eval
// epilogue's own fold) takes that route where this is false: a captured graph would otherwise
// hold the work of making the value, on every replay.
bool keeps(bool cache, std::initializer_list<c10::optional<at::Tensor>> from);

// Drops every kept value (frozen_weights' exit, through the clear_cache op).
void clear_derived();

}  // namespace cutlass_fused
