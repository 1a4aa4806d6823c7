"""How close the layer's numbers are: errors against float64, against cuBLAS's and torchao's, and
training curves against the unfused model's. One subcommand a question.

    python benchmarks/accuracy.py COMMAND [options]      (COMMAND --help for its options)

fp8_accuracy, parity_probe and fp8_teacher also run on the CPU, at a small default case there; the
others check CUDA kernels.
"""
import contextlib
import copy
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import cutlass_fused
from _common import Commands, arg, case_arg, cuda_device, shape
from cutlass_fused import bench_rows, bench_step, timing
from cutlass_fused.ops import ops
from cutlass_fused.seed import SeedModel

cli = Commands(__doc__)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@cli.command()
def errors(args):
    """Max |error| against float64 of the train and eval forward, ours next to eager PyTorch's.

    For every kernel family and precision on this GPU, at batch 1024, 1024 → 1000.
    """
    dev = cuda_device("errors")
    m, k, n = 1024, 1024, 1000
    modes = {"bf16": (torch.bfloat16, False), "f16": (torch.float16, False), "tf32": (torch.float32, True),
             "f32": (torch.float32, False)}
    families = ["sm90", "sm80"] if torch.cuda.get_device_capability() == (9, 0) else ["sm80"]
    print(f"{torch.cuda.get_device_name()}, batch={m} in={k} out={n}: max|y - float64|, ours / eager")
    print(f"{'family':6s} {'mode':5s} {'train ours':>11s} {'train eager':>12s} {'eval ours':>10s} {'eval eager':>11s}")
    for family in families:
        for mode, (dtype, tf32) in modes.items():
            torch.manual_seed(0)
            torch.backends.cuda.matmul.allow_tf32 = tf32
            seed = SeedModel(k, n).to(dev)
            seed.bn.running_mean.normal_()
            seed.bn.running_var.uniform_(0.5, 2)
            ref = SeedModel(k, n).to(dev).double()
            ref.load_state_dict(seed.state_dict())
            eager = SeedModel(k, n).to(dev).to(dtype)
            eager.load_state_dict(seed.state_dict())
            ours = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=dev, dtype=dtype)
            ours.load_state_dict(seed.state_dict())
            x = torch.randn(m, k, device=dev).to(dtype)
            row = []
            for train in (True, False):
                for mod in (ref, eager, ours):
                    mod.train(train)
                with torch.no_grad(), cutlass_fused.use_kernel_family(family):
                    y64 = ref(x.double())
                    row += [(ours(x).double() - y64).abs().max().item(), (eager(x).double() - y64).abs().max().item()]
            print(f"{family:6s} {mode:5s} {row[0]:11.2e} {row[1]:12.2e} {row[2]:10.2e} {row[3]:11.2e}")


def relative_max_error(h, ref):
    return ((h.double() - ref).abs().max() / ref.abs().max()).item()


@cli.command(arg("--k", type=int, action="append", help="a reduction size; repeatable, default 48 300 1024 8192"))
def f32_accuracy(args):
    """Error of every built fp32 (3xTF32) kernel against cuBLAS SGEMM's.

    As tests/test_fp32.py measures it: max |h - float64| / max |float64| of h = x W^T + b, as a
    ratio to SGEMM's on the same data, the worst of three seeds, at several K. Issue 8's rule: at
    most 2 (plus a 1e-7 floor). Eval kernels are run through linear_stats, statistics kernels
    through the training forward's h.
    """
    dev = cuda_device("f32_accuracy")
    torch.backends.cuda.matmul.allow_tf32 = False
    names = [n for n in cutlass_fused.built_kernels() if "_f32x3_eval_" in n or "_f32x3_stats_" in n]
    for k in args.k or [48, 300, 1024, 8192]:
        worst = {n: 0.0 for n in names}
        for seed in range(3):
            torch.manual_seed(1000 * k + seed)
            x = torch.randn(256, k, device=dev)
            w = torch.randn(520, k, device=dev) / k ** 0.5
            b = torch.randn(520, device=dev)
            ref = F.linear(x.double(), w.double(), b.double())
            e_sgemm = relative_max_error(F.linear(x, w, b), ref)
            for n in names:
                family = n.split("_")[0]
                with cutlass_fused.use_kernel_family(family), cutlass_fused.overrides(kernel=n):
                    if "_stats_" in n:
                        ones = torch.ones(520, device=dev)
                        h = ops.linear_scale_batch_norm_train(x, w, b, ones, None, None, None, None, None, 0.1,
                                                              1e-5, family)[1]
                    else:
                        h = ops.linear_stats(x, w, b, family)[0]
                worst[n] = max(worst[n], relative_max_error(h, ref) / e_sgemm)
        for n in names:
            print(f"f32 accuracy K={k:5d} {n:40s} error / SGEMM's {worst[n]:.2f}")


