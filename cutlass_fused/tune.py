"""python -m cutlass_fused.tune: time every built GEMM of one family and dtype on the layer.

    python -m cutlass_fused.tune [--shape B,IN,OUT ...] [--dtype bf16|f16|tf32|f32] [--family sm90|sm80]
                                 [--kernel NAME ...] [--swizzle=auto,1,2,4,8] [--raster=-,m,n] [--rounds N]
                                 [--out DIR]

Each candidate runs the layer's eval and training forward (no grad), selected through
cutlass_fused.overrides(kernel=...), and is reported as the median, over --rounds, of its ratio to torch.mm of
the same shape timed right before it; the candidates' order is reversed every other round.
Statistics kernels (mode "stats") run the training forward only; eval kernels run it with
the GEMM statistics off (overrides(stats_gemm=False)).
The kernels are codegen/kernels.py's rows; the one with default=True of a (family, dtype, mode) is its default.
--swizzle and --raster also time each kernel in each sm90 tile order (the persistent scheduler's
swizzle and raster direction, through overrides(swizzle=..., raster=...); "auto" is the
plan's swizzle and "-" CUTLASS's raster choice).
f32 is fp32 with TF32 disallowed: the f32x3 (3xTF32) kernels.
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

import cutlass_fused
from cutlass_fused.bench import SHAPES, Case, parse_shape
from cutlass_fused.timing import alternating, median_ms, meta


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m cutlass_fused.tune", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=parse_shape, action="append", help="B,IN,OUT (repeatable)")
    ap.add_argument("--dtype", choices=("bf16", "f16", "tf32", "f32"), default="bf16")
    ap.add_argument("--family", choices=("sm90", "sm80"), default="sm90")
    ap.add_argument("--kernel", action="append", help="only this kernel (repeatable)")
    ap.add_argument("--swizzle", type=lambda v: v.split(","), default=["auto"],
                    help="swizzle sizes, e.g. auto,1,2,4,8 (auto: the dispatcher's choice)")
    ap.add_argument("--raster", type=lambda v: v.split(","), default=["-"], help="raster orders, e.g. -,m,n")
    ap.add_argument("--rounds", type=int, default=1, help="times each candidate; the median ratio is reported")
    ap.add_argument("--out", default=os.environ.get("OUT", "tune_out"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("cutlass_fused.tune: needs a CUDA GPU")
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = args.dtype == "tf32"
    try:
        return run(args, argv)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32


def run(args, argv):
    stem = f"{args.family}_{'f32x3' if args.dtype == 'f32' else args.dtype}_"
    names = [n for n in cutlass_fused.built_kernels() if n.startswith((stem + "eval_", stem + "stats_"))]
    if args.kernel:
        missing = sorted(set(args.kernel) - set(names))
        if missing:
            raise SystemExit(f"cutlass_fused.tune: --kernel {missing[0]} is not a built {stem}* kernel")
        names = [n for n in names if n in args.kernel]
    if not names:
        raise SystemExit(f"cutlass_fused.tune: this build has no {stem}eval_* kernels")
    orders = [(s, r) for s in args.swizzle for r in args.raster]
    for s, r in orders:
        if s not in ("auto", "1", "2", "4", "8") or r not in ("-", "m", "n"):
            raise SystemExit(f"cutlass_fused.tune: expected --swizzle in auto,1,2,4,8 and --raster in -,m,n, "
                             f"got {s} {r}")
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    print(f"{'shape':16s} {'kernel':40s} {'order':>7s} {'eval x mm':>10s} {'train x mm':>10s}")
    for shape in args.shape or SHAPES:
        case = Case(shape, args.dtype, device)
        mm = case.fn("torch.mm", "train")
        cands = [Candidate(case, n, stem, args.family, s, r) for n in names for s, r in orders]
        # Each candidate is timed right after torch.mm, in every round: the GPU's clocks drift as
        # it heats (docs/decisions.md, "Measuring"), and the ratio of neighbours cancels that.
        for c in alternating(cands, args.rounds):
            c.time(mm)
        for c in cands:
            rows.append(c.report())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps({"meta": meta(argv, device), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out / 'tune.json'}")
    return 0


class Candidate:
    """One kernel in one tile order on one shape, forced through cutlass_fused.overrides()."""

    def __init__(self, case, name, stem, family, swizzle, raster):
        self.case, self.name, self.family = case, name, family
        self.swizzle, self.raster = swizzle, raster
        # A stats kernel serves only the training forward. An eval kernel serves training
        # only with the GEMM statistics off (they take the stats kernel's default).
        stats = name.startswith(stem + "stats_")
        self.modes = ("train",) if stats else ("eval", "train")
        self.choices = {"kernel": name, "stats_gemm": stats, "swizzle": 0 if swizzle == "auto" else int(swizzle),
                        "raster": "auto" if raster == "-" else raster}
        self.ms, self.mm_ms, self.error = {m: [] for m in self.modes}, [], None

    def time(self, mm):
        if self.error:
            return
        try:
            with cutlass_fused.use_kernel_family(self.family), cutlass_fused.overrides(**self.choices):
                for mode in self.modes:
                    fn = self.case.fn("cutlass_fused", mode)
                    self.mm_ms.append(median_ms(mm, True))
                    self.ms[mode].append(median_ms(fn, True))
        except RuntimeError as e:  # a candidate that cannot run this shape (can_implement) is reported
            self.error = str(e)

    def ratio(self, mode):
        mms = self.mm_ms[self.modes.index(mode)::len(self.modes)]
        return statistics.median(t / m for t, m in zip(self.ms[mode], mms))

    def report(self):
        shape = "x".join(map(str, self.case.shape))
        order = f"s{self.swizzle}{self.raster}"
        row = {"shape": list(self.case.shape), "dtype": self.case.dtype_name, "kernel": self.name,
               "swizzle": self.swizzle, "raster": self.raster}
        if self.error:
            print(f"{shape:16s} {self.name:40s} {order:>7s} cannot run: {self.error[:120]}")
            return {**row, "error": self.error}
        ratios = {m: self.ratio(m) for m in self.modes}
        ev = f"{ratios['eval']:10.3f}" if "eval" in ratios else f"{'-':>10s}"
        print(f"{shape:16s} {self.name:40s} {order:>7s} {ev} {ratios['train']:10.3f}", flush=True)
        return {**row, "mm_ms": statistics.median(self.mm_ms), **{f"{m}_ms": statistics.median(t)
                for m, t in self.ms.items()}, **{f"{m}_x_mm": r for m, r in ratios.items()}}


if __name__ == "__main__":
    sys.exit(main())
