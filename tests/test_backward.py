"""Gradients of the fused layer against autograd through the unfused float64 model."""
import pytest
import torch
from torch import nn

import cutlass_fused
from cutlass_fused.seed import SeedModel as Seed
from cutlass_fused.ops import ops
from common import (END_TO_END_BATCH, FAMILIES, FAMILY_IDS, MODES, assert_close_rule_scaled, modes_for, params,
                    precision, tf32)

NAMES = ["x", "weight", "bias", "scale", "bn_weight", "bn_bias"]


def straight_through_tf32(t):
    """t rounded to TF32 in the forward, identity in the backward."""
    return t + (tf32(t) - t).detach()


def unfused(inp, training, running, mode=None):
    """The seed model on `inp` (a dict of NAMES), through F ops; differentiable."""
    x, w = inp["x"], inp["weight"]
    if mode == "tf32":
        x, w = straight_through_tf32(x), straight_through_tf32(w)
    z = nn.functional.linear(x, w, inp["bias"])
    if inp["scale"] is not None:
        z = z * inp["scale"]
    return nn.functional.batch_norm(z, *running, inp["bn_weight"], inp["bn_bias"], training, 0.1, 1e-5)


def leaves(p, x, dtype, device, affine=True, frozen=()):
    """Fresh leaf tensors in dtype on device; parameters in `frozen` do not require grad."""
    vals = {"x": x, "weight": p["weight"], "bias": p["bias"], "scale": p["scale"],
            "bn_weight": p["bn_weight"] if affine else None, "bn_bias": p["bn_bias"] if affine else None}
    return {k: None if v is None else v.detach().to(device, dtype).requires_grad_(k not in frozen)
            for k, v in vals.items()}


def grads(inp, y, dy):
    y.backward(dy)
    return {k: (None if v is None or v.grad is None else v.grad) for k, v in inp.items()}


def check_grads(device, family, mode, shape, training, affine=True, frozen=(), zero_cols=0, scale=True, bias=True):
    """Our gradients vs float64, within 2x PyTorch's own same-precision error plus a floor;
    scale=False: the layer without a scale, bias=False: without a linear bias."""
    dtype, _ = MODES[mode]
    m, k, n = shape
    p = params(k, n, "cpu", torch.float32, affine=True, seed=m + n, scale=scale, bias=bias)
    if zero_cols:
        p["scale"][:zero_cols] = 0
        p["bn_weight"][zero_cols:2 * zero_cols] = 0
    x = torch.randn(m, k)
    dy = torch.randn(m, n)
    running = (p["running_mean"], p["running_var"])

    ours = leaves(p, x, dtype, device, affine, frozen)
    with precision(device, family, mode):
        rm, rv = (t.to(device, dtype).clone() for t in running)  # one dtype with bn_weight, as in a cast model
        y = cutlass_fused.linear_scale_batch_norm(
            ours["x"], ours["weight"], ours["bias"], ours["scale"], ours["bn_weight"], ours["bn_bias"],
            rm, rv, training)
        g_ours = grads(ours, y, dy.to(device, dtype))
    same = leaves(p, x, dtype, device, affine, frozen)
    g_same = grads(same, unfused(same, training, [t.to(device, dtype).clone() for t in running], mode),
                   dy.to(device, dtype))
    ref = leaves(p, x, torch.float64, "cpu", affine, frozen)
    g_ref = grads(ref, unfused(ref, training, [t.double().clone() for t in running]), dy.double())
    for name in NAMES:
        if g_ref[name] is None:
            assert g_ours[name] is None, f"{name}: gradient given for an input that needs none"
            continue
        assert g_ours[name] is not None, f"{name}: missing gradient"
        assert g_ours[name].dtype == ours[name].dtype and g_ours[name].shape == ours[name].shape
        assert_close_rule_scaled(g_ours[name], g_same[name], g_ref[name], mode, f"d{name}")


CASES = [pytest.param(d, f, mode, id=f"{fid}-{mode}")
         for (d, f), fid in zip(FAMILIES, FAMILY_IDS) for mode in modes_for(d)]


@pytest.mark.parametrize("device,family,mode", CASES)
@pytest.mark.parametrize("shape", [(256, 384, 200), (1000, 1000, 769)], ids=["aligned", "unaligned"])
def test_training_grads(device, family, mode, shape):
    check_grads(device, family, mode, shape, training=True)


