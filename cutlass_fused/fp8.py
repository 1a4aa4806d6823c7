"""FP8 for the layer (issue 33): x and W rounded to e4m3 under per-tensor scales before the GEMM.

Built: the semantics. Each call measures the amax of x and of W (current scaling) and rounds
them to e4m3 (torch.float8_e4m3fn) under power-of-two scales s = 2^(floor(log2(448 / amax)) -
margin); the GEMM then sees x8 / s_x and W8 / s_w. Power-of-two scales make those values exact in
fp32, bf16 and (inside its range) fp16, so the layer's own kernels compute exactly what an e4m3
GEMM followed by 1 / (s_x s_w) would, to their accumulation's rounding; a power of two costs at
most one bit of e4m3's range (amax lands in (224, 448]), as torchao's round_scales_to_power_of_2.
The statistics and the running stats are those of the quantized h (fp64 sums, as without FP8).
Gradients pass the rounding straight through (TransformerEngine's and torchao's convention); the
backward runs in the layer's dtype.

Delayed scaling (Float8Recipe(scaling="delayed")), in TransformerEngine's convention: each
training forward records the amax of x and W in an amax history (rows are steps, row 0 the latest)
and sets the scales that the next call uses from the history's max (or its latest row); a call
quantizes with the scales it finds. So a kernel can measure the amax in the pass that casts.
The state is the layer's buffers `fp8_amax_history` (history length x 2: x, W) and `fp8_scale`
(2), in its state_dict. Before any step the scales are 1; an amax that is 0 or not finite keeps the
scale it had (TransformerEngine's rule). Values past 448 / scale saturate, as there.

The e4m3 kernels (train_e4m3 and eval_e4m3 below): in training, through ops.quantize_e4m3 (current
scaling: the amax and the cast on the GPU, this file's scale_of and quantize op for op) or
ops.quantize_with_scale (delayed scaling: the cast under the state's scale, measuring the amax in
the same pass; then ops.fp8_record, DelayedState.record in one launch; in training the two casts,
that step and the operand scales are one op, ops.fp8_delayed_operands), and the e4m3 statistics
GEMM; in eval where no gradient is asked for (inference), the same casts and one e4m3 GEMM with the
BatchNorm fold in its epilogue. The module picks them (LinearScaleBatchNorm1d._runs_e4m3,
_runs_e4m3_eval). Every other FP8 call runs the same rounding through the 16-bit kernels
("emulated"), which emulate=True forces; on a GPU whose build has no e4m3 kernels, a recipe without
emulate=True is refused. Inside frozen_weights(), a current-scaling W8 and its scale are kept
between calls while W is unchanged (csrc/derived_cache.h).
"""
import dataclasses

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
E5M2 = torch.float8_e5m2  # the FP8 backward's dh (Float8Recipe(backward="e5m2"))
# Scales stay normal fp32 powers of two, so that x * s and x8 / s are exact.
MAX_EXPONENT = 126


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """How the layer rounds x and W to e4m3: per-tensor current scaling with power-of-two scales.

    margin: the scale is 2^(floor(log2(448 / amax)) - margin) (TransformerEngine's margin: headroom
    in powers of two). emulate: run the rounding through the 16-bit kernels even where the e4m3
    kernels could run; without it, a CUDA layer on a GPU or build without them raises.
    backward: "bf16" (the backward's GEMMs in bf16 over the dequantized operands) or "e5m2" (dh
    rounded to e5m2 under its own current scale, dX and dW as FP8 GEMMs over it and the forward's
    e4m3 x8 and W8: TransformerEngine's hybrid format; dh under current scaling with either
    scaling of x and W). "e5m2" is taken by the e4m3 training path only, so it needs a recipe
    without emulate; the layer's other calls (eval, SyncBN, fp32 or fp16 data) differentiate in
    their own dtype. fast_accum: the e4m3 kernels' forward GEMMs (training and eval) accumulate
    in the tensor cores alone, without CUTLASS's promotion into a second fp32 accumulator every
    4 MMAs, as torchao's and TransformerEngine's forward GEMMs do by default: faster, with a
    larger error in h that grows with in_features (docs/decisions.md, "Fast accumulation (run on an
    H100)"). The backward's GEMMs stay promoted (as the peers keep theirs), and the CPU and the
    emulated path accumulate as the bf16 kernels do; so it takes a recipe without emulate."""

    margin: int = 0
    emulate: bool = False
    scaling: str = "current"
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    backward: str = "bf16"
    fast_accum: bool = False

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.margin) or self.margin < 0:
            raise ValueError(f"cutlass_fused: expected Float8Recipe margin to be an int >= 0, but got {self.margin!r}")
        if not isinstance(self.emulate, bool):
            raise ValueError(f"cutlass_fused: expected Float8Recipe emulate to be a bool, but got {self.emulate!r}")
        if self.scaling not in ("current", "delayed"):
            raise ValueError(f"cutlass_fused: expected Float8Recipe scaling to be 'current' or 'delayed', but got "
                             f"{self.scaling!r}")
        if not is_int(self.amax_history_len) or self.amax_history_len < 1:
            raise ValueError(f"cutlass_fused: expected Float8Recipe amax_history_len to be an int >= 1, but got "
                             f"{self.amax_history_len!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"cutlass_fused: expected Float8Recipe amax_compute_algo to be 'max' or 'most_recent', "
                             f"but got {self.amax_compute_algo!r}")
        if self.backward not in ("bf16", "e5m2"):
            raise ValueError(f"cutlass_fused: expected Float8Recipe backward to be 'bf16' or 'e5m2', but got "
                             f"{self.backward!r}")
        if not isinstance(self.fast_accum, bool):
            raise ValueError(f"cutlass_fused: expected Float8Recipe fast_accum to be a bool, but got "
                             f"{self.fast_accum!r}")
        if self.fast_accum and self.emulate:
            raise ValueError("cutlass_fused: Float8Recipe(fast_accum=True) is the e4m3 kernels' accumulation, which "
                             "takes a recipe without emulate")
        if self.backward == "e5m2" and self.emulate:
            raise ValueError("cutlass_fused: Float8Recipe(backward='e5m2') runs with the e4m3 training path, which "
                             "takes a recipe without emulate")

    @property
    def delayed(self):
        return self.scaling == "delayed"


