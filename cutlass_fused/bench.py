"""python -m cutlass_fused.bench: the layer against cuBLAS (torch.mm), eager PyTorch and torch.compile.

    python -m cutlass_fused.bench [--shape B,IN,OUT ...] [--dtype bf16|f16|tf32|f32]
        [--mode train|eval|fwdbwd ...] [--family auto|sm90|sm80] [--impl NAME ...]
        [--graphs] [--sweep] [--profile] [--rounds N] [--out DIR]
    python -m cutlass_fused.bench --step [--step-case PRECISION,BATCH,WIDTH,BLOCKS[,ACTIVATION] ...]
        [--rounds N] [--out DIR]                               # whole training steps (bench_step.py)
    python -m cutlass_fused.bench --report DIR/results.json     # the README's markdown table

Every time is the median of triton.testing.do_bench (CUDA events where triton is
missing) after warm-up, and every ratio is to torch.mm of the same shape and
precision (fwdbwd: to three torch.mm). A GPU's clocks drift as it heats over a
run, so a mode's rows are timed in --rounds across the implementations, torch.mm
before each, and every ratio is to the median of all of the shape's torch.mm
times. Without a GPU it checks the layer against float64, times it against
eager on the CPU, and exits 0. The default run (no --shape, --sweep, --dtype, --mode,
--impl or --autocast) then times whole training steps too (step.json, step.png).
"""
import argparse
import contextlib
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

import cutlass_fused
from cutlass_fused import bench_rows, bench_step, report, timing
from cutlass_fused.seed import SeedModel

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "tf32": torch.float32, "f32": torch.float32}
SHAPES = [(128, 1024, 512), (1024, 8192, 8192), (16384, 4096, 4096), (4096, 4096, 4096)]
SWEEP = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
MODES = ("train", "eval", "fwdbwd")
IMPLS = ("torch.mm", "eager", "compile", "compile-max-autotune", "cutlass_fused", "cutlass_fused-frozen",
         "cutlass_fused-noscale",
         "cutlass_fused-fp8", "cutlass_fused-fp8-e5m2", "cutlass_fused-fp8-delayed", "cutlass_fused-fp8-delayed-e5m2",
         "cutlass_fused-fp8-delayed-fast", "cutlass_fused-fp8-delayed-e5m2-fast", "torchao-float8",
         "torchao-float8+compile")
# cutlass_fused-frozen: ours inside cutlass_fused.frozen_weights() (the eval fold and fp32's weight
# split kept between calls), on a copy of the layer of its own; the torchao rows: the unfused model
# with torchao's float8 training of its Linear (issue 33's anchor; torchao is not a dependency).
# cutlass_fused-fp8: ours with Float8Recipe() (the e4m3 kernels, issue 33); cutlass_fused-fp8-e5m2:
# with Float8Recipe(backward="e5m2") (FP8 dX and dW GEMMs too); -delayed: with scaling="delayed" (x
# and W cast under the scales of the calls before, one pass each); -fast: with fast_accum=True (the
# forward's GEMMs accumulate in the tensor cores alone). cutlass_fused-noscale: LinearBatchNorm1d over
# ours's Linear and BatchNorm1d (the layer without a scale, on the same weights). Asked for by --impl only.
DEFAULT_IMPLS = IMPLS[:5]
GEMMS = {"train": 1, "eval": 1, "fwdbwd": 3}
# Error floor of the correctness check: one output rounding step of an O(1) value.
FLOOR = {"bf16": 2e-2, "f16": 3e-3, "tf32": 2e-3, "f32": 1e-5}