@pytest.mark.parametrize("device,family,mode", CASES)
def test_eval_grads(device, family, mode):
    check_grads(device, family, mode, (3, 769, 200), training=False)


@pytest.mark.parametrize("device,family,mode", CASES)
def test_grads_without_scale(device, family, mode):
    check_grads(device, family, mode, (1000, 1000, 769), training=True, scale=False)
    # training end to end from END_TO_END_BATCH rows (test_batch_norm_backward_small_batch below it)
    check_grads(device, family, mode, (END_TO_END_BATCH, 769, 200), training=True, scale=False, bias=False)
    check_grads(device, family, mode, (3, 769, 200), training=False, scale=False)


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_affine_false_zeros_and_frozen(device, family):
    check_grads(device, family, "f32", (128, 96, 72), training=True, affine=False)
    check_grads(device, family, "f32", (128, 96, 72), training=True, zero_cols=5)
    check_grads(device, family, "f32", (128, 96, 72), training=True, frozen=("x",))
    check_grads(device, family, "f32", (128, 96, 72), training=True, frozen=("weight", "bias", "bn_weight"))
    check_grads(device, family, "f32", (64, 40, 24), training=False, frozen=("x", "scale"))


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("dtype,scale_dtype,bias_dtype", [(torch.bfloat16, torch.float32, torch.float32),
                                                          (torch.bfloat16, torch.bfloat16, torch.bfloat16),
                                                          (torch.float16, torch.float16, torch.float32),
                                                          (torch.float32, torch.float32, torch.float32)])
@pytest.mark.parametrize("m", [3, 300, 1000])
def test_linear_bias_gradient_from_the_op(device, family, dtype, scale_dtype, bias_dtype, m):
    """batch_norm_backward's dlinear_bias is what the autograd computed before it: dscale as the
    op returns it, times 0.0, in the bias's dtype; bit for bit (the zeros' signs, NaN where a
    column of dy is not finite), in the backward kernel each batch takes."""
    n = 300
    g = torch.Generator().manual_seed(m)
    h = (torch.randn(m, n, generator=g) * 2 + 0.5).to(device, dtype)
    scale = torch.randn(n, generator=g).to(device, scale_dtype)
    gamma = torch.randn(n, generator=g).to(device, scale_dtype)
    stats = torch.stack([h.double().sum(0), (h.double() ** 2).sum(0)])
    _, mean, invstd = ops.batch_norm_finalize(h, stats, scale, m, gamma, None, 1e-5)
    dy = torch.randn(m, n, generator=g).to(device, dtype)
    dy[0, 7] = float("nan")
    dy[1, 9] = float("inf")
    with cutlass_fused.use_kernel_family(family):
        _, dscale, _, _, dbias = ops.batch_norm_backward(dy, h, mean, invstd, scale, gamma, 1e-5,
                                                         linear_bias_dtype=bias_dtype)
        _, _, _, _, none = ops.batch_norm_backward(dy, h, mean, invstd, scale, gamma, 1e-5)
    want = (dscale * 0.0).to(bias_dtype)
    assert dbias.dtype == bias_dtype and dbias.shape == (n,) and none.numel() == 0
    assert torch.equal(dbias.isnan(), want.isnan()) and dbias.isnan()[[7, 9]].all()
    finite = ~want.isnan()
    assert (dbias[finite] == 0).all() and torch.equal(torch.signbit(dbias)[finite], torch.signbit(want)[finite])


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("mode", ["bf16", "f32"])
@pytest.mark.parametrize("m", [2, 3])
@pytest.mark.parametrize("with_scale", [True, False], ids=["scale", "no_scale"])
def test_batch_norm_backward_small_batch(device, family, mode, m, with_scale):
    """At batch 2-3 the end-to-end gradient is as ill-conditioned as the forward (see
    common.END_TO_END_BATCH): check the fused BN backward on our own h instead."""
    dtype, _ = MODES[mode]
    n = 769
    h = (torch.randn(m, n) * 3 + 1).to(device, dtype)
    scale, gamma = torch.randn(n, device=device) if with_scale else None, torch.randn(n, device=device)
    stats = torch.stack([h.double().sum(0), (h.double() ** 2).sum(0)])
    _, mean, invstd = ops.batch_norm_finalize(h, stats, scale, m, gamma, None, 1e-5)
    dy = torch.randn(m, n, device=device).to(dtype)
    with cutlass_fused.use_kernel_family(family):
        dh, dscale, dgamma, dbeta, _ = ops.batch_norm_backward(dy, h, mean, invstd, scale, gamma, 1e-5)

    def bn(hh, s, g, b, dt):
        return nn.functional.batch_norm(hh if s is None else hh * s, None, None, g, b, True, 0.1, 1e-5).to(dt)

    def run(dt, dev):
        leaf = lambda t: None if t is None else t.detach().to(dev, dt).requires_grad_()
        ins = [leaf(h), leaf(scale), leaf(gamma), leaf(torch.zeros(n))]
        bn(*ins, dt).backward(dy.to(dev, dt))
        return [None if t is None else t.grad for t in ins]

    ref = run(torch.float64, "cpu")
    same = run(torch.float32 if mode == "f32" else dtype, device)
    for what, got, r, s in zip(("dh", "dscale", "dgamma", "dbeta"), (dh, dscale, dgamma, dbeta), ref, same):
        if r is None:  # no scale: the op returns an empty dscale
            assert got.numel() == 0, f"{what}: given for a layer without it"
            continue
        assert_close_rule_scaled(got, s, r, mode, what)


