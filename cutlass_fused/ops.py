"""Loads the compiled ops, registers their fake (meta) kernels, and keys torch.compile's caches on
this build.

The schemas live in csrc/ops.cpp; this file only describes output metadata.
"""
import hashlib

import torch

from . import _C  # noqa: F401  (registers torch.ops.cutlass_fused.*)

ops = torch.ops.cutlass_fused


def build_tag(path: str = _C.__file__) -> str:
    """This build of the extension, by its contents: `cutlass_fused:` and 16 hex digits of sha256."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return "cutlass_fused:" + digest.hexdigest()[:16]


def with_build_tag(tag: str, build: str) -> str:
    """A cache_key_tag that carries `build` once, beside the user's own tag and in place of another
    build's."""
    parts = [p for p in tag.split("|") if p and not p.startswith("cutlass_fused:")]
    return "|".join(parts + [build])


# AOTAutograd's cache keys a compiled graph on Dynamo's graph, which holds our ops as calls, not on
# what our C++ autograd and autocast kernels trace them into (csrc/autograd.cpp). Without this, a
# process could be handed the forward and backward traced from an earlier build, with that build's
# decomposition (as happened here: a fixed backward ran the old one from a warm cache). Every cache
# key then carries the build, where torch has the tag.
try:
    from torch.compiler import config as _config
except ImportError:
    _config = None
if hasattr(_config, "cache_key_tag"):
    _config.cache_key_tag = with_build_tag(_config.cache_key_tag, build_tag())


