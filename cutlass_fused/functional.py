"""cutlass_fused.linear_scale_batch_norm: BatchNorm1d((x @ W^T + b) * scale), fused."""
import torch

from . import _family
from .ops import ops


def linear_scale_batch_norm(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, training,
                            momentum=0.1, eps=1e-5, num_batches_tracked=None):
    """`F.batch_norm(F.linear(x, weight, bias) * scale, running_mean, running_var, bn_weight, bn_bias,
    training, momentum, eps)`, as one GEMM with a fused epilogue plus one normalize kernel.

    In training the running stats are updated in place, as are `num_batches_tracked`
    (+1) when given; `momentum=None` then means a cumulative average, momentum =
    1 / num_batches_tracked, as in nn.BatchNorm1d. In eval the batch norm folds
    into the GEMM's epilogue.
    """
    family = _family.current()
    if not training:
        if running_mean is None or running_var is None:
            raise RuntimeError("running_mean must be defined in evaluation mode")
        return ops.linear_scale_batch_norm_eval(x, weight, bias, scale, bn_weight, bn_bias, running_mean,
                                                running_var, eps, family)
    if x.dim() == 2 and x.shape[0] <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {x.shape}")
    if (running_mean is None) != (running_var is None):
        raise ValueError("cutlass_fused: running_mean and running_var must both be given or both be None")
    cumulative = None
    if running_mean is not None:
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        if momentum is None:
            if num_batches_tracked is None:
                raise ValueError("cutlass_fused: momentum=None (a cumulative average) needs num_batches_tracked")
            cumulative = num_batches_tracked
    y, _, stats, _, _ = ops.linear_scale_batch_norm_train(x, weight, bias, scale, bn_weight, bn_bias, eps, family,
                                                          torch.are_deterministic_algorithms_enabled())
    if running_mean is not None:
        ops.update_running_stats(stats, scale.detach(), x.shape[0], running_mean, running_var, cumulative,
                                 0.0 if momentum is None else float(momentum))
    return y
