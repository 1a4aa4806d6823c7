"""Host time and step timelines: what the host costs a call or a training step, and where a step's
GPU time goes or waits. One subcommand a question; all need a CUDA GPU.

    python benchmarks/host.py COMMAND [options]      (COMMAND --help for its options)

The step subcommands run the step benchmark's MLP (cutlass_fused.bench_step, `python -m
cutlass_fused.bench --step`) by its rows; host_overhead, layer_host and fp8_host time the layer and the ops
under it at a shape small enough that the GPU finishes each kernel before the host issues the next,
so the wall time a call is the host's (cutlass_fused.timing.wall_us).
"""
import collections
import copy
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import cutlass_fused
from _common import Commands, arg, case_arg, cuda_device, shape
from cutlass_fused import bench_step, timing
from cutlass_fused.fp8 import E4M3, E5M2, Float8Recipe
from cutlass_fused.ops import ops
from cutlass_fused.seed import SeedModel

ROWS = [r for r in bench_step.ALL_ROWS if not r.startswith("torchao")]
STEP_CASE = "amp-bf16,4096,4096,4"

cli = Commands(__doc__)


def row_arg(choices):
    return arg("--row", action="append", choices=choices, metavar="ROW",
               help=f"a step benchmark row; repeatable, default fused and compile. One of: {', '.join(choices)}")


