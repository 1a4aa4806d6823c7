"""python -m cutlass_fused.bench --step: whole training steps of models built of the layer.

A case's MODEL (MODELS): "seed", BLOCKS x [Linear(width, width) -> * scale -> BatchNorm1d -> activation]
(SeedModel and an nn activation), then a head Linear(width, 1000), cross-entropy on random targets;
"plain", the same MLP as users write it, without the scale and with Linear(bias=False); "simsiam", a
SimSiam-style projector, BLOCKS x [Linear(width, width, bias=False) -> BatchNorm1d], an activation after
each but the last, whose BatchNorm has affine=False, called on two views of a batch (BATCH rows each)
with SimSiam's symmetric negative cosine loss (each view's output against the other's, detached). AdamW
(fused on CUDA) steps it and zero_grad(set_to_none=True) ends the step. The rows, each on its own deep
copy of one initial model: eager, compile (torch.compile of the model), fused (cutlass_fused.fuse of the
model) and fused+compile; the optimizer is never compiled. The compile-ro rows compile with
mode="reduce-overhead" (REDUCE_OVERHEAD_ROWS). `--step-row` picks rows, also issue 33's anchors:
torchao-float8 (torchao's float8 training of the blocks' Linears, tensorwise scaling; BatchNorm stays
PyTorch's), and it or its rowwise recipe under torch.compile; the fused FP8 rows (FP8_ROWS); and eager,
fused and the FP8 rows as one CUDA graph a step (GRAPH_ROWS); fused-unlinked (UNLINKED_ROWS). A row's
first PARITY_STEPS steps run on a data stream shared by all rows, and its loss parity is the largest
relative difference of those losses from eager's. Then the step on one fixed batch is timed
(timing.median_ms), the rows in --rounds, and its peak memory taken (timing.peak_extra_mib). x mm: a
row's step time over its GEMMs' alone in torch.mm (GemmFloor, timed in the same rounds).
"""
import argparse
import collections
import contextlib
import copy
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import cutlass_fused
from cutlass_fused import bench_rows, report, timing
from cutlass_fused.seed import SeedModel

