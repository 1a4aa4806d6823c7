#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "kernels/check.h"
#include "kernels/dispatch.cuh"
#include "kernels/fp8_cast.h"
#include "kernels/grid.h"

namespace cutlass_fused {
namespace {

// The largest finite value of each format (torch.finfo(...).max).
template <Fp8 F>
constexpr float kMax = F == Fp8::e4m3 ? 448.f : 57344.f;
template <Fp8 F>
constexpr __nv_fp8_interpretation_t kKind = F == Fp8::e4m3 ? __NV_E4M3 : __NV_E5M2;
constexpr float kMaxExponent = 126.f;  // fp8.MAX_EXPONENT: scales stay normal fp32
constexpr int kThreads = 256;

__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// |v|'s bits: their unsigned order is |v|'s, with NaN above +inf above every finite value, so
// an atomicMax over them gives torch's abs().amax() (NaN wherever a NaN is).
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// atomicMax(*amax, the largest m of the block's threads); every thread of the block calls it.
__device__ __forceinline__ void block_max(unsigned m, unsigned* amax) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
  __shared__ unsigned warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) m = max(m, warp_max[w]);
    atomicMax(amax, m);
  }
}

template <typename T, int V>
__global__ void amax_kernel(T const* __restrict__ t, int64_t n, unsigned* __restrict__ amax) {
  unsigned m = 0;
  int64_t stride = int64_t{gridDim.x} * kThreads, first = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  auto packs = reinterpret_cast<Pack<T, V> const*>(t);
  for (int64_t i = first; i < n / V; i += stride) {
    Pack<T, V> p = packs[i];
#pragma unroll
    for (int j = 0; j < V; ++j) m = max(m, abs_bits(widen(p.v[j])));
  }
  for (int64_t i = n / V * V + first; i < n; i += stride) m = max(m, abs_bits(widen(t[i])));
  block_max(m, amax);
}

// fp8.scale_from_amax for a finite amax > 0, in torch's fp32 operations: Python's 448 / amax is
// torch's amax.reciprocal() * 448 (Tensor.__rtruediv__), two roundings, not one division.
template <Fp8 F>
__device__ __forceinline__ float scale_from(float amax, int margin) {
  float e = floorf(log2f((1.f / amax) * kMax<F>)) - static_cast<float>(margin);
  return exp2f(fminf(fmaxf(e, -kMaxExponent), kMaxExponent));
}

// The same with current scaling's fallback of 1.
template <Fp8 F>
__device__ __forceinline__ float scale_of(unsigned amax_bits, int margin) {
  if (amax_bits == 0 || amax_bits >= 0x7f800000u) return 1.f;
  return scale_from<F>(__uint_as_float(amax_bits), margin);
}

template <Fp8 F>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  // The clamp is the saturation fp8.quantize applies before torch's cast, which would make an
  // overflow NaN (e4m3fn) or infinite (e5m2); a non-finite product becomes NaN (0x7f in both
  // formats), not the largest value.
  if (!isfinite(v)) return 0x7f;
  return __nv_cvt_float_to_fp8(fminf(fmaxf(v, -kMax<F>), kMax<F>), __NV_SATFINITE, kKind<F>);
}

// out[i] = f(in[i]) over n elements, V a pack (V-element loads and stores), grid-strided; the
// elements past the last whole pack one at a time.
template <int V, typename In, typename Out, typename F>
__device__ __forceinline__ void map_packs(In const* __restrict__ in, int64_t n, Out* __restrict__ out, F f) {
  int64_t stride = int64_t{gridDim.x} * kThreads, first = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  auto packs = reinterpret_cast<Pack<In, V> const*>(in);
  auto out_packs = reinterpret_cast<Pack<Out, V>*>(out);
  for (int64_t i = first; i < n / V; i += stride) {
    Pack<In, V> p = packs[i];
    Pack<Out, V> q;
#pragma unroll
    for (int j = 0; j < V; ++j) q.v[j] = f(p.v[j]);
    out_packs[i] = q;
  }
  for (int64_t i = n / V * V + first; i < n; i += stride) out[i] = f(in[i]);
}

