"""Our kernels, timed apart and against cuBLAS: one subcommand a question.

    python benchmarks/kernels.py COMMAND [options]      (COMMAND --help for its options)

Kernel times come from torch.profiler, call times from cutlass_fused.timing (do_bench medians); the
candidates of a comparison run in rounds, their order reversed every other round, so that the
GPU's clock drift hits them alike. The layer's own rows against torch.mm and torch.compile are
`python -m cutlass_fused.bench`.
"""
import contextlib
import copy
import statistics
import sys

import torch
import torch.nn.functional as F

import cutlass_fused
from _common import Commands, arg, cuda_device, shape
from cutlass_fused import bench, fp8
from cutlass_fused.ops import ops
from cutlass_fused.seed import SeedModel
from cutlass_fused.timing import alternating, events_ms, graphed, median_ms, profile

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
ROUNDS = arg("--rounds", type=int, default=3, help="rounds over the candidates (default 3)")

cli = Commands(__doc__)


def short_name(kernel):
    """A kernel's name as one line's listing needs it: without the return type, the namespaces
    and the template arguments (every CUTLASS GEMM reads cutlass::device_kernel)."""
    name = kernel.removeprefix("void ").replace("(anonymous namespace)::", "")
    name = name.split("<")[0].split("(")[0]
    return name.removeprefix("cutlass_fused::").strip()


@cli.command(
    arg("--dtype", action="append", choices=DTYPES, help="repeatable; default bf16"),
    arg("--shape", action="append", type=shape, metavar="B,N", help="repeatable; default four shapes"),
    ROUNDS,
    arg("--kernels", action="append", choices=["passes", "slab", "cooperative"],
        help="repeatable; default passes and slab"),
    arg("--act", action="append", choices=["none", "relu", "gelu", "silu"],
        help="the activation whose derivative the backward folds in; repeatable, default none"),
    arg("--by-kernel", action="store_true", help="also each kernel's median µs"),
    arg("--cold", action="store_true", help="a 256 MiB write before each call (L2 flushed)"))
def backward_time(args):
    """The batch-norm backward's GPU time by kernel choice.

    The two passes (column sums, then dh) against the slab kernel or the cooperative kernel
    (cutlass_fused.overrides(backward=...)), summed over the kernels a call launches (torch.profiler,
    20 calls a round, median of rounds), the choices timed in turn.

    --cold writes a 256 MiB buffer before each call, as do_bench does, and counts only our kernels:
    so that a call's first pass does not find dy and h in L2 from the call before, which
    back-to-back calls of one backward leave there and a training step's does not (its dy is new,
    its h was written a layer's forward ago).
    """
    dev = cuda_device("backward_time")
    choices = args.kernels or ["passes", "slab"]
    for dtype, act in ((d, a) for d in args.dtype or ["bf16"] for a in args.act or ["none"]):
        for m, n in args.shape or [(256, 8192), (512, 8192), (1024, 8192), (256, 4096)]:
            h = torch.randn(m, n, device=dev).to(DTYPES[dtype])
            scale, gamma = torch.randn(n, device=dev), torch.randn(n, device=dev)
            stats = torch.stack([h.double().sum(0), (h.double() ** 2).sum(0)])
            _, mean, invstd = ops.batch_norm_finalize(h, stats, scale, m, gamma, None, 1e-5)
            dy = torch.randn_like(h)
            beta = torch.randn(n, device=dev)
            backward = lambda: ops.batch_norm_backward(dy, h, mean, invstd, scale, gamma, 1e-5, beta, act)
            flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev) if args.cold else None
            call = (lambda: (flush.zero_(), backward())) if args.cold else backward
            us = {c: [] for c in choices}
            per_kernel = {c: {} for c in choices}
            for c in alternating(choices, args.rounds):
                with cutlass_fused.overrides(backward=c):
                    kernels = profile(call, calls=20)[1]
                if args.cold:
                    kernels = {k: t for k, t in kernels.items() if "cutlass_fused" in k}
                us[c].append(sum(kernels.values()))
                for name, t in kernels.items():
                    per_kernel[c].setdefault(name, []).append(t)
            print(f"{dtype} {act} {m}x{n}: " + ", ".join(
                f"{c} {statistics.median(v):6.1f} us (rounds {', '.join(f'{t:.1f}' for t in v)})"
                for c, v in us.items()), flush=True)
            if args.by_kernel:
                for c, kernels in per_kernel.items():
                    for name, v in kernels.items():
                        print(f"    {c}: {statistics.median(v):7.1f} us  {name[:110]}")


