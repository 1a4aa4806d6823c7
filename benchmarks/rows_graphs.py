"""The plan's GEMM row against forced rows, in CUDA graphs, each × a torch.mm of the shape timed
right before it (what `python -m cutlass_fused.tune` does without graphs, and with the plan's own
pick first): the GPU-bound ratios of small batches, whose host time a graphless call would measure.

    python benchmarks/rows_graphs.py M,K,N:MODE:ROW[,ROW...][:DTYPE] ...

MODE train or eval; ROW a kernel row without its family and dtype (stats_128x128x64_c1x1x1) or a
full name (cutlass_fused.built_kernels()); DTYPE bf16 (default), f16, or e4m3 / e4m3_fast for FP8
layers (Float8Recipe(scaling="delayed"), fast_accum for e4m3_fast; still × a bf16 torch.mm). A
graph holds 10 calls, replayed under the bench's timer (median_ms); 3 rounds, the median ratio reported.
"""
import statistics
import sys

import torch

import cutlass_fused
from cutlass_fused.timing import graphed, median_ms

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
CALLS = 10


def graph_us(fn):
    """µs a call of fn, from CALLS calls captured in one graph, timed as the bench times its graphs."""
    return median_ms(graphed(lambda: [fn() for _ in range(CALLS)]), True) * 1000 / CALLS


def run(spec, rounds=3):
    parts = spec.split(":")
    m, k, n = map(int, parts[0].split(","))
    mode, rows = parts[1], [r for r in parts[2].split(",") if r]
    tag = parts[3] if len(parts) > 3 else "bf16"
    fp8 = tag.startswith("e4m3")
    dtype = torch.bfloat16 if fp8 else DTYPES[tag]
    recipe = cutlass_fused.Float8Recipe(scaling="delayed", fast_accum=tag == "e4m3_fast") if fp8 else None
    torch.manual_seed(0)
    layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, device="cuda", dtype=dtype, fp8=recipe)
    layer.train(mode == "train")
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    prefix = f"sm90_{'e4m3' if fp8 else tag}_"
    planned = cutlass_fused.plan(m, n, k, dtype, mode, fp8=tag if fp8 else "none")["kernel"]
    cases = [("plan=" + planned.removeprefix(prefix), None)]
    cases += [(r.removeprefix(prefix), r if r.startswith("sm") else prefix + r) for r in rows]
    mm, ratios = [], {label: [] for label, _ in cases}
    with torch.no_grad():
        for _ in range(rounds):
            for label, kernel in cases:
                mm.append(graph_us(lambda: torch.mm(x, w.t())))
                with cutlass_fused.overrides(kernel=kernel):
                    ratios[label].append(graph_us(lambda: layer(x)) / mm[-1])
    print(f"{m}x{k}->{n} {tag} {mode} x mm in graphs (mm {statistics.median(mm):.1f} us): "
          + ", ".join(f"{label} {statistics.median(r):.3f}" for label, r in ratios.items()), flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("rows_graphs.py: needs a CUDA GPU")
    for spec in sys.argv[1:]:
        try:
            run(spec)
        except Exception as e:  # one spec that cannot run should not lose the others' numbers
            print(f"{spec}: {type(e).__name__}: {e}", flush=True)
