"""Interleaved A/B of the fp32 (TF32 off) training forward: each statistics-GEMM candidate, the
exact pass (overrides(stats_gemm=False)) and eval, against eager, in rounds so that clock drift hits
all alike; then the per-kernel split of each from torch.profiler.

    python benchmarks/stats_ab.py [--rounds 3] [--kernel NAME ...] [--swizzle S ...]

--swizzle adds the default statistics kernel in that tile order (overrides(swizzle=...)).
"""
import argparse
import statistics

import torch

import cutlass_fused
from cutlass_fused.seed import SeedModel
from cutlass_fused.timing import events_ms, profile


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernel", action="append", help="statistics kernels (default: every f32x3 one built)")
    ap.add_argument("--swizzle", action="append", default=[], help="also the default kernel in this swizzle")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    kernels = args.kernel or [k for k in cutlass_fused.built_kernels() if k.startswith("sm90_f32x3_stats_")]
    # (label, cutlass_fused.overrides() or None for eager, training)
    configs = [(k.split("_stats_")[1], {"kernel": k}, True) for k in kernels]
    configs += [(f"default s{s}", {"swizzle": int(s)}, True) for s in args.swizzle]
    configs += [("pass", {"stats_gemm": False}, True), ("eval", {}, False), ("eager", None, True)]
    for m, k, n in [(1024, 8192, 8192), (16384, 4096, 4096)]:
        torch.manual_seed(0)
        seed = SeedModel(k, n).cuda()
        ours = cutlass_fused.LinearScaleBatchNorm1d(k, n, device="cuda")
        ours.load_state_dict(seed.state_dict())
        x = torch.randn(m, k, device="cuda")
        times = {}
        with torch.no_grad():
            for _ in range(args.rounds):
                for label, env, train in configs:
                    mod = seed if env is None else ours
                    mod.train(train)
                    with cutlass_fused.overrides(**(env or {})):
                        times.setdefault(label, []).append(events_ms(lambda: mod(x), warmup=3, calls=20))
            eager = statistics.median(times["eager"])
            print(f"{m}x{k}x{n}, ms (median of {args.rounds} rounds; eager / this):")
            for label, env, train in configs:
                t = statistics.median(times[label])
                split = ""
                if env is not None:
                    ours.train(train)
                    with cutlass_fused.overrides(**env):
                        _, per_kernel = profile(lambda: ours(x), calls=10)
                    split = "  " + "; ".join(f"{us:.1f} {name[:48]}" for name, us in
                                             sorted(per_kernel.items(), key=lambda kv: -kv[1]))
                print(f"  {label:24s} {t:8.4f} ({min(times[label]):.4f}-{max(times[label]):.4f})  "
                      f"{eager / t:5.3f}x{split}")


if __name__ == "__main__":
    main()