template <typename T, int V, Fp8 F>
__global__ void cast_kernel(T const* __restrict__ t, int64_t n, unsigned const* __restrict__ amax, int margin,
                            float* __restrict__ scale_out, uint8_t* __restrict__ out) {
  float s = scale_of<F>(*amax, margin);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_out = s;
  map_packs<V>(t, n, out, [s](T v) { return to_fp8<F>(widen(v) * s); });
}

// Delayed scaling's cast: the scale given (and copied to *scale_copy), t's amax measured in the
// same pass (abs_bits' order).
template <typename T, int V, Fp8 F>
__global__ void cast_measure_kernel(T const* __restrict__ t, int64_t n, float const* __restrict__ scale,
                                    float* __restrict__ scale_copy, unsigned* __restrict__ amax,
                                    uint8_t* __restrict__ out) {
  float s = *scale;
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_copy = s;
  unsigned m = 0;
  map_packs<V>(t, n, out, [s, &m](T v) {
    float w = widen(v);
    m = max(m, abs_bits(w));
    return to_fp8<F>(w * s);
  });
  block_max(m, amax);
}

// The transposing cast: a block rounds a kTile x kTile tile of t, each thread a run of kRun
// elements of one row, stores the bytes to out by rows and to shared memory, then each thread
// gathers kRun bytes of one tile column and stores them to out_t as a row. 16-byte accesses where
// the sizes and pointers allow (vec_*), else element by element, bounds checked at the edges.
constexpr int kTile = 64, kRun = 16;
static_assert(kTile * kTile / kRun == kThreads, "one run a thread");