_E4M3_KERNELS = {}  # (device index, family, dtype) -> the plan's answer (a layer asks on every training call)


def e4m3_kernels(device, family="auto", operands=torch.bfloat16):
    """Whether the e4m3 GEMMs run on `device` for the kernel family `family` ("auto", "sm90",
    "sm80"; cutlass_fused.use_kernel_family's), x and W reaching them in `operands`: the plan's
    answer (csrc/kernels/plan.h, e4m3_runs: bf16 operands, the sm90 family, a built e4m3 row),
    asked once per device, family and dtype."""
    from .ops import ops
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, family, operands)
    if key not in _E4M3_KERNELS:
        major, minor = torch.cuda.get_device_capability(index)
        _E4M3_KERNELS[key] = ops.e4m3_runs(family, major * 10 + minor, operands)
    return _E4M3_KERNELS[key]


def check(recipe, device):
    """`recipe` as the layer takes it (None or a Float8Recipe), refused where it cannot run."""
    if recipe is None:
        return None
    if not isinstance(recipe, Float8Recipe):
        raise TypeError(f"cutlass_fused: expected fp8 to be None or a cutlass_fused.Float8Recipe, but got {recipe!r}")
    if device.type == "cuda" and not recipe.emulate and not e4m3_kernels(device):
        raise RuntimeError("cutlass_fused: fp8 needs e4m3 GEMM kernels, which this build does not have (issue 33); "
                           "Float8Recipe(emulate=True) runs the same rounding through the 16-bit kernels, without "
                           "FP8's speed")
    return recipe


def scale_of(t, margin=0, fp8=E4M3):
    """The power-of-two scale that maps t's amax into (224, 448] (e5m2: (28672, 57344]; less
    `margin` powers of two), as a 0-dim fp32 tensor on t's device (no host sync). 1 where the amax is
    0 or not finite (a NaN or an Inf in t, which quantize makes NaN)."""
    return scale_from_amax(amax_of(t), margin, torch.ones((), device=t.device), torch.finfo(fp8).max)


def amax_of(t):
    """max |t| as a 0-dim fp32 tensor on t's device (0 for an empty t; NaN where t holds one)."""
    if t.numel() == 0:
        return torch.zeros((), device=t.device)
    return t.detach().abs().amax().float()


def scale_from_amax(amax, margin, fallback, largest=E4M3_MAX):
    """2^(floor(log2(largest / amax)) - margin), elementwise; `fallback` where amax is 0 or not
    finite. largest: the format's largest finite value (448 for e4m3)."""
    usable = torch.isfinite(amax) & (amax > 0)
    exponent = torch.floor(torch.log2(largest / torch.where(usable, amax, torch.ones_like(amax)))) - margin
    return torch.where(usable, torch.exp2(exponent.clamp(-MAX_EXPONENT, MAX_EXPONENT)), fallback)


def quantize(t, scale, fp8=E4M3):
    """t * scale rounded to e4m3 (or `fp8`), finite values saturated at +-448 (its largest; as
    TransformerEngine and torchao cast). NaN and Inf become NaN: e4m3fn has no Inf, and torch's cast
    would make one 448 (e5m2: keep an Inf that a large finite value would also have become)."""
    largest = torch.finfo(fp8).max
    v = t.to(torch.promote_types(t.dtype, torch.float32)) * scale  # one rounding, to fp8
    v = torch.where(torch.isfinite(v), v.clamp(-largest, largest), torch.full_like(v, float("nan")))
    return v.to(fp8)


