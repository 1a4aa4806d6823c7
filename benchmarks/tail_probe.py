"""Runs the training forward a few times at one shape, for ncu/nsys to look at the kernels after the GEMM.

python benchmarks/tail_probe.py 1024 8192 8192
"""
import sys

import torch

import cutlass_fused

m, k, n = (int(a) for a in sys.argv[1:4])
layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, device="cuda", dtype=torch.bfloat16)
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    for _ in range(3):
        layer(x)
torch.cuda.synchronize()