template <typename T>
__device__ __forceinline__ void load_run(T const* src, int valid, bool vec, float (&v)[kRun]) {
  if (vec && valid == kRun) {
    constexpr int V = 16 / sizeof(T);
#pragma unroll
    for (int p = 0; p < kRun / V; ++p) {
      Pack<T, V> pk = reinterpret_cast<Pack<T, V> const*>(src)[p];
#pragma unroll
      for (int j = 0; j < V; ++j) v[p * V + j] = widen(pk.v[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kRun; ++j) v[j] = j < valid ? widen(src[j]) : 0.f;
  }
}

__device__ __forceinline__ void store_run(uint8_t* dst, int valid, bool vec, Pack<uint8_t, kRun> const& q) {
  if (vec && valid == kRun) {
    *reinterpret_cast<Pack<uint8_t, kRun>*>(dst) = q;
  } else {
#pragma unroll  // a constant index keeps q in registers
    for (int j = 0; j < kRun; ++j)
      if (j < valid) dst[j] = q.v[j];
  }
}

// Given: delayed scaling's form, *scale read (and copied to *scale_copy) and the tile's amax
// measured into *amax; else the scale made from *amax (current scaling) and written to *scale.
template <typename T, Fp8 F, bool Given>
__global__ void cast_transpose_kernel(T const* __restrict__ t, int64_t rows, int64_t cols, int64_t col_tiles,
                                      unsigned* __restrict__ amax, int margin, float* __restrict__ scale,
                                      float* __restrict__ scale_copy, uint8_t* __restrict__ out,
                                      uint8_t* __restrict__ out_t, bool vec_in, bool vec_out, bool vec_out_t) {
  // 4 bytes of padding a row: a gather's 16 rows apart fall on different banks but for 2-way.
  __shared__ alignas(16) uint8_t tile[kTile][kTile + 4];
  float s;
  unsigned m = 0;
  if constexpr (Given) {
    s = *scale;
    if (blockIdx.x == 0 && threadIdx.x == 0) *scale_copy = s;
  } else {
    s = scale_of<F>(*amax, margin);
    if (blockIdx.x == 0 && threadIdx.x == 0) *scale = s;
  }
  int64_t r0 = blockIdx.x / col_tiles * kTile, c0 = blockIdx.x % col_tiles * kTile;
  int r = threadIdx.x / (kTile / kRun), c = threadIdx.x % (kTile / kRun) * kRun;
  if (r0 + r < rows && c0 + c < cols) {
    int valid = static_cast<int>(min(int64_t{kRun}, cols - c0 - c));
    float v[kRun];
    load_run(t + (r0 + r) * cols + c0 + c, valid, vec_in, v);
    Pack<uint8_t, kRun> q;
#pragma unroll
    for (int j = 0; j < kRun; ++j) q.v[j] = to_fp8<F>(v[j] * s);
    if constexpr (Given) {  // past `valid`, load_run's zeros
#pragma unroll
      for (int j = 0; j < kRun; ++j) m = max(m, abs_bits(v[j]));
    }
    if (out) store_run(out + (r0 + r) * cols + c0 + c, valid, vec_out, q);
    // As words: a row is 68 bytes, so each run starts 4-byte aligned.
#pragma unroll
    for (int w = 0; w < kRun / 4; ++w)
      reinterpret_cast<uint32_t*>(&tile[r][c])[w] = reinterpret_cast<uint32_t const*>(q.v)[w];
  }
  __syncthreads();
  // Now r names a column of the tile (a row of out_t) and c a run of the tile's rows.
  if (c0 + r < cols && r0 + c < rows) {
    int valid = static_cast<int>(min(int64_t{kRun}, rows - r0 - c));
    Pack<uint8_t, kRun> q;
#pragma unroll
    for (int j = 0; j < kRun; ++j) q.v[j] = tile[c + j][r];
    store_run(out_t + (c0 + r) * rows + r0 + c, valid, vec_out_t, q);
  }
  if constexpr (Given) block_max(m, amax);
}

// TransformerEngine's amax-history update for a layer's two columns (x, W) of history (len x 2,
// row 0 the latest): the rows shift down one, row 0 takes this step's amaxes, and each scale
// becomes scale_from of the history's max (or of row 0), kept where that is 0 or not finite.
// fp8.DelayedState.record's operations: torch's amax over rows is NaN where any row is.
// Column c's step, this step's amax given.
__device__ __forceinline__ void record_column(float* __restrict__ history, int64_t len, int c, float amax, int margin,
                                              bool use_max, float* __restrict__ scale) {
  for (int64_t r = len - 1; r > 0; --r) history[r * 2 + c] = history[(r - 1) * 2 + c];
  float reduced = history[c] = amax;
  for (int64_t r = 1; use_max && r < len; ++r) {
    float h = history[r * 2 + c];
    reduced = isnan(reduced) || isnan(h) ? __int_as_float(0x7fffffff) : fmaxf(reduced, h);
  }
  if (reduced > 0.f && isfinite(reduced)) scale[c] = scale_from<Fp8::e4m3>(reduced, margin);
}

__global__ void record_kernel(float* __restrict__ history, int64_t len, float const* __restrict__ amax_x,
                              float const* __restrict__ amax_w, int margin, bool use_max, float* __restrict__ scale) {
  int c = threadIdx.x;
  if (c < 2) record_column(history, len, c, c == 0 ? *amax_x : *amax_w, margin, use_max, scale);
}

template <typename T>
__device__ __forceinline__ T narrowed(float v);
template <>
__device__ __forceinline__ float narrowed<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 narrowed<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half narrowed<__half>(float v) { return __float2half_rn(v); }

template <Fp8 F>
__device__ __forceinline__ float from_fp8(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), kKind<F>)));
}

// An fp8 value is exact in fp32 and a power-of-two scale multiplies it exactly, so the one
// rounding is to T: torch's t8.to(T) * scale.to(T) gives the same bits (its product of two exact
// T values is formed in fp32 and rounded once).
template <typename T, int V, Fp8 F>
__global__ void dequantize_kernel(uint8_t const* __restrict__ t8, int64_t n, float const* __restrict__ scale,
                                  T* __restrict__ out) {
  float s = scale ? *scale : 1.f;
  map_packs<V>(t8, n, out, [s](uint8_t b) { return narrowed<T>(from_fp8<F>(b) * s); });
}

