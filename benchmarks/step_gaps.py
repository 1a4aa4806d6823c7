"""Where a training step's GPU sits idle: the gaps between consecutive kernels of the step
benchmark's MLP (cutlass_fused.bench_step), from a torch.profiler trace, per row.

    python benchmarks/step_gaps.py [--case amp-bf16,4096,4096,4] [--row fused --row compile] [--top 12]

For each row, one profiled step at a time (TRACES of them, medians): the kernels' sum and the idle
time between them within the step (the span from its first kernel's start to its last one's end,
less the kernels; overlapping kernels count once), then the last trace's largest gaps with the
kernels on either side and the host ops that were running when the GPU went idle, which is what the
GPU waited for. The profiler adds host time to every op, so the gaps are upper bounds.
"""
import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from cutlass_fused import bench_step

TRACES = 3


def kernels_and_ops(row):
    row.step(row.x, row.target)
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            row.step(row.x, row.target)
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                     key=lambda e: e["ts"])
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    return kernels, ops


def host_ops_at(ops, t):
    """The innermost host ops running at time t (the shortest first)."""
    live = [o for o in ops if o["ts"] <= t <= o["ts"] + o["dur"]]
    return [o["name"] for o in sorted(live, key=lambda o: o["dur"])[:3]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", type=bench_step.parse_case, default=bench_step.Case("amp-bf16", 4096, 4096, 4, "relu"))
    ap.add_argument("--row", action="append", choices=bench_step.ROWS)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    device = torch.device("cuda")
    base = bench_step.mlp(args.case, device)
    reports = []
    for name in args.row or ["fused", "compile"]:
        with bench_step.precision_flags(args.case.precision):
            row = bench_step.Row(name, base, args.case, device, reports)
            traces = [kernels_and_ops(row) for _ in range(TRACES)]
        spans, busys, idles = [], [], []
        for kernels, ops in traces:
            busy, gaps, end = 0.0, [], None
            for i, k in enumerate(kernels):
                start, stop = k["ts"], k["ts"] + k["dur"]
                if end is not None and start > end:
                    gaps.append((start - end, kernels[i - 1]["name"], k["name"], end))
                busy += max(0.0, stop - max(start, end or start))
                end = stop if end is None else max(end, stop)
            spans.append(end - kernels[0]["ts"])
            busys.append(busy)
            idles.append(sum(g[0] for g in gaps))
        med = statistics.median
        print(f"== {name} {bench_step.label(args.case)}, {TRACES} traces of one step: first kernel to last "
              f"{med(spans):.1f} us, kernels {med(busys):.1f}, idle between them {med(idles):.1f} "
              f"({len(gaps)} gaps in the last)")
        for us, before, after, t in sorted(gaps, reverse=True)[:args.top]:
            print(f"  {us:7.1f} us after {before[:50]!r} before {after[:50]!r}; host in {host_ops_at(ops, t)}")
        row.opt.zero_grad(set_to_none=True)
        del row
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
