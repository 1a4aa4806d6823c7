"""Profile one training step (fwd+bwd) of the fused layer: where GPU and host time go.
    python benchmarks/profile_step.py [BATCH IN OUT]"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import cutlass_fused


def main():
    m, k, n = map(int, sys.argv[1:4]) if len(sys.argv) > 3 else (1024, 8192, 8192)
    layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(dy)

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    main()