// The FP8 ops' bias and scale (fp8_operand_scales): alpha = 1 / (s_x s_w) in fp32, then bias /
// alpha in bias's dtype rounded on to bf16, and scale * alpha in scale's dtype. torch, which these
// replace, casts the 0-dim fp32 alpha to the other operand's dtype before a 16-bit op and computes
// in fp32 (its opmath), rounding once to that dtype: so do these, for the same bits.
template <typename B, typename S>
__device__ __forceinline__ void operand_scales_body(float const* __restrict__ s_x, float const* __restrict__ s_w,
                                                    B const* __restrict__ bias, int64_t nb,
                                                    S const* __restrict__ scale, int64_t ns,
                                                    __nv_bfloat16* __restrict__ b_out, S* __restrict__ sc_out) {
  float alpha = 1.f / (*s_x * *s_w);
  float alpha_b = widen(narrowed<B>(alpha)), alpha_s = widen(narrowed<S>(alpha));
  int64_t stride = int64_t{gridDim.x} * kThreads;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < max(nb, ns); i += stride) {
    if (i < nb) b_out[i] = __float2bfloat16_rn(widen(narrowed<B>(widen(bias[i]) / alpha_b)));
    if (i < ns) sc_out[i] = narrowed<S>((scale == nullptr ? 1.f : widen(scale[i])) * alpha_s);  // no scale: alpha
  }
}

template <typename B, typename S>
__global__ void operand_scales_kernel(float const* __restrict__ s_x, float const* __restrict__ s_w,
                                      B const* __restrict__ bias, int64_t nb, S const* __restrict__ scale, int64_t ns,
                                      __nv_bfloat16* __restrict__ b_out, S* __restrict__ sc_out) {
  operand_scales_body(s_x, s_w, bias, nb, scale, ns, b_out, sc_out);
}

// Delayed scaling's step and the operand scales in one launch (delayed_operands): block 0's first
// two threads step the history's columns from the casts' amaxes (amax_bits, fp32 bits), and every
// block takes its share of operand_scales_body, which reads the scales the casts used (s_x, s_w,
// their copies), not the state this launch moves on.
template <typename B, typename S>
__global__ void record_and_scales_kernel(float* __restrict__ history, int64_t len,
                                         unsigned const* __restrict__ amax_bits, int margin, bool use_max, float* __restrict__ fp8_scale,
                                         float const* __restrict__ s_x, float const* __restrict__ s_w,
                                         B const* __restrict__ bias, int64_t nb, S const* __restrict__ scale,
                                         int64_t ns, __nv_bfloat16* __restrict__ b_out, S* __restrict__ sc_out) {
  if (blockIdx.x == 0 && threadIdx.x < 2)
    record_column(history, len, threadIdx.x, __uint_as_float(amax_bits[threadIdx.x]), margin, use_max, fp8_scale);
  operand_scales_body(s_x, s_w, bias, nb, scale, ns, b_out, sc_out);
}

// The e4m3 op's backward scalars (fp8_backward_scales), as torch computes `dsc * 0`, `dsc / (s_x
// * s_w)` and `s_g.reciprocal()`: in dsc's dtype D (the 0-dim fp32 product cast to D first, fp32
// opmath, one rounding to D), then cast to the gradient's dtype. A 0-dim CUDA tensor is no CPU
// scalar, so torch divides (a / b), as here, and does not multiply by a reciprocal.
template <typename D, typename B, typename S>
__global__ void backward_scales_kernel(D const* __restrict__ dsc, int64_t n, float const* __restrict__ s_x,
                                       float const* __restrict__ s_w, float const* __restrict__ s_g,
                                       B* __restrict__ dbias, S* __restrict__ dscale, float* __restrict__ inv_g) {
  float p = widen(narrowed<D>(*s_x * *s_w));
  int64_t first = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  if (first == 0 && s_g) *inv_g = 1.f / *s_g;
  for (int64_t i = first; i < n; i += int64_t{gridDim.x} * kThreads) {
    float d = widen(dsc[i]);
    if (dbias) dbias[i] = narrowed<B>(widen(narrowed<D>(d * 0.f)));
    dscale[i] = narrowed<S>(widen(narrowed<D>(d / p)));
  }
}

unsigned grid_for(int64_t packs) { return strided_grid(packs, kThreads, 2048); }