def host_op_table(step, top):
    """The `top` ops of most host time (self CPU) over 10 steps: the profiler adds its own cost to
    every op, so read the order, not the sum."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


def launches(step):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@cli.command(
    case_arg("amp-bf16,256,1024,4"),
    arg("--row", action="append", choices=ROWS, metavar="ROW",
        help="a step benchmark row; repeatable, default fused and fused-fp8-delayed-e5m2. One of: "
             + ", ".join(ROWS)),
    arg("--profile", type=int, default=0, metavar="N", help="also list the N ops of most host time"))
def step_host(args):
    """The host's time a training step, by row.

    The step benchmark's MLP at a case small enough that the GPU finishes each kernel before the
    host issues the next, so a step's wall time is the host's. For each row: the wall time a step
    (best and median of 5 runs of 50 steps: this host's speed drifts between runs, the same code
    15% apart, and the best run is the closest to the host's own cost), the CUDA launches a step,
    and with --profile N the N ops of most host time (self CPU, torch.profiler over 10 steps; the
    profiler adds its own cost to every op, so read the order, not the sum). A row whose host time
    a step exceeds its GPU time at a large case (step_busy) is host-bound there.
    """
    device = cuda_device("step_host")
    base = bench_step.mlp(args.case, device)
    for name in args.row or ["fused", "fused-fp8-delayed-e5m2"]:
        row = bench_step.Row(name, base, args.case, device, [1])  # a non-empty list: no fuse report
        step = lambda: row.step(row.x, row.target)  # noqa: E731
        runs = [timing.wall_us(step, 50) for _ in range(5)]
        best, median = min(runs), statistics.median(runs)
        print(f"{bench_step.label(args.case)} {name}: {best:.1f} us a step (median {median:.1f}), {launches(step)} "
              "launches a step")
        if args.profile:
            host_op_table(step, args.profile)
        del row
        torch.cuda.empty_cache()


def profiled_events(fn, calls=1):
    """The chrome-trace events of `calls` calls of fn under torch.profiler (CPU and CUDA activity),
    after one call unprofiled, with the wall time a call under the profiler (µs)."""
    fn()
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / calls * 1e6
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"], wall


def kernels_and_ops(row):
    """One profiled step's kernels (by start) and host ops, from its chrome trace."""
    events, _ = profiled_events(lambda: row.step(row.x, row.target))
    kernels = sorted((e for e in events
                      if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                     key=lambda e: e["ts"])
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    return kernels, host


def host_ops_at(host, t):
    """The innermost host ops running at time t (the shortest first)."""
    live = [o for o in host if o["ts"] <= t <= o["ts"] + o["dur"]]
    return [o["name"] for o in sorted(live, key=lambda o: o["dur"])[:3]]


@cli.command(
    case_arg(STEP_CASE),
    row_arg(bench_step.ROWS),
    arg("--top", type=int, default=12, help="the largest gaps to list (default 12)"))
def step_gaps(args):
    """Where a training step's GPU sits idle: the gaps between consecutive kernels, per row.

    From torch.profiler traces of the step benchmark's MLP, one profiled step at a time from an idle
    queue (3 of them, medians): the kernels' sum and the idle time between them within the step (the
    span from its first kernel's start to its last one's end, less the kernels; overlapping kernels
    count once), then the last trace's largest gaps with the kernels on either side and the host
    ops that were running when the GPU went idle, which is what the GPU waited for. The profiler
    adds host time to every op, so the gaps are upper bounds. step_busy shows whether the GPU still
    waits once the queue is full.
    """
    device = cuda_device("step_gaps")
    base = bench_step.mlp(args.case, device)
    reports = []
    for name in args.row or ["fused", "compile"]:
        with bench_step.precision_flags(args.case.precision):
            row = bench_step.Row(name, base, args.case, device, reports)
            traces = [kernels_and_ops(row) for _ in range(3)]
        spans, busys, idles = [], [], []
        for kernels, host in traces:
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
        print(f"== {name} {bench_step.label(args.case)}, {len(traces)} traces of one step: first kernel to last "
              f"{med(spans):.1f} us, kernels {med(busys):.1f}, idle between them {med(idles):.1f} "
              f"({len(gaps)} gaps in the last)")
        for us, before, after, t in sorted(gaps, reverse=True)[:args.top]:
            print(f"  {us:7.1f} us after {before[:50]!r} before {after[:50]!r}; host in {host_ops_at(host, t)}")
        row.opt.zero_grad(set_to_none=True)
        del row
        torch.cuda.empty_cache()


def sync_calls(step):
    """The synchronizing calls one step makes (torch's sync debug mode)."""
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


def busy(step, top, steps=8):
    """`steps` back-to-back steps under torch.profiler, CUDA activity only (no host-side recording to
    slow the host); prints, over the middle half of their kernels, the span a step, the time the GPU
    was busy, the gaps, and the kernels by time."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.elapsed_us() > 0), key=lambda e: e.time_range.start)
    if len(kernels) < 4 * steps:
        print(f"  the profiler saw {len(kernels)} GPU events")
        return
    middle = kernels[len(kernels) // 4: 3 * len(kernels) // 4]
    in_steps = len(middle) / (len(kernels) / steps)  # the middle half, in steps
    span = middle[-1].time_range.end - middle[0].time_range.start
    on, end, gaps = 0.0, middle[0].time_range.start, 0
    for e in middle:  # overlapping kernels count once
        start, stop = e.time_range.start, e.time_range.end
        gaps += start > end
        on += max(0.0, stop - max(start, end))
        end = max(end, stop)
    print(f"  back to back: {len(kernels) / steps:.0f} kernels a step; span {span / in_steps:.1f} us a step, busy "
          f"{on / in_steps:.1f}, gaps {(span - on) / in_steps:.1f} ({gaps / in_steps:.0f} of them)")
    by_name = {}
    for e in middle:
        t = by_name.setdefault(e.name[:90], [0.0, 0])
        t[0] += e.time_range.elapsed_us()
        t[1] += 1
    for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {us / in_steps:8.1f} us x{n / in_steps:4.1f}  {name}")


@cli.command(
    case_arg(STEP_CASE),
    row_arg(ROWS),
    arg("--top", type=int, default=16, help="the kernels of most time to list (default 16)"))
def step_busy(args):
    """Where a training step's time goes in steady state, steps run back to back as do_bench runs them.

    For each row of the step benchmark's MLP: whether a step makes a synchronizing call (torch's
    sync debug mode), its time under do_bench (three times), then eight back-to-back steps under
    torch.profiler with CUDA activity only (no host-side recording to slow the host): over the
    middle half of their kernels, the span a step, the time the GPU was busy, the gaps, and the
    kernels by time; for a row with a +graph twin (eager, fused, the FP8 rows), also that twin's
    replay (the step as one CUDA graph, AdamW capturable), which is the GPU's time with no host in
    the way. step_gaps traces single steps from an idle queue, which shows where the GPU waits on
    the host then; this shows whether it does once the queue is full.
    """
    device = cuda_device("step_busy")
    base = bench_step.mlp(args.case, device)
    for name in args.row or ["fused", "compile"]:
        row = bench_step.Row(name, base, args.case, device, [])
        step = lambda: row.step(row.x, row.target)  # noqa: E731
        found = sync_calls(step)
        print(f"{bench_step.label(args.case)} {name}: {len(found)} synchronizing calls a step {found[:2]}")
        times = [timing.median_ms(step, True) for _ in range(3)]
        print(f"  do_bench {' '.join(f'{t:.3f}' for t in times)} ms")
        busy(step, args.top)
        del row
        if name + "+graph" in bench_step.GRAPH_ROWS:  # the step's GPU time, no host in the way
            row = bench_step.Row(name + "+graph", base, args.case, device, [])
            print(f"  one CUDA graph of the step: {timing.median_ms(lambda: row.step(row.x, row.target), True):.3f} ms")
            del row
        torch.cuda.empty_cache()


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
        names = [f["name"] for f in e.get("frames", [])
                 if any(k in f["name"] or k in f["filename"] for k in FRAME_KEYS)]
        print(f"    {e['size'] / 2**20:8.1f} MiB  " + " < ".join(dict.fromkeys(n[:60] for n in names[:4])))


@cli.command(
    case_arg(STEP_CASE),
    row_arg(bench_step.ROWS),
    arg("--top", type=int, default=25, help="the kernels (ops, allocations) to list (default 25)"),
    arg("--ops", metavar="NAME", help="also list the ATen ops whose name holds NAME (e.g. copy, to), by input shapes"),
    arg("--memory", action="store_true", help="also list the allocations alive at a step's peak"))
def profile_mlp_step(args):
    """Where the step benchmark's GPU time goes: the kernels of one training step, per row.

    torch.profiler's kernels of the MLP's step, in µs per step (over 5 steps), largest first. The
    first line of each row: the sum of its kernels' time against the step's wall time
    (timing.median_ms), so that time outside kernels (launch gaps, the host) shows as their
    difference.

    --memory lists the allocations alive at one step's peak (torch.cuda.memory's history), largest
    first, with the frames that made them: what the step's peak memory holds. --ops NAME lists,
    after the kernels, the ATen ops whose name holds NAME, by input shapes, with their GPU time a
    step: which tensors a row's casts convert.
    """
    cuda_device("profile_mlp_step")
    device = torch.device("cuda", torch.cuda.current_device())
    steps = 5
    base = bench_step.mlp(args.case, device)
    with bench_step.precision_flags(args.case.precision):
        for name in args.row or ["fused", "compile"]:
            row = bench_step.Row(name, base, args.case, device, [])
            wall = timing.median_ms(lambda: row.step(row.x, row.target), True)
            torch.cuda.synchronize()
            acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.ops else [])
            with profile(activities=acts, record_shapes=bool(args.ops)) as prof:
                for _ in range(steps):
                    row.step(row.x, row.target)
                torch.cuda.synchronize()
            us = collections.Counter()
            count = collections.Counter()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    us[e.name] += e.device_time / steps
                    count[e.name] += 1
            print(f"== {name} {bench_step.label(args.case)}: kernels {sum(us.values()) / 1e3:.3f} ms a step, "
                  f"wall {wall:.3f} ms")
            for k, v in us.most_common(args.top):
                print(f"  {v:9.1f} us  x{count[k] // steps:<3d} {k[:110]}")
            if args.ops:
                aten = [a for a in prof.key_averages(group_by_input_shape=True)
                        if args.ops in a.key and a.device_time_total > 0]
                for a in sorted(aten, key=lambda a: -a.device_time_total)[:args.top]:
                    print(f"  op {a.device_time_total / steps:9.1f} us  x{a.count // steps:<3d} {a.key} "
                          f"{a.input_shapes}")
            if args.memory:
                peak_allocations(row, args.top)


def best_us(fn):
    """Host µs a call, the best of 3 runs of 1000 calls: this host's speed drifts between runs."""
    return min(timing.wall_us(fn, 1000, warmup=200) for _ in range(3))


