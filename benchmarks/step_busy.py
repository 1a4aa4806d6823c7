"""Where a training step's time goes in steady state: the step benchmark's MLP
(cutlass_fused.bench_step) run back to back, as do_bench runs it, per row.

    python benchmarks/step_busy.py [--case amp-bf16,4096,4096,4] [--row fused --row compile] [--top 16]

For each row: whether a step makes a synchronizing call (torch's sync debug mode), its time under
do_bench (three times), then eight back-to-back steps under torch.profiler with CUDA activity only
(no host-side recording to slow the host): over the middle half of their kernels, the span a step,
the time the GPU was busy, the gaps, and the kernels by time; for a row with a +graph twin (eager,
fused, the FP8 rows), also that twin's replay (the step as one CUDA graph, AdamW capturable), which is
the GPU's time with no host in the way. benchmarks/step_gaps.py traces single steps from an idle
queue, which shows where the GPU waits on the host then; this shows whether it does once the queue
is full.
"""
import argparse
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from cutlass_fused import bench_step, timing

STEPS = 8


def syncs(step):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)]


def busy(step, top):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.elapsed_us() > 0), key=lambda e: e.time_range.start)
    if len(kernels) < 4 * STEPS:
        print(f"  the profiler saw {len(kernels)} GPU events")
        return
    middle = kernels[len(kernels) // 4: 3 * len(kernels) // 4]
    steps = len(middle) / (len(kernels) / STEPS)  # the middle half, in steps
    span = middle[-1].time_range.end - middle[0].time_range.start
    on, end, gaps = 0.0, middle[0].time_range.start, 0
    for e in middle:  # overlapping kernels count once
        start, stop = e.time_range.start, e.time_range.end
        gaps += start > end
        on += max(0.0, stop - max(start, end))
        end = max(end, stop)
    print(f"  back to back: {len(kernels) / STEPS:.0f} kernels a step; span {span / steps:.1f} us a step, busy "
          f"{on / steps:.1f}, gaps {(span - on) / steps:.1f} ({gaps / steps:.0f} of them)")
    by_name = {}
    for e in middle:
        t = by_name.setdefault(e.name[:90], [0.0, 0])
        t[0] += e.time_range.elapsed_us()
        t[1] += 1
    for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {us / steps:8.1f} us x{n / steps:4.1f}  {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="amp-bf16,4096,4096,4")
    ap.add_argument("--row", action="append", choices=[r for r in bench_step.ALL_ROWS if not r.startswith("torchao")])
    ap.add_argument("--top", type=int, default=16)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_busy.py times CUDA steps: no GPU here")
    case, device = bench_step.parse_case(args.case), torch.device("cuda")
    base = bench_step.mlp(case, device)
    for name in args.row or ["fused", "compile"]:
        row = bench_step.Row(name, base, case, device, [])
        step = lambda: row.step(row.x, row.target)  # noqa: E731
        found = syncs(step)
        print(f"{bench_step.label(case)} {name}: {len(found)} synchronizing calls a step {found[:2]}")
        times = [timing.median_ms(step, True) for _ in range(3)]
        print(f"  do_bench {' '.join(f'{t:.3f}' for t in times)} ms")
        busy(step, args.top)
        del row
        if name + "+graph" in bench_step.GRAPH_ROWS:  # the step's GPU time, no host in the way
            row = bench_step.Row(name + "+graph", base, case, device, [])
            print(f"  one CUDA graph of the step: {timing.median_ms(row.timed_step(), True):.3f} ms")
            del row
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