bool aligned16(void const* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// *amax = the bits of max |t| over n elements (abs_bits' order), from zero: 16-byte loads where t
// is aligned.
template <typename T>
void launch_amax(T const* t, int64_t n, unsigned* amax, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  check_cuda(cudaMemsetAsync(amax, 0, sizeof(unsigned), stream), "fp8 cast (amax reset)");
  if (aligned16(t)) {
    amax_kernel<T, V><<<grid_for(n / V), kThreads, 0, stream>>>(t, n, amax);
  } else {
    amax_kernel<T, 1><<<grid_for(n), kThreads, 0, stream>>>(t, n, amax);
  }
}

template <typename T, Fp8 F>
void run(void const* t_, int64_t n, int margin, unsigned* amax, float* scale, uint8_t* out, cudaStream_t stream) {
  auto t = static_cast<T const*>(t_);
  constexpr int V = 16 / sizeof(T);  // 16-byte loads, V-byte stores
  launch_amax(t, n, amax, stream);
  if (aligned16(t) && reinterpret_cast<uintptr_t>(out) % V == 0) {
    cast_kernel<T, V, F><<<grid_for(n / V), kThreads, 0, stream>>>(t, n, amax, margin, scale, out);
  } else {
    cast_kernel<T, 1, F><<<grid_for(n), kThreads, 0, stream>>>(t, n, amax, margin, scale, out);
  }
  check_cuda(cudaGetLastError(), "quantize_e4m3");
}

// The scale's copy for an empty t, which launches no cast (delayed scaling's forms).
void copy_scale(float const* scale, float* scale_copy, cudaStream_t stream) {
  check_cuda(cudaMemcpyAsync(scale_copy, scale, sizeof(float), cudaMemcpyDeviceToDevice, stream), "fp8 scale copy");
}

// reset: zero *amax first (Given; delayed_operands zeroes both of its amaxes in one memset).
template <typename T, Fp8 F, bool Given>
void run_transposed(void const* t_, int64_t rows, int64_t cols, int margin, unsigned* amax, float* scale,
                    float* scale_copy, uint8_t* out, uint8_t* out_t, cudaStream_t stream, bool reset = true) {
  auto t = static_cast<T const*>(t_);
  if constexpr (Given) {
    if (reset) check_cuda(cudaMemsetAsync(amax, 0, sizeof(unsigned), stream), "fp8 cast (amax reset)");
    if (rows * cols == 0) return copy_scale(scale, scale_copy, stream);  // amax 0
  } else {
    launch_amax(t, rows * cols, amax, stream);
    if (rows * cols == 0) {
      cast_kernel<T, 1, F><<<1, kThreads, 0, stream>>>(t, 0, amax, margin, scale, out_t);  // the scale alone
      check_cuda(cudaGetLastError(), "quantize_fp8_transposed");
      return;
    }
  }
  int64_t row_tiles = (rows + kTile - 1) / kTile, col_tiles = (cols + kTile - 1) / kTile;
  bool vec_in = aligned16(t) && cols * sizeof(T) % 16 == 0;
  bool vec_out = out != nullptr && aligned16(out) && cols % 16 == 0;
  bool vec_out_t = aligned16(out_t) && rows % 16 == 0;
  check_cuda(row_tiles * col_tiles < (int64_t{1} << 31) ? cudaSuccess : cudaErrorInvalidValue,
             "quantize_fp8_transposed (more than 2^31 tiles)");
  cast_transpose_kernel<T, F, Given><<<static_cast<unsigned>(row_tiles * col_tiles), kThreads, 0, stream>>>(
      t, rows, cols, col_tiles, amax, margin, scale, scale_copy, out, out_t, vec_in, vec_out, vec_out_t);
  check_cuda(cudaGetLastError(), "quantize_fp8_transposed");
}

template <typename T>
void run_measured(void const* t_, int64_t n, float const* scale, float* scale_copy, unsigned* amax, uint8_t* out,
                  cudaStream_t stream, bool reset = true) {
  auto t = static_cast<T const*>(t_);
  constexpr int V = 16 / sizeof(T);
  if (reset) check_cuda(cudaMemsetAsync(amax, 0, sizeof(unsigned), stream), "fp8 cast (amax reset)");
  if (n == 0) return copy_scale(scale, scale_copy, stream);
  if (aligned16(t) && reinterpret_cast<uintptr_t>(out) % V == 0) {
    cast_measure_kernel<T, V, Fp8::e4m3><<<grid_for(n / V), kThreads, 0, stream>>>(t, n, scale, scale_copy, amax, out);
  } else {
    cast_measure_kernel<T, 1, Fp8::e4m3><<<grid_for(n), kThreads, 0, stream>>>(t, n, scale, scale_copy, amax, out);
  }
  check_cuda(cudaGetLastError(), "quantize_e4m3_with_scale");
}

template <typename T, Fp8 F>
void run_dequantize(uint8_t const* t8, int64_t n, float const* scale, void* out_, cudaStream_t stream) {
  auto out = static_cast<T*>(out_);
  constexpr int V = 16;  // 16-byte loads of fp8
  if (n == 0) return;
  if (aligned16(t8) && reinterpret_cast<uintptr_t>(out) % (V * sizeof(T)) == 0) {
    dequantize_kernel<T, V, F><<<grid_for(n / V), kThreads, 0, stream>>>(t8, n, scale, out);
  } else {
    dequantize_kernel<T, 1, F><<<grid_for(n), kThreads, 0, stream>>>(t8, n, scale, out);
  }
  check_cuda(cudaGetLastError(), "dequantize_fp8");
}

// f(format), the format a template value.
template <class F>
void dispatch_format(Fp8 format, F&& f) {
  if (format == Fp8::e4m3)
    f(std::integral_constant<Fp8, Fp8::e4m3>{});
  else
    f(std::integral_constant<Fp8, Fp8::e5m2>{});
}

// f(bias value, scale value): the scale arithmetic's kernels take the bias's and the scale's
// dtypes as two template parameters.
template <class F>
void dispatch_scales(DType bias_dtype, DType scale_dtype, F&& f) {
  dispatch(bias_dtype, [&](auto b) { dispatch(scale_dtype, [&](auto s) { f(b, s); }); });
}

}  // namespace