def test_gradcheck_float64_cpu():
    torch.manual_seed(0)
    m, k, n = 6, 5, 4
    leaf = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)
    args = (leaf(m, k), leaf(n, k), leaf(n), leaf(n), leaf(n), leaf(n))
    train = lambda x, w, b, s, g, bb: cutlass_fused.linear_scale_batch_norm(x, w, b, s, g, bb, None, None, True)
    assert torch.autograd.gradcheck(train, args)
    rm, rv = torch.randn(n, dtype=torch.float64), torch.rand(n, dtype=torch.float64) + 0.5
    evaluate = lambda x, w, b, s, g, bb: cutlass_fused.linear_scale_batch_norm(x, w, b, s, g, bb, rm, rv, False)
    assert torch.autograd.gradcheck(evaluate, args)


def test_double_backward_raises():
    x = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    layer = cutlass_fused.LinearScaleBatchNorm1d(4, 3).double()
    (gx,) = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=False)
    assert gx.shape == x.shape
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_training_loop_matches_unfused(device, family, opt):
    """20 optimizer steps in fp32: losses, parameters and running stats track a float64
    run of the unfused model at least half as well as the fp32 unfused model does."""
    torch.manual_seed(0)
    seed = Seed(48, 32)
    # |scale| >= 0.5. Near scale = 0 (var(z) ~ eps) dscale ~ eps invstd^3 is ~1e3 times
    # as sensitive to h, so two fp32 runs' trajectories part there: on an H200 one
    # scale entry at 0.004 made torch's own fp32 run's dscale 5e-4 off at one step,
    # and ours (3xTF32, whose h error at K=48 is ~2x cuBLAS SGEMM's) 5x more.
    # Single steps at scale = 0 are checked in test_affine_false_zeros_and_frozen.
    with torch.no_grad():
        seed.scale.copy_(seed.scale.sign() * (0.5 + seed.scale.abs()))
    models = {"ref": Seed(48, 32).double(), "same": Seed(48, 32).to(device),
              "ours": cutlass_fused.LinearScaleBatchNorm1d(48, 32, device=device)}
    for mdl in models.values():
        mdl.load_state_dict(seed.state_dict())
    make = (lambda ps: torch.optim.SGD(ps, lr=0.05)) if opt == "sgd" else (lambda ps: torch.optim.Adam(ps, lr=1e-2))
    opts = {k: make(mdl.parameters()) for k, mdl in models.items()}
    target = torch.randn(64, 32, dtype=torch.float64)
    losses = {k: [] for k in models}
    with precision(device, family, "f32"):
        for _ in range(20):
            x = torch.randn(64, 48, dtype=torch.float64)
            for k, mdl in models.items():
                dev, dt = ("cpu", torch.float64) if k == "ref" else (device, torch.float32)
                opts[k].zero_grad()
                loss = ((mdl(x.to(dev, dt)) - target.to(dev, dt)) ** 2).mean()
                loss.backward()
                opts[k].step()
                losses[k].append(loss.item())
    as_t = lambda v: torch.tensor(v, dtype=torch.float64)
    # The loss (about 2 here) is compared relative to its size.
    assert_close_rule_scaled(as_t(losses["ours"]), as_t(losses["same"]), as_t(losses["ref"]), "f32", "losses")
    ref = models["ref"].state_dict()
    for k, v in models["ours"].state_dict().items():
        if v.is_floating_point():
            assert_close_rule_scaled(v, models["same"].state_dict()[k], ref[k], "f32", k)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_float64_gradients_stay_float64(training):
    """A float64 layer's gradients match float64 autograd of the unfused model to ~1e-12,
    in eval too (its backward once rounded everything through fp32: 2e-6 off)."""
    torch.manual_seed(0)
    seed = Seed(40, 24).double()
    ours = cutlass_fused.LinearScaleBatchNorm1d(40, 24).double()
    ours.load_state_dict(seed.state_dict())
    seed.train(training), ours.train(training)
    x = torch.randn(33, 40, dtype=torch.float64)
    xs, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(33, 24, dtype=torch.float64)
    seed(xs).backward(dy)
    ours(xo).backward(dy)
    assert (xo.grad - xs.grad).abs().max().item() < 1e-10
    for (name, p), q in zip(ours.named_parameters(), seed.parameters()):
        assert p.grad.dtype == torch.float64
        assert (p.grad - q.grad).abs().max().item() <= 1e-10 * max(1.0, q.grad.abs().max().item()), name


