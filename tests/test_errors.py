"""Bad input gets PyTorch's words and names the argument."""
import pytest
import torch

import cutlass_fused
from common import needs_cuda


def args(m=4, k=6, n=5, **over):
    a = dict(x=torch.randn(m, k), weight=torch.randn(n, k), bias=torch.randn(n), scale=torch.randn(n),
             bn_weight=torch.ones(n), bn_bias=torch.zeros(n), running_mean=torch.zeros(n),
             running_var=torch.ones(n), training=True)
    a.update(over)
    return a


def test_batch_of_one_in_training():
    with pytest.raises(ValueError, match=r"Expected more than 1 value per channel when training, got input size"):
        cutlass_fused.linear_scale_batch_norm(**args(m=1))
    cutlass_fused.linear_scale_batch_norm(**args(m=1, training=False))  # eval takes a batch of one


@pytest.mark.parametrize("over,match", [
    (dict(x=torch.randn(4, 7)), "mat1 and mat2 shapes cannot be multiplied"),
    (dict(x=torch.randn(4, 6, 1)), "expected input to be 2-D"),
    (dict(scale=torch.randn(3)), r"expected scale to have shape \[5\]"),
    (dict(bias=torch.randn(6)), r"expected bias to have shape \[5\]"),
    (dict(weight=torch.randn(5, 6, dtype=torch.float64)), "same dtype"),
])
def test_bad_shapes(over, match):
    with pytest.raises(RuntimeError, match=match):
        cutlass_fused.linear_scale_batch_norm(**args(**over))


def test_eval_needs_running_stats():
    with pytest.raises(RuntimeError, match="running_mean must be defined in evaluation mode"):
        cutlass_fused.linear_scale_batch_norm(**args(training=False, running_mean=None, running_var=None))


def test_cumulative_momentum_needs_counter():
    with pytest.raises(ValueError, match="num_batches_tracked"):
        cutlass_fused.linear_scale_batch_norm(**args(), momentum=None)


def test_unknown_family():
    with pytest.raises(ValueError, match="kernel family"):
        with cutlass_fused.use_kernel_family("sm70"):
            pass


@needs_cuda
def test_mixed_devices():
    a = {k: v.cuda() if isinstance(v, torch.Tensor) and k != "scale" else v for k, v in args().items()}
    with pytest.raises(RuntimeError, match="expected scale to be on cuda"):
        cutlass_fused.linear_scale_batch_norm(**a)
