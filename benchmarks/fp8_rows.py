"""The e4m3 training forward by kernel row (issue 33): each sm90 e4m3 statistics GEMM of the table,
forced in turn, timed and checked, beside the floors of the same run.

    python benchmarks/fp8_rows.py [--shape 16384,4096,4096 ...] [--rounds 3] [--swizzle auto,2,4,8]

Per shape, medians of do_bench over the rounds (the rows' order reversed every other round):
- torch.mm (bf16) and torch._scaled_mm (cuBLAS's e4m3 GEMM, bf16 out, per-tensor scales; promoted,
  and "fast" with use_fast_accum): the floors;
- bf16: our bf16 training forward;
- each e4m3 row (in each --swizzle of the persistent scheduler; "auto" is the plan's): the layer with
  Float8Recipe() (quantize, the row's GEMM, the tail; fast_accum=True for a fast-accumulate row,
  which the plan takes only under that recipe), its GEMM's own GPU µs (torch.profiler), and
  y's max error against float64 of the same quantized operands, so a fast-accumulate row is judged
  by what it costs in accuracy as well as what it saves.
"""
import argparse
import statistics

import torch

import cutlass_fused
from cutlass_fused import fp8
from cutlass_fused.ops import ops
from cutlass_fused.seed import SeedModel
from cutlass_fused.timing import alternating, median_ms, profile

SHAPES = [(16384, 4096, 4096), (4096, 4096, 4096), (1024, 8192, 8192)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", type=lambda s: tuple(int(v) for v in s.split(",")))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--swizzle", type=lambda v: v.split(","), default=["auto"],
                    help="tile-order swizzles to time each row in, e.g. auto,2,4,8")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if not fp8.e4m3_kernels(dev):
        raise SystemExit("fp8_rows: needs an sm90 GPU and a build with the e4m3 rows")
    if any(w not in ("auto", "1", "2", "4", "8") for w in args.swizzle):
        raise SystemExit(f"fp8_rows: expected --swizzle in auto,1,2,4,8, got {args.swizzle}")
    kernels = [n for n in ops.kernel_names() if "_e4m3_stats_" in n]
    # A candidate: (row, swizzle), named "row" for the plan's swizzle, else "row s<swizzle>".
    cands = {(n if w == "auto" else f"{n} s{w}"): (n, 0 if w == "auto" else int(w))
             for n in kernels for w in args.swizzle}
    for m, k, n in args.shape or SHAPES:
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
        x8, s_x = ops.quantize_e4m3(x)
        w8, s_w = ops.quantize_e4m3(base.gemm.weight.detach())
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
                with _forcing(cands.get(name)):
                    times[name].append(median_ms(calls[name], True))
            mm = statistics.median(times["torch.mm"])
            print(f"{m}x{k}x{n}: ms (x torch.mm); e4m3 rows: GEMM µs, max|y - float64 of the quantized model|")
            for name, t in times.items():
                ms = statistics.median(t)
                line = f"  {name:44s} {ms:8.4f}  {ms / mm:5.3f}"
                if name in cands:
                    _, by_kernel = profile(lambda: _forced(layer[name], x, cands[name]), calls=5)
                    gemm = max(v for kname, v in by_kernel.items() if "cutlass" in kname and "e4m3" in kname)
                    err = (_forced(layer[name], x, cands[name]).double() - y64).abs().max().item()
                    line += f"  GEMM {gemm:7.1f} µs  err {err:.4f}"
                print(line, flush=True)
            err_bf16 = (bf16(x).double() - y64_bf16).abs().max().item()
            print(f"  (bf16's own max|y - float64|: {err_bf16:.4f})")


def _forcing(cand):
    """overrides forcing (row, swizzle); None forces nothing (the floors and bf16)."""
    row, swizzle = cand if cand is not None else (None, 0)
    return cutlass_fused.overrides(kernel=row, swizzle=swizzle or None)


def _forced(layer, x, cand):
    with _forcing(cand):
        return layer(x)


if __name__ == "__main__":
    main()
