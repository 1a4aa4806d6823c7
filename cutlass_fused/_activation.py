"""The activation the layer applies after its BatchNorm: names, checks, and the torch ops that
apply it where no kernel of ours does (an empty batch)."""
import numbers

import torch.nn.functional as F

# The ops' `activation` argument (csrc/kernels/types.h, Activation), as PyTorch computes each.
_APPLY = {
    "none": lambda y, slope: y,
    "relu": lambda y, slope: F.relu(y),
    "leaky_relu": lambda y, slope: F.leaky_relu(y, slope),
    "gelu": lambda y, slope: F.gelu(y),
    "gelu_tanh": lambda y, slope: F.gelu(y, approximate="tanh"),
    "silu": lambda y, slope: F.silu(y),
}
NAMES = tuple(_APPLY)


def check(activation, negative_slope=0.01):
    """The op's activation name for `activation` (None is "none"), with a ValueError naming the
    valid ones for anything else, and the slope as a float."""
    name = "none" if activation is None else activation
    if name not in _APPLY:
        valid = ", ".join(repr(n) for n in NAMES[1:-1]) + f" or {NAMES[-1]!r}"
        raise ValueError(f"cutlass_fused: expected activation to be None, {valid}, but got {activation!r}")
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, numbers.Real):
        raise ValueError(f"cutlass_fused: expected negative_slope to be a real number, but got {negative_slope!r}")
    return name, float(negative_slope)


def apply(y, activation, negative_slope):
    return _APPLY[activation](y, negative_slope)
