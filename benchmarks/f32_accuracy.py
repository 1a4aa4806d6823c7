"""Error of every built fp32 (3xTF32) kernel against cuBLAS SGEMM's, as tests/test_fp32.py
measures it: max |h - float64| / max |float64| of h = x W^T + b, as a ratio to SGEMM's on the
same data, the worst of three seeds, at several K. Issue 8's rule: at most 2 (plus a 1e-7 floor).
Eval kernels are run through linear_stats, statistics kernels through the training forward's h.
    python benchmarks/f32_accuracy.py [--k 48 --k 300 ...]"""
import argparse

import torch

import cutlass_fused
from cutlass_fused.ops import ops


def err(h, ref):
    return ((h.double() - ref).abs().max() / ref.abs().max()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, action="append", help="reduction sizes (default 48 300 1024 8192)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    names = [n for n in cutlass_fused.built_kernels() if "_f32x3_eval_" in n or "_f32x3_stats_" in n]
    for k in args.k or [48, 300, 1024, 8192]:
        worst = {n: 0.0 for n in names}
        for seed in range(3):
            torch.manual_seed(1000 * k + seed)
            x = torch.randn(256, k, device="cuda")
            w = torch.randn(520, k, device="cuda") / k ** 0.5
            b = torch.randn(520, device="cuda")
            ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
            e_sgemm = err(torch.nn.functional.linear(x, w, b), ref)
            for n in names:
                family = n.split("_")[0]
                with cutlass_fused.use_kernel_family(family), cutlass_fused.overrides(kernel=n):
                    if "_stats_" in n:
                        ones = torch.ones(520, device="cuda")
                        h = ops.linear_scale_batch_norm_train(x, w, b, ones, None, None, None, None, None, 0.1,
                                                              1e-5, family)[1]
                    else:
                        h = ops.linear_stats(x, w, b, family)[0]
                worst[n] = max(worst[n], err(h, ref) / e_sgemm)
        for n in names:
            print(f"f32 accuracy K={k:5d} {n:40s} error / SGEMM's {worst[n]:.2f}")


if __name__ == "__main__":
    main()