def ops_breakdown(m, k, n, dev, dt):
    """Host us a call of each layer under the module's forward (no grad), best of 3 runs."""
    mod = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=dev, dtype=dt)
    bn = mod.bn
    x = torch.randn(m, k, device=dev, dtype=dt)
    w, b, s = mod.gemm.weight.detach(), mod.gemm.bias.detach(), mod.scale.detach()
    train = (x, w, b, s, bn.weight.detach(), bn.bias.detach(), bn.running_mean, bn.running_var,
             bn.num_batches_tracked, 0.1, 1e-5, "auto", True)
    wt = w.t().contiguous()
    h, stats = ops.linear_stats(x, w, b, "auto")
    _, mean, invstd = ops.batch_norm_finalize(h, stats, s, m, bn.weight, bn.bias, 1e-5)
    w32, b32 = w.float(), b.float()
    rows = {
        "torch.mm": lambda: torch.mm(x, w.t()),
        "torch.empty": lambda: torch.empty(m, n, device=dev, dtype=dt),
        "ops.matmul": lambda: ops.matmul(x, wt, "auto"),
        "ops.linear_stats": lambda: ops.linear_stats(x, w, b, "auto"),
        "ops.batch_norm_finalize": lambda: ops.batch_norm_finalize(h, stats, s, m, bn.weight, bn.bias, 1e-5),
        "train op": lambda: ops.linear_scale_batch_norm_train(*train),
        "eval op": lambda: ops.linear_scale_batch_norm_eval(*train[:8], 1e-5, "auto", True),
        "batch_norm_backward": lambda: ops.batch_norm_backward(h, h, mean, invstd, s, bn.weight, 1e-5, bn.bias),
        "fp32 W.to, b.to": lambda: (w32.to(dt), b32.to(dt)),
        "cast_linear_inputs(W, b)": lambda: ops.cast_linear_inputs(x, w32, b32, dt),
        "module forward": lambda: mod(x),
    }
    print(f"host cost per call by layer, batch={m} in={k} out={n} bf16, no grad (us, best of 3)")
    with torch.no_grad():
        for name, fn in rows.items():
            print(f"  {name:24s} {best_us(fn):7.1f}")


