"""cutlass_fused.linear_scale_batch_norm: BatchNorm1d((x @ W^T + b) [* scale]), fused; and the
training forward of linked layers (train_linked)."""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import _activation, _family
from .fp8 import operands as fp8_operands
from .frozen import may_cache
from .ops import ops


def unfused(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, training, momentum, eps,
            num_batches_tracked, activation, negative_slope, output_dtype):
    """The layer as the unfused model computes it, in PyTorch's own ops (F.linear, `* scale`,
    F.batch_norm as nn.BatchNorm1d calls it, the activation): for the inputs no kernel of ours
    takes, so that they get PyTorch's result or PyTorch's error. num_batches_tracked counts the
    call, and momentum=None is the cumulative average, as in nn.BatchNorm1d."""
    h = F.linear(x, weight, None if bias is None else bias.to(x.dtype))
    z = h if scale is None else h * scale
    if training and running_mean is not None and num_batches_tracked is not None:
        num_batches_tracked.add_(1)
    if momentum is None:  # nn.BatchNorm1d's factor, read on the host as it reads it
        momentum = 1.0 / float(num_batches_tracked) if training and num_batches_tracked is not None else 0.0
    y = F.batch_norm(z, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps)
    y = _activation.apply(y, activation, negative_slope)
    return y if output_dtype is None else y.to(output_dtype)


def linear_scale_batch_norm(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, training,
                            momentum=0.1, eps=1e-5, num_batches_tracked=None, activation=None, negative_slope=0.01,
                            output_dtype=None, fp8=None):
    """`F.batch_norm(F.linear(x, weight, bias) * scale, running_mean, running_var, bn_weight, bn_bias,
    training, momentum, eps)`, as one GEMM with a fused epilogue plus one normalize kernel; with
    scale=None, `F.batch_norm(F.linear(x, weight, bias), ...)`. x is 2-D (batch, in_features); any
    other x runs as those PyTorch ops run it, with their result or their error.

    `activation` (None, "relu", "leaky_relu" with `negative_slope`, "gelu", "gelu_tanh" or
    "silu") is applied to the batch norm's output in the same kernel; its backward recomputes
    what it needs from h. `output_dtype` (None: that of `h * scale`, as the unfused model
    computes it: h's without a scale) is y's dtype, rounded once from its value in h * scale's dtype.

    In training the running stats are updated in place, as are `num_batches_tracked`
    (+1) when given; `momentum=None` then means a cumulative average, momentum =
    1 / num_batches_tracked, as in nn.BatchNorm1d. In eval the batch norm folds
    into the GEMM's epilogue.

    `fp8` (None or a cutlass_fused.Float8Recipe with current scaling): x and weight rounded to e4m3
    under per-tensor scales before the GEMM (cutlass_fused/fp8.py; emulated: the e4m3 kernels are not
    built). Delayed scaling keeps an amax history between calls: the module holds it.
    """
    x, weight = fp8_operands(x, weight, fp8)
    family = _family.current()
    activation, negative_slope = _activation.check(activation, negative_slope)
    args = (x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, training)
    if x.dim() != 2:  # PyTorch's own result (a 3-D input's dim 1 as the channels) or its error
        return unfused(*args, momentum, eps, num_batches_tracked, activation, negative_slope, output_dtype)
    # F.batch_norm's checks, in its order and words; the size is the batch norm's input's.
    if training and x.shape[0] == 1:
        raise ValueError("Expected more than 1 value per channel when training, got input size "
                         f"{torch.Size([1, weight.shape[0]])}")
    if eps <= 0.0:
        # PyTorch's own check, in this version's words (torch 2.11 and 2.13 differ, and older
        # versions accept any eps): F.batch_norm on a 2 x 1 probe with the same eps.
        probe = torch.zeros(2, 1)
        F.batch_norm(probe, torch.zeros(1), torch.ones(1), training=training, eps=eps)
    if x.shape[0] == 0:
        # An empty batch as PyTorch runs it: an empty y, the running stats left alone, zero
        # gradients (nn.BatchNorm1d still counts the batch). No kernel has work to do, and no
        # cumulative momentum is read (there is nothing to average).
        return unfused(*args, 0.0 if momentum is None else momentum, eps, num_batches_tracked, activation,
                       negative_slope, output_dtype)
    if not training:
        if running_mean is None or running_var is None:
            raise RuntimeError("running_mean must be defined in evaluation mode")
        return ops.linear_scale_batch_norm_eval(x, weight, bias, scale, bn_weight, bn_bias, running_mean,
                                                running_var, eps, family,
                                                may_cache(weight, bias, scale, bn_weight, bn_bias, running_mean,
                                                          running_var), activation, negative_slope, output_dtype)
    if running_mean is None and running_var is None:
        num_batches_tracked = None  # as nn.BatchNorm1d: counted only where running stats are kept
    # One op updates the running stats and num_batches_tracked in place (on CUDA
    # in the same kernel that normalizes).
    y, _, _, _, _ = ops.linear_scale_batch_norm_train(
        x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
        None if momentum is None else float(momentum), eps, family,
        may_cache(weight, bias, scale, bn_weight, bn_bias, running_mean, running_var), activation, negative_slope,
        output_dtype)
    return y


