"""The FP8 layer's training forward and backward by kernel (issue 33): our bf16 layer, the e4m3 path
with the bf16 backward and with backward="e5m2", each kernel's µs per call from torch.profiler
(cutlass_fused.timing.profile, 5 calls), largest first, and their sum.

    python benchmarks/fp8_kernels.py [--shape M,K,N ...] [--top 12]
"""
import argparse

import torch

import cutlass_fused
from cutlass_fused.timing import profile

ROWS = {"bf16": None, "fp8": "bf16", "fp8-e5m2": "e5m2"}


def layer_call(m, k, n, backward):
    fp8 = None if backward is None else cutlass_fused.Float8Recipe(backward=backward)
    layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, device="cuda", dtype=torch.bfloat16, fp8=fp8)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def call():
        layer(x).backward(dy)
    return call


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", type=lambda s: tuple(int(v) for v in s.split(",")))
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_kernels: needs a CUDA GPU")
    for m, k, n in args.shape or [(16384, 4096, 4096), (4096, 4096, 4096)]:
        for name, backward in ROWS.items():
            launches, kernels = profile(layer_call(m, k, n, backward))
            print(f"{m}x{k}x{n} {name}: {launches:.0f} launches, {sum(kernels.values()):.1f} µs of kernels a call")
            for kname, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]:
                print(f"  {us:8.1f}  {kname[:110]}")


if __name__ == "__main__":
    main()
