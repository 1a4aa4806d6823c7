"""Soak test: random shapes, dtypes, modes and kernel families against float64
for a while, watching device memory for growth.

    python3 scripts/soak.py --minutes 5          # on a GPU (CPU: the CPU path)

Each step builds the unfused model's float64 result and PyTorch's own result
in the same precision, and requires ours to be within 2x PyTorch's error plus
a floor (the test suite's rule). Memory is sampled after the first minute
(caches warm) and at the end; any growth beyond 64 MiB fails.
"""
import argparse
import random
import sys
import time

import torch
import torch.nn.functional as F

import cutlass_fused

FLOOR = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5, "tf32": 2e-3}


def tf32(t):
    """t with the low 13 mantissa bits dropped, as TF32 tensor cores read it."""
    return (t.float().contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def unfused(x, p, training, running, dtype, round_tf32=False):
    """The unfused model in dtype. With round_tf32, PyTorch's TF32 precision whether or
    not cuBLAS picks a TF32 kernel for the shape (it does not at small ones)."""
    cast = lambda t: None if t is None else t.to(dtype)
    x, w = x.to(dtype), cast(p["w"])
    if round_tf32:
        x, w = tf32(x), tf32(w)
    z = F.linear(x, w, cast(p["b"])) * cast(p["scale"])
    rm, rv = (t.to(dtype).clone() for t in running)
    y = F.batch_norm(z, rm, rv, cast(p["g"]), cast(p["beta"]), training, 0.1, 1e-5)
    return y, rm, rv


def step(rng, device, families):
    m = rng.choice([2, 3, 7, 64, 333, 1000, 2048, rng.randint(2, 3000)])
    k, n = rng.choice([8, 96, 769, 1024, rng.randint(1, 1500)]), rng.choice([1, 40, 130, 1000, rng.randint(1, 1500)])
    mode = rng.choice(["bf16", "f16", "f32", "tf32"] if device == "cuda" else ["bf16", "f32"])
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}.get(mode, torch.float32)
    family, training = rng.choice(families), rng.random() < 0.7
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    r = lambda *s: torch.randn(*s, generator=gen)
    p = {"w": r(n, k) / k ** 0.5, "b": r(n), "scale": r(n), "g": 1 + 0.1 * r(n), "beta": 0.1 * r(n)}
    running = (0.1 * r(n), 1 + 0.1 * r(n).abs())
    x = r(m, k).to(dtype)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    try:
        dev = {key: v.to(device) for key, v in p.items()}
        rm, rv = (t.to(device).clone() for t in running)
        with cutlass_fused.use_kernel_family(family):
            y = cutlass_fused.linear_scale_batch_norm(x.to(device), dev["w"].to(dtype), dev["b"], dev["scale"],
                                                      dev["g"], dev["beta"], rm, rv, training)
        y_t, _, _ = unfused(x.to(device), dev, training, (t.to(device) for t in running), dtype, mode == "tf32")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    y64, rm64, rv64 = unfused(x.double(), {key: v.double() for key, v in p.items()}, training,
                              (t.double() for t in running), torch.float64)
    err = lambda a: (a.double().cpu() - y64).abs().max().item()
    if training and m < 64:  # tiny batches amplify any rounding of z (tests/test_forward.py, END_TO_END_BATCH)
        ok = torch.isfinite(y).all().item()
    else:
        ok = err(y) <= 2 * err(y_t) + FLOOR["tf32" if mode == "tf32" else dtype]
    what = f"{family} {mode} {'train' if training else 'eval'} {m}x{k}->{n}"
    return ok, what, err(y), err(y_t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    families = ["auto"]
    if device == "cuda":
        families = ["sm80"] + (["sm90"] if torch.cuda.get_device_capability() == (9, 0) else [])
    rng = random.Random(args.seed)
    start, steps, failures, baseline = time.time(), 0, 0, None
    while time.time() - start < args.minutes * 60:
        ok, what, e_ours, e_torch = step(rng, device, families)
        steps += 1
        if not ok:
            failures += 1
            print(f"FAIL {what}: error {e_ours:.3g}, PyTorch's {e_torch:.3g}", flush=True)
        if device == "cuda" and baseline is None and time.time() - start > min(60, args.minutes * 30):
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated()
    growth = 0
    if device == "cuda" and baseline is not None:
        torch.cuda.synchronize()
        growth = torch.cuda.memory_allocated() - baseline
    print(f"soak: {steps} steps in {time.time() - start:.0f} s, {failures} failures, "
          f"device memory growth {growth / 2**20:.1f} MiB after warm-up")
    return 1 if failures or growth > 64 * 2**20 else 0


if __name__ == "__main__":
    sys.exit(main())
