"""Training steps under DDP with SyncBatchNorm on 2 GPUs (issue 31, item 7): the step benchmark's MLP
(cutlass_fused.bench_step), each rank its own BATCH rows, the batch statistics the group's.

    python benchmarks/ddp_step.py [--case amp-bf16,4096,4096,4] [--rounds 3] [--out DIR] [--profile N]

Rows, each on a copy of one initial model wrapped in DistributedDataParallel:
  sync eager     nn.SyncBatchNorm.convert_sync_batchnorm(model)
  sync compile   torch.compile of that DDP model
  fused          cutlass_fused.fuse(model), then cutlass_fused.convert_sync_batchnorm
  fused+compile  torch.compile of that DDP model
Each line: rank 0's median ms per step (fixed_ms, the rows alternating over --rounds), its ratio to
the step's GEMMs alone as torch.mm runs them on one rank's rows (bench_step.GemmFloor, timed in the
same rounds: the floor without the collectives), the peak extra MiB of one step, the speedups, and
the loss parity against sync eager over the first PARITY_STEPS steps (the largest relative
difference). Writes ddp_step.json in the results schema.
--profile N: then N more steps of each row under torch.profiler on every rank (the collectives
need both), and rank 0 prints its ops of most GPU time and of most host time (self CPU), with the
wall time a step under the profiler. The profiler adds host time to every op: read the order.
"""
import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cutlass_fused
from cutlass_fused import bench_step, timing

WORLD = 2
ROWS = ("sync eager", "sync compile", "fused", "fused+compile")
PARITY_STEPS = 10


def build(name, base, device):
    model = copy.deepcopy(base)
    if name.startswith("fused"):
        model, report = cutlass_fused.fuse(model)
        model = cutlass_fused.convert_sync_batchnorm(model)
        assert len(report.fused) == sum(isinstance(m, cutlass_fused.LinearBatchNorm1d) for m in model.modules())
    else:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp = DDP(model.to(device), device_ids=[device.index])
    call = torch.compile(ddp) if name.endswith("compile") else ddp
    return call, torch.optim.AdamW(ddp.parameters(), fused=True)


def fixed_ms(fn):
    """The median ms of 15 calls after 3, each timed with CUDA events (timing.events_ms). A fixed
    count, not timing.median_ms's time budget: every rank must run the same collectives, or they
    deadlock."""
    return timing.events_ms(fn, warmup=3, calls=15)


def profiled(name, step, batch, n, rank):
    """n steps of one row under torch.profiler; rank 0 prints where its GPU and host time go."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t = time.perf_counter()
        for _ in range(n):
            step(*batch)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / n * 1e3
    if rank != 0:
        return
    print(f"== {name}: {wall:.3f} ms a step under the profiler ({n} steps, rank 0)")
    ops = p.key_averages()
    print(ops.table(sort_by="device_time_total", row_limit=15, max_name_column_width=70))
    print(ops.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))


def worker(rank, store, case, rounds, out, profile_steps=0):
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120), device_id=device)
    try:
        run_rows(rank, device, case, rounds, out, profile_steps)
    finally:
        dist.destroy_process_group()


def run_rows(rank, device, case, rounds, out, profile_steps=0):
    base = bench_step.mlp(case, device)
    amp = case.precision == "amp-bf16"

    def stepper(call, opt):
        def step(x, target):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = bench_step.loss_of(case, call, x, target)  # a simsiam case: its two views
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step

    # Each rank its own stream of batches (the batch statistics are the group's).
    data = [bench_step.batch(case, device, 1000 * rank + i) for i in range(PARITY_STEPS + 1)]
    steps, losses, floor = {}, {}, bench_step.GemmFloor(case, device)
    with bench_step.precision_flags(case.precision):
        for name in ROWS:
            steps[name] = stepper(*build(name, base, device))
            losses[name] = [steps[name](*data[i]).item() for i in range(PARITY_STEPS)]
        times = {name: [] for name in ROWS + (floor.name,)}
        for name in timing.alternating(list(ROWS) + [floor.name], rounds):
            times[name].append(fixed_ms(floor.run if name == floor.name else lambda: steps[name](*data[-1])))
        peaks = {name: timing.peak_extra_mib(lambda: steps[name](*data[-1])) for name in ROWS}
        if profile_steps:
            for name in ROWS:
                profiled(name, steps[name], data[-1], profile_steps, rank)
    if rank != 0:
        return
    ms = {name: statistics.median(t) for name, t in times.items()}
    mm = ms[floor.name]
    rows = [{"mode": "ddp-step", **case._asdict(), "world": WORLD, "impl": name, "ms": ms[name], "mm_ms": mm,
             "x_mm": ms[name] / mm, "peak_extra_mib": peaks[name], "vs_sync_eager": ms["sync eager"] / ms[name],
             "vs_sync_compile": ms["sync compile"] / ms[name],
             "loss_parity": max(abs(a - e) / abs(e) for a, e in zip(losses[name], losses["sync eager"]))}
            for name in ROWS]
    meta = {**timing.meta([], device), "command": "python " + " ".join(sys.argv)}
    result = {"mode": "ddp-step", "meta": meta, "parity_steps": PARITY_STEPS,
              "peak_extra_mib": bench_step.PEAK, "rows": rows}
    path = Path(out) / "ddp_step.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():  # an earlier case of this run
        result["rows"] = json.loads(path.read_text())["rows"] + rows
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{bench_step.label(case)}, {WORLD} GPUs, {case.batch} rows each; torch.mm floor {mm:.3f} ms:")
    for r in rows:
        print(f"  {r['impl']:14s} {r['ms']:7.3f} ms/step  {r['x_mm']:5.2f} x mm  peak {r['peak_extra_mib']:6.0f} MiB  "
              f"vs sync eager {r['vs_sync_eager']:.2f}  vs sync compile {r['vs_sync_compile']:.2f}  "
              f"loss parity {r['loss_parity']:.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", action="append", type=bench_step.parse_case)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then N steps of each row under torch.profiler; rank 0 prints its top ops")
    args = ap.parse_args()
    if torch.cuda.device_count() < WORLD:
        raise SystemExit(f"benchmarks/ddp_step.py: needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    for case in args.case or [bench_step.Case("amp-bf16", 4096, 4096, 4, "relu")]:
        with tempfile.TemporaryDirectory() as d:
            mp.start_processes(worker, args=(os.path.join(d, "store"), case, args.rounds, args.out, args.profile),
                               nprocs=WORLD, start_method="spawn")


if __name__ == "__main__":
    main()
