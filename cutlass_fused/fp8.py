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

Not built: e4m3 GEMM kernels. So on CUDA the layer refuses an FP8 recipe unless emulate=True,
which runs the same rounding through the 16-bit kernels, for tests, without FP8's speed. On the
CPU the rounding always runs that way (the layer's CPU path is PyTorch's ops).
"""
import dataclasses

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
# Scales stay normal fp32 powers of two, so that x * s and x8 / s are exact.
MAX_EXPONENT = 126


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """How the layer rounds x and W to e4m3: per-tensor current scaling with power-of-two scales.

    margin: the scale is 2^(floor(log2(448 / amax)) - margin) (TransformerEngine's margin: headroom
    in powers of two). emulate: on CUDA, run the rounding through the 16-bit kernels (the e4m3
    kernels are not built yet); without it a CUDA layer with this recipe raises."""

    margin: int = 0
    emulate: bool = False

    def __post_init__(self):
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"cutlass_fused: expected Float8Recipe margin to be an int >= 0, but got {self.margin!r}")
        if not isinstance(self.emulate, bool):
            raise ValueError(f"cutlass_fused: expected Float8Recipe emulate to be a bool, but got {self.emulate!r}")


def check(recipe, device):
    """`recipe` as the layer takes it (None or a Float8Recipe), refused where it cannot run."""
    if recipe is None:
        return None
    if not isinstance(recipe, Float8Recipe):
        raise TypeError(f"cutlass_fused: expected fp8 to be None or a cutlass_fused.Float8Recipe, but got {recipe!r}")
    if device.type == "cuda" and not recipe.emulate:
        raise RuntimeError("cutlass_fused: fp8 needs e4m3 GEMM kernels, which this build does not have (issue 33); "
                           "Float8Recipe(emulate=True) runs the same rounding through the 16-bit kernels, without "
                           "FP8's speed")
    return recipe


def scale_of(t, margin=0):
    """The power-of-two scale that maps t's amax into (224, 448] (less `margin` powers of two), as
    a 0-dim fp32 tensor on t's device (no host sync). 1 where the amax is 0 or not finite (a NaN or
    an Inf in t, which quantize makes NaN)."""
    if t.numel() == 0:
        return torch.ones((), device=t.device)
    amax = t.detach().abs().amax().float()
    usable = torch.isfinite(amax) & (amax > 0)
    exponent = torch.floor(torch.log2(E4M3_MAX / torch.where(usable, amax, torch.ones_like(amax)))) - margin
    return torch.where(usable, torch.exp2(exponent.clamp(-MAX_EXPONENT, MAX_EXPONENT)), torch.ones_like(amax))


def quantize(t, scale):
    """t * scale rounded to e4m3, finite values saturated at +-448 (as TransformerEngine and
    torchao cast). NaN and Inf become NaN: e4m3fn has no Inf, and torch's cast would saturate one
    to 448, a finite value where the input had none."""
    v = t.to(torch.promote_types(t.dtype, torch.float32)) * scale  # one rounding, to e4m3
    v = torch.where(torch.isfinite(v), v.clamp(-E4M3_MAX, E4M3_MAX), torch.full_like(v, float("nan")))
    return v.to(E4M3)


class _RoundToE4M3(torch.autograd.Function):
    """x8 / s in t's dtype, with the gradient passed straight through."""

    @staticmethod
    def forward(ctx, t, margin):
        scale = scale_of(t, margin)
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
    return _RoundToE4M3.apply(t, margin)


def operands(x, weight, recipe):
    """(x, weight) as the layer's GEMM takes them under `recipe` (None: unchanged)."""
    if check(recipe, x.device) is None:
        return x, weight
    return round_to_e4m3(x, recipe.margin), round_to_e4m3(weight, recipe.margin)
