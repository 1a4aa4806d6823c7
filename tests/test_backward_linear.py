"""batch_norm_backward_linear: the BN backward of a layer whose y feeds a Linear, from that Linear's
output gradient dz and weight (issue 71, item 1). On the sm90 family a 16-bit problem with a
select activation runs the grad GEMM (the sums in the dX GEMM's epilogue) and one pass; the rest
runs torch.mm and batch_norm_backward. Both are held to float64 under the 2x rule, and to the
composition they replace."""
import pytest
import torch
import torch.nn.functional as F

import cutlass_fused
from cutlass_fused.ops import ops
from common import CUDA, FAMILIES, FAMILY_IDS, FLOOR, HOPPER, assert_close_rule_scaled, cuda_kernels, max_err

OUTPUTS = ("dh", "dscale", "dweight", "dbias", "dlinear_bias")
ACTS = ("none", "relu", "leaky_relu", "gelu")
# (batch, features, next Linear's outputs): batches of 2, 3 and 1000; partial tiles in every
# direction; 769 and 5125 features, whose rows are no whole 16-byte groups (torch.mm's route).
SHAPES = [(2, 1000, 512), (3, 256, 1000), (1000, 1000, 768), (300, 2048, 136), (1000, 769, 512), (64, 5125, 64)]


