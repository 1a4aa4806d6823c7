"""Where the step benchmark's GPU time goes: torch.profiler's kernels of one training step of the MLP
(cutlass_fused.bench_step), per row, in µs per step, largest first.

    python benchmarks/profile_mlp_step.py [--case amp-bf16,4096,4096,4] [--row fused --row compile] [--top 25]
        [--ops copy] [--memory]

--memory lists the allocations alive at one step's peak (torch.cuda.memory's history), largest
first, with the frames that made them: what the step's peak memory holds.
--ops NAME lists, after the kernels, the ATen ops whose name holds NAME (e.g. copy, to), by input
shapes, with their GPU time a step: which tensors a row's casts convert.

The last line of each row: the sum of its kernels' time against the step's wall time (timing.median_ms),
so that time outside kernels (launch gaps, the host) shows as their difference.
"""
import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from cutlass_fused import bench_step, timing

STEPS = 5


# Frames worth naming in an allocation's stack: ours, ATen's ops, autograd's nodes, autocast.
FRAME_KEYS = ("cutlass_fused", "at::native::", "Backward", "autocast", "AccumulateGrad", "bench_step")


def peak_allocations(row, top):
    """The allocations one step holds at its peak, largest first. Memory from before the step
    (weights, AdamW's states, the batch) is not in the history, so the sum is the step's extra, as
    timing.peak_extra_mib counts it."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        row.step(row.x, row.target)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live, total, peak, at_peak = {}, 0, 0, {}
    for e in snap["device_traces"][torch.cuda.current_device()]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    print(f"  memory: {peak / 2**20:.1f} MiB at the step's peak, in {len(at_peak)} allocations; the largest:")
    for e in sorted(at_peak.values(), key=lambda e: -e["size"])[:top]:
        names = [f["name"] for f in e.get("frames", []) if any(k in f["name"] or k in f["filename"] for k in FRAME_KEYS)]
        print(f"    {e['size'] / 2**20:8.1f} MiB  " + " < ".join(dict.fromkeys(n[:60] for n in names[:4])))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", type=bench_step.parse_case, default=bench_step.Case("amp-bf16", 4096, 4096, 4, "relu"))
    ap.add_argument("--row", action="append", choices=bench_step.ROWS)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--ops", help="also list the ATen ops whose name holds this, by input shapes")
    ap.add_argument("--memory", action="store_true", help="also list the allocations alive at a step's peak")
    args = ap.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    base = bench_step.mlp(args.case, device)
    with bench_step.precision_flags(args.case.precision):
        for name in args.row or ["fused", "compile"]:
            row = bench_step.Row(name, base, args.case, device, [])
            wall = timing.median_ms(lambda: row.step(row.x, row.target), True)
            torch.cuda.synchronize()
            acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.ops else [])
            with profile(activities=acts, record_shapes=bool(args.ops)) as prof:
                for _ in range(STEPS):
                    row.step(row.x, row.target)
                torch.cuda.synchronize()
            us = collections.Counter()
            count = collections.Counter()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    us[e.name] += e.device_time / STEPS
                    count[e.name] += 1
            print(f"== {name} {bench_step.label(args.case)}: kernels {sum(us.values()) / 1e3:.3f} ms a step, "
                  f"wall {wall:.3f} ms")
            for k, v in us.most_common(args.top):
                print(f"  {v:9.1f} us  x{count[k] // STEPS:<3d} {k[:110]}")
            if args.ops:
                ops = [a for a in prof.key_averages(group_by_input_shape=True)
                       if args.ops in a.key and a.device_time_total > 0]
                for a in sorted(ops, key=lambda a: -a.device_time_total)[:args.top]:
                    print(f"  op {a.device_time_total / STEPS:9.1f} us  x{a.count // STEPS:<3d} {a.key} "
                          f"{a.input_shapes}")
            if args.memory:
                peak_allocations(row, args.top)


if __name__ == "__main__":
    main()