_GRAD_RUNS = {}


def _grad_runs(index, family, dtype, activation):
    from .ops import ops
    key = (index, family, dtype, activation)
    if key not in _GRAD_RUNS:
        major, minor = torch.cuda.get_device_capability(index)
        _GRAD_RUNS[key] = ops.grad_runs(family, major * 10 + minor, dtype, activation)
    return _GRAD_RUNS[key]


# torch.compile calls it while tracing and keeps its answer, a constant for the device and the build.
_grad_runs = getattr(torch.compiler, "assume_constant_result", lambda f: f)(_grad_runs)


def links(x, activation):
    """Whether a training layer with x's device and h in x's dtype (the autocast dtype under
    autocast) and `activation` hands the next layer a Link: on CUDA where batch_norm_backward_linear
    has a grad kernel (the plan's answer, ops.grad_runs, asked once per device, family, dtype and
    activation), since elsewhere the linked backward is the unlinked one's ops with more host time
    (docs/decisions.md, "Backward": linked layers); on the CPU always, where the route's autograd
    runs on PyTorch's ops (tests)."""
    if x.device.type != "cuda":
        return True
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _grad_runs(index, _family.current(), dtype, activation)


class Link(NamedTuple):
    """What a linked layer hands the next one (train_linked): its y, then its h, statistics and the
    tensors whose gradients the next layer's backward gives, in the linked op's prev_* order
    (csrc/ops.cpp)."""
    y: torch.Tensor
    h: torch.Tensor
    mean: torch.Tensor
    invstd: torch.Tensor
    bias: Optional[torch.Tensor]
    scale: Optional[torch.Tensor]
    bn_weight: Optional[torch.Tensor]
    bn_bias: Optional[torch.Tensor]
    eps: float
    activation: str
    negative_slope: float


def train_linked(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, momentum, eps,
                 num_batches_tracked, activation, negative_slope, output_dtype, prev):
    """linear_scale_batch_norm's training forward for a layer whose y is the next layer's x alone
    (cutlass_fused.fuse links them): (y, this layer's Link). `prev`: the previous layer's Link, x
    being its y, or None. The backward of the next layer's call runs this layer's BN backward in
    its dX GEMM (docs/decisions.md, "Backward": linked layers). The caller checks that x is 2-D,
    has two rows or more and that eps > 0 (linear_scale_batch_norm's errors are the plain call's)."""
    activation, negative_slope = _activation.check(activation, negative_slope)
    _check_link(x, prev)
    if running_mean is None and running_var is None:
        num_batches_tracked = None  # as nn.BatchNorm1d: counted only where running stats are kept
    y, h, _, mean, invstd = ops.linear_scale_batch_norm_train_linked(
        x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
        None if momentum is None else float(momentum), eps, _family.current(),
        may_cache(weight, bias, scale, bn_weight, bn_bias, running_mean, running_var), activation, negative_slope,
        output_dtype, *(prev[1:] if prev is not None else ()))
    return y, Link(y, h, mean, invstd, bias, scale, bn_weight, bn_bias, eps, activation, negative_slope)


def _check_link(x, link):
    """A Link's backward is that of its y's only: x must be that y itself (the next layer's gradient
    reaches the layer before through its h, not through x)."""
    if link is not None and link.y is not x:
        raise ValueError("cutlass_fused: expected x to be the y of the layer whose Link is given (link.y), "
                         "but got another tensor")


def linear_after(x, link, linear):
    """linear(x) for an nn.Linear whose x is a linked layer's y, `link` that layer's Link (None: it
    had none): F.linear through the linear_linked op, whose backward runs that layer's BN backward in
    its dX GEMM, where autograd records the call and the Linear runs as a plain call would (no hooks,
    outside FSDP, which would unshard its parameters in its own call); else the Linear's own call."""
    module = torch.nn.modules.module
    hooks = (linear._forward_hooks or linear._forward_pre_hooks or linear._backward_hooks
             or linear._backward_pre_hooks or any(getattr(module, f"_global_{kind}_hooks", None) for kind in
                                                  ("forward", "forward_pre", "backward", "backward_pre")))
    if (link is None or hooks or getattr(linear, "_is_fsdp_managed_module", False) or not torch.is_grad_enabled()
            or x.dim() != 2):
        return linear(x)
    _check_link(x, link)
    return ops.linear_linked(x, linear.weight, linear.bias, *link[1:], _family.current())