void quantize_e4m3(void const* t, DType dtype, int64_t n, int margin, unsigned* amax_bits, float* scale, uint8_t* out,
                   cudaStream_t stream) {
  dispatch(dtype, [&](auto v) { run<decltype(v), Fp8::e4m3>(t, n, margin, amax_bits, scale, out, stream); });
}

void dequantize_fp8(uint8_t const* t8, Fp8 format, int64_t n, float const* scale, DType dtype, void* out,
                    cudaStream_t stream) {
  dispatch(dtype, [&](auto v) {
    dispatch_format(format, [&](auto f) { run_dequantize<decltype(v), decltype(f)::value>(t8, n, scale, out, stream); });
  });
}

void quantize_fp8_transposed(void const* t, DType dtype, Fp8 format, int64_t rows, int64_t cols, int margin,
                             unsigned* amax_bits, float* scale, uint8_t* out, uint8_t* out_t, cudaStream_t stream) {
  dispatch(dtype, [&](auto v) {
    dispatch_format(format, [&](auto f) {
      run_transposed<decltype(v), decltype(f)::value, false>(t, rows, cols, margin, amax_bits, scale, nullptr, out,
                                                             out_t, stream);
    });
  });
}

void quantize_e4m3_with_scale(void const* t, DType dtype, int64_t n, float const* scale, float* scale_copy,
                              unsigned* amax_bits, uint8_t* out, cudaStream_t stream) {
  dispatch(dtype, [&](auto v) { run_measured<decltype(v)>(t, n, scale, scale_copy, amax_bits, out, stream); });
}

void quantize_fp8_transposed_with_scale(void const* t, DType dtype, Fp8 format, int64_t rows, int64_t cols,
                                        float const* scale, float* scale_copy, unsigned* amax_bits, uint8_t* out,
                                        uint8_t* out_t, cudaStream_t stream) {
  // The kernel only reads *scale in this form (Given).
  auto s = const_cast<float*>(scale);
  dispatch(dtype, [&](auto v) {
    dispatch_format(format, [&](auto f) {
      run_transposed<decltype(v), decltype(f)::value, true>(t, rows, cols, 0, amax_bits, s, scale_copy, out, out_t,
                                                            stream);
    });
  });
}