def torchao_row(recipe, dev):
    """A function (seed model in bf16, x) -> y through torchao's float8 Linear (the bench's anchor,
    cutlass_fused.bench_rows.torchao_float8), or None without torchao."""
    if importlib.util.find_spec("torchao") is None:
        return None
    return lambda seed, x: bench_rows.torchao_float8(seed, recipe, dev)(x)


@cli.command(
    arg("--shape", action="append", type=shape, metavar="B,IN,OUT",
        help="repeatable; default 4096,4096,4096 and 16384,4096,4096 (CPU: 512,256,128)"),
    arg("--seeds", type=int, default=3, metavar="N", help="seeds of weights and x (default 3)"))
def fp8_accuracy(args):
    """FP8's error in the training forward beside torchao's float8 training.

    Issue 33: y's error within 2x torchao float8's, against the unquantized float64 model on the
    same inputs. Rows, each y = BatchNorm1d((x W^T + b) * scale) in training mode from the same
    bf16 weights and x:
    - bf16: our layer in bf16 (no FP8);
    - ours fp8: our layer with Float8Recipe() (per-tensor current scaling, power-of-two scales):
      the e4m3 kernels where fp8.e4m3_kernels finds them, else emulated on the 16-bit kernels;
    - torchao tensorwise / rowwise: the unfused model in bf16 with its Linear converted by
      torchao.float8.convert_to_float8_training (emulate=True off CUDA), BatchNorm as PyTorch's.
      Skipped where torchao is not installed (pip install torchao; on the GPU machine, carry its
      wheel).
    Each line: max and rms |y - y64| over the seeds' outputs, and the max against torchao
    tensorwise's.
    """
    dev = device()
    emulate = dev.type == "cuda" and not cutlass_fused.fp8.e4m3_kernels(dev)
    rows = {"bf16": None, "ours fp8": None, "torchao tensorwise": torchao_row("tensorwise", dev),
            "torchao rowwise": torchao_row("rowwise", dev)}
    default = [(4096, 4096, 4096), (16384, 4096, 4096)] if dev.type == "cuda" else [(512, 256, 128)]
    for m, k, n in args.shape or default:
        errs = {name: [] for name in rows}
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            base = SeedModel(k, n).to(dev, torch.bfloat16)
            with torch.no_grad():
                base.scale.uniform_(0.5, 2.0)  # |scale| away from 0, as a trained layer's
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = SeedModel(k, n).to(dev, torch.float64)
            ref.load_state_dict(base.state_dict())
            with torch.no_grad():
                y64 = ref(x.double())
                for name, run in rows.items():
                    if name.startswith("torchao") and run is None:
                        continue
                    if name.startswith("torchao"):
                        seed_model = SeedModel(k, n).to(dev, torch.bfloat16)
                        seed_model.load_state_dict(base.state_dict())
                        y = run(seed_model, x)
                    else:
                        recipe = cutlass_fused.Float8Recipe(emulate=emulate) if name == "ours fp8" else None
                        layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=dev, dtype=torch.bfloat16,
                                                                     fp8=recipe)
                        layer.load_state_dict(base.state_dict())
                        y = layer(x)
                    errs[name].append((y.double() - y64).flatten())
        print(f"{m}x{k}->{n} on {dev.type}, {args.seeds} seeds: |y - float64 model|")
        ao = torch.cat(errs["torchao tensorwise"]).abs().max().item() if errs["torchao tensorwise"] else None
        for name, e in errs.items():
            if not e:
                print(f"  {name:20s} skipped (torchao is not installed)")
                continue
            e = torch.cat(e)
            mx, rms = e.abs().max().item(), math.sqrt((e * e).mean().item())
            vs = f", {mx / ao:.2f}x torchao tensorwise's max" if ao else ""
            print(f"  {name:20s} max {mx:.4f}  rms {rms:.5f}{vs}")