def padded_ld(n: int, dtype: torch.dtype) -> int:
    """Row stride of h: rows padded to 16 bytes (the contract in csrc/ops.h)."""
    align = max(1, 16 // dtype.itemsize)
    return (n + align - 1) // align * align


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def z_dtype(dtype: torch.dtype, scale) -> torch.dtype:
    """The dtype of h * scale for h of `dtype`, as PyTorch types that product (csrc/ops.h,
    output_dtype): h's without a scale or with a 0-dim one, else the two promoted."""
    return dtype if scale is None or scale.dim() == 0 else torch.promote_types(dtype, scale.dtype)


@torch.library.register_fake("cutlass_fused::linear_stats")
def _linear_stats(x, weight, bias, family, cache=False):
    torch._check(x.dim() == 2 and weight.dim() == 2, lambda: "cutlass_fused: expected 2-D input and weight")
    torch._check(x.shape[1] == weight.shape[1], lambda: "cutlass_fused: mat1 and mat2 shapes cannot be multiplied")
    m, n = x.shape[0], weight.shape[0]
    h = x.new_empty_strided((m, n), (padded_ld(n, x.dtype), 1))
    return h, x.new_empty((2, n), dtype=torch.float64)


@torch.library.register_fake("cutlass_fused::batch_norm_finalize")
def _finalize(h, stats, scale, count, weight, bias, eps, activation="none", negative_slope=0.01):
    n = h.shape[1]
    # mean and invstd are fp64 for every dtype: the backward's h - mean cancels.
    y = h.new_empty(h.shape, dtype=z_dtype(h.dtype, scale))  # as h * scale promotes
    return y, h.new_empty((n,), dtype=torch.float64), h.new_empty((n,), dtype=torch.float64)


@torch.library.register_fake("cutlass_fused::linear_scale_batch_norm_train")
def _train(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked, momentum, eps,
           family, cache=False, activation="none", negative_slope=0.01, output_dtype=None):
    # The split ops' outputs; the running stats are updated in place.
    h, stats = _linear_stats(x, weight, bias, family)
    y, mean, invstd = _finalize(h, stats, scale, x.shape[0], bn_weight, bn_bias, eps)
    return y if output_dtype is None else y.to(output_dtype), h, stats, mean, invstd


@torch.library.register_fake("cutlass_fused::linear_scale_batch_norm_train_linked")
def _(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked, momentum, eps,
      family, cache=False, activation="none", negative_slope=0.01, output_dtype=None, prev_h=None, prev_mean=None,
      prev_invstd=None, prev_bias=None, prev_scale=None, prev_bn_weight=None, prev_bn_bias=None, prev_eps=1e-5,
      prev_activation="none", prev_negative_slope=0.01):
    # The training op's outputs; the previous layer's tensors are read by the backward alone.
    torch._check(prev_h is None or tuple(prev_h.shape) == tuple(x.shape),
                 lambda: f"cutlass_fused: expected prev_h of x's shape {tuple(x.shape)}, but got "
                         f"{None if prev_h is None else tuple(prev_h.shape)}")
    return _train(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
                  momentum, eps, family, cache, activation, negative_slope, output_dtype)


@torch.library.register_fake("cutlass_fused::linear_linked")
def _(x, weight, bias, prev_h, prev_mean, prev_invstd, prev_bias=None, prev_scale=None, prev_bn_weight=None,
      prev_bn_bias=None, prev_eps=1e-5, prev_activation="none", prev_negative_slope=0.01, family="auto"):
    torch._check(tuple(prev_h.shape) == tuple(x.shape),
                 lambda: f"cutlass_fused: expected prev_h of x's shape {tuple(x.shape)}, but got {tuple(prev_h.shape)}")
    return torch.nn.functional.linear(x, weight, bias)


@torch.library.register_fake("cutlass_fused::linear_scale_batch_norm_train_fp8")
def _(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked, momentum, eps,
      family, activation="none", negative_slope=0.01, output_dtype=None, fast_accum=False):
    # As the training op's over bf16 x and W: h is bf16 beside e4m3 operands.
    h, stats = _linear_stats(x.new_empty(x.shape, dtype=torch.bfloat16),
                             weight.new_empty(weight.shape, dtype=torch.bfloat16), bias, family)
    y, mean, invstd = _finalize(h, stats, scale, x.shape[0], bn_weight, bn_bias, eps)
    return y if output_dtype is None else y.to(output_dtype), h, stats, mean, invstd


@torch.library.register_fake("cutlass_fused::linear_scale_batch_norm_train_e4m3")
def _(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked, momentum, eps,
      family, activation="none", negative_slope=0.01, output_dtype=None, margin=0, backward="bf16", cache=False,
      amax_history=None, fp8_scale=None, amax_compute_algo="max", fast_accum=False):
    # y of the FP8 op: bf16 h times scale, promoted, or output_dtype; a delayed state updated in place.
    y = x.new_empty((x.shape[0], weight.shape[0]), dtype=z_dtype(torch.bfloat16, scale))
    return y if output_dtype is None else y.to(output_dtype)


@torch.library.register_fake("cutlass_fused::quantize_e4m3")
def _(t, margin=0, cache=False):
    return t.new_empty(t.shape, dtype=torch.float8_e4m3fn), t.new_empty((), dtype=torch.float32)


@torch.library.register_fake("cutlass_fused::quantize_transposed")
def _(t, dtype, margin=0, cache=False):
    torch._check(t.dim() == 2, lambda: f"cutlass_fused: expected t to be 2-D, but got {t.dim()}-D")
    return (t.new_empty(t.shape, dtype=dtype), t.new_empty((t.shape[1], t.shape[0]), dtype=dtype),
            t.new_empty((), dtype=torch.float32))


@torch.library.register_fake("cutlass_fused::quantize_with_scale")
def quantize_with_scale_fake(t, scale, dtype, transposed=False):
    if transposed:
        torch._check(t.dim() == 2, lambda: f"cutlass_fused: expected t to be 2-D, but got {t.dim()}-D")
        t8_t = t.new_empty((t.shape[1], t.shape[0]), dtype=dtype)
    else:
        t8_t = t.new_empty((0,), dtype=dtype)
    return (t.new_empty(t.shape, dtype=dtype), t8_t, t.new_empty((), dtype=torch.float32),
            t.new_empty((), dtype=torch.float32))


@torch.library.register_fake("cutlass_fused::fp8_operand_scales")
def fp8_operand_scales_fake(s_x, s_w, bias, scale):
    b = s_x.new_empty((0,) if bias is None else bias.shape, dtype=torch.bfloat16)
    return b, s_x.new_empty(()) if scale is None else scale.new_empty(scale.shape)  # no scale: alpha


@torch.library.register_fake("cutlass_fused::fp8_backward_scales")
def _(dsc, s_x, s_w, s_g, bias_dtype, scale_dtype):
    none = dsc.new_empty((0,), dtype=torch.float32)
    dbias = none if bias_dtype is None else dsc.new_empty(dsc.shape, dtype=bias_dtype)
    inv_g = none.clone() if s_g is None else dsc.new_empty((), dtype=torch.float32)
    return dbias, dsc.new_empty(dsc.shape, dtype=scale_dtype), inv_g


@torch.library.register_fake("cutlass_fused::fp8_record")
def _(amax_history, scale, amax_x, amax_w, margin=0, amax_compute_algo="max"):
    return None


@torch.library.register_fake("cutlass_fused::fp8_delayed_operands")
def _(x, weight, bias, scale, amax_history, fp8_scale, margin=0, amax_compute_algo="max", transposed=False):
    torch._check(x.dim() == 2 and weight.dim() == 2,
                 lambda: f"cutlass_fused: expected x and weight to be 2-D, but got {x.dim()}-D and {weight.dim()}-D")
    x8, x8_t, _, s_x = quantize_with_scale_fake(x, fp8_scale[0], torch.float8_e4m3fn, transposed)
    w8, w8_t, _, s_w = quantize_with_scale_fake(weight, fp8_scale[1], torch.float8_e4m3fn, transposed)
    b, sc = fp8_operand_scales_fake(s_x, s_w, bias, scale)
    return x8, x8_t, w8, w8_t, s_x, s_w, b, sc


@torch.library.register_fake("cutlass_fused::dequantize")
def _(t8, scale, dtype):
    return t8.new_empty(t8.shape, dtype=dtype)


@torch.library.register_fake("cutlass_fused::update_running_stats")
def _(stats, scale, count, running_mean, running_var, num_batches_tracked, momentum):
    return None


@torch.library.register_fake("cutlass_fused::batch_norm_backward")
def _backward_fake(dy, h, mean, invstd, scale, weight, eps, bias=None, activation="none", negative_slope=0.01,
                   linear_bias_dtype=None):
    n = h.shape[1]
    vec = _stat_dtype(h.dtype) if weight is None else weight.dtype
    # dscale: a value a column in scale's dtype; empty fp32 without a scale.
    dscale = h.new_empty((0,), dtype=torch.float32) if scale is None else h.new_empty((n,), dtype=scale.dtype)
    dlinear_bias = (h.new_empty((0,), dtype=dscale.dtype) if linear_bias_dtype is None
                    else h.new_empty((n,), dtype=linear_bias_dtype))
    return h.new_empty(h.shape), dscale, h.new_empty((n,), dtype=vec), h.new_empty((n,), dtype=vec), dlinear_bias


@torch.library.register_fake("cutlass_fused::batch_norm_backward_linear")
def _(dz, next_weight, h, mean, invstd, scale, weight, eps, bias=None, activation="none", negative_slope=0.01,
      linear_bias_dtype=None, family="auto"):
    torch._check(dz.dim() == 2 and next_weight.dim() == 2 and h.dim() == 2,
                 lambda: "cutlass_fused: expected 2-D dz, next_weight and h")
    torch._check(dz.shape[0] == h.shape[0] and next_weight.shape[0] == dz.shape[1]
                 and next_weight.shape[1] == h.shape[1],
                 lambda: f"cutlass_fused: expected dz (batch x k) and next_weight (k x n) for h {tuple(h.shape)}, "
                         f"but got {tuple(dz.shape)} and {tuple(next_weight.shape)}")
    return _backward_fake(h, h, mean, invstd, scale, weight, eps, bias, activation, negative_slope, linear_bias_dtype)


@torch.library.register_fake("cutlass_fused::batch_norm_backward_reduce")
def _(dy, h, mean, invstd, scale, weight, eps, bias=None, activation="none", negative_slope=0.01):
    return h.new_empty((2, h.shape[1]), dtype=torch.float64)


@torch.library.register_fake("cutlass_fused::batch_norm_backward_elemt")
def _(dy, h, mean, invstd, scale, weight, sums, count, eps, bias=None, activation="none", negative_slope=0.01):
    return h.new_empty(h.shape)


@torch.library.register_fake("cutlass_fused::sync_batch_norm_row")
def _(stats, count):
    return stats.new_empty((2 * stats.shape[1] + 1,))


@torch.library.register_fake("cutlass_fused::sync_batch_norm_merge")
def _(rows):
    n = (rows.shape[1] - 1) // 2
    return rows.new_empty((2, n)), rows.new_empty((2, n)), rows.new_empty((1,))


@torch.library.register_fake("cutlass_fused::sync_batch_norm_grads")
def _(local, sums, row, count, mean, invstd, scale, weight):
    return local.new_empty((4, local.shape[1]))


@torch.library.register_fake("cutlass_fused::linear_scale_batch_norm_eval")
def _(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, eps, family, cache=False,
      activation="none", negative_slope=0.01, output_dtype=None):
    torch._check(x.shape[1] == weight.shape[1], lambda: "cutlass_fused: mat1 and mat2 shapes cannot be multiplied")
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=output_dtype or z_dtype(x.dtype, scale))


