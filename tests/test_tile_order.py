"""The sm90 tile order (the persistent scheduler's swizzle and raster direction) and the stream-K
scheduler's twins of the default kernels (csrc/kernels/registry.cpp).

The order only decides which CTA computes which tile when: every tile's arithmetic, and the
statistics kernels' per-tile partial sums, are the same in any order, so each order must give
bitwise the outputs of CUTLASS's own order. The orders are forced through the environment, as
python -m cutlass_fused.tune forces them.
"""
import pytest
import torch

import cutlass_fused
from codegen.kernels import KERNELS
from common import CUDA, HOPPER, needs_cuda, params, precision

needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm90 GPU (the tile order is the sm90 scheduler's)")

# An unaligned feature count and a partial batch tile; batch 3 fills a single row of tiles;
# 16384 x 8192 and 16384 x 4096 outputs, where the dispatcher itself takes swizzle 8 (bf16 by its
# rule, fp32 statistics by its table; registry.cpp).
SHAPES = [(1000, 96, 5125), (3, 64, 769), (4096, 256, 1024), (16384, 64, 8192), (16384, 32, 4096)]
ORDERS = [("1", ""), ("2", "m"), ("8", "n"), ("4", ""), ("1", "m")]


def layer(shape, mode, training):
    m, k, n = shape
    dtype = torch.float32 if mode in ("f32", "tf32") else torch.bfloat16
    p = params(k, n, "cuda", dtype, seed=m + n)
    mod = cutlass_fused.LinearScaleBatchNorm1d(k, n, device="cuda", dtype=dtype)
    with torch.no_grad():
        mod.gemm.weight.copy_(p["weight"])
        mod.gemm.bias.copy_(p["bias"])
        mod.scale.copy_(p["scale"])
    mod.train(training)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(m))
    return mod, x


def forward(mod, x):
    state = {k: v.clone() for k, v in mod.state_dict().items()}
    with torch.no_grad():
        y = mod(x)
    out = [y] + [b.clone() for b in mod.buffers()]
    mod.load_state_dict(state)  # the next order starts from the same running statistics
    return out


@needs_hopper
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mode", ["bf16", "f32", "tf32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_tile_order_gives_the_same_bits(shape, mode, training, monkeypatch):
    mod, x = layer(shape, mode, training)
    with precision("cuda", "sm90", mode):
        want = forward(mod, x)
        for swizzle, raster in ORDERS:
            monkeypatch.setenv("CUTLASS_FUSED_SWIZZLE", swizzle)
            monkeypatch.setenv("CUTLASS_FUSED_RASTER", raster)
            got = forward(mod, x)
            for a, b in zip(got, want):
                assert torch.equal(a, b), f"swizzle {swizzle}, raster {raster or 'CUTLASS'} changed the output"


# Stream-K splits tiles along K only past 8 k-tiles a tile (CUTLASS's minimum), so K is 1024 here.
# 2300 x 4096: 288 tiles of 256 x 128 (eval) or 128 x 256 (statistics) on 132 SMs, 24 in the last
# wave, where the dispatcher takes the twin itself (the first 132 tiles data-parallel, 156 split);
# 1000 x 3973 (unaligned): 128 tiles, one partial wave, all of it split when the twin is forced.
STREAMK_SHAPES = [(2300, 1024, 4096), (1000, 1024, 3973)]


def kernels_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


# The stream-K twins of the table, and the layer mode each serves.
TWINS = [(k.name, k.dtype, k.mode == "stats") for k in KERNELS if k.streamk]


@needs_hopper
@pytest.mark.parametrize("kernel,mode,training", TWINS, ids=[t[0] for t in TWINS])
@pytest.mark.parametrize("shape", STREAMK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_stream_k_matches_data_parallel(shape, kernel, mode, training, monkeypatch):
    """The stream-K twin sums a split tile's K range in pieces, so h may differ from the
    data-parallel kernel's by a rounding step; y, normalized by statistics of its own h, and the
    running statistics are held to the same."""
    if kernel not in cutlass_fused.built_kernels():
        pytest.skip(f"{kernel} is not in this build")
    mod, x = layer(shape, mode, training)
    with precision("cuda", "sm90", mode):
        monkeypatch.setenv("CUTLASS_FUSED_STREAMK", "0")
        want, names = kernels_run(lambda: forward(mod, x))
        assert not any("_sk::" in n for n in names), names
        monkeypatch.setenv("CUTLASS_FUSED_STREAMK", "1")
        got, names = kernels_run(lambda: forward(mod, x))
    assert any(f"{kernel}::" in n for n in names), f"{kernel} did not run: {names}"
    # One bf16 / TF32 rounding of an O(1) output.
    tol = 2 ** -7 if mode == "bf16" else 2 ** -10
    for a, b in zip(got, want):
        if a.is_floating_point():
            assert (a.float() - b.float()).abs().max() <= tol * max(1.0, b.float().abs().max().item())
        else:
            assert torch.equal(a, b)


@needs_hopper
def test_the_dispatcher_takes_stream_k_for_a_partial_last_wave(monkeypatch):
    """2300 x 4096 (24 tiles in the third wave) takes the twin; 4096 x 4096 (512 tiles, the last
    wave 116 of 132) keeps the data-parallel kernel; bf16 training (the statistics GEMM)."""
    if torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count != 132:
        pytest.skip("the wave counts are worked out for 132 SMs")
    monkeypatch.delenv("CUTLASS_FUSED_STREAMK", raising=False)
    for (m, n), sk in (((2300, 4096), True), ((4096, 4096), False)):
        mod, x = layer((m, 1024, n), "bf16", True)
        _, names = kernels_run(lambda: forward(mod, x))
        assert any("stats_128x256x64_c2x1x1_sk" in k for k in names) == sk, (m, n, names)


@needs_cuda
@pytest.mark.parametrize("var,value", [("CUTLASS_FUSED_SWIZZLE", "3"), ("CUTLASS_FUSED_RASTER", "k"),
                                       ("CUTLASS_FUSED_STREAMK", "yes")])
def test_a_bad_tile_order_is_refused_by_name(var, value, monkeypatch):
    mod, x = layer((8, 32, 64), "bf16", False)
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"expected \\${var} to be"):
        with torch.no_grad():
            mod(x)


@pytest.mark.skipif(CUDA, reason="the CPU path has no tile order")
def test_the_cpu_path_ignores_the_tile_order(monkeypatch):
    m, x = cutlass_fused.LinearScaleBatchNorm1d(32, 64), torch.randn(8, 32)
    want = forward(m, x)
    monkeypatch.setenv("CUTLASS_FUSED_SWIZZLE", "3")
    for a, b in zip(forward(m, x), want):
        assert torch.equal(a, b)
