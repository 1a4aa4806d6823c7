"""KernelBench level-2 problems 33 and 39 (Gemm_Scale_BatchNorm) with this package: `ModelNew`,
the fused layer with KernelBench's `Model` constructor and state_dict; `check`, which compares
the two the way KernelBench's harness does, and `time_call`, which times one the way its evaluator
does. The problem files in examples/ are the drop-ins.
"""
import contextlib
import statistics

import torch

from .module import LinearScaleBatchNorm1d


class ModelNew(LinearScaleBatchNorm1d):
    """Model as one fused layer, with Model's constructor and state_dict keys. It draws its
    initial parameters from the RNG in Model's order, so under one seed the two start equal,
    which is how KernelBench's harness builds them."""

    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1):
        if tuple(scale_shape) != (out_features,):
            raise ValueError(f"ModelNew: scale_shape must be ({out_features},), got {tuple(scale_shape)}")
        super().__init__(in_features, out_features, eps=eps, momentum=momentum)


@contextlib.contextmanager
def without_tf32():
    """fp32 GEMMs with TF32 off, as KernelBench runs them; the flag as it was afterwards."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def check(problem, trials=5, seed=0):
    """Largest |Model - ModelNew| over `trials` calls of `problem` (a problem file's module), run as
    KernelBench does: both built under one seed, training mode under no_grad, fp32 with TF32 off,
    on the GPU when there is one. KernelBench passes when each call is allclose at 1e-4."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with without_tf32():
        models = []
        for cls in (problem.Model, problem.ModelNew):
            torch.manual_seed(seed)
            models.append(cls(*problem.get_init_inputs()).to(device))
        worst = 0.0
        with torch.no_grad():
            for _ in range(trials):
                x = [t.to(device) for t in problem.get_inputs()]
                worst = max(worst, (models[0](*x) - models[1](*x)).abs().max().item())
        return worst


def time_call(problem, cls, trials=100, warmup=3, seed=0):
    """ms a call of `cls` (problem.Model or problem.ModelNew), timed as KernelBench's evaluator
    times it: a fresh model from get_init_inputs() on the GPU, in training mode, under no_grad, fp32
    with TF32 off, on torch.rand inputs from get_inputs(); `warmup` calls, then `trials` calls, each
    between two CUDA events and followed by a synchronize. Returns the median and the list."""
    with without_tf32(), torch.no_grad():
        torch.manual_seed(seed)
        model = cls(*problem.get_init_inputs()).cuda()
        x = [t.cuda() for t in problem.get_inputs()]
        for _ in range(warmup):
            model(*x)
        torch.cuda.synchronize()
        times = []
        for _ in range(trials):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(*x)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times), times