def forced_call(fn, row):
    with cutlass_fused.overrides(kernel=row):
        return fn()


@cli.command(
    arg("--shape", action="append", type=shape, metavar="B,N,K",
        help="batch, the layer's features, the next Linear's outputs; repeatable; default three shapes"),
    arg("--act", action="append", choices=["none", "relu", "leaky_relu"], help="repeatable; default relu"),
    arg("--kernel", action="append", default=[], help="also the grad route forced to this grad row; repeatable"),
    ROUNDS, arg("--cold", action="store_true", help="a 256 MiB write before each call (L2 flushed)"))
def backward_linear(args):
    """The BN backward of a layer whose y feeds a Linear (issue 71, item 1), by route, bf16.

    mm+backward: the next Linear's dX GEMM in torch.mm, then batch_norm_backward (its sums reading dy
    and h, then dh); grad: batch_norm_backward_linear, whose GEMM makes g and the sums in its epilogue,
    then one pass (dh). Each route's kernels summed (torch.profiler, 20 calls a round, median of
    rounds), beside torch.mm's dX GEMM alone, and the wall time a call (do_bench) as a ratio to
    torch.mm's.
    """
    dev = cuda_device("backward_linear")
    for act in args.act or ["relu"]:
        for m, n, k in args.shape or [(1024, 8192, 8192), (16384, 4096, 4096), (4096, 4096, 4096)]:
            g = torch.Generator(device=dev).manual_seed(0)
            h = torch.randn(m, n, device=dev, generator=g).bfloat16()
            vec = lambda: torch.randn(n, device=dev, generator=g)
            scale, gamma, beta = vec(), vec(), vec()
            stats = torch.stack([h.double().sum(0), (h.double() ** 2).sum(0)])
            _, mean, invstd = ops.batch_norm_finalize(h, stats, scale, m, gamma, beta, 1e-5)
            dz = torch.randn(m, k, device=dev, generator=g).bfloat16()
            w2 = (torch.randn(k, n, device=dev, generator=g) / k ** 0.5).bfloat16()
            bn = (mean, invstd, scale, gamma, 1e-5, beta, act, 0.01, torch.float32)
            grad = lambda: ops.batch_norm_backward_linear(dz, w2, h, *bn, "sm90")
            calls = {"torch.mm": lambda: torch.mm(dz, w2),
                     "mm+backward": lambda: ops.batch_norm_backward(torch.mm(dz, w2), h, *bn), "grad": grad}
            for row in args.kernel:
                calls[row] = lambda row=row: forced_call(grad, row)
            flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev) if args.cold else None
            us = {c: [] for c in calls}
            by_kernel = {c: {} for c in calls}
            ms = {c: [] for c in calls}
            for c in alternating(list(calls), args.rounds):
                fn = (lambda f=calls[c]: (flush.zero_(), f())) if args.cold else calls[c]
                kernels = profile(fn, calls=20)[1]
                if args.cold:
                    kernels = {name: t for name, t in kernels.items()
                               if "elementwise" not in name and "fill" not in name}
                us[c].append(sum(kernels.values()))
                for name, t in kernels.items():
                    by_kernel[c].setdefault(name, []).append(t)
                ms[c].append(median_ms(calls[c], True))
            mm = statistics.median(ms["torch.mm"])
            print(f"bf16 {act} {m}x{n}x{k}: " + ", ".join(
                f"{c} {statistics.median(v):7.1f} us GPU, x mm {statistics.median(ms[c]) / mm:.3f}"
                for c, v in us.items()), flush=True)
            for c in ("mm+backward", "grad", *args.kernel):
                for name, v in by_kernel[c].items():
                    print(f"    {c}: {statistics.median(v):7.1f} us  {name[:100]}")


def kernel_part(name):
    """Which part of a fused bf16 model's step a profiled kernel is: "gemm" (CUTLASS's and
    cuBLAS's), "bn backward" (csrc/kernels/bn_backward.cu's, and the column partials and their
    reduction, which only the backward's passes run where the statistics GEMM makes the forward's
    sums), "bn forward" (the training tails), or "other" (fills, casts, the loss)."""
    if "device_kernel" in name or "nvjet" in name or "gemm" in name.lower() and "grad_gemm" not in name:
        return "gemm"
    if any(k in name for k in ("batch_norm_backward", "grad_input", "grad_partials", "grad_gemm_columns",
                               "column_partials", "reduce_partials")):
        return "bn backward"
    if any(k in name for k in ("batch_norm_train", "finalize_normalize", "update_running")):
        return "bn forward"
    return "other"


