"""The host's time a training step, by row: the step benchmark's MLP at a case small enough that
the GPU finishes each kernel before the host issues the next, so a step's wall time is the host's.

    python benchmarks/step_host.py [--case amp-bf16,256,1024,4] [--row fused --row fused-fp8] [--profile 30]

For each row: the wall time a step (best and median of 5 runs of 50 steps), the CUDA launches a step, and
with --profile N the N ops of most host time (self CPU, torch.profiler over 10 steps; the
profiler adds its own cost to every op, so read the order, not the sum). A row whose host time a
step exceeds its GPU time at a large case (benchmarks/step_busy.py) is host-bound there.
"""
import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cutlass_fused import bench_step

STEPS = 50


def wall_us(step):
    """(best, median) of 5 runs, us a step: this host's speed drifts between runs (the same code
    15% apart, H100), and the best run is the closest to the host's own cost."""
    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t) / STEPS * 1e6)
    return min(runs), statistics.median(runs)


def launches(step):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def host_ops(step, top):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="amp-bf16,256,1024,4")
    ap.add_argument("--row", action="append", choices=[r for r in bench_step.ALL_ROWS if not r.startswith("torchao")])
    ap.add_argument("--profile", type=int, default=0, help="list this many ops by host time")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_host.py times CUDA steps: no GPU here")
    case, device = bench_step.parse_case(args.case), torch.device("cuda")
    base = bench_step.mlp(case, device)
    for name in args.row or ["fused", "fused-fp8-delayed-e5m2"]:
        row = bench_step.Row(name, base, case, device, [1])  # a non-empty list: no fuse report
        step = lambda: row.step(row.x, row.target)  # noqa: E731
        best, median = wall_us(step)
        print(f"{bench_step.label(case)} {name}: {best:.1f} us a step (median {median:.1f}), {launches(step)} "
              "launches a step")
        if args.profile:
            host_ops(step, args.profile)
        del row
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
