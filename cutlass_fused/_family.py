"""Which CUTLASS kernel family the CUDA ops use.

"auto" picks sm90 on compute capability 9.0 and sm80 elsewhere (sm80-sm89,
and newer GPUs through its compute_80 PTX). "sm80" forces the Ampere family,
also on Hopper: that is how the Ampere kernels are tested without an Ampere
GPU. fp32 without TF32 is 3xTF32 in both: CUTLASS's in-kernel split on sm80,
operands split for the TF32 kernel on sm90.
"""
import contextlib
import os

FAMILIES = ("auto", "sm90", "sm80")
_override: list[str] = []


def _check(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"cutlass_fused: expected kernel family to be one of {FAMILIES}, but got {family!r}")
    return family


# Read once, at import (as the other overrides are: cutlass_fused/_overrides.py).
_from_environment = _check(os.environ.get("CUTLASS_FUSED_FAMILY", "") or "auto")


def current() -> str:
    """The family in force: the innermost use_kernel_family(), else $CUTLASS_FUSED_FAMILY at import, else "auto"."""
    if _override:
        return _override[-1]
    return _from_environment


@contextlib.contextmanager
def use_kernel_family(family: str):
    """Run the enclosed CUDA calls on one kernel family: `with use_kernel_family("sm80"): ...`."""
    _override.append(_check(family))
    try:
        yield
    finally:
        _override.pop()
