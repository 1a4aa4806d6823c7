"""Shared test helpers: devices, kernel families, dtypes and the error rule."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cutlass_fused

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
HOPPER = CUDA and torch.cuda.get_device_capability() == (9, 0)

# (device, family): every kernel family this machine can run, plus the CPU path.
FAMILIES = [("cpu", "auto")]
if CUDA:
    FAMILIES.append(("cuda", "sm80"))
    if HOPPER:
        FAMILIES.append(("cuda", "sm90"))
FAMILY_IDS = [f"{d}-{f}" for d, f in FAMILIES]


def cuda_kernels(fn):
    """fn()'s result and the names of the CUDA kernels it ran (torch.profiler; the device
    synchronized before the profile ends, so that every launch is counted)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def skip_without_e4m3(device):
    """Skips a CUDA case where the e4m3 kernels cannot run (cutlass_fused.fp8.e4m3_kernels: an sm90
    GPU and a build with the e4m3 rows); the CPU always runs the e4m3 op's bf16 reference."""
    if device == "cuda" and not cutlass_fused.fp8.e4m3_kernels(torch.device("cuda")):
        pytest.skip("the e4m3 kernels: an sm90 GPU and a build with the e4m3 rows")


# Precision modes: (dtype, allow_tf32). fp32 is run both ways on CUDA.
MODES = {
    "bf16": (torch.bfloat16, False),
    "f16": (torch.float16, False),
    "f32": (torch.float32, False),
    "tf32": (torch.float32, True),
}

def modes_for(device):
    """The precision modes a device runs: the CPU path has no tf32, and its f16 is bf16's code."""
    return ["bf16", "f16", "f32", "tf32"] if device == "cuda" else ["bf16", "f32"]


def shape_cases(shapes):
    """(device, family, mode, (batch, in, out)) params for every family, mode and shape."""
    for (device, family), fid in zip(FAMILIES, FAMILY_IDS):
        for mode in modes_for(device):
            for shape in shapes:
                yield pytest.param(device, family, mode, shape, id=f"{fid}-{mode}-{'x'.join(map(str, shape))}")


# Below this batch, y end to end is dominated by the one column whose few
# values nearly coincide: any rounding of z (ours or PyTorch's) is amplified
# there ~1/spread, and which implementation wins is luck. There we check the
# two stages instead, each against float64: h = x W^T + b, and the batch norm
# of our h * scale.
END_TO_END_BATCH = 64


# Error floors on top of 2x PyTorch's own error (flash-attention's rule). They
# only matter where PyTorch happens to be exact; each is about one output
# rounding step of an O(1) normalized value in that precision.
FLOOR = {"bf16": 2e-2, "f16": 3e-3, "f32": 1e-5, "tf32": 2e-3}


@contextlib.contextmanager
def precision(device, family, mode):
    _, tf32 = MODES[mode]
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        with cutlass_fused.use_kernel_family(family):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def params(n_in, n_out, device, dtype, bias=True, affine=True, seed=0, param_dtype=torch.float32, scale=True):
    """Fresh random parameters of the seed model (parameters fp32 unless asked); scale=False: of
    the layer without a scale (p["scale"] is None)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    p = {
        "weight": (r(n_out, n_in) / n_in ** 0.5).to(device, dtype),
        "bias": r(n_out).to(device, param_dtype) if bias else None,
        "scale": r(n_out).to(device, param_dtype),
        "bn_weight": (1 + 0.1 * r(n_out)).to(device, param_dtype) if affine else None,
        "bn_bias": (0.1 * r(n_out)).to(device, param_dtype) if affine else None,
        "running_mean": (0.1 * r(n_out)).to(device, param_dtype),
        "running_var": (1 + 0.1 * r(n_out).abs()).to(device, param_dtype),
    }
    if not scale:  # drawn all the same, so that the other tensors are the scaled layer's
        p["scale"] = None
    return p


def tf32(t):
    """t with the low 13 mantissa bits dropped: what TF32 tensor cores read from fp32 operands."""
    return (t.float().contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def reference_h(x, p, dtype=None, mode=None):
    """x W^T + b as the unfused model computes it, in `dtype` (default: x's).

    For mode "tf32" the operands are rounded to TF32 first and the product runs
    in fp32: PyTorch's TF32 precision without depending on whether cuBLAS
    happens to pick a TF32 kernel for the shape (at batch 3 it does not).
    """
    dtype = dtype or x.dtype
    cast = lambda t: None if t is None else t.to(dtype)
    x, w = x.to(dtype), cast(p["weight"])
    if mode == "tf32":
        x, w = tf32(x), tf32(w)
    return F.linear(x, w, cast(p["bias"]))


def reference_z(x, p, dtype=None, mode=None):
    """(x W^T + b) * scale, the batch norm's input, as the unfused model computes it (h itself
    where p["scale"] is None: the layer without a scale)."""
    h = reference_h(x, p, dtype, mode)
    return h if p["scale"] is None else h * p["scale"].to(dtype or x.dtype)


def batch_norm(z, p, running, training, momentum=0.1, eps=1e-5):
    """F.batch_norm on z with p's affine parameters in z's dtype; returns y and the updated running stats."""
    cast = lambda t: None if t is None else t.to(z.device, z.dtype)
    rm, rv = (cast(t).clone() for t in running)
    y = F.batch_norm(z, rm, rv, cast(p["bn_weight"]), cast(p["bn_bias"]), training, momentum, eps)
    return y, rm, rv


def max_err(a, b):
    d = (a.double() - b.double()).abs()
    return d.max().item() if d.numel() else 0.0  # an empty batch (a rank without rows) has no error


def assert_close_rule(ours, torch_same, ref64, mode, what):
    """Our error against float64 is at most 2x PyTorch's same-precision error plus a floor."""
    assert torch.isfinite(ours).all(), f"{what}: non-finite values (unwritten output?)"
    e_ours, e_torch = max_err(ours, ref64), max_err(torch_same, ref64)
    bound = 2 * e_torch + FLOOR[mode]
    assert e_ours <= bound, f"{what}: error {e_ours:.3g} > 2 x torch's {e_torch:.3g} + {FLOOR[mode]:.0e}"
    return e_ours, e_torch


def assert_close_rule_scaled(ours, torch_same, ref64, mode, what):
    """assert_close_rule relative to the reference's size, for values that are not O(1):
    gradients (sums over a batch or features) and losses."""
    k = max(1.0, ref64.abs().max().item() if ref64.numel() else 0.0)
    return assert_close_rule(ours.cpu() / k, torch_same.cpu() / k, ref64.cpu() / k, mode, what)


class ScaledBlock(nn.Module):
    """Linear -> * scale -> BatchNorm1d -> act: the seed model's block, as fuse() finds it."""

    def __init__(self, n_in, n_out, act):
        super().__init__()
        self.gemm = nn.Linear(n_in, n_out)
        self.scale = nn.Parameter(torch.randn(n_out))
        self.bn = nn.BatchNorm1d(n_out)
        self.act = act

    def forward(self, x):
        return self.act(self.bn(self.gemm(x) * self.scale))
