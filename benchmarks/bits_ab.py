"""Whether two builds give the same bits: fixed-seed layers' y (the plan's, and with the column pass,
overrides(stats_gemm=False)), every gradient and the running stats, per backward kernel (passes,
slab, cooperative), saved by one build and compared with another's. For a change meant to keep the
bits (a reordering, a new layout): run `save` with each build's .so, then `compare`.

    python benchmarks/bits_ab.py save OUT.pt
    python benchmarks/bits_ab.py compare A.pt B.pt

A case that cannot run (a slab past its rows) is saved as its error, which must match too. Off CUDA
it runs the CPU path (a check of the tool, not of kernels).
"""
import sys

import torch

import cutlass_fused

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(128, 96), (3, 1000), (300, 769), (1000, 5125), (1024, 8192), (2048, 4096), (520, 2056)]


def outputs(dt, m, n, act, backward):
    torch.manual_seed(0)
    layer = cutlass_fused.LinearScaleBatchNorm1d(64, n, device=DEVICE, dtype=DTYPES[dt], activation=act)
    x = torch.randn(m, 64, device=DEVICE, dtype=DTYPES[dt], requires_grad=True)
    dy = torch.randn(m, n, device=DEVICE, dtype=DTYPES[dt])
    with cutlass_fused.overrides(backward=backward):
        y = layer(x)
        y.backward(dy)
    with cutlass_fused.overrides(stats_gemm=False):
        y_pass = layer(x.detach())
    grads = [p.grad for p in layer.parameters() if p.grad is not None]
    return [t.detach().cpu() for t in [y, y_pass, x.grad, *layer.buffers(), *grads]]


def save(path):
    res = {}
    for dt in DTYPES:
        for m, n in SHAPES:
            for act in [None, "relu", "gelu"]:
                for backward in ["passes", "slab", "cooperative"]:
                    try:
                        res[(dt, m, n, act, backward)] = outputs(dt, m, n, act, backward)
                    except (RuntimeError, ValueError) as e:
                        res[(dt, m, n, act, backward)] = str(e)[:200]
    torch.save(res, path)
    print(f"cases {len(res)}, cannot run {sum(isinstance(v, str) for v in res.values())}")


def same(u, v):
    bytes_u, bytes_v = (t.reshape(-1).view(torch.uint8) for t in (u, v))
    return u.dtype == v.dtype and u.shape == v.shape and torch.equal(bytes_u, bytes_v)


def compare(path_a, path_b):
    a, b = torch.load(path_a), torch.load(path_b)
    assert a.keys() == b.keys(), "the two files hold different cases"
    equal = differ = 0
    for key in a:
        if isinstance(a[key], str) or isinstance(b[key], str):
            ok = a[key] == b[key]
        else:
            ok = len(a[key]) == len(b[key]) and all(same(u, v) for u, v in zip(a[key], b[key]))
        equal += ok
        differ += not ok
        if not ok:
            print("differs:", key)
    print(f"bit-identical {equal}, differing {differ}")
    return differ == 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["save"] and len(sys.argv) == 3:
        save(sys.argv[2])
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        sys.exit(0 if compare(sys.argv[2], sys.argv[3]) else 1)
    else:
        raise SystemExit(__doc__)