def _layer_and_input(device, m=96, k=40, n=24, seed=0):
    torch.manual_seed(seed)
    layer = cutlass_fused.LinearScaleBatchNorm1d(k, n, device=device)
    x = torch.randn(m, k, device=device, requires_grad=True)
    dy = torch.randn(m, n, device=device)
    return layer, x, dy


def _grads(layer, x):
    return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]


def _assert_unfused_grads(layer, x, dy, device, family, got):
    """got (from _grads) against autograd through the unfused model: float64 on the CPU as the
    reference, fp32 on `device` as PyTorch's own error (the 2x rule)."""
    runs = {}
    for key, dev, dt in (("ref", "cpu", torch.float64), ("same", device, torch.float32)):
        seed = Seed(layer.gemm.in_features, layer.gemm.out_features).to(dev, dt)
        seed.load_state_dict(layer.state_dict())
        xs = x.detach().to(dev, dt).requires_grad_()
        with precision(device, family, "f32"):
            seed(xs).backward(dy.to(dev, dt))
        runs[key] = [xs.grad] + [p.grad for p in seed.parameters()]
    names = ["x"] + [name for name, _ in layer.named_parameters()]
    for name, g, same, ref in zip(names, got, runs["same"], runs["ref"]):
        assert_close_rule_scaled(g, same, ref, "f32", f"d {name}")


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_retain_graph_backward_twice(device, family):
    """The backward lets go of h unless the graph is retained: retain_graph=True
    gives a second backward the same gradients, and a third one PyTorch's error."""
    layer, x, dy = _layer_and_input(device)
    with precision(device, family, "f32"):
        y = layer(x)
        y.backward(dy, retain_graph=True)
        first = _grads(layer, x)
        _assert_unfused_grads(layer, x, dy, device, family, first)
        x.grad = None
        layer.zero_grad(set_to_none=True)
        y.backward(dy)
        second = _grads(layer, x)
        for a, b in zip(first, second):
            assert torch.equal(a, b)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            y.backward(dy)


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_saved_tensor_hooks_see_h(device, family):
    """Under saved-tensor hooks (activation offload, checkpointing) h goes through
    them like every other saved tensor, and the gradients are unchanged."""
    layer, x, dy = _layer_and_input(device)
    with precision(device, family, "f32"):
        layer(x).backward(dy)
        plain = _grads(layer, x)
        _assert_unfused_grads(layer, x, dy, device, family, plain)
        x.grad = None
        layer.zero_grad(set_to_none=True)
        packed = []

        def pack(t):
            packed.append(tuple(t.shape))
            return t.clone()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x)
        y.backward(dy)
    assert tuple(y.shape) in packed  # h, the only saved batch x features tensor
    for a, b in zip(plain, _grads(layer, x)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("frozen", ["x", "weight"])
@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_saves_only_what_the_gradients_need(device, family, frozen):
    """As torch's linear: the weight is saved only for dX and x only for dW. A first layer's
    input needs no gradient, so its (autocast-cast) weight is not kept for the backward; the
    gradients that are asked for are the same bits as when both are."""
    layer, x, dy = _layer_and_input(device)
    with precision(device, family, "f32"):
        layer(x).backward(dy)
        full = {"x": x.grad.clone(), "weight": layer.gemm.weight.grad.clone()}
        x.grad = None
        layer.zero_grad(set_to_none=True)
        (x if frozen == "x" else layer.gemm.weight).requires_grad_(False)
        packed = []

        def pack(t):
            packed.append(t.data_ptr())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x)
        y.backward(dy)
    unneeded = layer.gemm.weight if frozen == "x" else x
    assert unneeded.data_ptr() not in packed
    assert (x.data_ptr() if frozen == "x" else layer.gemm.weight.data_ptr()) in packed
    if frozen == "x":
        assert x.grad is None and torch.equal(layer.gemm.weight.grad, full["weight"])
    else:
        assert layer.gemm.weight.grad is None and torch.equal(x.grad, full["x"])


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_changed_h_output_refuses_backward(device, family):
    """h, an output of the op that the backward needs, changed in place: the
    backward refuses, as it would for a tensor saved with save_for_backward."""
    layer, x, dy = _layer_and_input(device)
    with precision(device, family, "f32"):
        y, h, *_ = ops.linear_scale_batch_norm_train(
            x, layer.gemm.weight, layer.gemm.bias, layer.scale, layer.bn.weight, layer.bn.bias,
            None, None, None, 0.1, 1e-5, family)
        h.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward(dy)


