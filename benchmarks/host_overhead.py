"""Host (CPU) cost of one layer call and one training step, eager vs fused.

At a small shape the GPU finishes each kernel before the host issues the next,
so wall time per step is the host's launch cost. That cost is what a large
shape's fwd+bwd pays when it is host-bound. --ops also times the layers below the
module (the ops called directly, torch.mm, one allocation), best of 3 runs.
    python benchmarks/host_overhead.py [BATCH IN OUT] [--ops]"""
import sys
import time

import torch

import cutlass_fused
from cutlass_fused.seed import SeedModel as Seed


def per_call_us(fn, iters=2000):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e6


def ops_breakdown(m, k, n, dev, dt):
    """Host us a call of each layer under the module's forward (no grad), best of 3 runs."""
    mod = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=dev, dtype=dt)
    bn, ops = mod.bn, torch.ops.cutlass_fused
    x = torch.randn(m, k, device=dev, dtype=dt)
    w, b, s = mod.gemm.weight.detach(), mod.gemm.bias.detach(), mod.scale.detach()
    train = (x, w, b, s, bn.weight.detach(), bn.bias.detach(), bn.running_mean, bn.running_var,
             bn.num_batches_tracked, 0.1, 1e-5, "auto", True)
    wt = w.t().contiguous()
    h, stats = ops.linear_stats(x, w, b, "auto")
    rows = {
        "torch.mm": lambda: torch.mm(x, w.t()),
        "torch.empty": lambda: torch.empty(m, n, device=dev, dtype=dt),
        "ops.matmul": lambda: ops.matmul(x, wt, "auto"),
        "ops.linear_stats": lambda: ops.linear_stats(x, w, b, "auto"),
        "ops.batch_norm_finalize": lambda: ops.batch_norm_finalize(h, stats, s, m, bn.weight, bn.bias, 1e-5),
        "train op": lambda: ops.linear_scale_batch_norm_train(*train),
        "eval op": lambda: ops.linear_scale_batch_norm_eval(*train[:8], 1e-5, "auto", True),
        "module forward": lambda: mod(x),
    }
    print(f"host cost per call by layer, batch={m} in={k} out={n} bf16, no grad (us, best of 3)")
    with torch.no_grad():
        for name, fn in rows.items():
            print(f"  {name:24s} {min(per_call_us(fn, 1000) for _ in range(3)):7.1f}")


def main():
    args = [a for a in sys.argv[1:] if a != "--ops"]
    m, k, n = map(int, args[:3]) if len(args) > 2 else (64, 256, 256)
    dev, dt = "cuda", torch.bfloat16
    seed = Seed(k, n).to(dev, dt)
    ours = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=dev, dtype=dt)
    ours.load_state_dict(seed.state_dict())
    x = torch.randn(m, k, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=dt)
    print(f"host cost per call, batch={m} in={k} out={n} bf16 (us, wall / calls)")
    for name, mod in (("eager", seed), ("cutlass_fused", ours)):
        def fwd(mod=mod):
            with torch.no_grad():
                mod(x)

        def step(mod=mod):
            mod.zero_grad(set_to_none=True)
            x.grad = None
            mod(x).backward(dy)
        print(f"  {name:14s} train fwd {per_call_us(fwd):7.1f}   train fwd+bwd {per_call_us(step):7.1f}")
    if "--ops" in sys.argv:
        ops_breakdown(m, k, n, dev, dt)


if __name__ == "__main__":
    main()
