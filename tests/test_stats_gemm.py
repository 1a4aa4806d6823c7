"""The statistics GEMM (sm90 training in bf16, fp16, TF32 and 3xTF32; sm80 in bf16): h and
per-batch-tile sums of h and h^2 from one kernel (swapped operands on sm90), so that the training
tail reads h once (csrc/ops_cuda.cpp, stats_gemm).

16-bit and TF32 sums are fp32, so they are held against the exact path (CUTLASS_FUSED_STATS=0: our
fp64 pass over h) to fp32's accuracy, and the fallback against float64: a column whose mean dwarfs
its spread must take the exact pass, where fp32 sums would lose the variance entirely. fp32
without TF32 (3xTF32) sums in fp64, as the exact pass does, and is held to fp64's accuracy.
"""
import os

import pytest
import torch
import torch.nn.functional as F

import cutlass_fused
from codegen.kernels import KERNELS
from cutlass_fused.ops import ops
from common import HOPPER, cuda_kernels, params

needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm90 GPU (the statistics GEMM is sm90 only)")

# Big enough for the kernel's 128 x 256 tiles to fill half the GPU; 1000 leaves a partial batch
# tile (the zero-filled rows must not reach the sums), 5125 an unaligned feature count.
SHAPES = [(1000, 96, 5125), (16384, 64, 256), (4096, 512, 1024)]


# compute-sanitizer holds CUPTI, so the profiler sees no kernels under it: scripts/sanitize.sh
# sets this, and the tests then check only the numbers.
NO_PROFILER = bool(os.environ.get("CUTLASS_FUSED_NO_PROFILER"))


def train(x, p, override, stats, kernel="_stats_", family="sm90"):
    """The fused training forward, and whether a kernel whose name holds `kernel` ran
    (None where the profiler cannot tell)."""
    override(stats_gemm=stats)
    rm, rv = p["running_mean"].clone(), p["running_var"].clone()
    def run():
        return ops.linear_scale_batch_norm_train(x, p["weight"], p["bias"], p["scale"], p["bn_weight"], p["bn_bias"],
                                                 rm, rv, None, 0.1, 1e-5, family)

    if NO_PROFILER:
        return run(), rm, rv, None
    out, kernels = cuda_kernels(run)
    return out, rm, rv, any(kernel in k for k in kernels)


def column_moments(h):
    h = h.double()
    return h.mean(0), h.var(0, unbiased=False)


# Every statistics kernel of the table (the tuner's candidates), each forced in turn; the e4m3 rows
# serve the FP8 op, and test_fp8.test_each_e4m3_row forces them there.
STATS_KERNELS = [k.name for k in KERNELS if k.mode == "stats" and k.dtype != "e4m3"]


# bf16, fp16, fp32 with TF32 allowed, and fp32 without (3xTF32: f32x3 kernels).
DTYPES = ["bf16", "f16", "tf32", "f32"]

# Each path's statistics against float64 of its own h, relative to the spread: fp32 tile
# sums are good to ~1e-7 of the sum of squares, fp64 ones (and the exact pass) to ~1e-15.
STATS_TOL = {"bf16": 1e-5, "f16": 1e-5, "tf32": 1e-5, "f32": 1e-10}


def inputs(dtype, m, k, n, seed, monkeypatch, **kw):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", dtype == "tf32")
    dt = {"bf16": torch.bfloat16, "f16": torch.float16}.get(dtype, torch.float32)
    return params(k, n, "cuda", dt, seed=seed, **kw), torch.randn(m, k, device="cuda").to(dt)


def kernel_dtype(kernel):
    """The DTYPES entry a kernel of the table serves."""
    return {"f32x3": "f32"}.get(kernel.split("_")[1], kernel.split("_")[1])


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_stats_gemm_matches_exact_path(shape, dtype, monkeypatch, override):
    check_against_exact_path(shape, dtype, monkeypatch, override, "_stats_")


