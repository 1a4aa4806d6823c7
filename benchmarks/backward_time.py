"""The batch-norm backward's GPU time by kernel choice: the two passes (column sums, then dh)
against the slab kernel or the cooperative kernel (cutlass_fused.overrides(backward=...)), summed over the
kernels a call launches (torch.profiler, 20 calls a round, median of rounds), the choices timed
in turn, the order reversed every other round.

    python benchmarks/backward_time.py [--dtype bf16 --dtype f16 ...] [--shape B,N ...] [--rounds 3]
                                       [--kernels passes --kernels cooperative ...] [--act relu ...]
                                       [--by-kernel] [--cold]

--cold writes a 256 MiB buffer before each call, as do_bench does, and counts only our kernels: so
that a call's first pass does not find dy and h in L2 from the call before, which back-to-back
calls of one backward leave there and a training step's does not (its dy is new, its h was written
a layer's forward ago).
"""
import argparse
import statistics

import torch

import cutlass_fused
from cutlass_fused.ops import ops
from cutlass_fused.timing import alternating, profile

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
SHAPES = [(256, 8192), (512, 8192), (1024, 8192), (256, 4096)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", action="append", choices=DTYPES)
    ap.add_argument("--shape", action="append", type=lambda s: tuple(int(v) for v in s.split(",")))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernels", action="append", choices=["passes", "slab", "cooperative"],
                    help="repeatable; default: passes and slab")
    ap.add_argument("--act", action="append", choices=["none", "relu", "gelu", "silu"],
                    help="the activation whose derivative the backward folds in; repeatable, default none")
    ap.add_argument("--by-kernel", action="store_true", help="also each kernel's median µs")
    ap.add_argument("--cold", action="store_true", help="a 256 MiB write before each call (L2 flushed)")
    args = ap.parse_args()
    choices = args.kernels or ["passes", "slab"]
    for dtype, act in ((d, a) for d in args.dtype or ["bf16"] for a in args.act or ["none"]):
        for m, n in args.shape or SHAPES:
            h = torch.randn(m, n, device="cuda").to(DTYPES[dtype])
            scale, gamma = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
            stats = torch.stack([h.double().sum(0), (h.double() ** 2).sum(0)])
            _, mean, invstd = ops.batch_norm_finalize(h, stats, scale, m, gamma, None, 1e-5)
            dy = torch.randn_like(h)
            beta = torch.randn(n, device="cuda")
            backward = lambda: ops.batch_norm_backward(dy, h, mean, invstd, scale, gamma, 1e-5, beta, act)
            flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if args.cold else None
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


if __name__ == "__main__":
    main()