@cli.command(
    arg("--shape", action="append", type=shape, metavar="B,N",
        help="batch and width (both Linears N -> N); repeatable; default the three headline shapes"),
    ROUNDS)
def two_block(args):
    """A two-block model's fwd+bwd in CUDA graphs against its GEMMs in torch.mm (issue 71's target).

    Linear(N, N, bias=False) -> BatchNorm1d -> ReLU -> Linear(N, N, bias=False) -> BatchNorm1d in
    bf16, the input requiring grad, gradients set to None before each call: eager PyTorch, fuse() of
    it (its blocks linked: the first block's BN backward in the second's dX GEMM), fuse(link=False)
    of it, and its six GEMMs (two forward, two dX, two dW, with their operands' layouts) in torch.mm,
    each captured in one CUDA graph, do_bench medians in rounds. Then each fused call's kernels by
    part (torch.profiler, outside graphs; the linked call's grad GEMM is a "gemm"), and the BN
    backward's against its one-pass byte floor: dy and h read and dh written once, at the rate of a
    1 GiB copy timed in the same run.
    """
    dev = cuda_device("two_block")
    copy_src = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev)
    copy_dst = torch.empty_like(copy_src)
    copy_rate = 2 * copy_src.numel() * 2 / (median_ms(lambda: copy_dst.copy_(copy_src), True) * 1e-3)
    del copy_src, copy_dst
    print(f"copy rate {copy_rate / 1e12:.2f} TB/s (1 GiB, read and written)")
    for m, n in args.shape or [(1024, 8192), (16384, 4096), (4096, 4096)]:
        torch.manual_seed(0)
        block = lambda: [torch.nn.Linear(n, n, bias=False), torch.nn.BatchNorm1d(n)]
        model = torch.nn.Sequential(*block(), torch.nn.ReLU(), *block()).to(dev, torch.bfloat16)
        fused, report = cutlass_fused.fuse(copy.deepcopy(model))
        if len(report.fused) != 2 or len(report.linked) != 1:
            raise SystemExit(f"two_block: expected fuse() to fuse and link both blocks, but it reported\n{report}")
        unlinked, _ = cutlass_fused.fuse(copy.deepcopy(model), link=False)
        x = torch.randn(m, n, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

        def fwd_bwd(module):
            def call():
                module.zero_grad(set_to_none=True)
                x.grad = None
                module(x).backward(dy)
            return call

        a, b = (torch.randn(m, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
        w = torch.randn(n, n, device=dev, dtype=torch.bfloat16)

        def gemms():
            for _ in range(2):
                torch.mm(a, w.t())  # forward
                torch.mm(b, w)  # dX
                torch.mm(b.t(), a)  # dW
        calls = {"torch.mm x6": gemms, "eager": fwd_bwd(model), "fused": fwd_bwd(fused),
                 "fused unlinked": fwd_bwd(unlinked)}
        graphs = {name: graphed(fn) for name, fn in calls.items()}
        times = {name: [] for name in calls}
        for name in alternating(list(calls), args.rounds):
            times[name].append(median_ms(graphs[name], True))
        floor = statistics.median(times["torch.mm x6"])
        print(f"bf16 two blocks {m}x{n}: " + ", ".join(
            f"{name} {statistics.median(t):.3f} ms (x its GEMMs {statistics.median(t) / floor:.3f})"
            for name, t in times.items()), flush=True)
        one_pass = 3 * m * n * 2 / copy_rate * 1e6 * 2  # two layers' dy, h and dh
        for row in ("fused", "fused unlinked"):
            parts = {}
            for name, us in profile(calls[row], calls=10)[1].items():
                parts[kernel_part(name)] = parts.get(kernel_part(name), 0.0) + us
            print(f"    {row} kernels, us a call: " + ", ".join(f"{p} {us:.1f}" for p, us in sorted(parts.items()))
                  + f"; BN backward x its one-pass floor ({one_pass:.1f} us) "
                  f"{parts.get('bn backward', 0.0) / one_pass:.2f}", flush=True)


@cli.command(
    arg("--dtype", action="append", choices=bench.DTYPES, help="repeatable; default bf16 and tf32"),
    arg("--shape", action="append", type=shape, metavar="B,IN,OUT", help="repeatable; default three shapes"),
    ROUNDS,
    arg("--tail", action="append", choices=["cooperative", "slab", "small"],
        help="force this tail (overrides(tail=...)); repeatable, the tails timed in turn; default the plan's"))
def tail_time(args):
    """The training forward's two kernels timed apart: the GEMM and the tail after it.

    Each from torch.profiler (median of rounds), with the train forward and torch.mm timed in turn
    (do_bench, median), so that a change to the tail is judged by its own microseconds and by the
    ratio users see.
    """
    dev = cuda_device("tail_time")
    tails = args.tail or [None]
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for dtype in args.dtype or ["bf16", "tf32"]:
            torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
            for shp in args.shape or [(1024, 8192, 8192), (16384, 4096, 4096), (4096, 4096, 4096)]:
                case = bench.Case(shp, dtype, dev)
                train, mm = case.fn("cutlass_fused", "train"), case.fn("torch.mm", "train")
                gemm, tail, ratio = ({t: [] for t in tails} for _ in range(3))
                for t in alternating(tails, args.rounds):
                    with cutlass_fused.overrides(tail=t or "auto"):
                        _, kernels = profile(train, calls=20)
                        # The GEMM is the longest kernel; the tail, the other one (two launches a forward).
                        times = sorted(kernels.values(), reverse=True)
                        gemm[t].append(times[0])
                        tail[t].append(sum(times[1:]))
                        ratio[t].append(median_ms(train, True) / median_ms(mm, True))
                for t in tails:
                    print(f"{dtype} {'x'.join(map(str, shp))}{f' {t}' if t else ''}: "
                          f"GEMM {statistics.median(gemm[t]):8.1f} us, tail {statistics.median(tail[t]):6.1f} us "
                          f"(rounds {', '.join(f'{v:.1f}' for v in tail[t])}), "
                          f"train x mm {statistics.median(ratio[t]):.3f}", flush=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32


@cli.command(
    ROUNDS,
    arg("--kernel", action="append", help="a statistics kernel; repeatable, default every f32x3 one built"),
    arg("--swizzle", action="append", default=[],
        help="also the default statistics kernel in this tile order (overrides(swizzle=...)); repeatable"))
def stats_ab(args):
    """Interleaved A/B of the fp32 (TF32 off) training forward's statistics GEMMs.

    Each statistics-GEMM candidate, the exact pass (overrides(stats_gemm=False)) and eval, against
    eager, in rounds so that clock drift hits all alike; then the per-kernel split of each from
    torch.profiler. Each line: ms (the range over the rounds) and eager's time over this one's.
    """
    dev = cuda_device("stats_ab")
    torch.backends.cuda.matmul.allow_tf32 = False
    kernels = args.kernel or [k for k in cutlass_fused.built_kernels() if k.startswith("sm90_f32x3_stats_")]
    # (label, cutlass_fused.overrides() or None for eager, training)
    configs = [(k.split("_stats_")[1], {"kernel": k}, True) for k in kernels]
    configs += [(f"default s{s}", {"swizzle": int(s)}, True) for s in args.swizzle]
    configs += [("pass", {"stats_gemm": False}, True), ("eval", {}, False), ("eager", None, True)]
    for m, k, n in [(1024, 8192, 8192), (16384, 4096, 4096)]:
        torch.manual_seed(0)
        seed = SeedModel(k, n).to(dev)
        ours = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=dev)
        ours.load_state_dict(seed.state_dict())
        x = torch.randn(m, k, device=dev)
        times = {}
        with torch.no_grad():
            for _ in range(args.rounds):
                for label, env, train in configs:
                    mod = seed if env is None else ours
                    mod.train(train)
                    with cutlass_fused.overrides(**(env or {})):
                        times.setdefault(label, []).append(events_ms(lambda: mod(x), warmup=3, calls=20))
            eager = statistics.median(times["eager"])
            print(f"{m}x{k}x{n}, ms (median of {args.rounds} rounds; eager / this):")
            for label, env, train in configs:
                t = statistics.median(times[label])
                split = ""
                if env is not None:
                    ours.train(train)
                    with cutlass_fused.overrides(**env):
                        _, per_kernel = profile(lambda: ours(x), calls=10)
                    split = "  " + "; ".join(f"{us:.1f} {short_name(name)}" for name, us in
                                             sorted(per_kernel.items(), key=lambda kv: -kv[1]))
                print(f"  {label:24s} {t:8.4f} ({min(times[label]):.4f}-{max(times[label]):.4f})  "
                      f"{eager / t:5.3f}x{split}")


BITS_SHAPES = [(128, 96), (3, 1000), (300, 769), (1000, 5125), (1024, 8192), (2048, 4096), (520, 2056)]


def bits_outputs(device, dt, m, n, act, backward):
    """A fixed-seed layer's y (the plan's, and the column pass's), x's gradient, buffers and
    parameter gradients, copied to the CPU."""
    torch.manual_seed(0)
    layer = cutlass_fused.LinearScaleBatchNorm1d(64, n, device=device, dtype=DTYPES[dt], activation=act)
    x = torch.randn(m, 64, device=device, dtype=DTYPES[dt], requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=DTYPES[dt])
    with cutlass_fused.overrides(backward=backward):
        y = layer(x)
        y.backward(dy)
    with cutlass_fused.overrides(stats_gemm=False):
        y_pass = layer(x.detach())
    grads = [p.grad for p in layer.parameters() if p.grad is not None]
    return [t.detach().cpu() for t in [y, y_pass, x.grad, *layer.buffers(), *grads]]


def same_bits(u, v):
    bytes_u, bytes_v = (t.reshape(-1).view(torch.uint8) for t in (u, v))
    return u.dtype == v.dtype and u.shape == v.shape and torch.equal(bytes_u, bytes_v)


@cli.command(
    arg("action", choices=["save", "compare"], help="save this build's outputs, or compare two saved files"),
    arg("files", nargs="+", metavar="FILE.pt", help="save: the file to write; compare: the two files"),
    arg("--shape", action="append", type=shape, metavar="B,N", help="repeatable; default seven shapes"))
def bits_ab(args):
    """Whether two builds give the same bits.

    Fixed-seed layers' y (the plan's, and with the column pass, overrides(stats_gemm=False)), every
    gradient and the running stats, per backward kernel (passes, slab, cooperative), saved by one
    build and compared with another's. For a change meant to keep the bits (a reordering, a new
    layout): run `bits_ab save A.pt` with each build's .so, then `bits_ab compare A.pt B.pt`, which
    exits 1 where they differ.

    A case that cannot run (a slab past its rows) is saved as its error, which must match too. Off
    CUDA it runs the CPU path (a check of the tool, not of kernels). Compare files saved with the
    same --shape.
    """
    want = {"save": 1, "compare": 2}[args.action]
    if len(args.files) != want:
        raise SystemExit(f"bits_ab {args.action}: expected {want} file(s), got {len(args.files)}")
    if args.action == "save":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        res = {}
        for dt in DTYPES:
            for m, n in args.shape or BITS_SHAPES:
                for act in [None, "relu", "gelu"]:
                    for backward in ["passes", "slab", "cooperative"]:
                        key = (dt, m, n, act, backward)
                        try:
                            res[key] = bits_outputs(device, dt, m, n, act, backward)
                        except (RuntimeError, ValueError) as e:
                            res[key] = str(e)[:200]
        torch.save(res, args.files[0])
        print(f"cases {len(res)}, cannot run {sum(isinstance(v, str) for v in res.values())}")
        return 0
    a, b = (torch.load(p) for p in args.files)
    if a.keys() != b.keys():
        raise SystemExit("bits_ab compare: the two files hold different cases")
    equal = differ = 0
    for key in a:
        if isinstance(a[key], str) or isinstance(b[key], str):
            ok = a[key] == b[key]
        else:
            ok = len(a[key]) == len(b[key]) and all(same_bits(u, v) for u, v in zip(a[key], b[key]))
        equal += ok
        differ += not ok
        if not ok:
            print("differs:", key)
    print(f"bit-identical {equal}, differing {differ}")
    return 1 if differ else 0


ATEN = {"none": lambda t: t, "relu": F.relu, "leaky_relu": F.leaky_relu, "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}


@cli.command(
    arg("--shape", action="append", type=shape, metavar="B,IN,OUT", help="repeatable; default three shapes"),
    arg("--act", action="append", choices=list(ATEN), help="repeatable; default none, relu, gelu and silu"),
    ROUNDS,
    arg("--family", choices=["auto", "sm90", "sm80"], default="auto", help="kernel family (default auto)"),
    arg("--dtype", choices=["bf16", "f16"], default="bf16", help="default bf16"))
def eval_activation(args):
    """Eval with an activation in the GEMM's epilogue, against torch.mm and a separate ATen pass.

    Our eval forward inside frozen_weights() (the fold kept, so the GEMM is the call's only kernel,
    the activation in its epilogue) against torch.mm of the same shape, in the same run, with each
    activation; and the activation as a separate ATen pass after the eval GEMM, the route before
    the epilogue took it. Each line: µs a call (do_bench's median, the median of rounds) and ×
    torch.mm.
    """
    dev = cuda_device("eval_activation")
    dtype = DTYPES[args.dtype]
    acts = args.act or ["none", "relu", "gelu", "silu"]
    for m, k, n in args.shape or [(4096, 4096, 4096), (16384, 4096, 4096), (1024, 8192, 8192)]:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5
        layers = {a: cutlass_fused.LinearScaleBatchNorm1d(k, n, device=dev, dtype=dtype,
                                                          activation=None if a == "none" else a).eval()
                  for a in acts}
        plain = layers[acts[0]]
        with torch.no_grad():
            for layer in layers.values():
                layer.load_state_dict(plain.state_dict())
                layer.bn.running_var.uniform_(0.5, 2)
        fns = {"torch.mm": lambda: torch.mm(x, w.t())}
        for a, layer in layers.items():
            fns[f"ours {a}"] = lambda layer=layer: layer(x)
            if a != "none":
                fns[f"ours none + ATen {a}"] = lambda a=a: ATEN[a](plain(x))
        times = {name: [] for name in fns}
        with (torch.no_grad(), cutlass_fused.use_kernel_family(args.family),
              cutlass_fused.frozen_weights(*layers.values())):
            for name in alternating(list(fns), args.rounds):
                times[name].append(median_ms(fns[name], cuda=True) * 1e3)
        mm = statistics.median(times["torch.mm"])
        print(f"{args.dtype} {m}x{k}x{n} family {args.family}: torch.mm {mm:.1f} us")
        for name, ts in times.items():
            if name != "torch.mm":
                t = statistics.median(ts)
                print(f"  {name:28s} {t:8.1f} us  {t / mm:.3f} x mm")


def forcing(cand):
    """overrides forcing (row, swizzle); None forces nothing (the floors and bf16)."""
    row, swizzle = cand if cand is not None else (None, 0)
    return cutlass_fused.overrides(kernel=row, swizzle=swizzle or None)


def forced(layer, x, cand):
    with forcing(cand):
        return layer(x)


@cli.command(
    arg("--shape", action="append", type=shape, metavar="B,IN,OUT", help="repeatable; default three shapes"),
    ROUNDS,
    arg("--swizzle", type=lambda v: v.split(","), default=["auto"], metavar="S,S,...",
        help="tile-order swizzles to time each row in, e.g. auto,2,4,8 (default auto: the plan's)"))
def fp8_rows(args):
    """The e4m3 training forward by kernel row: each sm90 e4m3 statistics GEMM, forced in turn.

    Timed and checked beside the floors of the same run; per shape, medians of do_bench over the
    rounds:
    - torch.mm (bf16) and torch._scaled_mm (cuBLAS's e4m3 GEMM, bf16 out, per-tensor scales;
      promoted, and "fast" with use_fast_accum): the floors;
    - bf16: our bf16 training forward;
    - each e4m3 row (in each --swizzle of the persistent scheduler; "auto" is the plan's): the layer
      with Float8Recipe() (quantize, the row's GEMM, the tail; fast_accum=True for a
      fast-accumulate row, which the plan takes only under that recipe), its GEMM's own GPU µs
      (torch.profiler), and y's max error against float64 of the same quantized operands, so a
      fast-accumulate row is judged by what it costs in accuracy as well as what it saves.
    """
    dev = cuda_device("fp8_rows")
    if not fp8.e4m3_kernels(dev):
        raise SystemExit("fp8_rows: needs an sm90 GPU and a build with the e4m3 rows")
    if any(w not in ("auto", "1", "2", "4", "8") for w in args.swizzle):
        raise SystemExit(f"fp8_rows: expected --swizzle in auto,1,2,4,8, got {args.swizzle}")
    kernels = [n for n in ops.kernel_names() if "_e4m3_stats_" in n]
    # A candidate: (row, swizzle), named "row" for the plan's swizzle, else "row s<swizzle>".
    cands = {(n if w == "auto" else f"{n} s{w}"): (n, 0 if w == "auto" else int(w))
             for n in kernels for w in args.swizzle}
    for m, k, n in args.shape or [(16384, 4096, 4096), (4096, 4096, 4096), (1024, 8192, 8192)]:
        torch.manual_seed(0)
        base = SeedModel(k, n).to(dev, torch.bfloat16)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ours = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=dev, dtype=torch.bfloat16, fp8=fp8.Float8Recipe())
        ours.load_state_dict(base.state_dict())
        fast = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=dev, dtype=torch.bfloat16,
                                                    fp8=fp8.Float8Recipe(fast_accum=True))
        fast.load_state_dict(base.state_dict())
        layer = {c: fast if "fastacc" in c else ours for c in cands}
        bf16 = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=dev, dtype=torch.bfloat16)
        bf16.load_state_dict(base.state_dict())
        ref = SeedModel(k, n).to(dev, torch.float64)
        ref.load_state_dict(base.state_dict())
        with torch.no_grad():
            y64_bf16 = ref(x.double())  # the unquantized model, for bf16's own error
            ref.gemm.weight.copy_(fp8.round_to_e4m3(base.gemm.weight).double())
            y64 = ref(fp8.round_to_e4m3(x).double())
        x8, _ = ops.quantize_e4m3(x)
        w8, _ = ops.quantize_e4m3(base.gemm.weight.detach())
        one = torch.ones((), device=dev)
        calls = {
            "torch.mm": lambda: torch.mm(x, base.gemm.weight.t()),
            "torch._scaled_mm": lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16),
            "torch._scaled_mm fast": lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16,
                                                              use_fast_accum=True),
            "bf16": lambda: bf16(x),
        }
        for c in cands:
            calls[c] = lambda c=c: layer[c](x)
        times = {name: [] for name in calls}
        with torch.no_grad():
            for name in alternating(list(calls), args.rounds):
                with forcing(cands.get(name)):
                    times[name].append(median_ms(calls[name], True))
            mm = statistics.median(times["torch.mm"])
            print(f"{m}x{k}x{n}: ms (x torch.mm); e4m3 rows: GEMM µs, max|y - float64 of the quantized model|")
            for name, t in times.items():
                ms = statistics.median(t)
                line = f"  {name:44s} {ms:8.4f}  {ms / mm:5.3f}"
                if name in cands:
                    _, by_kernel = profile(lambda: forced(layer[name], x, cands[name]), calls=5)
                    gemm = max(v for kname, v in by_kernel.items() if "cutlass" in kname and "e4m3" in kname)
                    err = (forced(layer[name], x, cands[name]).double() - y64).abs().max().item()
                    line += f"  GEMM {gemm:7.1f} µs  err {err:.4f}"
                print(line, flush=True)
            err_bf16 = (bf16(x).double() - y64_bf16).abs().max().item()
            print(f"  (bf16's own max|y - float64|: {err_bf16:.4f})")