@needs_hopper
@pytest.mark.parametrize("dtype", ["bf16", "f16", "tf32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sm80_stats_gemm_matches_exact_path(shape, dtype, monkeypatch, override):
    """The sm80 family's statistics GEMM (run on Hopper): each CTA stores its own row of partial
    sums through CUTLASS's row reduction (csrc/kernels/gemm/sm80_stats.cuh); a partial batch tile
    (1000 rows) and unaligned features (5125) included."""
    if not any(k.startswith(f"sm80_{dtype}_stats_") for k in cutlass_fused.built_kernels()):
        pytest.skip("this build has no sm80 statistics kernel")
    check_against_exact_path(shape, dtype, monkeypatch, override, f"sm80_{dtype}_stats_", "sm80")


@needs_hopper
@pytest.mark.parametrize("kernel", STATS_KERNELS)
def test_each_stats_kernel(kernel, monkeypatch, override):
    if kernel not in cutlass_fused.built_kernels():
        pytest.skip(f"{kernel} is not in this build")
    override(kernel=kernel)
    # sm80's 256-row batch tiles: (4096, 512, 1024) fills half the GPU (16 x 8 CTAs), and 1000 rows
    # (4 x 41 CTAs at 5125 features) do too, with a partial batch tile.
    check_against_exact_path(SHAPES[0], kernel_dtype(kernel), monkeypatch, override, kernel, kernel.split("_")[0])


def check_against_exact_path(shape, dtype, monkeypatch, override, kernel, family="sm90"):
    m, k, n = shape
    p, x = inputs(dtype, m, k, n, m, monkeypatch)
    (y, h, stats, mean, invstd), rm, rv, used = train(x, p, override, True, kernel, family)
    (y0, h0, stats0, mean0, invstd0), rm0, rv0, used0 = train(x, p, override, False, "_stats_", family)
    assert NO_PROFILER or (used and not used0), f"{kernel} ran where it should not, or not where it should"
    # h: the same products, summed over K in another tile order: at most a rounding step apart.
    assert (h.float() - h0.float()).abs().max() <= 2 ** -7 * h0.float().abs().max()
    # The statistics against float64 of each path's own h.
    for hh, mu, istd in ((h, mean, invstd), (h0, mean0, invstd0)):
        ref_mean, ref_var = column_moments(hh)
        scale = p["scale"].double()
        ref_invstd = 1 / torch.sqrt(ref_var * scale * scale + 1e-5)
        spread = ref_var.sqrt() + 1e-30
        assert ((mu - ref_mean).abs() / spread).max() < STATS_TOL[dtype]
        assert ((istd - ref_invstd).abs() / ref_invstd).max() < STATS_TOL[dtype]
    # y: the paths' statistics differ far below a 16-bit h's rounding.
    assert (y.float() - y0.float()).abs().max() <= 2 ** -6 * max(1.0, y0.float().abs().max().item())
    for a, b in ((rm, rm0), (rv, rv0)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@needs_hopper
@pytest.mark.parametrize("dtype", DTYPES)
def test_stats_gemm_falls_back_where_fp32_loses_the_variance(dtype, monkeypatch, override):
    """Columns whose mean is ~100x their spread: fp32 sums of h^2 would keep ~7 bits of the
    variance, so those columns must take the exact pass (the others may keep the GEMM's sums).
    (Not 1000x for bf16: it would round h ~ 1000 to a constant, 8 apart, leaving no variance to
    test. fp32 without TF32, whose tile sums are fp64, takes 1000x, the README's robust case.)"""
    m, k, n = 4096, 256, 1024
    p, x = inputs(dtype, m, k, n, 7, monkeypatch)
    robust = torch.arange(0, n, 3, device="cuda")
    p["bias"][robust] = (1000 if dtype == "f32" else 100) * p["weight"].float().norm(dim=1)[robust]
    (y, h, stats, mean, invstd), _, _, used = train(x, p, override, True)
    assert NO_PROFILER or used
    ref_mean, ref_var = column_moments(h)
    var = stats[1] / m - (stats[0] / m) ** 2
    rel = ((var - ref_var).abs() / ref_var)
    assert rel[robust].max() < 1e-6, f"robust columns' variance off by {rel[robust].max():.3g}"
    assert rel.max() < 1e-4
    scale = p["scale"].double()
    ref_invstd = 1 / torch.sqrt(ref_var * scale * scale + 1e-5)
    assert ((invstd - ref_invstd).abs() / ref_invstd).max() < 1e-5


@needs_hopper
def test_stats_gemm_counts_the_batch_for_cumulative_momentum(monkeypatch, override):
    """momentum=None: the tail adds one to num_batches_tracked and every block reads it as
    1 / count. With the GEMM's sums it is counted before the first grid barrier (the second one
    is skipped when no column takes the exact pass), so check it against the exact path."""
    m, k, n = SHAPES[0]
    p, x = inputs("bf16", m, k, n, 11, monkeypatch)
    got = []
    for stats in (True, False):
        override(stats_gemm=stats)
        rm, rv = p["running_mean"].clone(), p["running_var"].clone()
        nbt = torch.tensor(3, device="cuda")
        ops.linear_scale_batch_norm_train(x, p["weight"], p["bias"], p["scale"], p["bn_weight"], p["bn_bias"],
                                          rm, rv, nbt, None, 1e-5, "sm90")
        got.append((nbt.item(), rm, rv))
    (c1, rm1, rv1), (c0, rm0, rv0) = got
    assert c1 == c0 == 4
    assert torch.allclose(rm1, rm0, rtol=1e-5, atol=1e-6) and torch.allclose(rv1, rv0, rtol=1e-5, atol=1e-6)
    # momentum 1/4: a quarter of the way from the old running mean to the batch mean.
    h = F.linear(x.float(), p["weight"].float(), p["bias"].float()).double()
    ref = 0.75 * p["running_mean"].double() + 0.25 * (h * p["scale"].double()).mean(0)
    assert (rm1.double() - ref).abs().max() < 1e-2


@needs_hopper
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32], ids=["f16-scale", "f32-scale"])
def test_stats_gemm_sees_fp16_overflow(scale_dtype, monkeypatch, override):
    """fp16 h with an fp16 scale: the unfused model rounds z = h * scale to fp16, so an element past
    65504 is inf and its column's mean and y are not finite (README's error table). The tile sums
    of h cannot show that: column 0 (h ~ N(0, 9), scale 1e4) overflows in ~3% of its rows and
    passes the mean^2 <= 64 var rule, so only the tail's bound sqrt(sum h^2) |scale| sends it to the
    exact pass. Column 2's h itself overflows (inf in the sums). With an fp32 scale z is fp32 and
    column 0 stays finite. Checked against float64 of the kernel's own h, as the unfused model's
    z would be."""
    m, k, n = SHAPES[0]
    p, x = inputs("f16", m, k, n, 5, monkeypatch, param_dtype=scale_dtype)
    g = torch.Generator().manual_seed(5)
    p["weight"][0] = (torch.randn(k, generator=g) * 3 / k ** 0.5).to(p["weight"])
    p["bias"][0], p["scale"][0], p["scale"][1] = 0, 1e4, 100
    p["weight"][2] = 0
    p["weight"][2, 0] = 3e4
    (y, h, stats, mean, invstd), _, _, used = train(x, p, override, True)
    assert NO_PROFILER or used
    h64 = h.double()
    if scale_dtype == torch.float16:  # as SumSquares: an overflowing z counts as an infinite h
        z = (h.float() * p["scale"].float()).half()
        h64 = torch.where(torch.isinf(z), torch.copysign(torch.full_like(h64, float("inf")), h64), h64)
    ref_mean = h64.mean(0)
    bad = ~torch.isfinite(ref_mean)
    assert bad[2] and bad[0] == (scale_dtype == torch.float16) and not bad[1]
    assert not bad[3:].any()
    for got in (mean, invstd, y.float().sum(0)):
        assert torch.equal(~torch.isfinite(got), bad)
    assert torch.equal(torch.isnan(mean), torch.isnan(ref_mean))
    assert torch.equal(torch.isinf(mean), torch.isinf(ref_mean))
    good = ~bad
    spread = h64[:, good].var(0, unbiased=False).sqrt()
    assert ((mean[good] - ref_mean[good]).abs() / spread).max() < STATS_TOL["f16"]
