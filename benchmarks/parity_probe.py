"""How far the step benchmark's losses part from eager's by rounding alone (issue 31's loss parity:
the largest relative difference from eager's loss over the first 30 steps, same weights and data).

    python benchmarks/parity_probe.py [--case amp-bf16,256,2048,6] [--seeds 5]   (CPU: --case f32,64,64,2)

Beside the benchmark's rows (compile, fused) it runs eager variants that differ from eager only in
rounding: eager again (is eager deterministic), eager with BatchNorm computed in float64 (as our
kernels take the statistics), and eager from weights moved by one fp32 ulp (how much 30 steps
amplify a difference of that size). Under amp-bf16 it also runs the fused model with each fused
layer's dW rounded to bf16 before AdamW, as the unfused model's autocast rounds it (ours comes from the
GEMM in fp32: docs/decisions.md, "Autocast"). Each line: a row's parity against eager, and the step
where it peaked. --seeds N repeats it for N initial weights (bench_step.mlp's seed) and data
streams (seed 0 is the step benchmark's own), then prints each row's parities across seeds, sorted:
one seed's number is one draw of a chaotic difference, and the spread says how far a row's draw can
fall from its typical.
"""
import argparse
import contextlib
import copy
import statistics

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from cutlass_fused import bench_step


class Float64BatchNorm(nn.Module):
    """nn.BatchNorm1d's forward with its arithmetic in float64, its buffers kept in their dtype."""

    def __init__(self, bn):
        super().__init__()
        self.bn = bn

    def forward(self, z):
        bn = self.bn
        wide = lambda t: None if t is None else t.double()
        rm, rv = wide(bn.running_mean), wide(bn.running_var)
        with torch.autocast(z.device.type, enabled=False):
            y = F.batch_norm(z.double(), rm, rv, wide(bn.weight), wide(bn.bias), self.training, bn.momentum, bn.eps)
        if self.training and rm is not None:
            with torch.no_grad():
                bn.running_mean.copy_(rm)
                bn.running_var.copy_(rv)
                bn.num_batches_tracked.add_(1)
        return y.to(z.dtype)


def float64_bn(model):
    """The model with each nn.BatchNorm1d (SeedModel's too) computing in float64."""
    model = copy.deepcopy(model)
    for m in list(model.modules()):
        for name, child in m.named_children():
            if type(child) is nn.BatchNorm1d:
                setattr(m, name, Float64BatchNorm(child))
    return model


def one_ulp(model):
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))
    return model


def bf16_dw(opt, args, kwargs):
    """An optimizer step pre-hook: each weight gradient rounded to bf16 and back, as eager's autocast
    gives it (a no-op for the head's, which autocast already gave so)."""
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dim() == 2:
                    p.grad.copy_(p.grad.to(torch.bfloat16))


@contextlib.contextmanager
def seeded_data(seed):
    """bench_step's data stream under another seed: batch i drawn as batch 1000 * seed + i (seed 0:
    the benchmark's own). Row draws its batches through bench_step.batch."""
    batch = bench_step.batch
    bench_step.batch = lambda case, device, i: batch(case, device, 1000 * seed + i)
    try:
        yield
    finally:
        bench_step.batch = batch


def parities(case, device, reports, seed=0):
    """{row: (largest relative difference from eager's loss, its step, the last step's)}, and the
    steps' count, from the model bench_step builds under `seed`. reports: bench_step.Row's (fuse's
    report printed while it is empty)."""
    base = bench_step.mlp(case, device, seed)
    with bench_step.precision_flags(case.precision):
        eager = bench_step.Row("eager", base, case, device, reports).losses
        rows = {
            "eager again": bench_step.Row("eager", base, case, device, reports).losses,
            "eager, BN in float64": bench_step.Row("eager", float64_bn(base), case, device, reports).losses,
            "eager, weights +1 ulp": bench_step.Row("eager", one_ulp(base), case, device, reports).losses,
            "fused": bench_step.Row("fused", base, case, device, reports).losses,
        }
        if case.precision == "amp-bf16":
            hook = register_optimizer_step_pre_hook(bf16_dw)
            try:
                rows["fused, dW through bf16"] = bench_step.Row("fused", base, case, device, reports).losses
            finally:
                hook.remove()
        if device.type == "cuda":  # no triton on the CPU
            rows["compile"] = bench_step.Row("compile", base, case, device, reports).losses
    out = {}
    for name, losses in rows.items():
        rel = [abs(a - e) / abs(e) for a, e in zip(losses, eager)]
        worst = max(range(len(rel)), key=rel.__getitem__)
        out[name] = (max(rel), worst, rel[-1])
    return out, len(eager)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", type=bench_step.parse_case, default=bench_step.Case("amp-bf16", 256, 2048, 6, "relu"))
    ap.add_argument("--seeds", type=int, default=1)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    across, reports = {}, []
    for seed in range(args.seeds):
        with seeded_data(seed):
            rows, steps = parities(args.case, device, reports, seed)
        print(f"{bench_step.label(args.case)}, seed {seed}: loss parity against eager over {steps} steps", flush=True)
        for name, (worst, step, last) in rows.items():
            print(f"  {name:24s} {worst:.1e} (step {step}); last step {last:.1e}")
            across.setdefault(name, []).append(worst)
    if args.seeds > 1:
        print(f"across {args.seeds} seeds, sorted (median):")
        for name, values in across.items():
            print(f"  {name:24s} {' '.join(f'{v:.1e}' for v in sorted(values))} ({statistics.median(values):.1e})")


if __name__ == "__main__":
    main()
