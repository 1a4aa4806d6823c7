"""Where the bf16 training forward's time goes at one shape, by four clocks at once (issue 32: at
16384x4096², do_bench's median of the forward exceeded the sum of its profiled kernels by 88 µs,
while torch.mm's two agreed).

    python benchmarks/forward_timeline.py [--shape 16384,4096,4096] [--calls 50]

For each call (torch.mm, the statistics GEMM alone through `linear_stats`, the training op, the
module in train mode under no_grad):
- do_bench: triton's median, which writes a 256 MB buffer (flushing L2) before each call;
- loop: CUDA events around `calls` back-to-back calls, per call (no flush);
- flushed: CUDA events around each call after the same flush, median;
- kernels: torch.profiler's kernels per call (their sum, and each);
- the SM clock (MHz) and power (W) nvidia-smi sampled every 20 ms during the flushed calls,
  min / median / max.
"""
import argparse
import statistics
import subprocess

import torch
from torch import nn

import cutlass_fused
from cutlass_fused.ops import ops
from cutlass_fused.timing import profile


class Sampler:
    """nvidia-smi's SM clock and power every 20 ms while inside the block."""

    def __enter__(self):
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--id={torch.cuda.current_device()}", "--query-gpu=clocks.sm,power.draw",
             "--format=csv,noheader,nounits", "-lms", "20"], stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        out, _ = self.proc.communicate()
        rows = [line.split(",") for line in out.strip().splitlines() if line.count(",") == 1]
        self.clock = [float(c) for c, _ in rows]
        self.power = [float(p) for _, p in rows]

    def summary(self):
        def three(v):
            return f"{min(v):.0f}/{statistics.median(v):.0f}/{max(v):.0f}" if v else "-"
        return f"SM MHz {three(self.clock)}, W {three(self.power)}"


def timed(fn, calls, flush):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    torch.cuda.synchronize()
    loop = a.elapsed_time(b) / calls * 1e3
    spans = []
    with Sampler() as clocks:
        for _ in range(calls):
            flush.zero_()
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            spans.append(a.elapsed_time(b) * 1e3)
    return loop, statistics.median(spans), clocks


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=lambda s: tuple(int(v) for v in s.split(",")), default=(16384, 4096, 4096))
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    from triton.testing import do_bench
    m, k, n = args.shape
    torch.manual_seed(0)
    dt = torch.bfloat16
    layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, device="cuda", dtype=dt).train()
    x = torch.randn(m, k, device="cuda", dtype=dt)
    w, b = layer.gemm.weight.detach(), layer.gemm.bias.detach()
    bn = layer.bn
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    calls = {
        "torch.mm": lambda: torch.mm(x, w.t()),
        "linear_stats (GEMM)": lambda: ops.linear_stats(x, w, b, "auto"),
        "train op": lambda: ops.linear_scale_batch_norm_train(
            x, w, b, layer.scale.detach(), bn.weight.detach(), bn.bias.detach(), bn.running_mean, bn.running_var,
            bn.num_batches_tracked, 0.1, 1e-5, "auto"),
    }

    def module():
        with torch.no_grad():
            return layer(x)
    calls["module (train)"] = module
    print(f"{torch.cuda.get_device_name()} bf16 {m}x{k}->{n}, {args.calls} calls")
    mm_us = None
    for name, fn in calls.items():
        bench_us = do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3
        loop, flushed, clocks = timed(fn, args.calls, flush)
        _, kernels = profile(fn, calls=20)
        total = sum(kernels.values())
        mm_us = mm_us or bench_us
        print(f"{name:20s} do_bench {bench_us:7.1f} us ({bench_us / mm_us:.3f} x mm), loop {loop:7.1f}, flushed "
              f"{flushed:7.1f}, kernels {total:7.1f}; {clocks.summary()}", flush=True)
        for kname, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
            print(f"    {us:7.1f} us  {kname[:100]}")


if __name__ == "__main__":
    main()
