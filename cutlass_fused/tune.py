"""python -m cutlass_fused.tune: time every built GEMM of one family and dtype on the layer.

    python -m cutlass_fused.tune [--shape B,IN,OUT ...] [--dtype bf16|f16|tf32|f32] [--family sm90|sm80]
                                 [--kernel NAME ...] [--swizzle 1,2,4,8] [--raster -,m,n] [--out DIR]

Each candidate runs the layer's eval and training forward (no grad), selected through
$CUTLASS_FUSED_KERNEL, and is reported as a ratio to torch.mm of the same shape and run.
Statistics kernels (mode "stats") run the training forward only; eval kernels run it with
the GEMM statistics off ($CUTLASS_FUSED_STATS=0).
The kernels are codegen/kernels.py's rows; the first row of a (family, dtype) is the default.
--swizzle and --raster also time each kernel in each sm90 tile order (the persistent scheduler's
swizzle and raster direction, through $CUTLASS_FUSED_SWIZZLE and $CUTLASS_FUSED_RASTER; "-" is
CUTLASS's own raster choice).
f32 is fp32 with TF32 disallowed: the f32x3 (3xTF32) kernels.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

import cutlass_fused
from cutlass_fused.bench import SHAPES, Case, median_ms, meta, parse_shape


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m cutlass_fused.tune", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=parse_shape, action="append", help="B,IN,OUT (repeatable)")
    ap.add_argument("--dtype", choices=("bf16", "f16", "tf32", "f32"), default="bf16")
    ap.add_argument("--family", choices=("sm90", "sm80"), default="sm90")
    ap.add_argument("--kernel", action="append", help="only this kernel (repeatable)")
    ap.add_argument("--swizzle", type=lambda v: v.split(","), default=["1"], help="swizzle sizes, e.g. 1,2,4,8")
    ap.add_argument("--raster", type=lambda v: v.split(","), default=["-"], help="raster orders, e.g. -,m,n")
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
        if s not in ("1", "2", "4", "8") or r not in ("-", "m", "n"):
            raise SystemExit(f"cutlass_fused.tune: expected --swizzle in 1,2,4,8 and --raster in -,m,n, got {s} {r}")
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    print(f"{'shape':16s} {'kernel':40s} {'order':>6s} {'eval x mm':>10s} {'train x mm':>10s}")
    for shape in args.shape or SHAPES:
        case = Case(shape, args.dtype, device)
        mm = median_ms(case.fn("torch.mm", "train"), True)
        for name in names:
            for swizzle, raster in orders:
                rows.append(time_kernel(case, name, stem, mm, args.family, swizzle, raster))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps({"meta": meta(argv, device), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out / 'tune.json'}")
    return 0


def time_kernel(case, name, stem, mm, family, swizzle, raster):
    """One kernel in one tile order on one shape: a row of tune.json, printed as it is measured."""
    # A stats kernel serves only the training forward. An eval kernel serves training
    # only with the GEMM statistics off (they take the stats kernel's default).
    stats = name.startswith(stem + "stats_")
    env = {"CUTLASS_FUSED_KERNEL": name, "CUTLASS_FUSED_STATS": "1" if stats else "0",
           "CUTLASS_FUSED_SWIZZLE": swizzle, "CUTLASS_FUSED_RASTER": "" if raster == "-" else raster}
    shape = "x".join(map(str, case.shape))
    order = f"s{swizzle}{raster}"
    row = {"shape": list(case.shape), "dtype": case.dtype_name, "kernel": name, "swizzle": int(swizzle), "raster": raster}
    os.environ.update(env)
    try:
        with cutlass_fused.use_kernel_family(family):
            ms = {mode: median_ms(case.fn("cutlass_fused", mode), True)
                  for mode in (("train",) if stats else ("eval", "train"))}
    except RuntimeError as e:  # a candidate that cannot run this shape (can_implement) is reported
        print(f"{shape:16s} {name:40s} {order:>6s} cannot run: {str(e)[:120]}")
        return {**row, "error": str(e)}
    finally:
        for k in env:
            del os.environ[k]
    ev = f"{ms['eval'] / mm:10.3f}" if "eval" in ms else f"{'-':>10s}"
    print(f"{shape:16s} {name:40s} {order:>6s} {ev} {ms['train'] / mm:10.3f}", flush=True)
    return {**row, "mm_ms": mm, **{f"{m}_ms": t for m, t in ms.items()}}


if __name__ == "__main__":
    sys.exit(main())