@cli.command(
    arg("--shape", type=shape, default=(64, 256, 256), metavar="B,IN,OUT", help="default 64,256,256"),
    arg("--ops", action="store_true",
        help="also the layers below the module: the ops called directly, torch.mm, one allocation"))
def host_overhead(args):
    """Host (CPU) cost of one layer call and one training step, eager against fused.

    At a small shape the GPU finishes each kernel before the host issues the next, so wall time per
    step is the host's launch cost (2000 calls after 200). That cost is what a large shape's
    fwd+bwd pays when it is host-bound. --ops also times the layers below the module, best of 3
    runs.
    """
    dev, dt = cuda_device("host_overhead"), torch.bfloat16
    m, k, n = args.shape
    seed = SeedModel(k, n).to(dev, dt)
    ours = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=dev, dtype=dt)
    ours.load_state_dict(seed.state_dict())
    x = torch.randn(m, k, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=dt)
    print(f"host cost per call, batch={m} in={k} out={n} bf16 (us, wall / calls)")
    for name, mod in (("eager", seed), ("cutlass_fused", ours)):
        def fwd(mod=mod):
            with torch.no_grad():
                mod(x)

        def step(mod=mod):
            mod.zero_grad(set_to_none=True)
            x.grad = None
            mod(x).backward(dy)
        print(f"  {name:14s} train fwd {timing.wall_us(fwd, 2000, warmup=200):7.1f}   "
              f"train fwd+bwd {timing.wall_us(step, 2000, warmup=200):7.1f}")
    if args.ops:
        ops_breakdown(m, k, n, dev, dt)


LAYER_ROWS = ("torch.mm", "eager", "compile", "fused", "fused+compile")


def layer_models(model, m, k, n, dev, dt):
    """The rows' callables' modules: the unfused layer (the seed's Linear -> * scale -> BatchNorm1d,
    or the plain Linear -> BatchNorm1d -> ReLU), torch.compile of it, fuse() of it, and both."""
    torch.manual_seed(0)
    if model == "seed":
        base = SeedModel(k, n)
    else:
        base = torch.nn.Sequential(torch.nn.Linear(k, n), torch.nn.BatchNorm1d(n), torch.nn.ReLU())
    base = base.to(dev, dt)
    fused, report = cutlass_fused.fuse(copy.deepcopy(base))
    if len(report.fused) != 1:
        raise SystemExit(f"layer_host: fuse() fused {len(report.fused)} layers of the {model} layer, expected 1")
    return {"eager": base, "compile": torch.compile(copy.deepcopy(base)), "fused": fused,
            "fused+compile": torch.compile(copy.deepcopy(fused))}


