"""FP8's error in the training forward beside torchao's float8 training (issue 33: y's error within 2x
torchao float8's), against the unquantized float64 model on the same inputs.

    python benchmarks/fp8_accuracy.py [--shape 4096,4096,4096 ...] [--seeds 3]

Rows, each y = BatchNorm1d((x W^T + b) * scale) in training mode from the same bf16 weights and x:
- bf16: our layer in bf16 (no FP8);
- ours fp8: our layer with Float8Recipe() (per-tensor current scaling, power-of-two scales): the
  e4m3 kernels where fp8.e4m3_kernels finds them, else emulated on the 16-bit kernels;
- torchao tensorwise / rowwise: the unfused model in bf16 with its Linear converted by
  torchao.float8.convert_to_float8_training (emulate=True off CUDA), BatchNorm as PyTorch's.
  Skipped where torchao is not installed (pip install torchao; on the GPU machine, carry its wheel).
Each line: max and rms |y - y64| over the seeds' outputs, and the max against torchao tensorwise's.
"""
import argparse
import importlib.util
import math

import torch

import cutlass_fused
from cutlass_fused import bench_rows
from cutlass_fused.seed import SeedModel

CPU_SHAPES = [(512, 256, 128)]
GPU_SHAPES = [(4096, 4096, 4096), (16384, 4096, 4096)]


def torchao_row(recipe, device):
    """A function (seed model in bf16, x) -> y through torchao's float8 Linear (the bench's anchor,
    cutlass_fused.bench_rows.torchao_float8), or None without torchao."""
    if importlib.util.find_spec("torchao") is None:
        return None
    return lambda seed, x: bench_rows.torchao_float8(seed, recipe, device)(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", type=lambda s: tuple(int(v) for v in s.split(",")))
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    emulate = device.type == "cuda" and not cutlass_fused.fp8.e4m3_kernels(device)
    rows = {"bf16": None, "ours fp8": None, "torchao tensorwise": torchao_row("tensorwise", device),
            "torchao rowwise": torchao_row("rowwise", device)}
    for m, k, n in args.shape or (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES):
        errs = {name: [] for name in rows}
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            base = SeedModel(k, n).to(device, torch.bfloat16)
            with torch.no_grad():
                base.scale.uniform_(0.5, 2.0)  # |scale| away from 0, as a trained layer's
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ref = SeedModel(k, n).to(device, torch.float64)
            ref.load_state_dict(base.state_dict())
            with torch.no_grad():
                y64 = ref(x.double())
                for name, run in rows.items():
                    if name.startswith("torchao") and run is None:
                        continue
                    if name.startswith("torchao"):
                        seed_model = SeedModel(k, n).to(device, torch.bfloat16)
                        seed_model.load_state_dict(base.state_dict())
                        y = run(seed_model, x)
                    else:
                        fp8 = cutlass_fused.Float8Recipe(emulate=emulate) if name == "ours fp8" else None
                        layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=device, dtype=torch.bfloat16,
                                                                     fp8=fp8)
                        layer.load_state_dict(base.state_dict())
                        y = layer(x)
                    errs[name].append((y.double() - y64).flatten())
        print(f"{m}x{k}->{n} on {device.type}, {args.seeds} seeds: |y - float64 model|")
        ao = torch.cat(errs["torchao tensorwise"]).abs().max().item() if errs["torchao tensorwise"] else None
        for name, e in errs.items():
            if not e:
                print(f"  {name:20s} skipped (torchao is not installed)")
                continue
            e = torch.cat(e)
            mx, rms = e.abs().max().item(), math.sqrt((e * e).mean().item())
            vs = f", {mx / ao:.2f}x torchao tensorwise's max" if ao else ""
            print(f"  {name:20s} max {mx:.4f}  rms {rms:.5f}{vs}")


if __name__ == "__main__":
    main()
