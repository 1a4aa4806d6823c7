"""The FP8 layer's eval forward (inference, issue 33): torch.mm of the shape, our bf16 eval, the
emulated FP8 eval (Float8Recipe(emulate=True): the rounding through the bf16 kernels) and the e4m3
eval (Float8Recipe(): quantize x, and W outside frozen_weights(), then one e4m3 GEMM with the fold)
and the same with fast_accum=True (the fast-accumulate eval row), in torch.no_grad; do_bench medians
in rounds (the rows' order reversed every other round), each row's ratio to the same run's
torch.mm, and the e4m3 rows' kernels from torch.profiler.

    python benchmarks/fp8_eval.py [--shape M,K,N ...] [--rounds 3]
"""
import argparse
import contextlib
import statistics

import torch

import cutlass_fused
from cutlass_fused.timing import alternating, median_ms, profile

RECIPES = {"bf16": None, "fp8-emulated": cutlass_fused.Float8Recipe(emulate=True), "fp8": cutlass_fused.Float8Recipe(),
           "fp8-fast": cutlass_fused.Float8Recipe(fast_accum=True)}


def rows(m, k, n):
    """{row: call}, and {row: the layer a row runs inside frozen_weights() of}."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    out, frozen = {"torch.mm": lambda: torch.mm(x, w.t())}, {}
    for name, recipe in RECIPES.items():
        layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, activation="relu", device="cuda", dtype=torch.bfloat16,
                                                     fp8=recipe).eval()
        out[name] = lambda layer=layer: layer(x)
        if recipe is not None and not recipe.emulate:  # W8 kept between calls
            out[f"{name}, frozen_weights()"] = out[name]
            frozen[f"{name}, frozen_weights()"] = layer
    return out, frozen


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", type=lambda s: tuple(int(v) for v in s.split(",")))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_eval: needs a CUDA GPU")
    for m, k, n in args.shape or [(16384, 4096, 4096), (4096, 4096, 4096), (1024, 8192, 8192)]:
        calls, frozen = rows(m, k, n)
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
    main()