def _backward_peak(family, backward):
    """The peak memory a bf16 backward adds over what the forward left (m, k, n = 2048, 4096, 1024:
    dX and dW outweigh dh, so the GEMMs' phase is the peak), and the bytes of an m x n, an m x k and
    an n x k tensor. backward(y, dy) runs it; the second of two steps is measured, the allocator warm."""
    m, k, n = 2048, 4096, 1024
    layer, x, dy = _layer_and_input("cuda", m, k, n)
    layer = layer.to(torch.bfloat16)
    x = x.detach().to(torch.bfloat16).requires_grad_()
    dy = dy.to(torch.bfloat16)
    with precision("cuda", family, "bf16"):
        for _ in range(2):
            x.grad = None
            layer.zero_grad(set_to_none=True)
            y = layer(x)
            torch.cuda.synchronize()
            after_forward = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            backward(y, dy)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - after_forward
    return extra, m * n * 2, m * k * 2, n * k * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", [f for d, f in FAMILIES if d == "cuda"])
def test_backward_frees_h_before_the_gemms(family):
    """Peak memory of the backward: h is freed once dh exists, so the dX and dW
    GEMMs run without it (one batch x features tensor less than before, which
    brought the step's peak to torch.compile's; issue 7, target 8)."""
    extra, mn, xk, nk = _backward_peak(family, lambda y, dy: y.backward(dy))
    # dh is made while h is alive (+mn), then dX and dW while dh is and h is not (+xk + nk):
    # keeping h would make that mn + xk + nk. Slack for the small vectors and workspaces.
    assert extra <= max(mn, xk + nk) + mn // 4, (extra, mn, xk, nk)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", [f for d, f in FAMILIES if d == "cuda"])
def test_backward_frees_dy_before_the_gemms(family):
    """As in a model, dy is made by the next node's backward (here a mul's) and nothing else holds
    it: the backward lets go of it once dh exists, so the dX and dW GEMMs run with neither dy nor h
    (keeping dy put one batch x features tensor on the step's peak)."""
    # The mul's backward makes dy (its factor w, times the sum's ones), a tensor only the engine holds.
    extra, mn, xk, nk = _backward_peak(family, lambda y, w: (y * w).sum().backward())
    # dh is made while dy and h are alive (+2 mn: dy and dh), then dX and dW with dh alone
    # (+xk + nk); keeping dy would make the GEMMs' phase mn + xk + nk.
    assert extra <= max(2 * mn, xk + nk) + mn // 4, (extra, mn, xk, nk)