class Float64BatchNorm(nn.Module):
    """nn.BatchNorm1d's forward with its arithmetic in float64, its buffers kept in their dtype."""

    def __init__(self, bn):
        super().__init__()
        self.bn = bn

    def forward(self, z):
        bn = self.bn
        wide = lambda t: None if t is None else t.double()
        rm, rv = wide(bn.running_mean), wide(bn.running_var)
        with torch.autocast(z.device.type, enabled=False):
            y = F.batch_norm(z.double(), rm, rv, wide(bn.weight), wide(bn.bias), self.training, bn.momentum, bn.eps)
        if self.training and rm is not None:
            with torch.no_grad():
                bn.running_mean.copy_(rm)
                bn.running_var.copy_(rv)
                bn.num_batches_tracked.add_(1)
        return y.to(z.dtype)


def float64_bn(model):
    """The model with each nn.BatchNorm1d (SeedModel's too) computing in float64."""
    model = copy.deepcopy(model)
    for m in list(model.modules()):
        for name, child in m.named_children():
            if type(child) is nn.BatchNorm1d:
                setattr(m, name, Float64BatchNorm(child))
    return model


def one_ulp(model):
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))
    return model


def bf16_dw(opt, args, kwargs):
    """An optimizer step pre-hook: each weight gradient rounded to bf16 and back, as eager's autocast
    gives it (a no-op for the head's, which autocast already gave so)."""
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dim() == 2:
                    p.grad.copy_(p.grad.to(torch.bfloat16))


@contextlib.contextmanager
def seeded_data(seed):
    """bench_step's data stream under another seed: batch i drawn as batch 1000 * seed + i (seed 0:
    the benchmark's own). Row draws its batches through bench_step.batch."""
    batch = bench_step.batch
    bench_step.batch = lambda case, dev, i: batch(case, dev, 1000 * seed + i)
    try:
        yield
    finally:
        bench_step.batch = batch


PARITY_CASE = ("amp-bf16,256,2048,6", "f32,64,64,2")  # (on CUDA, on the CPU)


def parities(case, dev, reports, seed=0):
    """{row: (largest relative difference from eager's loss, its step, the last step's)}, and the
    steps' count, from the model bench_step builds under `seed`. reports: bench_step.Row's (fuse's
    report printed while it is empty)."""
    base = bench_step.mlp(case, dev, seed)
    with bench_step.precision_flags(case.precision):
        eager = bench_step.Row("eager", base, case, dev, reports).losses
        rows = {
            "eager again": bench_step.Row("eager", base, case, dev, reports).losses,
            "eager, BN in float64": bench_step.Row("eager", float64_bn(base), case, dev, reports).losses,
            "eager, weights +1 ulp": bench_step.Row("eager", one_ulp(base), case, dev, reports).losses,
            "fused": bench_step.Row("fused", base, case, dev, reports).losses,
        }
        if case.precision == "amp-bf16":
            hook = register_optimizer_step_pre_hook(bf16_dw)
            try:
                rows["fused, dW through bf16"] = bench_step.Row("fused", base, case, dev, reports).losses
            finally:
                hook.remove()
        if dev.type == "cuda":  # no triton on the CPU
            rows["compile"] = bench_step.Row("compile", base, case, dev, reports).losses
    out = {}
    for name, losses in rows.items():
        rel = [abs(a - e) / abs(e) for a, e in zip(losses, eager)]
        worst = max(range(len(rel)), key=rel.__getitem__)
        out[name] = (max(rel), worst, rel[-1])
    return out, len(eager)


