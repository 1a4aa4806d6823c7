"""Overrides of the plan's kernel choices, and the plan itself.

The plan (csrc/kernels/plan.h) is the one function that decides, for each call, which GEMM kernel
runs, in which tile order, whether the statistics come from the GEMM, which training tail and
which backward kernels run, and the workspace they need. `overrides()` replaces some of those
choices for the CUDA calls inside it; tests compare the choices' bits and `python -m
cutlass_fused.tune` times candidates this way. `plan()` shows what the plan chooses, on any
machine.

The environment variables CUTLASS_FUSED_KERNEL, _TAIL, _BACKWARD, _SWIZZLE, _RASTER, _STATS
(0: no statistics GEMM) and _POISON (1: every output starts as NaN, for tests) are read once, at
import, as the starting overrides; a bad value raises there. They are never read again.
"""
import contextlib
import dataclasses
import os
import threading

import torch

from .ops import ops


@dataclasses.dataclass(frozen=True)
class Overrides:
    kernel: str = "auto"      # a kernel table row (cutlass_fused.built_kernels()), taken where it serves
    tail: str = "auto"        # training tail: cooperative, slab or small
    backward: str = "auto"    # backward kernels: passes, slab or cooperative
    swizzle: int = 0          # sm90 tile order: 1, 2, 4 or 8 tiles across the raster; 0 the plan's
    raster: str = "auto"      # m or n; auto: CUTLASS's heuristic
    stats_gemm: bool = True   # False: training takes the eval GEMM and the tail's exact sums
    poison: bool = False      # every output starts as NaN (tests)

    def apply(self):
        ops.set_overrides(self.kernel, self.tail, self.backward, self.swizzle, self.raster, self.stats_gemm,
                          self.poison)


def _from_environment() -> Overrides:
    env = os.environ.get
    swizzle = env("CUTLASS_FUSED_SWIZZLE", "") or "0"
    if not swizzle.isdigit():
        raise ValueError(f"cutlass_fused: expected $CUTLASS_FUSED_SWIZZLE to be 1, 2, 4 or 8, but got {swizzle!r}")
    return Overrides(kernel=env("CUTLASS_FUSED_KERNEL", "") or "auto", tail=env("CUTLASS_FUSED_TAIL", "") or "auto",
                     backward=env("CUTLASS_FUSED_BACKWARD", "") or "auto", swizzle=int(swizzle),
                     raster=env("CUTLASS_FUSED_RASTER", "") or "auto",
                     stats_gemm=env("CUTLASS_FUSED_STATS", "1") != "0", poison=env("CUTLASS_FUSED_POISON") == "1")


# Process-wide, as the C++ side is: the autograd engine runs the backward on its own threads.
_lock = threading.Lock()
_current = _from_environment()
_current.apply()


def current() -> Overrides:
    return _current


@contextlib.contextmanager
def overrides(**choices):
    """Override plan choices inside the block, e.g. `with cutlass_fused.overrides(tail="slab"):`.

    Keys: kernel, tail, backward, swizzle, raster, stats_gemm, poison (see Overrides); None keeps
    the value in force. An unknown key or value raises ValueError naming the valid ones. The
    overrides are process-wide (every thread's CUDA calls see them) and are restored on exit.
    """
    global _current
    unknown = set(choices) - {f.name for f in dataclasses.fields(Overrides)}
    if unknown:
        raise ValueError(f"cutlass_fused: unknown override {sorted(unknown)[0]!r}; expected one of "
                         f"{[f.name for f in dataclasses.fields(Overrides)]}")
    with _lock:
        before = _current
        new = dataclasses.replace(before, **{k: v for k, v in choices.items() if v is not None})
        new.apply()  # checks every value first
        _current = new
    try:
        yield new
    finally:
        with _lock:
            before.apply()
            _current = before


def plan(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, mode: str = "train", *,
         family: str = "auto", capability: tuple = (9, 0), sm_count: int = 132, y_dtype: torch.dtype = None,
         allow_tf32: bool = None, cumulative: bool = False, aligned: bool = True, activation: str = "none",
         fp8: str = "none", output_dtype: torch.dtype = None, fold_kept: bool = False) -> dict:
    """What the plan chooses for one call, as a dict, with the overrides in force; on any device.

    mode: train, linear (the split ops' GEMM), eval, matmul, backward or backward_linear (k: the
    next Linear's out_features). m is the batch, n the features, k the input features. y_dtype: y's
    (or dy's) dtype, by default dtype (a wider one is the autocast case). allow_tf32: torch's
    current setting by default. aligned: the data's base pointers are 16-byte aligned (fresh
    allocations are). activation: the layer's (the backward's kernels depend on it). fp8: "e4m3" for
    the FP8 ops (x and W in e4m3, dtype bf16, h's), "e4m3_fast" for them under
    Float8Recipe(fast_accum=True). output_dtype: the ops' argument, the dtype y is asked in (by
    default y_dtype's). fold_kept: eval inside frozen_weights(), which keeps the call's eval fold.
    """
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    y_wider = y_dtype is not None and y_dtype != dtype
    text = ops.plan(mode, m, n, k, dtype, y_wider, allow_tf32, family, capability[0] * 10 + capability[1], sm_count,
                    cumulative, aligned, activation, fp8, output_dtype, fold_kept)
    out = {}
    for line in text.splitlines():
        key, value = line.split("=", 1)
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    for key in ("stats_gemm", "split", "remainder", "inf_fix", "eval_in_fp32", "fold_scale_apart", "fold_in_epilogue",
                "y_cast", "y_in_x", "act_in_epilogue"):
        out[key] = bool(out[key])
    return out