def layer(m, n, k, device, dtype, affine=True, scale=True, seed=0):
    """A forward's saved h, statistics and parameters, and the next Linear's dz and weight."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    h = (r(m, n) * 2 + 0.5).to(device, dtype)
    sc = (r(n) * 0.5 + 1).to(device) if scale else None
    gamma, beta = ((r(n).to(device), r(n).to(device)) if affine else (None, None))
    stats = torch.stack([h.double().sum(0), (h.double() ** 2).sum(0)])
    _, mean, invstd = ops.batch_norm_finalize(h, stats, sc, m, gamma, beta, 1e-5)
    dz = r(m, k).to(device, dtype)
    w2 = (r(k, n) / k ** 0.5).to(device, dtype)
    return h, sc, gamma, beta, mean, invstd, dz, w2


def unfused(h, sc, gamma, beta, dz, w2, act, dtype):
    """The gradients of (h, scale, gamma, beta) through y = act(BN(h * scale)) and z = y W2^T, with
    dz as z's gradient, as PyTorch computes them: in h's dtype with fp32 vectors (dtype h.dtype),
    or all in float64 (the reference)."""
    ref = dtype == torch.float64
    leaf = lambda t, dt: None if t is None else t.detach().to(dt).requires_grad_()
    hh = leaf(h, dtype)
    s, g, b = (leaf(t, torch.float64 if ref else torch.float32) for t in (sc, gamma, beta))
    z = hh * s if s is not None else hh
    y = F.batch_norm(z, None, None, g, b, training=True, eps=1e-5)
    y = {"none": lambda t: t, "relu": F.relu, "leaky_relu": F.leaky_relu, "gelu": F.gelu}[act](y)
    out = y.to(dtype) @ w2.to(dtype).t()
    out.backward(dz.to(dtype))
    return [t.grad if t is not None else None for t in (hh, s, g, b)]


def check_against_float64(out, h, sc, gamma, beta, dz, w2, act, mode):
    ref = unfused(h, sc, gamma, beta, dz, w2, act, torch.float64)
    same = unfused(h, sc, gamma, beta, dz, w2, act, h.dtype)
    dh, dscale, dweight, dbias, _ = out
    for name, ours, r, t in (("dh", dh, ref[0], same[0]), ("dscale", dscale, ref[1], same[1]),
                             ("dweight", dweight, ref[2], same[2]), ("dbias", dbias, ref[3], same[3])):
        if r is None:
            continue
        assert_close_rule_scaled(ours.float(), t.float(), r, mode, name)


def run(h, sc, gamma, beta, mean, invstd, dz, w2, act, family="auto", bias_dtype=torch.float32):
    return ops.batch_norm_backward_linear(dz, w2, h, mean, invstd, sc, gamma, 1e-5, beta, act, 0.01, bias_dtype,
                                          family)


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("mode", ["bf16", "f16"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_against_float64(device, family, mode, act, shape, override):
    if device == "cpu" and mode == "f16":
        pytest.skip("the CPU path's f16 is bf16's code")
    override(poison=True)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[mode]
    args = layer(*shape, device, dtype, seed=sum(shape))
    h, sc, gamma, beta, mean, invstd, dz, w2 = args
    out = run(*args, act, family)
    assert all(torch.isfinite(t).all() for t in out), "an output left unwritten"
    check_against_float64(out, h, sc, gamma, beta, dz, w2, act, mode)


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("act", ["relu", "leaky_relu"])
@pytest.mark.parametrize("affine,scale", [(False, False), (True, False), (False, True)],
                         ids=["affine_false", "no_scale", "scale_only"])
def test_layer_forms(device, family, act, affine, scale, override):
    """affine=False, no scale, a scale alone: the vectors the layer lacks read 1 and 0."""
    override(poison=True)
    args = layer(1000, 1024, 520, device, torch.bfloat16, affine=affine, scale=scale)
    h, sc, gamma, beta, mean, invstd, dz, w2 = args
    out = run(*args, act, family)
    check_against_float64(out, h, sc, gamma, beta, dz, w2, act, "bf16")
    if not scale:
        assert out[1].numel() == 0


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("act", ACTS)
def test_close_to_the_composition(device, family, act):
    """Against batch_norm_backward(torch.mm(dz, next_weight)): the same dtypes and shapes, values
    within the rounding of the sums' other order (and of g, which the grad route rounds to h's
    dtype as PyTorch's activation backward does)."""
    args = layer(1000, 2048, 1024, device, torch.bfloat16, seed=3)
    h, sc, gamma, beta, mean, invstd, dz, w2 = args
    ours = run(*args, act, family)
    theirs = ops.batch_norm_backward(torch.mm(dz, w2), h, mean, invstd, sc, gamma, 1e-5, beta, act, 0.01,
                                     torch.float32)
    for name, a, b in zip(OUTPUTS, ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        k = max(1.0, b.abs().max().item()) if b.numel() else 1.0
        assert max_err(a, b) / k <= FLOOR["bf16"], name


@pytest.mark.skipif(not HOPPER, reason="the grad kernels are sm90's")
@pytest.mark.parametrize("act,shape,grad_kernel", [
    ("relu", (1000, 1000, 768), True), ("leaky_relu", (3, 256, 1000), True), ("none", (1000, 1024, 512), True),
    ("gelu", (1000, 1024, 512), False), ("relu", (1000, 769, 512), False)])
def test_route(act, shape, grad_kernel):
    """The grad GEMM runs where the plan says (16-bit sm90, a select activation, whole 16-byte rows),
    and torch.mm elsewhere; on the sm80 family always torch.mm."""
    args = layer(*shape, "cuda", torch.bfloat16)
    _, names = cuda_kernels(lambda: run(*args, act, "sm90"))
    assert any("_grad_" in n for n in names) == grad_kernel
    _, names = cuda_kernels(lambda: run(*args, act, "sm80"))
    assert not any("_grad_" in n for n in names)


@pytest.mark.skipif(not HOPPER, reason="the grad kernels are sm90's")
def test_same_bits_every_call():
    """Fixed-order sums: the same inputs give the same bits."""
    args = layer(4096, 2048, 1024, "cuda", torch.bfloat16)
    a, b = run(*args, "relu", "sm90"), run(*args, "relu", "sm90")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.skipif(not HOPPER, reason="the grad kernels are sm90's")
def test_large_mean_keeps_its_bits():
    """A mean 1000x the spread: the GEMM centers g (h - mean_h) per element, so dweight keeps its
    precision where an uncentered fp32 sum would lose it."""
    h, sc, gamma, beta, mean, invstd, dz, w2 = layer(1000, 1024, 512, "cuda", torch.bfloat16)
    h = (h.float() * 0.01 + 1000).bfloat16()
    stats = torch.stack([h.double().sum(0), (h.double() ** 2).sum(0)])
    _, mean, invstd = ops.batch_norm_finalize(h, stats, sc, 1000, gamma, beta, 1e-5)
    out = run(h, sc, gamma, beta, mean, invstd, dz, w2, "none", "sm90")
    check_against_float64(out, h, sc, gamma, beta, dz, w2, "none", "bf16")


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
@pytest.mark.parametrize("act", ["none", "relu"])
def test_opcheck(device, act):
    args = layer(24, 64, 40, device, torch.bfloat16)
    h, sc, gamma, beta, mean, invstd, dz, w2 = args
    torch.library.opcheck(ops.batch_norm_backward_linear, (dz, w2, h, mean, invstd, sc, gamma, 1e-5, beta, act))
    torch.library.opcheck(ops.batch_norm_backward_linear, (dz, w2, h, mean, invstd, None, None, 1e-5),
                          {"linear_bias_dtype": torch.float32})


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_bad_inputs(device):
    h, sc, gamma, beta, mean, invstd, dz, w2 = layer(8, 16, 24, device, torch.bfloat16)
    call = lambda dz_, w_, h_=h: ops.batch_norm_backward_linear(dz_, w_, h_, mean, invstd, sc, gamma, 1e-5)
    with pytest.raises(RuntimeError, match="expected dz to be 2-D with h's 8 rows"):
        call(dz[:5], w2)
    with pytest.raises(RuntimeError, match=r"expected next_weight of shape \[24, 16\]"):
        call(dz, w2.t().contiguous())
    with pytest.raises(RuntimeError, match="expected dz and next_weight in h's dtype"):
        call(dz.float(), w2)
    with pytest.raises(RuntimeError, match="expected family"):
        ops.batch_norm_backward_linear(dz, w2, h, mean, invstd, sc, gamma, 1e-5, family="sm70")


def test_plan():
    """The plan's route, on any machine: the grad kernel for 16-bit sm90 problems with a select
    activation and whole 16-byte rows; torch.mm (no kernel) otherwise."""
    plan = lambda *a, **k: cutlass_fused.plan(*a, mode="backward_linear", **k)
    p = plan(1024, 8192, 8192, torch.bfloat16, activation="relu")
    assert p["kernel"].startswith("sm90_bf16_grad_") and p["backward"] == "passes"
    assert p["sum_tiles"] == 1024 // 256 and p["sum_ld"] == 8192
    assert plan(1000, 1000, 768, torch.float16, activation="leaky_relu")["kernel"].startswith("sm90_f16_grad_")
    for kw in ({"activation": "gelu"}, {"family": "sm80"}, {"aligned": False}, {"y_dtype": torch.float32}):
        assert plan(1024, 2048, 2048, torch.bfloat16, **kw)["kernel"] == "", kw
    assert plan(1024, 2048, 2048, torch.float32)["kernel"] == ""
    assert plan(1000, 769, 512, torch.bfloat16)["kernel"] == ""
    assert plan(1000, 1024, 516, torch.bfloat16)["kernel"] == ""
    with cutlass_fused.overrides(stats_gemm=False):
        assert plan(1024, 2048, 2048, torch.bfloat16)["kernel"] == ""