class Case:
    """One shape and precision: the models, the inputs and a callable per (impl, mode)."""

    def __init__(self, shape, dtype_name, device, autocast=None, frozen=False):
        m, k, n = shape
        self.shape, self.dtype_name, self.device = shape, dtype_name, device
        # Under autocast the models and inputs stay fp32, as in a mixed-precision training loop.
        self.autocast = autocast
        self.label = f"{dtype_name}-autocast" if autocast else dtype_name  # the rows' "dtype"
        dt = torch.float32 if autocast else DTYPES[dtype_name]
        torch.manual_seed(0)
        self.seed = SeedModel(k, n).to(device, dt)
        self.ours = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=device, dtype=dt)
        self.ours.load_state_dict(self.seed.state_dict())
        # For cutlass_fused-frozen: a copy of ours, frozen for the case's lifetime (close() leaves
        # the scope), since a scope per call would drop what it keeps at every exit.
        self.frozen, self.scope = None, contextlib.ExitStack()
        if frozen:
            self.frozen = copy.deepcopy(self.ours)
            self.scope.enter_context(cutlass_fused.frozen_weights(self.frozen))
        self.x = torch.randn(m, k, device=device, dtype=dt)
        self.xg = self.x.clone().requires_grad_()
        self.dy = torch.randn(m, n, device=device, dtype=dt)
        self.compiled = {}

    def model(self, impl):
        if impl == "eager":
            return self.seed
        if impl == "cutlass_fused":
            return self.ours
        if impl == "cutlass_fused-frozen":
            return self.frozen
        if impl == "cutlass_fused-noscale":
            if impl not in self.compiled:
                self.compiled[impl] = cutlass_fused.LinearBatchNorm1d.from_modules(self.ours.gemm, self.ours.bn)
            return self.compiled[impl]
        if impl.startswith("cutlass_fused-fp8"):
            if impl not in self.compiled:
                layer = copy.deepcopy(self.ours)
                layer.fp8 = bench_rows.fp8_recipe(impl)
                self.compiled[impl] = layer
            return self.compiled[impl]
        if impl not in self.compiled:
            mode = "max-autotune-no-cudagraphs" if impl == "compile-max-autotune" else "default"
            model = SeedModel(*self.shape[1:]).to(self.device, self.seed.gemm.weight.dtype)
            model.load_state_dict(self.seed.state_dict())
            if impl.startswith("torchao"):
                model = bench_rows.torchao_float8(model, "tensorwise", self.device)
            call = torch.compile(model, mode=mode, dynamic=False) if impl.endswith("compile") else model
            self.compiled[impl] = (model, call)
        return self.compiled[impl]

    def fn(self, impl, mode):
        if impl == "torch.mm" and self.autocast:
            # The floor stays the bare GEMM in the autocast dtype, without the casts.
            dt = DTYPES[self.dtype_name]
            x, w = self.x.to(dt), self.seed.gemm.weight.detach().to(dt)
            return lambda: torch.mm(x, w.t())
        fn = self._fn(impl, mode)
        if not self.autocast:
            return fn
        dt = DTYPES[self.dtype_name]

        def under_autocast():
            with torch.autocast(self.device.type, dtype=dt):
                return fn()
        return under_autocast

    def _fn(self, impl, mode):
        if impl == "torch.mm":
            w = self.seed.gemm.weight.detach()
            return lambda: torch.mm(self.x, w.t())
        model = self.model(impl)
        module, call = model if isinstance(model, tuple) else (model, model)
        module.train(mode != "eval")
        if mode != "fwdbwd":
            def fwd():
                with torch.no_grad():
                    return call(self.x)
            return fwd

        def step():
            module.zero_grad(set_to_none=True)
            self.xg.grad = None
            call(self.xg).backward(self.dy)
        return step

    def close(self):
        self.scope.close()


def check(case, family):
    """Max |y - float64| of ours (and its frozen copy, where asked for) and eager, train and eval; raises on a
    mismatch."""
    out = {}
    ref = SeedModel(*case.shape[1:]).to(case.device, torch.float64)
    ref.load_state_dict(case.seed.state_dict())
    for mode in ("train", "eval"):
        train = mode == "train"
        state = {k: v.clone() for k, v in case.seed.state_dict().items()}
        ours = [m for m in (case.ours, case.frozen) if m is not None]
        for mod in (case.seed, *ours, ref):
            mod.train(train)
            mod.load_state_dict(state)
        amp = torch.autocast(case.device.type, dtype=DTYPES[case.dtype_name], enabled=bool(case.autocast))
        with torch.no_grad(), cutlass_fused.use_kernel_family(family):
            y64 = ref(case.x.double())
            with amp:
                ys, y_eager = [m(case.x) for m in ours], case.seed(case.x)
            e_ours = max((y.double() - y64).abs().max().item() for y in ys)
            e_eager = (y_eager.double() - y64).abs().max().item()
        for mod in (case.seed, *ours):
            mod.load_state_dict(state)
        ok = e_ours <= 2 * e_eager + FLOOR[case.dtype_name]
        out[mode] = (e_ours, e_eager, ok)
    return out