@cli.command(
    case_arg(*PARITY_CASE),
    arg("--seeds", type=int, default=1, metavar="N",
        help="initial weights and data streams to repeat it for (default 1)"))
def parity_probe(args):
    """How far the step benchmark's losses part from eager's by rounding alone.

    Issue 31's loss parity: the largest relative difference from eager's loss over the first 30
    steps, same weights and data. Beside the benchmark's rows (compile, fused) it runs eager
    variants that differ from eager only in rounding: eager again (is eager deterministic), eager
    with BatchNorm computed in float64 (as our kernels take the statistics), and eager from weights
    moved by one fp32 ulp (how much 30 steps amplify a difference of that size). Under amp-bf16 it
    also runs the fused model with each fused layer's dW rounded to bf16 before AdamW, as the
    unfused model's autocast rounds it (ours comes from the GEMM in fp32: docs/decisions.md,
    "Autocast"). Each line: a row's parity against eager, and the step where it peaked.

    --seeds N repeats it for N initial weights (bench_step.mlp's seed) and data streams (seed 0 is
    the step benchmark's own), then prints each row's parities across seeds, sorted: one seed's
    number is one draw of a chaotic difference, and the spread says how far a row's draw can fall
    from its typical.
    """
    dev = device()
    case = args.case or bench_step.parse_case(PARITY_CASE[dev.type != "cuda"])
    across, reports = {}, []
    for seed in range(args.seeds):
        with seeded_data(seed):
            rows, steps = parities(case, dev, reports, seed)
        print(f"{bench_step.label(case)}, seed {seed}: loss parity against eager over {steps} steps", flush=True)
        for name, (worst, step, last) in rows.items():
            print(f"  {name:24s} {worst:.1e} (step {step}); last step {last:.1e}")
            across.setdefault(name, []).append(worst)
    if args.seeds > 1:
        print(f"across {args.seeds} seeds, sorted (median):")
        for name, values in across.items():
            print(f"  {name:24s} {' '.join(f'{v:.1e}' for v in sorted(values))} ({statistics.median(values):.1e})")


TEACHER_CASE = ("amp-bf16,1024,1024,4", "f32,256,256,2")  # (on CUDA, on the CPU)
TEACHER_FINAL = 20  # steps in the final loss


def teacher(width, dev):
    g = torch.Generator().manual_seed(1234)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, bench_step.CLASSES))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5)
    return model.to(dev).requires_grad_(False)


def student(case, dev, recipe):
    model, _ = cutlass_fused.fuse(bench_step.mlp(case, dev))
    for m in model.modules():
        if isinstance(m, cutlass_fused.LinearScaleBatchNorm1d):
            m.fp8 = recipe
    return model