def self_times(events):
    """Each host event's own time (its span less the spans of the events nested in it, on its
    thread), summed by name: cpu_ops, autograd's nodes and the CUDA runtime and driver calls."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation"):
            by_thread[e.get("tid")].append(e)
    own = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                own[stack[-1]["name"]] -= e["dur"]
            own[e["name"]] += e["dur"]
            stack.append(e)
    return own


def traced_self_times(fn, calls):
    """self_times of `calls` calls of fn under torch.profiler, µs a call, with the wall time a call
    under the profiler."""
    events, wall = profiled_events(fn, calls)
    return {k: v / calls for k, v in self_times(events).items()}, wall


@cli.command(
    arg("--shape", type=shape, default=(128, 1024, 512), metavar="B,IN,OUT",
        help="default 128,1024,512 (the layer benchmark's smallest shape)"),
    arg("--model", choices=("seed", "plain"), default="seed",
        help="seed: Linear -> * scale -> BatchNorm1d (the layer benchmark's); plain: Linear -> BatchNorm1d -> ReLU"),
    arg("--amp", action="store_true", help="fp32 parameters under bf16 autocast (else bf16 parameters)"),
    arg("--row", action="append", choices=LAYER_ROWS, metavar="ROW",
        help=f"repeatable, default all: {', '.join(LAYER_ROWS)}"),
    arg("--trace", type=int, default=0, metavar="N",
        help="also list, for each row's fwd+bwd, the N host events of most own time a call"))
def layer_host(args):
    """The host's time a layer call: eager PyTorch, torch.compile, ours, ours compiled, torch.mm.

    At a shape small enough that the GPU finishes each kernel before the host issues the next, the
    wall time a call is the host's cost (best of 3 runs of 1000 calls after 200; this host's speed
    drifts between runs). For each row: the training forward under no_grad (the layer benchmark's
    train mode), the forward with autograd recording, and forward + backward (x needing its
    gradient, as inside a model), with the CUDA launches of a fwd+bwd. torch.mm: one GEMM, its
    launch cost. --trace N: each host event's own time a fwd+bwd call (torch.profiler's cpu_ops,
    autograd nodes, CUDA runtime and driver calls, less what is nested in them), the N largest, and
    the wall time a call left outside every event (Python, mostly). The profiler adds its own cost
    to every event: read the order and the ratios, not the sum.
    """
    dev = cuda_device("layer_host")
    m, k, n = args.shape
    dt = torch.float32 if args.amp else torch.bfloat16
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp)
    models = layer_models(args.model, m, k, n, dev, dt)
    x = torch.randn(m, k, device=dev, dtype=dt)
    xg = x.clone().requires_grad_()
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16 if args.amp else dt)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    xb = x.to(torch.bfloat16)
    print(f"host us a call, {args.model} layer, batch={m} in={k} out={n} {'amp-bf16' if args.amp else 'bf16'} "
          "(best of 3 runs of 1000 calls)")
    for name in args.row or LAYER_ROWS:
        if name == "torch.mm":
            print(f"  {name:14s} mm {best_us(lambda: torch.mm(xb, w.t())):7.1f}")
            continue
        mod = models[name]
        mod.train()

        def no_grad(mod=mod):
            with torch.no_grad(), amp:
                mod(x)

        def fwd(mod=mod):
            with amp:
                mod(xg)

        def step(mod=mod):
            for p in mod.parameters():
                p.grad = None
            xg.grad = None
            with amp:
                y = mod(xg)
            y.backward(dy.to(y.dtype))

        print(f"  {name:14s} fwd (no grad) {best_us(no_grad):7.1f}   fwd {best_us(fwd):7.1f}   "
              f"fwd+bwd {best_us(step):7.1f}   {launches(step)} launches a fwd+bwd")
        if args.trace:
            own, wall = traced_self_times(step, 200)
            events = sum(own.values())
            print(f"    under the profiler: {wall:.1f} us a call, {events:.1f} in events, {wall - events:.1f} outside")
            for key, us in sorted(own.items(), key=lambda kv: -kv[1])[:args.trace]:
                print(f"    {us:7.1f}  {key[:100]}")


def fp8_layer_rows(m, k, n, dev):
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    recipes = {"bf16": None, "fp8": Float8Recipe(), "fp8-e5m2": Float8Recipe(backward="e5m2"),
               "fp8-delayed": Float8Recipe(scaling="delayed"),
               "fp8-delayed-e5m2": Float8Recipe(scaling="delayed", backward="e5m2")}
    print(f"the layer, batch={m} in={k} out={n} bf16 (us a call; relu)")
    for name, recipe in recipes.items():
        mod = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=dev, dtype=torch.bfloat16, activation="relu",
                                                   fp8=recipe)

        def fwd(mod=mod):
            mod(x)

        def step(mod=mod):
            mod.zero_grad(set_to_none=True)
            x.grad = None
            mod(x).backward(dy)

        with torch.no_grad():
            f0 = best_us(fwd)
        print(f"  {name:18s} fwd (no grad) {f0:7.1f}   fwd {best_us(fwd):7.1f}   fwd+bwd {best_us(step):7.1f}")


def fp8_reference_rows(m, k, n, dev):
    """What this host charges for torch's own layers: Linear alone, and the unfused block."""
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    mods = {"nn.Linear": torch.nn.Linear(k, n),
            "unfused block + relu": torch.nn.Sequential(SeedModel(k, n), torch.nn.ReLU())}
    for name, mod in mods.items():
        mod = mod.to(dev, torch.bfloat16)

        def step(mod=mod):
            mod.zero_grad(set_to_none=True)
            x.grad = None
            mod(x).backward(dy)

        print(f"  {name:18s} fwd+bwd {best_us(step):7.1f}")


