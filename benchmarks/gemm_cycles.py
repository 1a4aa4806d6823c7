"""The training GEMMs at one shape, a few calls each, for ncu to count their cycles at a locked clock
(issue 32: on an H200 our statistics GEMM took 773.6 us at 16384x4096² against cuBLAS's 710.1, and
it ran at a lower SM clock and a higher power reading; do cycles or the clock make the difference?).

    ncu --clock-control base -k regex:"nvjet|sm90_bf16" --metrics gpu__time_duration.sum,sm__cycles_elapsed.max \\
        python benchmarks/gemm_cycles.py 16384 4096 4096

Runs, in order, CALLS times each: torch.mm (cuBLAS); the layer's training forward with the
statistics GEMM (our sm90 stats kernel, then the tail); the same with the statistics GEMM off
(overrides(stats_gemm=False): the eval kernel, then the column pass and the tail). bf16.
"""
import sys

import torch

import cutlass_fused

CALLS = 3

m, k, n = (int(a) for a in sys.argv[1:4])
layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, device="cuda", dtype=torch.bfloat16)
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
w = layer.gemm.weight.detach()
with torch.no_grad():
    for _ in range(CALLS):
        torch.mm(x, w.t())
    for _ in range(CALLS):
        layer(x)
    with cutlass_fused.overrides(stats_gemm=False):
        for _ in range(CALLS):
            layer(x)
torch.cuda.synchronize()