def train_student(case, dev, recipe, steps, teach):
    model = student(case, dev, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=dev.type == "cuda")
    dtype = torch.bfloat16 if case.precision == "bf16" else torch.float32
    losses = []
    with bench_step.precision_flags(case.precision):
        for i in range(steps):
            g = torch.Generator(device=dev).manual_seed(i)
            x = torch.randn(case.batch, case.width, device=dev, generator=g)
            target = teach(x).argmax(1)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=case.precision == "amp-bf16"):
                loss = F.cross_entropy(model(x.to(dtype)), target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    return torch.stack(losses).float().tolist()


@cli.command(
    case_arg(*TEACHER_CASE),
    arg("--steps", type=int, default=300, metavar="N", help=f"training steps, more than {TEACHER_FINAL} (default 300)"),
    arg("--out", type=Path, metavar="DIR", help="write DIR/fp8_teacher.json"))
def fp8_teacher(args):
    """FP8's accuracy in training: the step benchmark's MLP learns a fixed teacher task.

    Issue 33: the MLP, fused, learns the task without FP8 and with each FP8 scaling, from the same
    initial weights on the same data stream. The teacher is a random frozen MLP (width -> width ->
    1000, ReLU); a batch's targets are its argmax on x ~ N(0, 1), a fresh x each step. The student
    is bench_step's MLP (BLOCKS fused Linear -> scale -> BatchNorm -> activation blocks and a Linear
    head), trained with AdamW (lr 1e-3) on cross-entropy. Rows: no FP8, Float8Recipe() (current
    scaling), Float8Recipe(scaling="delayed") and, where the e4m3 path runs,
    Float8Recipe(backward="e5m2") (dX and dW as FP8 GEMMs too) with each scaling, and the delayed
    one with fast_accum=True ("fp8 delayed e5m2 fast": the forward's GEMMs without promotion; on
    the CPU, which ignores it, the row before's). On CUDA both scalings run the e4m3 kernels where
    fp8.e4m3_kernels finds them; without the kernels they run with emulate=True (the same rounding
    through the 16-bit kernels). Printed: the loss every 25 steps, and each row's final loss (the
    mean of the last 20 steps) against the row without FP8 (issue 33's target: within 3%).
    """
    dev = device()
    case = args.case or bench_step.parse_case(TEACHER_CASE[dev.type != "cuda"])
    if args.steps <= TEACHER_FINAL:
        sys.exit(f"fp8_teacher: expected --steps above {TEACHER_FINAL}, but got {args.steps}")
    emulate = dev.type == "cuda" and not cutlass_fused.fp8.e4m3_kernels(dev)
    rows = {"no fp8": None, "fp8 current": cutlass_fused.Float8Recipe(emulate=emulate),
            "fp8 delayed": cutlass_fused.Float8Recipe(scaling="delayed", emulate=emulate)}
    if not emulate:  # the e5m2 backward runs on the e4m3 path only
        rows["fp8 e5m2 bwd"] = cutlass_fused.Float8Recipe(backward="e5m2")
        rows["fp8 delayed e5m2"] = cutlass_fused.Float8Recipe(scaling="delayed", backward="e5m2")
        rows["fp8 delayed e5m2 fast"] = cutlass_fused.Float8Recipe(scaling="delayed", backward="e5m2", fast_accum=True)
    teach = teacher(case.width, dev)
    curves = {name: train_student(case, dev, recipe, args.steps, teach) for name, recipe in rows.items()}
    print(f"{bench_step.label(case)}, {args.steps} steps on {dev.type}"
          f"{' (FP8 emulated on the 16-bit kernels)' if emulate else ''}")
    print("step  " + "  ".join(f"{name:>12s}" for name in curves))
    for i in list(range(0, args.steps, 25)) + [args.steps - 1]:
        print(f"{i:4d}  " + "  ".join(f"{c[i]:12.4f}" for c in curves.values()))
    final = {name: statistics.fmean(c[-TEACHER_FINAL:]) for name, c in curves.items()}
    base = final["no fp8"]
    for name, value in final.items():
        print(f"final loss {name:12s} {value:.4f}  {value / base:.4f} x no fp8")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"mode": "fp8_teacher", **case._asdict(), "device": dev.type, "emulated": emulate,
                  "steps": args.steps, "final_steps": TEACHER_FINAL, "final": final, "curves": curves,
                  "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None}
        (args.out / "fp8_teacher.json").write_text(json.dumps(result, indent=1))


@cli.command(arg("--family", default="auto", choices=("auto", "sm90", "sm80"), help="kernel family (default auto)"),
             arg("--time", action="store_true", help="also time problems 33 and 39 as KernelBench's evaluator does"),
             arg("--rounds", type=int, default=3, help="with --time: rounds, each timing Model then ModelNew"),
             arg("--out", type=Path, help="with --time: write the times to OUT/kernelbench.json"))
def kernelbench_check(args):
    """KernelBench's correctness check for level-2 problems 33 and 39 (and the original 39).

    Training mode under no_grad, fp32 with TF32 off, torch.rand inputs, five seeds,
    allclose(atol=rtol=1e-4) of the output and the running stats against the eager model. Exits 1
    where a shape fails a seed. With --time, then each problem file of examples/ is timed as the
    evaluator times it (cutlass_fused.kernelbench.time_call: a fresh model, the median of 100
    CUDA-event trials after 3 warm-up calls), Model and ModelNew in turn in each round; the speedup
    is Model's median over ModelNew's, of the same round.
    """
    dev = cuda_device("kernelbench_check")
    failures = check_seed_shapes(dev, args.family)
    if args.time:
        with cutlass_fused.use_kernel_family(args.family):
            time_problems(args)
    return 1 if failures else 0


def time_problems(args):
    """kernelbench_check --time: each problem's Model and ModelNew, as the evaluator times them."""
    from cutlass_fused.kernelbench import time_call
    rows = []
    for number, file in [(33, "kernelbench_33_gemm_scale_batchnorm.py"), (39, "kernelbench_39_gemm_scale_batchnorm.py")]:
        spec = importlib.util.spec_from_file_location(f"kernelbench_{number}", EXAMPLES / file)
        problem = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(problem)
        for r in range(args.rounds):
            eager, _ = time_call(problem, problem.Model)
            ours, _ = time_call(problem, problem.ModelNew)
            rows.append({"problem": number, "round": r, "family": args.family, "eager_ms": eager, "ours_ms": ours,
                         "speedup": eager / ours})
            print(f"kernelbench time problem {number} round {r} family={args.family}: Model {eager:.3f} ms, "
                  f"ModelNew {ours:.3f} ms, {eager / ours:.3f}x")
            torch.cuda.empty_cache()
        best = statistics.median(row["speedup"] for row in rows if row["problem"] == number)
        print(f"kernelbench time problem {number}: median speedup {best:.3f}x over {args.rounds} rounds")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = timing.meta(sys.argv[1:], torch.device("cuda"))
        meta["command"] = "python benchmarks/accuracy.py " + " ".join(sys.argv[1:])
        (args.out / "kernelbench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def check_seed_shapes(dev, family):
    """kernelbench_check's five seeds at each shape; the number of shapes that failed one."""
    torch.backends.cuda.matmul.allow_tf32 = False
    failures = 0
    for m, k, n in [(1024, 8192, 8192), (16384, 4096, 4096), (128, 1024, 512)]:
        passed, worst = 0, 0.0
        for trial in range(5):
            torch.manual_seed(trial)
            ref = SeedModel(k, n).to(dev)
            ours = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=dev)
            ours.load_state_dict(ref.state_dict())
            x = torch.rand(m, k, device=dev)
            with torch.no_grad(), cutlass_fused.use_kernel_family(family):
                y_ref, y = ref(x), ours(x)
            pairs = [(y, y_ref), (ours.bn.running_mean, ref.bn.running_mean),
                     (ours.bn.running_var, ref.bn.running_var)]
            ok = all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in pairs)
            worst = max(worst, (y - y_ref).abs().max().item())
            passed += ok
        failures += passed < 5
        print(f"kernelbench check {m}x{k}x{n} family={family}: {passed}/5 passed, max |y - eager| {worst:.3g}")
    return failures


if __name__ == "__main__":
    sys.exit(cli.main())