@cli.command()
def fp8_casts(args):
    """The FP8 casts at the FP8 layer's shapes: current scaling against delayed scaling.

    Current scaling (an amax pass, then the cast) against delayed scaling (one cast that measures
    the amax), plain and transposing, beside a bf16 copy of x (HBM's pace). do_bench medians in µs,
    and the bytes each moves per second (bf16 in, e4m3 out).
    """
    dev = cuda_device("fp8_casts")
    for m, k in [(16384, 4096), (4096, 4096), (8192, 8192), (1024, 8192)]:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        s = torch.tensor(8.0, device=dev)
        rows = {"x.clone() (4 B)": (lambda: x.clone(), 4),
                "current (amax+cast, 5 B)": (lambda: ops.quantize_e4m3(x, 0), 5),
                "delayed (cast+amax, 3 B)": (lambda: ops.quantize_with_scale(x, s, fp8.E4M3, False), 3),
                "current transposed (6 B)": (lambda: ops.quantize_transposed(x, fp8.E4M3, 0), 6),
                "delayed transposed (4 B)": (lambda: ops.quantize_with_scale(x, s, fp8.E4M3, True), 4)}
        print(f"{m}x{k} bf16:")
        for name, (f, b) in rows.items():
            ms = median_ms(f, True)
            print(f"  {name:28s} {ms * 1e3:8.1f} us  {b * x.numel() / ms / 1e6:7.0f} GB/s")


