"""Eval with an activation (issue 31): our eval forward inside frozen_weights() (the fold kept, so
the GEMM is the call's only kernel, the activation in its epilogue) against torch.mm of the same
shape, in the same run, with each activation; and the activation as a separate ATen pass after
the eval GEMM, the route before the epilogue took it.

    python benchmarks/eval_activation.py [--shape B,IN,OUT ...] [--act none --act relu ...] [--rounds 3]
                                         [--family sm80] [--dtype f16]

Each line: µs a call (do_bench's median, the median of rounds) and × torch.mm.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

import cutlass_fused
from cutlass_fused.timing import alternating, median_ms

SHAPES = [(4096, 4096, 4096), (16384, 4096, 4096), (1024, 8192, 8192)]
ATEN = {"none": lambda t: t, "relu": F.relu, "leaky_relu": F.leaky_relu, "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", type=lambda s: tuple(int(v) for v in s.split(",")))
    ap.add_argument("--act", action="append", choices=list(ATEN))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--family", choices=["auto", "sm90", "sm80"], default="auto")
    ap.add_argument("--dtype", choices=["bf16", "f16"], default="bf16")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    acts = args.act or ["none", "relu", "gelu", "silu"]
    for m, k, n in args.shape or SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
        layers = {a: cutlass_fused.LinearScaleBatchNorm1d(k, n, device="cuda", dtype=dtype,
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
        with torch.no_grad(), cutlass_fused.use_kernel_family(args.family), cutlass_fused.frozen_weights(*layers.values()):
            for name in alternating(list(fns), args.rounds):
                times[name].append(median_ms(fns[name], cuda=True) * 1e3)
        mm = statistics.median(times["torch.mm"])
        print(f"{args.dtype} {m}x{k}x{n} family {args.family}: torch.mm {mm:.1f} us")
        for name, ts in times.items():
            if name != "torch.mm":
                t = statistics.median(ts)
                print(f"  {name:28s} {t:8.1f} us  {t / mm:.3f} x mm")


if __name__ == "__main__":
    main()
