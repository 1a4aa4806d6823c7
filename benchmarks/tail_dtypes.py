"""The AMP tails, timed apart (torch.profiler, median of rounds): bf16 x and W with fp32 scale and BN
parameters, as under autocast, the training tail writing y in fp32 (the unfused model's dtype) or in
bf16 (output_dtype), with each activation, and the BN backward reading an fp32 or a bf16 dy.

    python benchmarks/tail_dtypes.py [--shape B,IN,OUT ...] [--act none --act relu ...] [--rounds 3] [--family sm80]

Each line: the tail's (or the BN backward's) µs, and per byte moved against the bf16-y twin's
(issue 31: the fp32-y tail at most 1.6x the bf16-y tail's time).
"""
import argparse
import statistics

import torch

from cutlass_fused.ops import ops
from cutlass_fused.timing import alternating, profile

SHAPES = [(4096, 4096, 4096), (16384, 4096, 4096), (1024, 8192, 8192)]


def tail_us(fn):
    """The µs of every kernel but the longest (the GEMM), a call: the tail after it."""
    _, kernels = profile(fn, calls=20)
    times = sorted(kernels.values(), reverse=True)
    return sum(times[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", type=lambda s: tuple(int(v) for v in s.split(",")))
    ap.add_argument("--act", action="append", choices=["none", "relu", "leaky_relu", "gelu", "gelu_tanh", "silu"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--family", choices=["auto", "sm90", "sm80"], default="auto")
    args = ap.parse_args()
    acts = args.act or ["none", "relu", "gelu"]
    for m, k, n in args.shape or SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        r = lambda *s, dt=torch.float32: torch.randn(*s, device="cuda", generator=g).to(dt)
        x, w = r(m, k, dt=torch.bfloat16), r(n, k, dt=torch.bfloat16) / k ** 0.5
        vec = [r(n), r(n), 1 + 0.1 * r(n), 0.1 * r(n)]  # bias, scale, bn_weight, bn_bias: fp32
        rm, rv = 0.1 * r(n), 1 + r(n).abs()
        cases = [(act, y) for act in acts for y in (torch.float32, torch.bfloat16)]
        fwd = {c: [] for c in cases}
        bwd = {c: [] for c in cases}
        for act, y_dt in alternating(cases, args.rounds):
            train = lambda: ops.linear_scale_batch_norm_train(x, w, *vec, rm, rv, None, 0.1, 1e-5, args.family, False,
                                                              act, 0.01, y_dt)
            fwd[act, y_dt].append(tail_us(train))
            y, h, _, mean, invstd = train()
            dy = torch.randn_like(y)
            back = lambda: ops.batch_norm_backward(dy, h, mean, invstd, vec[1], vec[2], 1e-5, vec[3], act, 0.01)
            _, kernels = profile(back, calls=20)
            bwd[act, y_dt].append(sum(kernels.values()))
        for act in acts:
            f32, b16 = (statistics.median(fwd[act, t]) for t in (torch.float32, torch.bfloat16))
            bf32, bb16 = (statistics.median(bwd[act, t]) for t in (torch.float32, torch.bfloat16))
            # Bytes: the tail reads h (2) and writes y (4 or 2); the backward reads dy (4 or 2) and h, writes dh.
            print(f"{m}x{k}x{n} {act:10s} tail y fp32 {f32:7.1f} us, y bf16 {b16:7.1f} us: {f32 / b16:.2f}x time "
                  f"for 1.50x bytes | BN backward dy fp32 {bf32:7.1f} us, dy bf16 {bb16:7.1f} us: "
                  f"{bf32 / bb16:.2f}x time for 1.33x bytes", flush=True)


if __name__ == "__main__":
    main()
