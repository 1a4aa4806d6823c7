"""Host (CPU) cost of one layer call and one training step, eager vs fused.

At a small shape the GPU finishes each kernel before the host issues the next,
so wall time per step is the host's launch cost. That cost is what a large
shape's fwd+bwd pays when it is host-bound.
    python benchmarks/host_overhead.py [BATCH IN OUT]"""
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


def main():
    m, k, n = map(int, sys.argv[1:4]) if len(sys.argv) > 3 else (64, 256, 256)
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


if __name__ == "__main__":
    main()