def fp8_op_rows(m, k, n, dev):
    bf = torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=bf)
    w = torch.randn(n, k, device=dev, dtype=bf)
    dh = torch.randn(m, n, device=dev, dtype=bf)
    s = torch.ones(2, device=dev)
    hist = torch.zeros(16, 2, device=dev)
    b, sc = torch.randn(n, device=dev, dtype=bf), torch.randn(n, device=dev, dtype=bf)
    x8, x8_t, ax, s_x = ops.quantize_with_scale(x, s[0], E4M3, True)
    w8, w8_t, aw, s_w = ops.quantize_with_scale(w, s[1], E4M3, True)
    g8, g8_t, s_g = ops.quantize_transposed(dh, E5M2, 0, False)
    inv = s_g.reciprocal()
    h = torch.randn(m, n, device=dev, dtype=bf)
    mean, invstd = torch.zeros(n, device=dev), torch.ones(n, device=dev)
    rows = {
        "torch.empty": lambda: torch.empty(m, n, device=dev, dtype=bf),
        "torch.mm": lambda: torch.mm(x, w.t()),
        "tensor.reciprocal (0-dim)": lambda: s_g.reciprocal(),
        "quantize_with_scale": lambda: ops.quantize_with_scale(x, s[0], E4M3, False),
        "quantize_with_scale, transposed": lambda: ops.quantize_with_scale(x, s[0], E4M3, True),
        "quantize_e4m3": lambda: ops.quantize_e4m3(x, 0, False),
        "quantize_transposed e5m2": lambda: ops.quantize_transposed(dh, E5M2, 0, False),
        "fp8_record": lambda: ops.fp8_record(hist, s, ax, aw, 0, "max"),
        "fp8_operand_scales": lambda: ops.fp8_operand_scales(s_x, s_w, b, sc),
        "torch._scaled_mm (dX)": lambda: torch._scaled_mm(g8, w8_t.t(), inv, s_x, out_dtype=bf),
        "torch._scaled_mm (dW)": lambda: torch._scaled_mm(g8_t, x8_t.t(), inv, s_w, out_dtype=bf),
        "batch_norm_backward, relu": lambda: ops.batch_norm_backward(dh, h, mean, invstd, sc, b, 1e-5, b, "relu"),
        "scalars: 1/s, d*0, d/(s s)": lambda: (s_g.reciprocal(), sc * 0, sc / (s_x * s_w)),
    }
    if hasattr(ops, "fp8_backward_scales"):  # a build before it has the torch ops above only
        rows["fp8_backward_scales"] = lambda: ops.fp8_backward_scales(sc, s_x, s_w, s_g, bf, bf)
    print(f"the ops, batch={m} in={k} out={n} (us a call, no grad)")
    with torch.no_grad():
        for name, fn in rows.items():
            print(f"  {name:34s} {best_us(fn):7.1f}")


@cli.command(arg("--shape", type=shape, default=(256, 1024, 1024), metavar="B,IN,OUT", help="default 256,1024,1024"))
def fp8_host(args):
    """Host (CPU) cost of the FP8 layer and of each op under it, against the bf16 layer.

    At a small shape the GPU finishes each kernel before the host issues the next, so the wall time
    a call is the host's cost (best of 3 runs of 1000 calls): what a large shape pays where it is
    host-bound (the e4m3 training step, step_busy). No profiler: it adds its own cost to every op.
    """
    dev = cuda_device("fp8_host")
    m, k, n = args.shape
    fp8_layer_rows(m, k, n, dev)
    fp8_reference_rows(m, k, n, dev)
    fp8_op_rows(m, k, n, dev)


if __name__ == "__main__":
    sys.exit(cli.main())
