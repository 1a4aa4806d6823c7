"""The sm90 tile order (the persistent scheduler's swizzle and raster direction, csrc/kernels/plan.cpp).

The order only decides which CTA computes which tile when: every tile's arithmetic, and the
statistics kernels' per-tile partial sums, are the same in any order, so each order must give
bitwise the outputs of CUTLASS's own order. The orders are forced through cutlass_fused.overrides(),
as python -m cutlass_fused.tune forces them.
"""
import pytest
import torch

import cutlass_fused
from common import CUDA, HOPPER, params, precision

needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm90 GPU (the tile order is the sm90 scheduler's)")

# An unaligned feature count and a partial batch tile; batch 3 fills a single row of tiles;
# 16384 x 8192 and 16384 x 4096 outputs, where the dispatcher itself takes swizzle 8 (bf16 by its
# rule, fp32 statistics by its table; plan.cpp).
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
def test_every_tile_order_gives_the_same_bits(shape, mode, training, override):
    mod, x = layer(shape, mode, training)
    with precision("cuda", "sm90", mode):
        want = forward(mod, x)
        for swizzle, raster in ORDERS:
            override(swizzle=int(swizzle), raster=raster or "auto")
            got = forward(mod, x)
            for a, b in zip(got, want):
                assert torch.equal(a, b), f"swizzle {swizzle}, raster {raster or 'CUTLASS'} changed the output"


@pytest.mark.parametrize("key,value,words", [("swizzle", 3, "expected swizzle to be 0 \\(auto\\), 1, 2, 4 or 8"),
                                             ("raster", "k", "expected raster to be 'auto', 'm' or 'n'")])
def test_a_bad_tile_order_is_refused_by_name(key, value, words):
    with pytest.raises(ValueError, match=words):
        with cutlass_fused.overrides(**{key: value}):
            pass


@pytest.mark.skipif(CUDA, reason="the CPU path has no tile order")
def test_the_cpu_path_ignores_the_tile_order(override):
    m, x = cutlass_fused.LinearScaleBatchNorm1d(32, 64), torch.randn(8, 32)
    want = forward(m, x)
    override(swizzle=2, raster="m")
    for a, b in zip(forward(m, x), want):
        assert torch.equal(a, b)
