"""torch.library.opcheck on every op, on every device."""
import pytest
import torch

import cutlass_fused  # noqa: F401
from cutlass_fused.ops import ops
from common import CUDA

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
DTYPES = [torch.float32, torch.bfloat16]


def samples(device, dtype, m=7, k=13, n=10):
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    v = lambda: torch.randn(n, device=device)
    return x, w, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_scale_stats(device, dtype, bias):
    x, w, v = samples(device, dtype)
    torch.library.opcheck(ops.linear_scale_stats, (x, w, v() if bias else None, v(), "auto", False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("running", ["none", "momentum", "cumulative"])
def test_batch_norm_finalize(device, dtype, running):
    x, w, v = samples(device, dtype)
    z, stats = ops.linear_scale_stats(x, w, v(), v(), "auto", False)
    rm, rv = (v(), v().abs() + 1) if running != "none" else (None, None)
    nbt = torch.tensor(3, device=device) if running == "cumulative" else None
    torch.library.opcheck(ops.batch_norm_finalize, (z, stats, x.shape[0], v(), v(), rm, rv, nbt, 0.1, 1e-5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_scale_batch_norm_eval(device, dtype):
    x, w, v = samples(device, dtype)
    torch.library.opcheck(ops.linear_scale_batch_norm_eval,
                          (x, w, v(), v(), v(), v(), v(), v().abs() + 1, 1e-5, "auto"))


def test_kernel_names_lists_only_built_kernels():
    names = cutlass_fused.built_kernels()
    assert all(n.startswith(("sm80_", "sm90_")) for n in names)
    if CUDA:
        assert any(n.startswith("sm80_") for n in names)
