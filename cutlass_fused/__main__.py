"""python -m cutlass_fused: run the fused layer on the best device, check it against the
plain PyTorch model, and (on a GPU) time it against eager PyTorch and torch.mm.

    python -m cutlass_fused [--shape BATCH IN OUT] [--dtype bf16|f16|f32|tf32] [--family auto|sm90|sm80]
"""
import argparse
import statistics

import torch

import cutlass_fused
from cutlass_fused.seed import SeedModel as Seed

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "tf32": torch.float32}


def bench_ms(fn, device):
    """Median milliseconds after warm-up: triton's do_bench where present, else CUDA events."""
    if device.type != "cuda":
        return None
    try:
        from triton.testing import do_bench
        return do_bench(fn, warmup=100, rep=500, return_mode="median")
    except ImportError:
        for _ in range(10):
            fn()
        times = []
        for _ in range(50):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)


def main():
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(prog="python -m cutlass_fused",
                                 description="Run the fused layer on the best device, check it against the plain "
                                             "PyTorch model, and (on a GPU) time it against eager PyTorch and torch.mm.")
    ap.add_argument("--shape", type=int, nargs=3, metavar=("BATCH", "IN", "OUT"),
                    default=(1024, 8192, 8192) if cuda else (128, 1024, 512),
                    help="the layer's size (default: 1024 8192 8192 on a GPU, 128 1024 512 on the CPU)")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16" if cuda else "f32",
                    help="f32: fp32 with TF32 off; tf32: with it on (default: bf16 on a GPU, f32 on the CPU)")
    ap.add_argument("--family", default="auto", choices=("auto", "sm90", "sm80"),
                    help="CUDA kernel family: auto picks sm90 on Hopper, sm80 elsewhere (default: auto)")
    args = ap.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = args.dtype == "tf32"
    m, k, n = args.shape
    torch.manual_seed(0)

    seed = Seed(k, n).to(device, dtype)
    ours = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=device, dtype=dtype)
    ours.load_state_dict(seed.state_dict())
    ref = Seed(k, n).to(device, torch.float64)
    ref.load_state_dict(seed.state_dict())
    x = torch.randn(m, k, device=device, dtype=dtype)
    name = torch.cuda.get_device_name() if cuda else "CPU"
    built = len(cutlass_fused.built_kernels())
    why = "" if built else (" (a CPU build: no CUDA kernels; the layer runs PyTorch ops here)" if not cuda
                            else " (this build has no CUDA kernels: rebuild with CUDA torch and nvcc)")
    print(f"cutlass_fused on {name}: batch={m} in={k} out={n} {args.dtype}, kernels built: {built}{why}")

    with cutlass_fused.use_kernel_family(args.family):
        for mode, train in (("train", True), ("eval", False)):
            for mod in (seed, ours, ref):
                mod.train(train)
            with torch.no_grad():
                y_ref = ref(x.double())
                e_ours = (ours(x).double() - y_ref).abs().max().item()
                e_eager = (seed(x).double() - y_ref).abs().max().item()
            ok = e_ours <= 2 * e_eager + 2e-2
            print(f"  {mode:5s} max|err| vs float64: ours {e_ours:.3e}, eager {e_eager:.3e}  "
                  f"[{'ok' if ok else 'MISMATCH'}]")
            if not ok:
                raise SystemExit(1)
        if not cuda:
            print("  (no GPU: timings skipped)")
            return
        w = seed.gemm.weight
        mm = bench_ms(lambda: torch.mm(x, w.t()), device)
        rows = [("torch.mm", mm, 1)]
        with torch.no_grad():
            for mode, train in (("train", True), ("eval", False)):
                seed.train(train), ours.train(train)
                rows.append((f"eager {mode} fwd", bench_ms(lambda: seed(x), device), 1))
                rows.append((f"cutlass_fused {mode} fwd", bench_ms(lambda: ours(x), device), 1))
        seed.train(), ours.train()
        xg = x.clone().requires_grad_()
        dy = torch.randn(m, n, device=device, dtype=dtype)
        peaks = {}
        for name, mod in (("eager", seed), ("cutlass_fused", ours)):
            def step(mod=mod):
                mod.zero_grad(set_to_none=True)
                xg.grad = None
                mod(xg).backward(dy)
            rows.append((f"{name} train fwd+bwd", bench_ms(step, device), 3))
            step()  # grads allocated once, as in a training loop
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
    flops = 2 * m * n * k
    print(f"  {'what':26s} {'ms':>8s} {'TFLOP/s':>8s} {'x torch.mm':>10s} {'x (GEMMs x torch.mm)':>20s}")
    for what, ms, gemms in rows:
        print(f"  {what:26s} {ms:8.4f} {gemms * flops / ms / 1e9:8.1f} {ms / mm:10.3f} {ms / (gemms * mm):20.3f}")
    print(f"  peak extra memory of train fwd+bwd: eager {peaks['eager']:.0f} MiB, "
          f"cutlass_fused {peaks['cutlass_fused']:.0f} MiB ({peaks['cutlass_fused'] / peaks['eager']:.2f}x)")


if __name__ == "__main__":
    main()
