"""The training forward's two kernels, timed apart: the GEMM and the tail after it (torch.profiler,
median of rounds), with the train forward and torch.mm timed in turn (do_bench, median), so that a
change to the tail is judged by its own microseconds and by the ratio users see.

    python benchmarks/tail_time.py [--dtype bf16 --dtype tf32 ...] [--shape B,IN,OUT ...] [--rounds 3]
                                   [--tail cooperative --tail slab ...]

--tail times each forced tail (cutlass_fused.overrides(tail=...)) in turn, the order reversed every other round.
"""
import argparse
import statistics

import torch

import cutlass_fused
from cutlass_fused.bench import DTYPES, Case
from cutlass_fused.timing import alternating, median_ms, profile

SHAPES = [(1024, 8192, 8192), (16384, 4096, 4096), (4096, 4096, 4096)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", action="append", choices=DTYPES)
    ap.add_argument("--shape", action="append", type=lambda s: tuple(int(v) for v in s.split(",")))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tail", action="append", choices=["cooperative", "slab", "small"])
    args = ap.parse_args()
    tails = args.tail or [None]
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for dtype in args.dtype or ["bf16", "tf32"]:
            torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
            for shape in args.shape or SHAPES:
                case = Case(shape, dtype, torch.device("cuda"))
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
                    print(f"{dtype} {'x'.join(map(str, shape))}{f' {t}' if t else ''}: "
                          f"GEMM {statistics.median(gemm[t]):8.1f} us, tail {statistics.median(tail[t]):6.1f} us "
                          f"(rounds {', '.join(f'{v:.1f}' for v in tail[t])}), "
                          f"train x mm {statistics.median(ratio[t]):.3f}", flush=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32


if __name__ == "__main__":
    main()