@cli.command(
    arg("--shape", action="append", type=shape, metavar="M,K,N", help="repeatable; default 16384,4096,4096 and 4096^3"),
    ROUNDS)
def fp8_given_x8(args):
    """Issue 71's FP8 lead at its best, before it is built: a block's training forward with x arriving in e4m3.

    GPU time a call (torch.profiler, the kernels summed, median of rounds) of the bf16 training op
    against the e4m3 one over an x8 made once outside (the lead's x, which the block before would
    write): W's delayed cast (W moves every step), the operand scales, then
    linear_scale_batch_norm_train_fp8, without fast accumulation; and today's delayed e4m3 forward
    (x cast too). The tail still stores y in bf16 here, which the lead would store in e4m3.
    """
    dev = cuda_device("fp8_given_x8")
    for m, k, n in args.shape or [(16384, 4096, 4096), (4096, 4096, 4096)]:
        torch.manual_seed(0)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
        g, b = torch.ones(n, device=dev), torch.zeros(n, device=dev)
        rm, rv = torch.zeros(n, device=dev), torch.ones(n, device=dev)
        x8, s_x = ops.quantize_e4m3(x)
        s_x, s_w = s_x.reshape(1), fp8.scale_of(w).reshape(1)  # fp32, one element: the ops' scale form
        state = fp8.DelayedState(torch.zeros(16, 2, device=dev), torch.cat([s_x, s_w]))
        stats = (g, b, rm, rv, None, 0.1, 1e-5, "auto")

        def given_x8():
            w8 = ops.quantize_with_scale(w, s_w, fp8.E4M3)[0]
            bias8, sc = ops.fp8_operand_scales(s_x, s_w, bias, None)
            ops.linear_scale_batch_norm_train_fp8(x8, w8, bias8, sc, *stats, "relu")

        calls = {"bf16": lambda: ops.linear_scale_batch_norm_train(x, w, bias, None, *stats, False, "relu"),
                 "e4m3, x given in e4m3": given_x8,
                 "e4m3 delayed today": lambda: fp8.train_e4m3(x, w, bias, None, *stats, "relu", state=state)}
        gpu, kernels = {name: [] for name in calls}, {}
        for name in alternating(list(calls), args.rounds):
            kernels[name] = profile(calls[name], calls=10)[1]  # the last round's, for the listing
            gpu[name].append(sum(kernels[name].values()))
        base = statistics.median(gpu["bf16"])
        for name, t in gpu.items():
            top = sorted(kernels[name].items(), key=lambda kv: -kv[1])[:4]
            print(f"{m}x{k}x{n} {name}: GPU {statistics.median(t):7.1f} us a call, bf16 / this "
                  f"{base / statistics.median(t):.3f}; " + ", ".join(f"{us:.1f} {short_name(kn)}" for kn, us in top),
                  flush=True)


