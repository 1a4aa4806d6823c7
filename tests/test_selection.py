"""Kernel selection by problem size (csrc/kernels/registry.cpp), read off the profiler."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import cutlass_fused
from common import HOPPER


def gemm_kernels(m, k, n, training=False):
    """The sm90 bf16 GEMMs one forward launches."""
    layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, device="cuda", dtype=torch.bfloat16).train(training)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), cutlass_fused.use_kernel_family("sm90"):
        layer(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            layer(x)
            torch.cuda.synchronize()
    return {e.name for e in prof.events() if "sm90_bf16_" in e.name}


@pytest.mark.skipif(not HOPPER, reason="the sm90 family's tiles need a Hopper GPU")
@pytest.mark.parametrize("shape,tile", [((4096, 1024, 8192), "256x128x64_c1x2x1"),
                                        ((256, 1024, 8192), "128x128x64_c1x2x1"),
                                        ((128, 1024, 512), "128x64x64_c1x2x1")])
def test_small_problems_take_smaller_tiles(shape, tile):
    names = gemm_kernels(*shape)
    assert len(names) == 1 and f"sm90_bf16_eval_{tile}" in next(iter(names)), names


# Training: the statistics GEMM's default tile; its 128x128 tile (no cluster) where 128x256 fills
# less than half the SMs; the eval kernel (and the tail's own sums) where neither fills that many.
@pytest.mark.skipif(not HOPPER, reason="the sm90 family's tiles need a Hopper GPU")
@pytest.mark.parametrize("shape,kernel", [((1024, 1024, 8192), "stats_128x256x64_c2x1x1"),
                                          ((256, 1024, 8192), "stats_128x128x64_c1x1x1"),
                                          ((128, 1024, 8192), "eval_128x64x64_c1x2x1")])
def test_training_gemm_by_batch(shape, kernel, monkeypatch):
    monkeypatch.delenv("CUTLASS_FUSED_STATS", raising=False)
    monkeypatch.delenv("CUTLASS_FUSED_KERNEL", raising=False)
    names = gemm_kernels(*shape, training=True)
    assert len(names) == 1 and f"sm90_bf16_{kernel}" in next(iter(names)), names
