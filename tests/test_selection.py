"""Kernel selection by problem size (csrc/kernels/plan.cpp), read off the profiler: the plan's choices
as the GPU runs them (tests/test_plan.py checks the same rules on the CPU)."""
import contextlib

import pytest
import torch

import cutlass_fused
from common import HOPPER, cuda_kernels


def launched(m, k, n, training=False, family=None, dtype=torch.bfloat16):
    """The names of the kernels one forward of the layer launches (after a warm-up call), on
    `family`, or the one in force."""
    layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, device="cuda", dtype=dtype).train(training)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    family_ctx = cutlass_fused.use_kernel_family(family) if family else contextlib.nullcontext()
    with torch.no_grad(), family_ctx:
        layer(x)
        torch.cuda.synchronize()
        return set(cuda_kernels(lambda: layer(x))[1])


def gemm_kernels(m, k, n, training=False, dtype="bf16"):
    """The sm90 GEMMs of `dtype` one forward launches."""
    names = launched(m, k, n, training, "sm90", {"bf16": torch.bfloat16, "f16": torch.float16}[dtype])
    return {name for name in names if f"sm90_{dtype}_" in name}


@pytest.mark.skipif(not HOPPER, reason="the sm90 family's tiles need a Hopper GPU")
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("shape,tile", [((4096, 1024, 8192), "256x128x64_c1x2x1"),
                                        ((256, 1024, 8192), "128x128x64_c1x2x1"),
                                        ((128, 1024, 512), "128x64x64_c1x2x1")])
def test_small_problems_take_smaller_tiles(shape, tile, dtype):
    names = gemm_kernels(*shape, dtype=dtype)
    assert len(names) == 1 and f"sm90_{dtype}_eval_{tile}" in next(iter(names)), names


# Training (bf16 and fp16 share the tiles): the statistics GEMM's default tile; its 128x128 tile
# (no cluster) where 128x256 fills less than half the SMs; the eval kernel (and the tail's own
# sums) where neither fills that many.
@pytest.mark.skipif(not HOPPER, reason="the sm90 family's tiles need a Hopper GPU")
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("shape,kernel", [((1024, 1024, 8192), "stats_128x256x64_c2x1x1"),
                                          ((256, 1024, 8192), "stats_128x128x64_c1x1x1"),
                                          ((128, 1024, 8192), "eval_128x64x64_c1x2x1")])
def test_training_gemm_by_batch(shape, kernel, dtype):
    names = gemm_kernels(*shape, training=True, dtype=dtype)
    assert len(names) == 1 and f"sm90_{dtype}_{kernel}" in next(iter(names)), names


# A shape plan.cpp's kTunedKernels names takes its measured kernel, and a neighbour the rule's.
@pytest.mark.skipif(not HOPPER, reason="the sm90 family's tiles need a Hopper GPU")
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("shape,kernel", [((1024, 8192, 8192), "stats_128x256x64_c1x1x1"),
                                          ((1024, 8192 - 64, 8192), "stats_128x256x64_c2x1x1"),
                                          ((512, 8192, 8192), "stats_128x256x64_c1x1x1"),
                                          ((512, 8192 - 64, 8192), "stats_128x256x64_c2x1x1")])
def test_tuned_kernel_by_shape(shape, kernel, dtype):
    names = gemm_kernels(*shape, training=True, dtype=dtype)
    assert len(names) == 1 and f"sm90_{dtype}_{kernel}" in next(iter(names)), names


# The eval entries: 256 x 8192^2 in bf16 takes the CTA pair along the batch, a neighbour the rule's
# 128x128 tile with the pair along the features, and fp16 (no such row) the rule's too; 512 rows in
# bf16 its entry's tile.
@pytest.mark.skipif(not HOPPER, reason="the sm90 family's tiles need a Hopper GPU")
@pytest.mark.parametrize("shape,dtype,kernel", [((256, 8192, 8192), "bf16", "eval_128x128x64_c2x1x1"),
                                                ((256, 8192, 8192 - 128), "bf16", "eval_128x128x64_c1x2x1"),
                                                ((256, 8192, 8192), "f16", "eval_128x128x64_c1x2x1"),
                                                ((512, 8192, 8192), "bf16", "eval_128x256x64_c1x1x1")])
def test_tuned_eval_kernel_by_shape(shape, dtype, kernel):
    names = gemm_kernels(*shape, dtype=dtype)
    assert len(names) == 1 and f"sm90_{dtype}_{kernel}" in next(iter(names)), names


# The launched kernel where slot_use replaces the default (test_plan's test_tiles_by_slot_use): the
# 192-wide tiles where the 256-wide ones pad the batch or leave a partial wave, in both modes and
# 16-bit dtypes; 640 x 8192^2 takes its entry's 128x128 tile, and its neighbour the rule's 128x192.
@pytest.mark.skipif(not HOPPER, reason="the sm90 family's tiles need a Hopper GPU")
@pytest.mark.parametrize("shape,training,dtype,kernel", [
    ((384, 8192, 8192), False, "bf16", "eval_128x192x64_c1x1x1"),
    ((384, 8192, 8192), True, "bf16", "stats_128x192x64_c1x1x1"),
    ((768, 1024, 8192), True, "bf16", "stats_128x192x64_c1x1x1"),
    ((1536, 1024, 4096), False, "bf16", "eval_128x192x64_c1x1x1"),
    ((384, 1024, 8192), True, "f16", "stats_128x192x64_c1x1x1"),
    ((768, 1024, 8192), False, "f16", "eval_128x192x64_c1x1x1"),
    ((640, 8192, 8192), True, "bf16", "stats_128x128x64_c1x1x1"),  # kTunedKernels
    ((640, 8192 - 64, 8192), True, "bf16", "stats_128x192x64_c1x1x1"),
    ((640, 8192, 8192), True, "f16", "stats_128x128x64_c1x1x1"),
    # 128 rows in 256-row tiles are half padding: 128x128.
    ((128, 1024, 12288), False, "bf16", "eval_128x128x64_c1x2x1"),
    ((128, 1024, 12288), True, "f16", "stats_128x128x64_c1x1x1")])
def test_tiles_by_slot_use_launched(shape, training, dtype, kernel):
    names = gemm_kernels(*shape, training=training, dtype=dtype)
    assert len(names) == 1 and f"sm90_{dtype}_{kernel}" in next(iter(names)), names


# The training tail by shape (csrc/kernels/plan.cpp, pick_tail): 16-bit h in registers at
# <= 128 rows, in a shared-memory slab of every row at 129-512 rows where slabs of 64-byte rows
# fill the GPU (8192 columns: 256 slabs of 32; 4096 columns would need 32-byte rows), the
# cooperative kernel for the rest.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape,tail", [((128, 256, 8192), "small"), ((256, 256, 8192), "slab"),
                                        ((512, 256, 8192), "slab"), ((1024, 256, 8192), "cooperative"),
                                        ((256, 256, 4096), "cooperative")])
def test_training_tail_by_shape(shape, tail):
    names = {name for name in launched(*shape, training=True) if "batch_norm_train" in name}
    kernel = {"small": "batch_norm_train_small_kernel", "slab": "batch_norm_train_slab_kernel",
              "cooperative": "batch_norm_train_kernel"}[tail]
    assert len(names) == 1 and kernel in next(iter(names)), names
