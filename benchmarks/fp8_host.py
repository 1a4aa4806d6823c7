"""Host (CPU) cost of the FP8 layer and of each op under it, against the bf16 layer.

At a small shape the GPU finishes each kernel before the host issues the next, so the wall time
a call is the host's cost: what a large shape pays where it is host-bound (the e4m3 training
step, benchmarks/step_busy.py). No profiler: it adds its own cost to every op.
    python benchmarks/fp8_host.py [BATCH IN OUT]"""
import sys

import torch
from host_overhead import per_call_us as one_run_us  # benchmarks/, this script's directory

import cutlass_fused
from cutlass_fused.fp8 import E4M3, E5M2, Float8Recipe

ops = torch.ops.cutlass_fused


def per_call_us(fn):
    """Best of 3 runs of 1000 calls: this host's speed drifts between runs."""
    return min(one_run_us(fn, 1000) for _ in range(3))


def layer_rows(m, k, n, dev):
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    recipes = {"bf16": None, "fp8": Float8Recipe(), "fp8-e5m2": Float8Recipe(backward="e5m2"),
               "fp8-delayed": Float8Recipe(scaling="delayed"),
               "fp8-delayed-e5m2": Float8Recipe(scaling="delayed", backward="e5m2")}
    print(f"the layer, batch={m} in={k} out={n} bf16 (us a call; relu)")
    for name, recipe in recipes.items():
        mod = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=dev, dtype=torch.bfloat16, activation="relu",
                                                   fp8=recipe)

        def fwd(mod=mod):
            mod(x)

        def step(mod=mod):
            mod.zero_grad(set_to_none=True)
            x.grad = None
            mod(x).backward(dy)

        with torch.no_grad():
            f0 = per_call_us(fwd)
        print(f"  {name:18s} fwd (no grad) {f0:7.1f}   fwd {per_call_us(fwd):7.1f}   fwd+bwd {per_call_us(step):7.1f}")


def reference_rows(m, k, n, dev):
    """What this host charges for torch's own layers: Linear alone, and the unfused block."""
    from cutlass_fused.seed import SeedModel
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    mods = {"nn.Linear": torch.nn.Linear(k, n), "unfused block + relu": torch.nn.Sequential(SeedModel(k, n),
                                                                                            torch.nn.ReLU())}
    for name, mod in mods.items():
        mod = mod.to(dev, torch.bfloat16)

        def step(mod=mod):
            mod.zero_grad(set_to_none=True)
            x.grad = None
            mod(x).backward(dy)

        print(f"  {name:18s} fwd+bwd {per_call_us(step):7.1f}")


def op_rows(m, k, n, dev):
    bf = torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=bf)
    w = torch.randn(n, k, device=dev, dtype=bf)
    dh = torch.randn(m, n, device=dev, dtype=bf)
    s = torch.ones(2, device=dev)
    hist = torch.zeros(16, 2, device=dev)
    b, sc = torch.randn(n, device=dev, dtype=bf), torch.randn(n, device=dev, dtype=bf)
    x8, x8_t, ax, s_x = ops.quantize_with_scale(x, s[0], E4M3, True)
    w8, w8_t, aw, s_w = ops.quantize_with_scale(w, s[1], E4M3, True)
    g8, g8_t, s_g = ops.quantize_transposed(dh, E5M2, 0, False)
    inv = s_g.reciprocal()
    h = torch.randn(m, n, device=dev, dtype=bf)
    mean, invstd = torch.zeros(n, device=dev), torch.ones(n, device=dev)
    rows = {
        "torch.empty": lambda: torch.empty(m, n, device=dev, dtype=bf),
        "torch.mm": lambda: torch.mm(x, w.t()),
        "tensor.reciprocal (0-dim)": lambda: s_g.reciprocal(),
        "quantize_with_scale": lambda: ops.quantize_with_scale(x, s[0], E4M3, False),
        "quantize_with_scale, transposed": lambda: ops.quantize_with_scale(x, s[0], E4M3, True),
        "quantize_e4m3": lambda: ops.quantize_e4m3(x, 0, False),
        "quantize_transposed e5m2": lambda: ops.quantize_transposed(dh, E5M2, 0, False),
        "fp8_record": lambda: ops.fp8_record(hist, s, ax, aw, 0, "max"),
        "fp8_operand_scales": lambda: ops.fp8_operand_scales(s_x, s_w, b, sc),
        "torch._scaled_mm (dX)": lambda: torch._scaled_mm(g8, w8_t.t(), inv, s_x, out_dtype=bf),
        "torch._scaled_mm (dW)": lambda: torch._scaled_mm(g8_t, x8_t.t(), inv, s_w, out_dtype=bf),
        "batch_norm_backward, relu": lambda: ops.batch_norm_backward(dh, h, mean, invstd, sc, b, 1e-5, b, "relu"),
        "scalars: 1/s, d*0, d/(s s)": lambda: (s_g.reciprocal(), sc * 0, sc / (s_x * s_w)),
    }
    if hasattr(ops, "fp8_backward_scales"):  # a build before it has the torch ops above only
        rows["fp8_backward_scales"] = lambda: ops.fp8_backward_scales(sc, s_x, s_w, s_g, bf, bf)
    print(f"the ops, batch={m} in={k} out={n} (us a call, no grad)")
    with torch.no_grad():
        for name, fn in rows.items():
            print(f"  {name:34s} {per_call_us(fn):7.1f}")


def main():
    m, k, n = map(int, sys.argv[1:4]) if len(sys.argv) > 3 else (256, 1024, 1024)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_host.py times CUDA calls: no GPU here")
    dev = torch.device("cuda")
    layer_rows(m, k, n, dev)
    reference_rows(m, k, n, dev)
    op_rows(m, k, n, dev)


if __name__ == "__main__":
    main()