Case = collections.namedtuple("Case", "precision batch width blocks activation model", defaults=("seed",))
MODELS = ("seed", "plain", "simsiam")
PRECISIONS = ("amp-bf16", "bf16", "tf32", "f32")
ACTIVATIONS = {"none": nn.Identity, "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "leaky_relu": nn.LeakyReLU}
ROWS = ("eager", "compile", "fused", "fused+compile")
TORCHAO_ROWS = ("torchao-float8", "torchao-float8+compile", "torchao-float8-rowwise+compile")
# fused-fp8: fuse(model) with Float8Recipe() on every fused layer (the e4m3 kernels; issue 33);
# fused-fp8-e5m2: with Float8Recipe(backward="e5m2") (the FP8 backward's GEMMs as well);
# fused-fp8-delayed-e5m2: with scaling="delayed" too (one cast pass each for x and W); -fast: with
# fast_accum=True as well (the forward's GEMMs accumulate in the tensor cores alone).
FP8_ROWS = ("fused-fp8", "fused-fp8-e5m2", "fused-fp8-delayed-e5m2", "fused-fp8-delayed-e5m2-fast")
# +graph: the whole step (forward, backward, AdamW with capturable=True) as one CUDA graph, replayed
# by cutlass_fused.graphed_step (its batch copied in, its loss copied out): the GPU's time for the
# step with little host in the way, which a host-bound step (the FP8 rows': docs/decisions.md) does
# not get eagerly.
GRAPH_ROWS = tuple(r + "+graph" for r in ("eager", "fused") + FP8_ROWS)
# fused-unlinked: fuse(model, link=False), each layer's BN backward its own (docs/decisions.md,
# "Backward": linked layers), beside the fused row's linked blocks.
UNLINKED_ROWS = ("fused-unlinked", "fused-unlinked+graph")
# compile-ro: torch.compile(mode="reduce-overhead") of the model, or of the fused model: Inductor's
# CUDA graphs of the forward and the backward (AdamW stays eager), which leave out the host time its
# generated wrapper costs a host-bound step (docs/decisions.md, "Training step").
REDUCE_OVERHEAD_ROWS = ("compile-ro", "fused+compile-ro")
ALL_ROWS = (ROWS + tuple(r + c for r in FP8_ROWS for c in ("", "+compile")) + GRAPH_ROWS + TORCHAO_ROWS
            + REDUCE_OVERHEAD_ROWS + UNLINKED_ROWS)
CASES = [Case("amp-bf16", 4096, 4096, 4, "relu"), Case("amp-bf16", 1024, 8192, 4, "relu"),
         Case("bf16", 4096, 4096, 4, "relu"), Case("amp-bf16", 256, 2048, 6, "relu"),
         Case("amp-bf16", 4096, 4096, 4, "relu", "plain"), Case("amp-bf16", 512, 2048, 3, "relu", "simsiam"),
         Case("amp-bf16", 4096, 2048, 3, "relu", "simsiam")]
# The CPU runs the layer's PyTorch path and has no triton for torch.compile: one tiny case, in
# seconds, that shows the command and the fused model's training work there.
CPU_CASE = Case("f32", 64, 64, 2, "relu")
CPU_ROWS = ("eager", "fused")
CLASSES = 1000
PARITY_STEPS = 30
PEAK = ("timing.peak_extra_mib: torch.cuda.max_memory_allocated during one step minus memory_allocated "
        "before it (weights, AdamW states and the batch), after a step first; for a +graph row, during the "
        "step its graph captured (the graph's pool); null on the CPU and for a compile-ro row (Inductor's "
        "graphs keep a private pool between steps, which these counters do not show)")
GRAPH_WARMUP = 3
CASE_HELP = ("PRECISION,BATCH,WIDTH,BLOCKS[,ACTIVATION[,MODEL]]: a training-step case (repeatable; implies "
             f"--step). PRECISION: {', '.join(PRECISIONS)} (amp-bf16: fp32 weights under torch.autocast bf16; bf16: "
             "model and inputs in bf16; tf32: fp32 with TF32 matmuls; f32: TF32 off). ACTIVATION: "
             f"{', '.join(ACTIVATIONS)} (default relu). MODEL: {', '.join(MODELS)} (default seed; the module's "
             "docstring says what each is). Default cases: "
             + " ".join(",".join(map(str, c[:4] + ((c.activation, c.model) if c.model != "seed" else ()))) for c in CASES)
             + f"; on the CPU {','.join(map(str, CPU_CASE[:4]))}")


def parse_case(s):
    parts = s.split(",")
    parts += ["relu", "seed"][len(parts) - 4:] if 4 <= len(parts) < 6 else []  # the optional fields
    try:
        case = Case(parts[0], *map(int, parts[1:4]), *parts[4:6]) if len(parts) == 6 else None
    except ValueError:
        case = None
    # BatchNorm in training needs two rows to normalize.
    if (case is None or case.precision not in PRECISIONS or case.activation not in ACTIVATIONS or case.batch < 2
            or min(case.width, case.blocks) < 1 or case.model not in MODELS):
        raise argparse.ArgumentTypeError(f"expected --step-case {CASE_HELP.split(':')[0]} (BATCH at least 2, WIDTH "
                                         f"and BLOCKS at least 1), but got {s!r}")
    return case


def case_of(row):
    return Case(*(row.get(f, Case._field_defaults.get(f)) for f in Case._fields))  # records before `model` too


def label(case):
    model = "" if case.model == "seed" else f" {case.model}"
    return f"{case.precision} {case.batch}x{case.width}x{case.blocks} {case.activation}{model}"


def mlp(case, device, seed=0):
    """The case's model (MODELS), drawn from seed."""
    torch.manual_seed(seed)
    w, act = case.width, ACTIVATIONS[case.activation]
    if case.model == "seed":
        layers = [m for _ in range(case.blocks) for m in (SeedModel(w, w), act())] + [nn.Linear(w, CLASSES)]
    elif case.model == "plain":
        layers = [m for _ in range(case.blocks) for m in (nn.Linear(w, w, bias=False), nn.BatchNorm1d(w), act())]
        layers.append(nn.Linear(w, CLASSES))
    else:  # simsiam's projector: the last block without the activation, its BatchNorm without affine
        layers = []
        for i in range(case.blocks):
            last = i == case.blocks - 1
            layers += [nn.Linear(w, w, bias=False), nn.BatchNorm1d(w, affine=not last)] + ([] if last else [act()])
    model = nn.Sequential(*layers).to(device)
    return model.to(torch.bfloat16) if case.precision == "bf16" else model


def views(case):
    """How many times a step calls the model: SimSiam's two views, else one batch."""
    return 2 if case.model == "simsiam" else 1


def batch(case, device, i):
    """The i-th batch of the data stream, the same for every row: x (views x batch x width for
    simsiam: two noisy views of one batch) and the targets."""
    g = torch.Generator(device=device).manual_seed(i)
    x = torch.randn(case.batch, case.width, device=device, generator=g)
    target = torch.randint(0, CLASSES, (case.batch,), device=device, generator=g)
    if views(case) == 2:
        x = x + 0.5 * torch.randn(2, case.batch, case.width, device=device, generator=g)
    return x.to(torch.bfloat16) if case.precision == "bf16" else x, target


def loss_of(case, model, x, target):
    """The step's loss: cross-entropy of the head's logits, or SimSiam's symmetric negative cosine
    similarity of the two views' outputs, each against the other's detached."""
    if views(case) == 1:
        return F.cross_entropy(model(x), target)
    z1, z2 = model(x[0]), model(x[1])
    return -(F.cosine_similarity(z1, z2.detach()).mean() + F.cosine_similarity(z2, z1.detach()).mean()) / 2


@contextlib.contextmanager
def precision_flags(precision):
    """TF32 on for tf32 alone, and the global flags as they were afterwards."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


class Row:
    """One row's model, optimizer and step; built by running the parity steps, which also warm it
    up (and compile it)."""

    def __init__(self, name, base, case, device, reports):
        self.name, self.case, self.device = name, case, device
        module, self.fused_layers = copy.deepcopy(base), None
        if name.startswith("fused"):
            module, fusion = cutlass_fused.fuse(module, link="unlinked" not in name)
            self.fused_layers = len(fusion.fused)
            if not reports:
                print(fusion)
            reports.append(fusion)
        if name.startswith("torchao"):
            module = bench_rows.torchao_float8(module, "rowwise" if "rowwise" in name else "tensorwise", device)
        if name.startswith("fused-fp8"):
            recipe = bench_rows.fp8_recipe(name)
            for layer in module.modules():
                if isinstance(layer, cutlass_fused.LinearBatchNorm1d):
                    layer.fp8 = recipe
        mode = compile_mode(name)
        self.call = module if mode is None else torch.compile(module, mode=mode)
        self.graphed = name.endswith("+graph")
        if self.graphed and device.type != "cuda":
            raise RuntimeError("the +graph rows capture CUDA graphs: they need a GPU")
        self.opt = torch.optim.AdamW(module.parameters(), fused=device.type == "cuda", capturable=self.graphed)
        # A +graph row's step is cutlass_fused.graphed_step's: its first GRAPH_WARMUP calls eager, the
        # next captured, then replays; its peak is the capturing call's (the graph's pool).
        self.run = (cutlass_fused.graphed_step(self.body, module, self.opt, warmup=GRAPH_WARMUP) if self.graphed
                    else self.body)
        self.capture_peak, losses = None, []
        for i in range(PARITY_STEPS):
            x, target = batch(case, device, i)
            if self.graphed and i == GRAPH_WARMUP:  # the capturing call
                loss, self.capture_peak = timing.peak_mib(lambda: self.step(x, target), device)
            else:
                loss = self.step(x, target)
            losses.append(loss.detach())
        self.losses = torch.stack(losses).float().tolist()
        self.x, self.target = batch(case, device, PARITY_STEPS)
        self.times = []

    def body(self, x, target):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.case.precision == "amp-bf16"):
            loss = loss_of(self.case, self.call, x, target)
        loss.backward()
        self.opt.step()
        # After the step, so that the memory before the next one is the weights and AdamW's states.
        self.opt.zero_grad(set_to_none=True)
        return loss

    def step(self, x, target):
        return self.run(x, target)

    def time(self):
        self.times.append(timing.median_ms(lambda: self.step(self.x, self.target), self.device.type == "cuda"))

    def peak(self):
        if self.graphed:
            return self.capture_peak
        if compile_mode(self.name) == "reduce-overhead":
            # Inductor's graphs keep their private pool between steps, and the allocator's counters
            # show only what is live in it, a small part of the default row's peak (decisions.md,
            # "Training step"): not a peak to set beside the others.
            return None
        return timing.peak_extra_mib(lambda: self.step(self.x, self.target)) if self.device.type == "cuda" else None


class GemmFloor:
    """The step's GEMMs alone, as torch.mm runs them: for each Linear and view, y = x W^T,
    dX = dy W and dW = dy^T x, in the dtype the step's GEMMs take (bf16 under amp-bf16 and bf16, fp32
    otherwise, TF32 as the case's flags say). The floor a step races; timed in the rows' rounds."""

    name = "mm"

    def __init__(self, case, device):
        dt = torch.bfloat16 if case.precision in ("amp-bf16", "bf16") else torch.float32
        g = torch.Generator(device=device).manual_seed(0)
        r = lambda *shape: torch.randn(*shape, device=device, generator=g).to(dt)
        outs = [case.width] * case.blocks + ([] if case.model == "simsiam" else [CLASSES])
        self.operands = [(r(case.batch, case.width), r(n, case.width), r(case.batch, n))
                         for n in outs for _ in range(views(case))]
        self.cuda, self.times = device.type == "cuda", []

    def run(self):
        for x, w, dy in self.operands:
            torch.mm(x, w.t()), torch.mm(dy, w), torch.mm(dy.t(), x)

    def time(self):
        self.times.append(timing.median_ms(self.run, self.cuda))


def measure_case(case, rows, device, rounds):
    """The case's rows: dicts in the results schema, a failed row with its error."""
    torch._dynamo.reset()
    base, reports, errors, live = mlp(case, device), [], {}, {}
    for name in rows:
        failed = []
        row = timing.guarded(name, "step", label(case), lambda: Row(name, base, case, device, reports), failed)
        if row is None:
            errors[name] = failed[0]
        else:
            live[name] = row
    floor = GemmFloor(case, device)
    for row in timing.alternating([floor, *live.values()], rounds):
        if row is floor:
            row.time()
        elif row.name in live:
            failed = []
            timing.guarded(row.name, "step", label(case), row.time, failed)
            if failed:
                errors[row.name] = failed[0]
                del live[row.name]
    out = []
    eager = live.get("eager")
    mm_ms = statistics.median(floor.times)
    for name in rows:
        row = live.get(name)
        out.append({"mode": "step", **case._asdict(), "impl": name, "ms": None, "mm_ms": mm_ms, "x_mm": None,
                    "peak_extra_mib": None, "vs_eager": None, "vs_compile": None, "loss_parity": None,
                    "loss_last": None, "fused_layers": None, "error": errors.get(name)})
        if row is None:
            continue
        failed = []
        peak = timing.guarded(name, "step", label(case), row.peak, failed)
        out[-1].update(ms=statistics.median(row.times), peak_extra_mib=peak, loss_last=row.losses[-1],
                       fused_layers=row.fused_layers, error=failed[0] if failed else None)
        if eager is not None:
            out[-1]["loss_parity"] = max(abs(a - e) / abs(e) for a, e in zip(row.losses, eager.losses))
    ms = {r["impl"]: r["ms"] for r in out}
    for r in out:
        if r["ms"]:
            r["x_mm"] = r["ms"] / mm_ms
            r["vs_eager"] = ms["eager"] / r["ms"] if ms.get("eager") else None
            r["vs_compile"] = ms["compile"] / r["ms"] if ms.get("compile") else None
    return out


def measure(cases, rows, device, rounds, argv, out_dir):
    """Every case's rows; writes step.json after each case, so that a run cut short keeps them."""
    result = {"mode": "step", "meta": timing.meta(argv, device), "parity_steps": PARITY_STEPS,
              "peak_extra_mib": PEAK, "rows": []}
    for case in cases:
        print(f"cutlass_fused.bench: step {label(case)}: {', '.join(rows)}", file=sys.stderr)
        with precision_flags(case.precision):
            result["rows"] += measure_case(case, rows, device, rounds)
        (out_dir / "step.json").write_text(json.dumps(result, indent=1) + "\n")
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the case's models are gone; the next one's may be larger
    return result


def compile_mode(name):
    """The torch.compile mode of a row (None: not compiled)."""
    if name.endswith("compile-ro"):
        return "reduce-overhead"
    return "default" if name.endswith("compile") else None


def run(args, argv):
    """--step, or the step cases of the default GPU run: 1 where a fused row failed (after writing all)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cases = args.step_case or (CASES if cuda else [CPU_CASE])
    if not cuda and any(c.precision == "tf32" for c in cases):
        raise SystemExit("cutlass_fused.bench: --step-case tf32 needs a GPU; the CPU runs amp-bf16, bf16 and f32")
    rows = tuple(dict.fromkeys(args.step_row)) if args.step_row else (ROWS if cuda else CPU_ROWS)
    if not cuda and any(compile_mode(r) for r in rows):
        raise SystemExit("cutlass_fused.bench: the --step-row compile rows need a GPU (no torch.compile on the CPU)")
    if not cuda and any(r.endswith("+graph") for r in rows):
        raise SystemExit("cutlass_fused.bench: the --step-row +graph rows need a GPU (they capture CUDA graphs)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = measure(cases, rows, device, args.rounds, argv, out_dir)
    print(table(result))
    if not cuda:
        print("On the CPU the fused layer runs PyTorch ops and torch.compile is not run: the rows check that "
              "the fused model trains as eager does; their times say nothing of the kernels' speed.")
    plot(result, out_dir / "step.png")
    print(f"wrote {out_dir / 'step.json'}")
    return int(any(r["error"] for r in result["rows"] if r["impl"] == "fused"))


def table(result, markdown=False):
    head = ["precision", "batch", "width", "blocks", "act", "model", "impl", "ms/step", "x mm", "peak MiB",
            "vs eager", "vs compile", "loss parity", "fused"]
    # .get: records written before x mm (or the model) existed render too.
    lines = [[r["precision"], str(r["batch"]), str(r["width"]), str(r["blocks"]), r["activation"],
              r.get("model", "seed"), r["impl"],
              "failed" if r["ms"] is None else report.fmt(r["ms"], ".3f"), report.fmt(r.get("x_mm"), ".2f"),
              report.fmt(r["peak_extra_mib"], ".0f"),
              report.fmt(r["vs_eager"], ".2f"), report.fmt(r["vs_compile"], ".2f"),
              report.fmt(r["loss_parity"], ".1e"), report.fmt(r["fused_layers"], "d")] for r in result["rows"]]
    out = report.render(head, lines, 7, markdown, result["meta"])
    notes = [f"{r['impl']} {label(case_of(r))}: {r['error']}"
             for r in result["rows"] if r["error"]]
    return "\n".join([out, *("failed: " + n for n in notes)])


def plot(result, path):
    """One panel a case: each row's ms per step, with its speedup over eager."""
    plt = report.pyplot()
    rows = [r for r in result["rows"] if r["ms"]]
    if plt is None or not rows:
        return
    cases = list(dict.fromkeys(case_of(r) for r in rows))
    fig, axes = plt.subplots(1, len(cases), figsize=(max(5.5, 3.4 * len(cases)), 3.4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, case in zip(axes[0], cases):
        sel = [r for r in rows if case_of(r) == case]
        bars = ax.bar(range(len(sel)), [r["ms"] for r in sel], color=[colors[ALL_ROWS.index(r["impl"]) % len(colors)] for r in sel])
        ax.bar_label(bars, labels=[f"{r['ms']:.2f}" + (f"\n{r['vs_eager']:.2f}x" if r["vs_eager"] else "")
                                   for r in sel], fontsize=6)
        ax.set_ylim(0, 1.25 * max(r["ms"] for r in sel))
        ax.set_xticks(range(len(sel)))
        ax.set_xticklabels([r["impl"] for r in sel], fontsize=7, rotation=20, ha="right")
        ax.set_title(label(case), fontsize=8)
    axes[0][0].set_ylabel("ms per training step\nlower is better (x: over eager)", fontsize=7)
    report.save_figure(plt, fig, result["meta"], path)