# The backward's two passes, its slab kernel and its cooperative kernel (CUTLASS_FUSED_BACKWARD)
# must write the same bits: slab rows of 128, 64 and 32 bytes (two slabs, dy's and h's: at most
# 256, 512 and 1024 rows), a last slab with some columns (1032), a slab wider than the layer (24),
# a mean 1000x the spread; batches too big for a slab (the cooperative kernel's: 1500 rows with a
# partial last chunk, 4096 rows of 2048 columns; 520 x 50816, whose fp32 column groups (397) alone
# outnumber the co-resident blocks (3 x 132 SMs), so that a block takes two items: past the slab's
# rows the backward's chunks (limits::grad_rows) are as many as one wave of blocks takes).
SLAB_SHAPES = [(256, 4096), (500, 8192), (1000, 2048), (200, 1032), (3, 24), (1500, 1032), (4096, 2048),
               (520, 50816)]
SLAB_ROWS_MAX = 1024  # two slabs of 32-byte rows in 64 KiB


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,n", SLAB_SHAPES, ids=lambda s: str(s))
@pytest.mark.parametrize("mode", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("large_mean", [False, True], ids=["spread", "large_mean"])
def test_backward_kernels_agree(m, n, mode, large_mean, override):
    dtype, _ = MODES[mode]
    g = torch.Generator().manual_seed(m + n)
    h = (torch.randn(m, n, generator=g) * 2 + (1000 if large_mean else 0.5)).to("cuda", dtype)
    scale, gamma = torch.randn(n, generator=g).cuda(), torch.randn(n, generator=g).cuda()
    stats = torch.stack([h.double().sum(0), (h.double() ** 2).sum(0)])
    _, mean, invstd = ops.batch_norm_finalize(h, stats, scale, m, gamma, None, 1e-5)
    dy = torch.randn(m, n, generator=g).to("cuda", dtype)
    out = {}
    for kernels in ("passes", "slab", "cooperative") if m <= SLAB_ROWS_MAX else ("passes", "cooperative"):
        override(backward=kernels)
        out[kernels] = ops.batch_norm_backward(dy, h, mean, invstd, scale, gamma, 1e-5,
                                               linear_bias_dtype=torch.float32)
    assert all(torch.isfinite(t).all() for t in out["passes"])
    for kernels in out:
        for name, a, b in zip(("dh", "dscale", "dweight", "dbias", "dlinear_bias"), out["passes"], out[kernels]):
            assert torch.equal(a, b), f"{kernels}: {name}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_forced_backward_that_cannot_run(override):
    """dy in fp32 for a bf16 h (y's dtype under an fp32 scale) has no slab or cooperative kernel:
    an error."""
    h = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    ones = torch.ones(512, device="cuda", dtype=torch.float64)
    args = (torch.randn(256, 512, device="cuda"), h, ones * 0, ones, torch.ones(512, device="cuda"), None, 1e-5)
    override(backward="slab")
    with pytest.raises(RuntimeError, match="slab backward needs dy in h's dtype"):
        ops.batch_norm_backward(*args)
    override(backward="cooperative")
    with pytest.raises(RuntimeError, match="cooperative backward needs dy in h's dtype"):
        ops.batch_norm_backward(*args)



@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_zero_dim_scale(device, family, training):
    """A 0-dim scale is one value for every column, as h * scale broadcasts it; its gradient is the
    sum of the columns', in its own shape."""
    torch.manual_seed(0)
    m, k, n = 65, 40, 24
    p = params(k, n, "cpu", torch.float32, seed=5)
    p["scale"] = torch.tensor(-1.7)
    x, dy = torch.randn(m, k), torch.randn(m, n)
    running = (p["running_mean"], p["running_var"])
    outs = {}
    for name, dtype, dev in (("ours", torch.float32, device), ("same", torch.float32, "cpu"),
                             ("ref", torch.float64, "cpu")):
        inp = leaves(p, x, dtype, dev)
        rm, rv = (t.to(dev, dtype).clone() for t in running)
        with precision(dev, family, "f32"):
            if name == "ours":
                y = cutlass_fused.linear_scale_batch_norm(inp["x"], inp["weight"], inp["bias"], inp["scale"],
                                                          inp["bn_weight"], inp["bn_bias"], rm, rv, training)
            else:
                y = unfused(inp, training, (rm, rv))
        outs[name] = (y.detach(), grads(inp, y, dy.to(dev, dtype)))
    for key in NAMES:
        ours, same, ref = (outs[n][1][key] for n in ("ours", "same", "ref"))
        assert ours.shape == ref.shape, key
        assert_close_rule_scaled(ours, same, ref, "f32", f"d{key}")
