"""KernelBench's correctness check for level-2 problems 33 and 39 (and the original 39):
training mode under no_grad, fp32 with TF32 off, torch.rand inputs, five seeds,
allclose(atol=rtol=1e-4) of the output and the running stats against the eager model.
    python benchmarks/kernelbench_check.py [--family auto|sm90|sm80]"""
import argparse

import torch

import cutlass_fused
from cutlass_fused.seed import SeedModel

SHAPES = [(1024, 8192, 8192), (16384, 4096, 4096), (128, 1024, 512)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="auto", choices=("auto", "sm90", "sm80"))
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    failures = 0
    for m, k, n in SHAPES:
        passed, worst = 0, 0.0
        for trial in range(5):
            torch.manual_seed(trial)
            ref = SeedModel(k, n).cuda()
            ours = cutlass_fused.LinearScaleBatchNorm1d(k, n, device="cuda")
            ours.load_state_dict(ref.state_dict())
            x = torch.rand(m, k, device="cuda")
            with torch.no_grad(), cutlass_fused.use_kernel_family(args.family):
                y_ref, y = ref(x), ours(x)
            pairs = [(y, y_ref), (ours.bn.running_mean, ref.bn.running_mean),
                     (ours.bn.running_var, ref.bn.running_var)]
            ok = all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in pairs)
            worst = max(worst, (y - y_ref).abs().max().item())
            passed += ok
        failures += passed < 5
        print(f"kernelbench check {m}x{k}x{n} family={args.family}: {passed}/5 passed, max |y - eager| {worst:.3g}")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