def parse_shape(s):
    try:
        b, i, o = (int(v) for v in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected --shape B,IN,OUT (three integers), but got {s!r}")
    return b, i, o


def run_shapes(shapes, sweep, cuda):
    """--shape's shapes, then the sweep's (once each, in one results file); without either,
    the default shapes."""
    if shapes or sweep:
        return list(dict.fromkeys((shapes or []) + sweep))
    return SHAPES if cuda else [(128, 1024, 512)]


def run(args, argv):
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        print("cutlass_fused.bench: no CUDA GPU here: checking against float64 and timing ours vs eager on the CPU")
        if args.dtype not in (None, "bf16", "f32"):
            raise SystemExit(f"cutlass_fused.bench: --dtype {args.dtype} needs a GPU; the CPU runs bf16 and f32")
    args.dtype = args.dtype or ("bf16" if cuda else "f32")
    if args.autocast and args.dtype not in ("bf16", "f16"):
        raise SystemExit("cutlass_fused.bench: --autocast needs --dtype bf16 or f16")
    if args.autocast and not cuda and args.dtype != "bf16":
        raise SystemExit("cutlass_fused.bench: CPU autocast runs bf16")
    torch.backends.cuda.matmul.allow_tf32 = args.dtype == "tf32"
    sweep = [(b, 8192, 8192) for b in SWEEP] if args.sweep else []
    shapes = run_shapes(args.shape, sweep, cuda)
    impls = args.impl or (DEFAULT_IMPLS if cuda else ("torch.mm", "eager", "cutlass_fused"))
    modes = args.mode or (("train", "eval") if args.sweep and not args.shape else MODES)
    graph_opts = [False, True] if args.graphs and cuda else [False]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, checks = [], []
    per_shape = len(modes) * len([i for i in impls if i != "torch.mm"]) * len(graph_opts)
    # torch.mm is measured once per shape (and graph option): a mode's torch.mm row is
    # GEMMS[mode] of it, the floor of that mode, so its ratio is 1 by definition.
    try:
        from tqdm import tqdm
        bar = tqdm(total=len(shapes) * (per_shape + len(graph_opts)), desc="bench", file=sys.stderr,
                   dynamic_ncols=True)
    except ImportError:
        bar = None
    name = "sweep.json" if args.sweep and not args.shape else "results.json"
    for shape in shapes:
        torch._dynamo.reset()
        case = Case(shape, args.dtype, device, args.autocast, frozen="cutlass_fused-frozen" in impls)
        res = check(case, args.family)
        for mode, (e_ours, e_eager, ok) in res.items():
            checks.append({"shape": list(shape), "dtype": case.label, "mode": mode, "err_ours": e_ours,
                           "err_eager": e_eager, "ok": ok})
            if not ok:
                raise SystemExit(f"cutlass_fused.bench: {mode} {shape} {args.dtype}: error {e_ours:.3g} exceeds "
                                 f"2 x eager's {e_eager:.3g} + {FLOOR[args.dtype]:g} against float64")
        # torch.mm is timed before every row in every round; each ratio is to the median of all
        # of the shape's torch.mm times (per graph option), which see the same clocks as the rows.
        mm, mm_call, mm_times = {}, {}, {g: [] for g in graph_opts}
        for g in graph_opts:
            if bar:
                bar.set_postfix_str(f"{'x'.join(map(str, shape))} torch.mm{' graph' if g else ''}")
            t = Timed(case, "torch.mm", "train", g, args.family)
            for _ in range(args.rounds):
                t.time(None, cuda)
            mm[g], mm_call[g] = t.row(args, out_dir, cuda), t.call
            mm_times[g] += t.times
            if bar:
                bar.update()
        shape_rows = []
        for mode in modes:
            # A mode's rows are timed in rounds across its implementations, each after a torch.mm,
            # so that every row sees the same spread of the GPU's clocks.
            jobs = [j for impl in impls if impl != "torch.mm" for g in graph_opts
                    for j in [timing.guarded(impl, mode, shape, lambda: Timed(case, impl, mode, g, args.family))] if j]
            for _ in range(args.rounds):
                for j in list(jobs):
                    if bar:
                        bar.set_postfix_str(f"{'x'.join(map(str, shape))} {mode} {j.impl}{' graph' if j.graph else ''}")
                    if timing.guarded(j.impl, mode, shape, lambda: j.time(mm_call[j.graph], cuda)) is None:
                        jobs.remove(j)
            if "torch.mm" in impls:
                for g in graph_opts:
                    k_, base = GEMMS[mode], mm[g]
                    shape_rows.append({**base, "mode": mode, "kernels": None if base["kernels"] is None else k_ * base["kernels"],
                                       "host_us": None if base["host_us"] is None else k_ * base["host_us"]})
            for j in jobs:
                mm_times[j.graph] += j.mm_times
                row = timing.guarded(j.impl, mode, shape, lambda: j.row(args, out_dir, cuda))
                if row is not None:
                    shape_rows.append(row)
            if bar:
                bar.update(len(impls) * len(graph_opts) - len(graph_opts) * ("torch.mm" in impls))
        for r in shape_rows:
            k_, base = GEMMS[r["mode"]], statistics.median(mm_times[r["graphs"]])
            if r["impl"] == "torch.mm":
                r["ms"] = k_ * base
                r["tflops"] = k_ * 2 * shape[0] * shape[1] * shape[2] / r["ms"] / 1e9
            r["ratio_to_mm"] = r["ms"] / (k_ * base)
        rows += shape_rows
        case.close()
        # Written after every shape, so that a run cut short keeps what it measured.
        result = {"meta": timing.meta(argv, device), "rows": rows, "checks": checks}
        (out_dir / name).write_text(json.dumps(result, indent=1) + "\n")
    if bar:
        bar.close()
    print(table(result))
    for c in checks:
        print(f"check {c['mode']:5s} {'x'.join(map(str, c['shape']))} {c['dtype']}: max|y - float64| "
              f"ours {c['err_ours']:.3e}, eager {c['err_eager']:.3e} [ok]")
    if not cuda:
        print("On the CPU the layer runs PyTorch ops (the CUDA kernels need a GPU): each ms is the median of "
              "5 wall-clock calls, and x mm divides by the CPU's own torch.mm of the same shape. The rows check "
              "the CPU path and compare it with eager; they say nothing of the kernels' speed.")
    if args.shape:
        plot(result, out_dir / "results.png", [r for r in rows if tuple(r["shape"]) in args.shape])
    if sweep:
        plot(result, out_dir / "sweep.png", [r for r in rows if tuple(r["shape"]) in sweep], sweep=True)
    if not args.shape and not sweep:
        plot(result, out_dir / "results.png", rows)
    print(f"wrote {out_dir / name}")
    return 0


class Timed:
    """One row: impl's callable, its times over the rounds, and the torch.mm times taken right
    before each."""

    def __init__(self, case, impl, mode, use_graph, family):
        self.case, self.impl, self.mode, self.graph, self.family = case, impl, mode, use_graph, family
        with cutlass_fused.use_kernel_family(family):
            self.fn = case.fn(impl, mode)
            self.call = timing.graphed(self.fn) if use_graph else self.fn
        self.times, self.mm_times = [], []

    def time(self, mm_call, cuda):
        with cutlass_fused.use_kernel_family(self.family):
            if mm_call is not None:
                self.mm_times.append(timing.median_ms(mm_call, cuda))
            self.times.append(timing.median_ms(self.call, cuda))
        return True

    def row(self, args, out_dir, cuda):
        (m, k, n), impl, mode = self.case.shape, self.impl, self.mode
        extra = {"peak_extra_mib": None, "kernels": None, "host_us": None}
        if cuda and not self.graph:
            with cutlass_fused.use_kernel_family(self.family):
                extra["peak_extra_mib"] = timing.peak_extra_mib(self.fn)
                trace = out_dir / f"trace_{impl}_{mode}_{m}x{k}x{n}.json" if args.profile else None
                launches, kernels = timing.profile(self.fn, trace=trace)
                extra["kernels"] = launches
                extra["host_us"] = timing.host_us(self.fn)
            if args.profile:
                print(f"\n{impl} {mode} {m}x{k}x{n}: GPU µs per call by kernel")
                for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
                    print(f"  {us:9.1f}  {name[:100]}")
        ms = statistics.median(self.times)
        return {"shape": [m, k, n], "dtype": self.case.label, "mode": mode, "impl": impl, "graphs": self.graph,
                "ms": ms, "tflops": GEMMS[mode] * 2 * m * n * k / ms / 1e9, "ratio_to_mm": None, **extra}


def speedups(rows, row):
    """(speedup over eager, over the faster torch.compile) for one row, or None."""
    def ms(impl):
        c = [r["ms"] for r in rows if r["impl"] == impl and r["shape"] == row["shape"]
             and r["mode"] == row["mode"] and r["graphs"] == row["graphs"] and r["dtype"] == row["dtype"]]
        return c[0] if c else None
    eager = ms("eager")
    comp = [t for t in (ms("compile"), ms("compile-max-autotune")) if t]
    return (eager / row["ms"] if eager else None), (min(comp) / row["ms"] if comp else None)


def table(result, markdown=False):
    rows = result["rows"]
    head = ["shape", "dtype", "mode", "impl", "graph", "ms", "TFLOP/s", "x mm", "vs eager", "vs compile",
            "peak MiB", "kernels", "host µs"]
    lines = []
    for r in rows:
        se, sc = speedups(rows, r)
        lines.append(["x".join(map(str, r["shape"])), r["dtype"], r["mode"], r["impl"], "yes" if r["graphs"] else "",
                      report.fmt(r["ms"], ".4f"), report.fmt(r["tflops"], ".1f"), report.fmt(r["ratio_to_mm"], ".3f"),
                      report.fmt(se, ".2f"), report.fmt(sc, ".2f"), report.fmt(r["peak_extra_mib"], ".0f"),
                      report.fmt(r["kernels"], ".0f"), report.fmt(r["host_us"], ".1f")])
    return report.render(head, lines, 5, markdown, result["meta"])


def plot(result, path, rows, sweep=False):
    plt = report.pyplot()
    rows = [r for r in rows if not r["graphs"] and r["impl"] != "torch.mm"]
    if plt is None or not rows:
        return
    modes = sorted({r["mode"] for r in rows}, key=MODES.index)
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    if sweep:
        fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.2), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            sel = [r for r in rows if r["mode"] == mode]
            for impl in impls:
                pts = sorted((r["shape"][0], r["tflops"]) for r in sel if r["impl"] == impl)
                ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch (in = out = 8192)")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{mode} ({rows[0]['dtype']})")
            ax.legend(fontsize=7)
    else:
        # One panel a shape and mode, each on its own linear scale: the large shapes' small
        # differences are what users compare, and a shared log axis flattens them under a small
        # shape's far larger ones (docs/decisions.md, "Measuring").
        shapes = sorted({tuple(r["shape"]) for r in rows})
        fig, axes = plt.subplots(len(modes), len(shapes), figsize=(max(5.5, 3.2 * len(shapes)), 2.9 * len(modes)),
                                 squeeze=False)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, mode in enumerate(modes):
            for j, shape in enumerate(shapes):
                ax = axes[i][j]
                by = {r["impl"]: r["ratio_to_mm"] for r in rows
                      if r["mode"] == mode and tuple(r["shape"]) == shape and r["ratio_to_mm"]}
                names = [impl for impl in impls if impl in by]
                bars = ax.bar(range(len(names)), [by[n] for n in names],
                              color=[colors[IMPLS.index(n) % len(colors)] for n in names])  # one color an impl
                ax.bar_label(bars, fmt="%.3f", fontsize=6)
                if by:
                    lo, hi = min(by.values()), max(by.values())
                    ax.set_ylim(min(0.9, 0.95 * lo), 1.08 * hi)
                ax.axhline(1.0, color="k", lw=0.8)
                ax.set_xticks(range(len(names)))
                ax.set_xticklabels(names, fontsize=6, rotation=30, ha="right")
                ax.set_title(f"{mode}, {'x'.join(map(str, shape))}", fontsize=8)
                if j == 0:
                    ax.set_ylabel("time / torch.mm" + (" (x3)" if mode == "fwdbwd" else "") + "\nlower is better",
                                  fontsize=7)
    report.save_figure(plt, fig, result["meta"], path)