void fp8_operand_scales(float const* s_x, float const* s_w, void const* bias, DType bias_dtype, int64_t nb,
                        void const* scale, DType scale_dtype, int64_t ns, void* b_out, void* sc_out,
                        cudaStream_t stream) {
  if (std::max(nb, ns) == 0) return;
  dispatch_scales(bias_dtype, scale_dtype, [&](auto b, auto sc) {
    using B = decltype(b);
    using S = decltype(sc);
    operand_scales_kernel<B, S><<<grid_for(std::max(nb, ns)), kThreads, 0, stream>>>(
        s_x, s_w, static_cast<B const*>(bias), nb, static_cast<S const*>(scale), ns,
        static_cast<__nv_bfloat16*>(b_out), static_cast<S*>(sc_out));
  });
  check_cuda(cudaGetLastError(), "fp8_operand_scales");
}

void fp8_backward_scales(void const* dsc, DType dsc_dtype, int64_t n, float const* s_x, float const* s_w,
                         float const* s_g, void* dbias, DType bias_dtype, void* dscale, DType scale_dtype,
                         float* inv_g, cudaStream_t stream) {
  dispatch(dsc_dtype, [&](auto d) {
    dispatch_scales(bias_dtype, scale_dtype, [&](auto b, auto s) {
      using D = decltype(d);
      using B = decltype(b);
      using S = decltype(s);
      backward_scales_kernel<D, B, S><<<grid_for(std::max<int64_t>(n, 1)), kThreads, 0, stream>>>(
          static_cast<D const*>(dsc), n, s_x, s_w, s_g, static_cast<B*>(dbias), static_cast<S*>(dscale), inv_g);
    });
  });
  check_cuda(cudaGetLastError(), "fp8_backward_scales");
}

void record_amax(float* history, int64_t len, float const* amax_x, float const* amax_w, int margin, bool use_max,
                 float* scale, cudaStream_t stream) {
  record_kernel<<<1, 32, 0, stream>>>(history, len, amax_x, amax_w, margin, use_max, scale);
  check_cuda(cudaGetLastError(), "fp8_record");
}

void delayed_operands(Fp8Operand const& x, Fp8Operand const& w, float* history, int64_t len, float* fp8_scale,
                      int margin, bool use_max, unsigned* amax_bits, float* s_x, float* s_w, void const* bias,
                      DType bias_dtype, int64_t nb, void const* scale, DType scale_dtype, int64_t ns, void* b_out,
                      void* sc_out, cudaStream_t stream) {
  check_cuda(cudaMemsetAsync(amax_bits, 0, 2 * sizeof(unsigned), stream), "fp8 cast (amax reset)");
  auto cast = [&](Fp8Operand const& o, float* state, float* copy, unsigned* amax) {
    dispatch(o.dtype, [&](auto v) {
      using T = decltype(v);
      if (o.out_t) {
        run_transposed<T, Fp8::e4m3, true>(o.t, o.rows, o.cols, 0, amax, state, copy, o.out, o.out_t, stream, false);
      } else {
        run_measured<T>(o.t, o.rows * o.cols, state, copy, amax, o.out, stream, false);
      }
    });
  };
  cast(x, fp8_scale, s_x, amax_bits);
  cast(w, fp8_scale + 1, s_w, amax_bits + 1);
  dispatch_scales(bias_dtype, scale_dtype, [&](auto b, auto sc) {
    using B = decltype(b);
    using S = decltype(sc);
    record_and_scales_kernel<B, S><<<grid_for(std::max<int64_t>({nb, ns, 1})), kThreads, 0, stream>>>(
        history, len, amax_bits, margin, use_max, fp8_scale, s_x, s_w, static_cast<B const*>(bias), nb,
        static_cast<S const*>(scale), ns, static_cast<__nv_bfloat16*>(b_out), static_cast<S*>(sc_out));
  });
  check_cuda(cudaGetLastError(), "fp8_delayed_operands");
}

}  // namespace cutlass_fused
