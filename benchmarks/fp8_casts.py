"""The FP8 casts at the FP8 layer's shapes: current scaling (an amax pass, then the cast) against
delayed scaling (one cast that measures the amax), plain and transposing, beside a bf16 copy of x
(HBM's pace). do_bench medians in µs, and the bytes each moves per second (bf16 in, e4m3 out).

    python benchmarks/fp8_casts.py
"""
import torch

import cutlass_fused  # noqa: F401  (the ops)
from cutlass_fused.ops import ops

E4M3 = torch.float8_e4m3fn


def main():
    if not torch.cuda.is_available():
        raise SystemExit("fp8_casts: needs a CUDA GPU")
    import triton.testing
    for m, k in [(16384, 4096), (4096, 4096), (8192, 8192), (1024, 8192)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        s = torch.tensor(8.0, device="cuda")
        rows = {"x.clone() (4 B)": (lambda: x.clone(), 4),
                "current (amax+cast, 5 B)": (lambda: ops.quantize_e4m3(x, 0), 5),
                "delayed (cast+amax, 3 B)": (lambda: ops.quantize_with_scale(x, s, E4M3, False), 3),
                "current transposed (6 B)": (lambda: ops.quantize_transposed(x, E4M3, 0), 6),
                "delayed transposed (4 B)": (lambda: ops.quantize_with_scale(x, s, E4M3, True), 4)}
        print(f"{m}x{k} bf16:")
        for name, (f, b) in rows.items():
            ms = triton.testing.do_bench(f, warmup=50, rep=300, return_mode="median")
            print(f"  {name:28s} {ms * 1e3:8.1f} us  {b * x.numel() / ms / 1e6:7.0f} GB/s")


if __name__ == "__main__":
    main()
