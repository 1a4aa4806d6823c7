"""How the benchmarks time, profile and record (the layer's rows, cutlass_fused.bench, and the
training steps', cutlass_fused.bench_step; the tuner and the scripts in benchmarks/ too)."""
import datetime
import gc
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import cutlass_fused
from cutlass_fused.graphs import on_side_stream


def alternating(items, rounds):
    """items in turn, `rounds` times over, the order reversed every other round, so that no item
    always runs first or last: the GPU's clocks drift as it heats, and small leads of one run did not
    repeat in the next (docs/decisions.md, "Measuring")."""
    for r in range(rounds):
        yield from (items if r % 2 == 0 else items[::-1])


def median_ms(fn, cuda):
    if not cuda:
        fn()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    try:
        from triton.testing import do_bench
        return do_bench(fn, warmup=50, rep=300, return_mode="median")
    except ImportError:
        return events_ms(fn)


def events_ms(fn, warmup=10, calls=50):
    """The median of `calls` CUDA-event timings of fn, after `warmup` calls: median_ms's timer where
    triton is missing."""
    for _ in range(warmup):
        fn()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    for a, b in zip(start, end):
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(start, end))


def host_us(fn, calls=20):
    """Host time to issue one call: few enough calls that the launch queue never blocks."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return us


def wall_us(fn, calls, warmup=0):
    """Wall time a call, µs: `calls` back-to-back calls after `warmup`, the GPU drained at both ends.
    Where the GPU finishes each kernel before the host issues the next (a small shape), that is the
    host's cost a call, the part a host-bound step pays; host_us counts the issue alone."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def peak_mib(fn, device=None):
    """(fn(), MiB its allocations peaked above what was live before it). Garbage is collected first:
    a collection inside fn (torch.cuda.graph makes one as it begins) could otherwise free it below
    the base and hide the peak."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, (torch.cuda.max_memory_allocated(device) - base) / 2**20


def peak_extra_mib(fn):
    fn()  # gradients and caches allocated once, as in a loop
    return peak_mib(fn)[1]


def profile(fn, calls=5, trace=None):
    """(GPU launches per call, {kernel name: µs per call}) from torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx
    fn()
    torch.cuda.synchronize()
    with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(str(trace))
    kernels = {}
    count = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count += 1
            us = getattr(e, "device_time", None)
            us = e.cuda_time if us is None else us
            kernels[e.name] = kernels.get(e.name, 0.0) + us / calls
    return count / calls, kernels


def graphed(fn, before=None):
    """fn captured once in a CUDA graph, after three warm-up calls on a side stream; returns the
    replay. `before` (not captured) runs ahead of each warm-up call and of the capture: a training
    step's zero_grad(set_to_none=True), so that the captured backward allocates its gradients."""
    def warm_up():
        for _ in range(3):
            if before is not None:
                before()
            fn()

    on_side_stream(warm_up, torch.cuda.current_device())
    if before is not None:
        before()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def guarded(impl, mode, shape, step, failed=None):
    """step(), or None where a baseline cannot run here (compile without a toolchain): reported,
    and appended to `failed` where given, not fatal. Ours always raises."""
    try:
        return step()
    except Exception as e:
        if impl.startswith("cutlass_fused"):
            raise
        error = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"cutlass_fused.bench: skipped {impl} {mode} {shape}: {error}", file=sys.stderr)
        if failed is not None:
            failed.append(error)
        return None


def meta(argv, device):
    try:
        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=Path(__file__).parent,
                                        timeout=10).stdout.strip()
        commit = git("rev-parse", "--short", "HEAD") or "unknown"
        if git("status", "--porcelain", "--untracked-files=no"):
            commit += "+dirty"  # the numbers are of a working tree that differs from that commit
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "version": cutlass_fused.__version__,
            "commit": commit, "date": datetime.date.today().isoformat(),
            "command": "python -m cutlass_fused.bench " + " ".join(argv)}