def _fp8_eval_y(x, weight, scale, output_dtype):
    """The FP8 eval ops' y: as the eval op's over bf16 x and W (bf16 h times scale, or output_dtype)."""
    torch._check(x.shape[1] == weight.shape[1], lambda: "cutlass_fused: mat1 and mat2 shapes cannot be multiplied")
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=output_dtype or z_dtype(torch.bfloat16, scale))


@torch.library.register_fake("cutlass_fused::linear_scale_batch_norm_eval_fp8")
def _(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, eps, family, activation="none",
      negative_slope=0.01, output_dtype=None, fast_accum=False):
    return _fp8_eval_y(x, weight, scale, output_dtype)


@torch.library.register_fake("cutlass_fused::linear_scale_batch_norm_eval_e4m3")
def _(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, eps, family, activation="none",
      negative_slope=0.01, output_dtype=None, margin=0, cache=False, fp8_scale=None, fast_accum=False):
    return _fp8_eval_y(x, weight, scale, output_dtype)


def autocast_casts(t, dtype) -> bool:
    """Whether autocast casts t to dtype (csrc/ops.h's rule, at::autocast::cached_cast's)."""
    return t is not None and t.is_floating_point() and t.dtype not in (torch.float64, dtype)


@torch.library.register_fake("cutlass_fused::cast_linear_inputs")
def _(x, weight, bias, dtype):
    torch._check(dtype in (torch.bfloat16, torch.float16),
                 lambda: f"cutlass_fused: expected dtype to be torch.bfloat16 or torch.float16, but got {dtype}")

    def cast(t, like):
        # t.to(dtype)'s strides where it is cast, else an empty tensor
        return torch.empty_like(t, dtype=dtype) if autocast_casts(t, dtype) else like.new_empty((0,), dtype=dtype)

    return cast(x, x), cast(weight, weight), cast(bias, x if bias is None else bias)


@torch.library.register_fake("cutlass_fused::matmul")
def _(a, b, family):
    torch._check(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0],
                 lambda: "cutlass_fused: mat1 and mat2 shapes cannot be multiplied")
    return a.new_empty((a.shape[0], b.shape[1]))