class _Help(argparse.HelpFormatter):
    """argparse's help, with lines broken at spaces only: the cases and row names hold hyphens."""

    def _split_lines(self, text, width):
        import textwrap
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m cutlass_fused.bench", description=__doc__.split("\n")[0],
                                 formatter_class=_Help)
    ap.add_argument("--shape", type=parse_shape, action="append",
                    help="B,IN,OUT (repeatable; default: " + " ".join(",".join(map(str, s)) for s in SHAPES)
                    + " on a GPU, 128,1024,512 on the CPU)")
    ap.add_argument("--dtype", choices=DTYPES, help="f32 = fp32 with TF32 disallowed (default: bf16 on a GPU, f32 on the CPU)")
    ap.add_argument("--mode", choices=MODES, action="append", help="repeatable; default: all three")
    ap.add_argument("--family", choices=("auto", "sm90", "sm80"), default="auto",
                    help="CUDA kernel family: auto picks sm90 on Hopper, sm80 elsewhere (default: auto)")
    ap.add_argument("--autocast", action="store_true",
                    help="fp32 models and inputs under torch.autocast(dtype=--dtype), which must be bf16 or f16")
    ap.add_argument("--impl", choices=IMPLS, action="append", metavar="IMPL",
                    help="repeatable; one of " + ", ".join(IMPLS) + ". Default: " + ", ".join(DEFAULT_IMPLS)
                         + " on a GPU; torch.mm, eager and cutlass_fused on the CPU")
    ap.add_argument("--graphs", action="store_true",
                    help="add rows with each call captured in a CUDA graph (GPU only; ignored on the CPU)")
    ap.add_argument("--sweep", action="store_true",
                    help="batch 128..16384 at 8192 -> 8192 (after any --shape, in the same results file)")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel GPU time split and Chrome traces (GPU only; ignored on the CPU)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="times each row (and its torch.mm) this many times; medians are reported (default: 1)")
    ap.add_argument("--step", action="store_true",
                    help="time whole training steps of an MLP of the layer (eager, compile, fused, fused+compile; "
                         "eager and fused on the CPU) instead of the layer alone; writes step.json and step.png")
    ap.add_argument("--step-case", type=bench_step.parse_case, action="append", metavar="CASE",
                    help=bench_step.CASE_HELP)
    ap.add_argument("--step-row", choices=bench_step.ALL_ROWS, action="append", metavar="ROW",
                    help="a training-step row (repeatable; implies --step): one of " + ", ".join(bench_step.ALL_ROWS)
                         + ". Default: the first four on a GPU, eager and fused on the CPU. The torchao rows "
                         "(issue 33's anchors) need torchao; the compile rows a GPU")
    ap.add_argument("--out", default="bench_out",
                    help="output folder for results.json (sweep.json, step.json) and the PNGs (default: bench_out)")
    ap.add_argument("--report", metavar="RESULTS_JSON", help="print a results file (any of the three) as a markdown "
                    "table and exit")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"expected --rounds to be at least 1, but got {args.rounds}")
    if args.report:
        result = json.loads(Path(args.report).read_text())
        print((bench_step.table if result.get("mode") == "step" else table)(result, markdown=True))
        return 0
    if args.step or args.step_case or args.step_row:
        return bench_step.run(args, argv)
    # The default run (the README's main job) times the training steps too; a run that picks the
    # layer's shapes, precision, modes or implementations is about the layer alone.
    steps = not (args.shape or args.sweep or args.dtype or args.mode or args.impl or args.autocast)
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        rc = run(args, argv)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    if steps:
        rc = bench_step.run(args, argv) or rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