class _RoundToE4M3(torch.autograd.Function):
    """x8 / s in t's dtype, with the gradient passed straight through (s: a 0-dim fp32 tensor)."""

    @staticmethod
    def forward(ctx, t, scale):
        wide = torch.promote_types(t.dtype, torch.float32)
        out = quantize(t, scale).to(wide) / scale
        # No .to() when the dtype is already t's: torch 2.11's torch.compile (aot_eager too) gives
        # x a zero gradient through a Function whose forward ends in a no-op .to (2.13's does not).
        return out if out.dtype == t.dtype else out.to(t.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def round_to_e4m3(t, margin=0):
    """t as the e4m3 GEMM sees it: rounded to e4m3 under its power-of-two scale, then divided by
    that scale (exact), in t's dtype; differentiable straight through."""
    return _RoundToE4M3.apply(t, scale_of(t, margin))


def round_with_scale(t, scale):
    """t as the e4m3 GEMM sees it under a given power-of-two scale (0-dim fp32): values past
    448 / scale saturate; differentiable straight through."""
    return _RoundToE4M3.apply(t, scale)


def operands(x, weight, recipe, state=None, update=False):
    """(x, weight) as the layer's GEMM takes them under `recipe` (None: unchanged). Delayed scaling
    takes the layer's `state` (DelayedState) and, with `update`, records this call's amaxes."""
    if check(recipe, x.device) is None:
        return x, weight
    if not recipe.delayed:
        return round_to_e4m3(x, recipe.margin), round_to_e4m3(weight, recipe.margin)
    if state is None:
        raise ValueError("cutlass_fused: delayed FP8 scaling keeps state between calls (an amax history); "
                         "use LinearScaleBatchNorm1d(fp8=...), or scaling='current' in the functional form")
    scale = state.scale.to(x.device)
    out = round_with_scale(x, scale[0]), round_with_scale(weight, scale[1])
    if update:
        state.record(torch.stack([amax_of(x), amax_of(weight)]), recipe)
    return out


class DelayedState:
    """A layer's delayed-scaling buffers: `history` (amax_history_len x 2, row 0 the latest step;
    columns x, W) and `scale` (2), both fp32."""

    def __init__(self, history, scale):
        self.history, self.scale = history, scale

    @staticmethod
    def buffers(recipe, device):
        return {"fp8_amax_history": torch.zeros(recipe.amax_history_len, 2, device=device),
                "fp8_scale": torch.ones(2, device=device)}

    @torch.no_grad()
    def record(self, amax, recipe):
        """Row 0 becomes this step's amaxes, the rest shift down one (the oldest drops); the scales
        for the next call then come from the history, in place (no host sync)."""
        amax = amax.to(self.history.device)
        self.history.copy_(torch.cat([amax[None], self.history[:-1]]))
        reduced = self.history.amax(0) if recipe.amax_compute_algo == "max" else self.history[0]
        self.scale.copy_(scale_from_amax(reduced, recipe.margin, self.scale))


def train_e4m3(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked, momentum,
               eps, family, activation="none", negative_slope=0.01, margin=0, output_dtype=None, backward="bf16",
               state=None, amax_compute_algo="max", fast_accum=False):
    """y of the training op with x and W rounded to e4m3, through the e4m3 kernels (on the CPU, the
    op's bf16 reference): the emulated path's values and gradients (tests/test_fp8.py). Current
    scaling, or delayed scaling under `state` (a DelayedState, updated in place as
    DelayedState.record would). x and W in bf16, or under bf16 autocast an fp32 W and an fp32 or
    bf16 x (the block before's y); y in h * scale's dtype, or output_dtype (rounded once from the
    fp32 value where the kernels write it, as the training op). One op with its autograd in C++
    (ops.linear_scale_batch_norm_train_e4m3, csrc/fp8_autograd.cpp); backward: Float8Recipe's
    ("bf16", or "e5m2": FP8 GEMMs over dh rounded to e5m2); fast_accum: Float8Recipe's."""
    from .frozen import may_cache
    from .ops import ops
    # Inside frozen_weights() (a frozen weight), W8 and its scale are kept between calls (current
    # scaling: a delayed W8 moves with its scale).
    cache = may_cache(weight, bias, scale, bn_weight, bn_bias, running_mean, running_var)
    history, fp8_scale = (None, None) if state is None else (state.history, state.scale)
    return ops.linear_scale_batch_norm_train_e4m3(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                                                  num_batches_tracked, momentum, eps, family, activation,
                                                  negative_slope, output_dtype, margin, backward, cache, history,
                                                  fp8_scale, amax_compute_algo, fast_accum)


def eval_e4m3(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, eps, family, activation="none",
              negative_slope=0.01, margin=0, output_dtype=None, state=None, fast_accum=False):
    """y of the eval op with x and W rounded to e4m3 under current scaling, or under a delayed
    `state`'s scales (read, not updated), through the e4m3 eval GEMM with the fold in its epilogue
    (on the CPU, the op's bf16 reference): the emulated path's y. x and W as train_e4m3 takes them.
    No autograd (ops.linear_scale_batch_norm_eval_e4m3): for inference; the layer takes it where no
    gradient is asked for."""
    from .frozen import may_cache
    from .ops import ops
    cache = may_cache(weight, bias, scale, bn_weight, bn_bias, running_mean, running_var)
    return ops.linear_scale_batch_norm_eval_e4m3(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                                                 eps, family, activation, negative_slope, output_dtype, margin, cache,
                                                 None if state is None else state.scale, fast_accum)
