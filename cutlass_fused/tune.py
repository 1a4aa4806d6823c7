"""python -m cutlass_fused.tune: time every built GEMM of one family and dtype on the layer.

    python -m cutlass_fused.tune [--shape B,IN,OUT ...] [--dtype bf16|f16|tf32|f32] [--family sm90|sm80] [--out DIR]

Each candidate runs the layer's eval and training forward (no grad), selected through
$CUTLASS_FUSED_KERNEL, and is reported as a ratio to torch.mm of the same shape and run.
Statistics kernels (mode "stats") run the training forward only; eval kernels run it with
the GEMM statistics off ($CUTLASS_FUSED_STATS=0).
The kernels are codegen/kernels.py's rows; the first row of a (family, dtype) is the default.
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
    if not names:
        raise SystemExit(f"cutlass_fused.tune: this build has no {stem}eval_* kernels")
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    print(f"{'shape':16s} {'kernel':40s} {'eval x mm':>10s} {'train x mm':>10s}")
    for shape in args.shape or SHAPES:
        case = Case(shape, args.dtype, device)
        mm = median_ms(case.fn("torch.mm", "train"), True)
        for name in names:
            # A stats kernel serves only the training forward. An eval kernel serves training
            # only with the GEMM statistics off (they take the stats kernel's default).
            stats = name.startswith(stem + "stats_")
            os.environ["CUTLASS_FUSED_KERNEL"] = name
            os.environ["CUTLASS_FUSED_STATS"] = "1" if stats else "0"
            try:
                with cutlass_fused.use_kernel_family(args.family):
                    ms = {mode: median_ms(case.fn("cutlass_fused", mode), True)
                          for mode in (("train",) if stats else ("eval", "train"))}
            except RuntimeError as e:  # a candidate that cannot run this shape (can_implement) is reported
                print(f"{'x'.join(map(str, shape)):16s} {name:40s} cannot run: {str(e)[:120]}")
                rows.append({"shape": list(shape), "dtype": args.dtype, "kernel": name, "error": str(e)})
                continue
            finally:
                del os.environ["CUTLASS_FUSED_KERNEL"], os.environ["CUTLASS_FUSED_STATS"]
            rows.append({"shape": list(shape), "dtype": args.dtype, "kernel": name, "mm_ms": mm,
                         **{f"{m}_ms": t for m, t in ms.items()}})
            ev = f"{ms['eval'] / mm:10.3f}" if "eval" in ms else f"{'-':>10s}"
            print(f"{'x'.join(map(str, shape)):16s} {name:40s} {ev} {ms['train'] / mm:10.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps({"meta": meta(argv, device), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out / 'tune.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