FP8_EVAL_RECIPES = {"bf16": None, "fp8-emulated": cutlass_fused.Float8Recipe(emulate=True),
                    "fp8": cutlass_fused.Float8Recipe(), "fp8-fast": cutlass_fused.Float8Recipe(fast_accum=True)}


def fp8_eval_rows(m, k, n, dev):
    """{row: call}, and {row: the layer a row runs inside frozen_weights() of}."""
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    out, frozen = {"torch.mm": lambda: torch.mm(x, w.t())}, {}
    for name, recipe in FP8_EVAL_RECIPES.items():
        layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, activation="relu", device=dev, dtype=torch.bfloat16,
                                                     fp8=recipe).eval()
        out[name] = lambda layer=layer: layer(x)
        if recipe is not None and not recipe.emulate:  # W8 kept between calls
            out[f"{name}, frozen_weights()"] = out[name]
            frozen[f"{name}, frozen_weights()"] = layer
    return out, frozen


@cli.command(
    arg("--shape", action="append", type=shape, metavar="M,K,N", help="repeatable; default three shapes"),
    ROUNDS)
def fp8_eval(args):
    """The FP8 layer's eval forward (inference) against bf16's and torch.mm.

    torch.mm of the shape, our bf16 eval, the emulated FP8 eval (Float8Recipe(emulate=True): the
    rounding through the bf16 kernels) and the e4m3 eval (Float8Recipe(): quantize x, and W outside
    frozen_weights(), then one e4m3 GEMM with the fold) and the same with fast_accum=True (the
    fast-accumulate eval row), in torch.no_grad; do_bench medians in rounds, each row's ratio to the
    same run's torch.mm, and the e4m3 rows' kernels from torch.profiler.
    """
    dev = cuda_device("fp8_eval")
    for m, k, n in args.shape or [(16384, 4096, 4096), (4096, 4096, 4096), (1024, 8192, 8192)]:
        calls, frozen = fp8_eval_rows(m, k, n, dev)
        scope = lambda name: cutlass_fused.frozen_weights(frozen[name]) if name in frozen else contextlib.nullcontext()
        times = {name: [] for name in calls}
        with torch.no_grad():
            for name in alternating(list(calls), args.rounds):
                with scope(name):
                    times[name].append(median_ms(calls[name], True))
            mm = statistics.median(times["torch.mm"])
            print(f"{m}x{k}x{n}, ms (x torch.mm):")
            for name, t in times.items():
                print(f"  {name:27s} {statistics.median(t):7.3f}  ({statistics.median(t) / mm:.3f})")
            for name in ("fp8", "fp8, frozen_weights()", "fp8-fast"):
                with scope(name):
                    launches, kernels = profile(calls[name])
                print(f"  {name} kernels: {launches:.0f} launches, {sum(kernels.values()):.1f} us a call")
                for kname, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:6]:
                    print(f"    {us:8.1f}  {kname[:100]}")


if __name__ == "__main__":
    sys.exit(cli.main())
