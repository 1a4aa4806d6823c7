"""Linked layers (issue 71, item 1): where a fused layer's y is the next fused layer's x alone, fuse()
links them, and the second layer's backward runs the first one's BN backward through
batch_norm_backward_linear (on the sm90 family's 16-bit route, its sums in the dX GEMM's epilogue).
Held to float64 under the 2x rule and to the unlinked model; the fallbacks, autograd's corner
cases, torch.compile and the op's own checks."""
import copy
import gc
import io
import weakref

import pytest
import torch
from torch import nn

import cutlass_fused
from cutlass_fused.functional import train_linked
from cutlass_fused.ops import ops
from common import CUDA, FAMILIES, FAMILY_IDS, HOPPER, ScaledBlock, assert_close_rule_scaled, cuda_kernels

ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "leaky_relu": lambda: nn.LeakyReLU(0.2), "silu": nn.SiLU}
# (batch, features of the three blocks): batches of 2, 3 and 1000; 769 and 5125 features, whose
# rows are no whole 16-byte groups (batch_norm_backward_linear's torch.mm route).
SHAPES = [(2, (64, 128, 96)), (3, (1000, 256, 512)), (1000, (512, 769, 256)), (256, (128, 5125, 64))]


def mlp(features, seed, scaled_middle=False, bias=True, affine=True, acts=("relu", "gelu"), head=0):
    """Three blocks over features (n0, n1, n2, n3): Linear -> BN -> act twice, then one without an
    activation; with `head`, a Linear(n3, head) after them (a linked layer's plain Linear)."""
    torch.manual_seed(seed)
    n = list(features)
    blocks = []
    for i, act in enumerate(acts):
        if scaled_middle and i == 1:
            blocks.append(ScaledBlock(n[i], n[i + 1], ACTS[act]()))
        else:
            blocks += [nn.Linear(n[i], n[i + 1], bias=bias), nn.BatchNorm1d(n[i + 1], affine=affine), ACTS[act]()]
    blocks += [nn.Linear(n[-2], n[-1], bias=bias), nn.BatchNorm1d(n[-1], affine=affine)]
    if head:
        blocks.append(nn.Linear(n[-1], head, bias=bias))
    model = nn.Sequential(*blocks)
    with torch.no_grad():  # BN vectors away from their initial 1 and 0, so that their gradients matter
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d) and m.affine:
                m.weight.normal_(1, 0.2)
                m.bias.normal_(0, 0.2)
    return model


def step(model, x, dy, params=None):
    """y and the gradients of x and every parameter (of `params`, a module whose parameters the
    model shares, where given), after one training forward and backward."""
    x = x.detach().requires_grad_()
    y = model(x)
    y.backward(dy.to(y.dtype))
    return y, [x.grad] + [p.grad for p in (params or model).parameters()]


def fused(model, link=True):
    """fuse() of a copy of `model`: (the fused module, its report, the copy, whose tensors it shares)."""
    base = copy.deepcopy(model)
    out, report = cutlass_fused.fuse(base, link=link)
    return out, report, base


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("mode", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{'-'.join(map(str, s[1]))}")
def test_linked_mlp_against_float64(device, family, mode, shape, override):
    if device == "cpu" and mode == "f16":
        pytest.skip("the CPU path's f16 is bf16's code")
    override(poison=True)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[mode]
    batch, features = shape
    head = 40 if batch in (3, 1000) else 0  # and the last block linked to a plain Linear
    # On a GPU a block links where its activation is a select one (functional.links): relu and
    # leaky_relu every block of two shapes, gelu's block unlinked in the others.
    acts = ("relu", "leaky_relu") if batch in (3, 1000) else ("relu", "gelu")
    model = mlp((features[0],) + features, seed=batch, scaled_middle=batch == 3, bias=batch != 2, head=head,
                acts=acts)
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, features[0], generator=g).to(device)
    dy = torch.randn(batch, head or features[-1], generator=g).to(device)
    ref = copy.deepcopy(model).to(device, torch.float64)
    y64, g64 = step(ref, x.double(), dy.double())
    same = copy.deepcopy(model).to(device, dtype)
    y_same, g_same = step(same, x.to(dtype), dy)
    linked, report, base = fused(model.to(device, dtype))
    assert len(report.fused) == 3 and len(report.linked) == (3 if head else 2), report
    with cutlass_fused.use_kernel_family(family):
        y, grads = step(linked, x.to(dtype), dy, base)
    names = ["x"] + [name for name, _ in model.named_parameters()]
    assert_close_rule_scaled(y.float(), y_same.float(), y64, mode, "y")
    for name, ours, t, r in zip(names, grads, g_same, g64):
        assert ours is not None and ours.dtype == t.dtype, name
        assert torch.isfinite(ours).all(), f"{name}: not finite"
        assert_close_rule_scaled(ours.float(), t.float(), r, mode, name)
    # The running stats as the unfused model's, in the same precision.
    for (name, ours), t, r in zip(base.named_buffers(), same.buffers(), ref.buffers()):
        if "running" in name:
            assert_close_rule_scaled(ours.float(), t.float(), r, mode, name)


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_linked_is_the_unlinked_model(device, family):
    """The same gradients as fuse(link=False): bit for bit where the linked route is the unlinked
    one's ops (the CPU, fp32), within the 2x rule where the grad GEMM runs."""
    model = mlp((96, 200, 136, 64), seed=1).to(device, torch.bfloat16)
    x = torch.randn(300, 96, device=device, dtype=torch.bfloat16)
    dy = torch.randn(300, 64, device=device)
    with cutlass_fused.use_kernel_family(family):
        y0, g0 = step(fused(model, link=False)[0], x, dy)
        y1, g1 = step(fused(model)[0], x, dy)  # the same parameters' order: no scaled block
    assert torch.equal(y0, y1)
    for a, b in zip(g0, g1):
        if device == "cpu":
            assert torch.equal(a, b)
        else:
            assert (a.float() - b.float()).abs().max() <= 2e-2 * max(1.0, a.float().abs().max().item())


def test_fuse_links_only_sole_users():
    """fuse() links a block to the next only where its y is that block's input alone."""

    class Branch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
            self.b = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
            self.c = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
            self.d = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))

        def forward(self, x):
            y = self.a(x)
            z = self.b(y)  # y has a second user below: a is not linked
            return self.d(self.c(z)) + y  # z only feeds c, and c only feeds d: linked

    model = Branch()
    gm, report, base = fused(model)
    assert len(report.fused) == 4
    assert report.linked == [("b_0_bn", "c_0_bn"), ("c_0_bn", "d_0_bn")], report
    assert "linked b_0_bn -> c_0_bn" in str(report)
    assert "link = True" in gm.code
    assert cutlass_fused.fuse(model, link=False)[1].linked == []
    x, dy = torch.randn(16, 8), torch.randn(16, 8)
    y0, g0 = step(model, x, dy)
    y1, g1 = step(gm, x, dy, base)
    assert_close_rule_scaled(y1, y0, y0.double(), "f32", "y")
    for a, b in zip(g0, g1):
        assert_close_rule_scaled(b, a, a.double(), "f32", "grad")


def test_fuse_leaves_sequence_forms_unlinked():
    """The (B, T, C) form's layers return a 3-D y: never linked."""

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.b1 = nn.Linear(8, 8), nn.BatchNorm1d(8)
            self.l2, self.b2 = nn.Linear(8, 8), nn.BatchNorm1d(8)

        def forward(self, x):
            y = self.b1(self.l1(x).transpose(1, 2)).transpose(1, 2)
            return self.b2(self.l2(y).transpose(1, 2)).transpose(1, 2)

    gm, report = cutlass_fused.fuse(Seq())
    assert len(report.fused) == 2 and report.linked == []
    gm(torch.randn(2, 5, 8)).sum().backward()


def test_linked_layers_fall_back_where_the_plain_call_runs():
    """Eval, no_grad, an FP8 recipe on one layer and PyTorch's batch-of-one error: each layer then
    runs its plain call, the others stay linked where they can."""
    model = mlp((16, 32, 24, 8), seed=2)
    gm, _ = cutlass_fused.fuse(copy.deepcopy(model))
    x = torch.randn(10, 16)
    assert torch.equal(gm.eval()(x), cutlass_fused.fuse(copy.deepcopy(model), link=False)[0].eval()(x))
    gm.train()
    with torch.no_grad():
        y = gm(x)
    assert torch.isfinite(y).all() and y.grad_fn is None
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        gm(x[:1])
    layers = [m for m in gm.modules() if isinstance(m, cutlass_fused.LinearBatchNorm1d)]
    layers[1].fp8 = cutlass_fused.Float8Recipe(emulate=True)
    ref = copy.deepcopy(gm)
    for m in ref.modules():
        if isinstance(m, cutlass_fused.LinearBatchNorm1d):
            m._linked = lambda x_, prev, m=m: (m.forward(x_), None)  # every layer unlinked
    dy = torch.randn(10, 8)
    _, g0 = step(ref, x, dy)
    _, g1 = step(gm, x, dy)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a)


def test_linked_op_frees_its_graph_without_a_backward():
    """A linked forward whose result is dropped frees h at once: no reference cycle through the
    node that made it (the op keeps a detached alias of its own differentiable h)."""
    w = torch.randn(6, 5, requires_grad=True)
    x = torch.randn(4, 5)
    gc.collect()
    gc.disable()
    try:
        y, link = train_linked(x, w, None, None, None, None, None, None, 0.1, 1e-5, None, "relu", 0.01, None, None)
        h = weakref.ref(link.h)
        del y, link
        assert h() is None, "h outlived its graph"
    finally:
        gc.enable()


def test_linked_backward_lets_go_of_h_and_keeps_it_for_retain_graph():
    model = mlp((8, 12, 10, 6), seed=3)
    gm, _ = cutlass_fused.fuse(copy.deepcopy(model))
    layer = next(m for m in gm.modules() if isinstance(m, cutlass_fused.LinearBatchNorm1d))
    x = torch.randn(7, 8)
    y, link = layer(x, link=True)
    nxt = [m for m in gm.modules() if isinstance(m, cutlass_fused.LinearBatchNorm1d)][1]
    y2, _ = nxt(y, link=link)
    h = weakref.ref(link.h)
    del link, y
    loss = y2.square().sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in layer.parameters()]
    assert h() is not None  # kept for the second backward
    for p in gm.parameters():
        p.grad = None
    loss.backward()
    for a, p in zip(first, layer.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=0, atol=0)
    del loss, y2
    assert h() is None


def test_linked_under_saved_tensor_hooks_and_frozen_parameters():
    """Saved-tensor hooks see every tensor the linked ops keep; a frozen first block and an input
    without a gradient still give the others theirs."""
    model = mlp((8, 12, 10, 6), seed=4)
    for p in model[0].parameters():
        p.requires_grad_(False)
    gm, _, base = fused(model)
    x, dy = torch.randn(9, 8), torch.randn(9, 6)
    y0 = model(x)
    y0.backward(dy)
    seen = []

    def pack(t):
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y1 = gm(x)
    y1.backward(dy)
    assert seen
    for (name, a), b in zip(model.named_parameters(), base.parameters()):
        if a.requires_grad:
            assert_close_rule_scaled(b.grad, a.grad, a.grad.double(), "f32", name)
        else:
            assert b.grad is None


def test_linked_model_compiles_and_saves():
    """torch.compile of a linked model: one graph, the eager gradients; torch.save of it loads."""
    torch._dynamo.reset()
    model = mlp((16, 32, 24, 8), seed=5, head=6)
    gm, report = cutlass_fused.fuse(copy.deepcopy(model))
    assert len(report.linked) == 3
    x, dy = torch.randn(12, 16), torch.randn(12, 6)
    y0, g0 = step(copy.deepcopy(gm), x, dy)
    from torch._dynamo.utils import counters
    counters.clear()
    compiled = torch.compile(copy.deepcopy(gm), fullgraph=True)
    y1, g1 = step(compiled, x, dy)
    torch.testing.assert_close(y1, y0)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a)
    torch._dynamo.reset()
    buf = io.BytesIO()
    torch.save(gm, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert "link = " in loaded.code
    y2, g2 = step(loaded, x, dy)
    torch.testing.assert_close(y2, y0, rtol=0, atol=0)


@pytest.mark.skipif(not hasattr(torch, "get_autocast_dtype"), reason="torch.get_autocast_dtype: torch >= 2.4")
def test_linked_under_autocast():
    """bf16 autocast over fp32 parameters: the unlinked fused model's gradients, in fp32."""
    model = mlp((16, 32, 24, 8), seed=6, scaled_middle=True, head=5)
    x, dy = torch.randn(20, 16), torch.randn(20, 5)
    out = []
    for link in (False, True):
        gm, _ = cutlass_fused.fuse(copy.deepcopy(model), link=link)
        with torch.autocast("cpu", torch.bfloat16):
            y, grads = step(gm, x, dy)
        out.append((y, grads))
    (y0, g0), (y1, g1) = out
    assert torch.equal(y0, y1)
    for a, b in zip(g0, g1):
        assert b.dtype == a.dtype == torch.float32
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def _linked_args(device, prev):
    g = torch.Generator().manual_seed(7)
    r = lambda *s, grad=True: torch.randn(*s, generator=g).to(device).requires_grad_(grad)
    w1, w2 = r(12, 8), r(10, 12)
    x = r(6, 8)
    y1, h1, _, mean1, invstd1 = ops.linear_scale_batch_norm_train_linked(
        x, w1, r(12), None, r(12), r(12), None, None, None, 0.1, 1e-5, "auto", False, "relu")
    args = (y1.detach(), w2, r(10), r(10), r(10), r(10), None, None, None, 0.1, 1e-5, "auto", False, "gelu", 0.01,
            None)
    if not prev:
        return args
    return args + (h1.detach().requires_grad_(), mean1, invstd1, r(12), None, r(12), r(12), 1e-5, "relu", 0.01)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
@pytest.mark.parametrize("prev", [False, True], ids=["first", "after"])
def test_linked_opcheck(device, prev):
    torch.library.opcheck(ops.linear_scale_batch_norm_train_linked, _linked_args(device, prev))


def test_linked_op_refuses_a_partial_or_misshapen_prev():
    args = _linked_args("cpu", True)
    with pytest.raises(RuntimeError, match="expected prev_mean and prev_invstd beside prev_h"):
        ops.linear_scale_batch_norm_train_linked(*args[:16], args[16], None, None)
    with pytest.raises(RuntimeError, match="expected prev_h of x's shape"):
        ops.linear_scale_batch_norm_train_linked(*args[:16], args[16][:, :5], *args[17:])
    with pytest.raises(RuntimeError, match="expected prev_mean and prev_invstd to be float64"):
        ops.linear_scale_batch_norm_train_linked(*args[:16], args[16], args[17].float(), *args[18:])


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_linked_under_activation_checkpointing(use_reentrant):
    """torch.utils.checkpoint around the first linked block: recomputed (non-reentrant, its saved
    tensors under checkpoint's hooks) or run without autograd and again in the backward (reentrant,
    unlinked then): the unlinked model's gradients either way."""
    from torch.utils.checkpoint import checkpoint

    model = mlp((8, 12, 10, 6), seed=8)

    class Checkpointed(nn.Module):
        def __init__(self, gm):
            super().__init__()
            self.gm = gm
            self.layers = [m for m in gm.modules() if isinstance(m, cutlass_fused.LinearBatchNorm1d)]

        def forward(self, x):
            a, b, c = self.layers
            x = x.requires_grad_() if use_reentrant else x
            y, link = checkpoint(lambda t: a(t, link=True), x, use_reentrant=use_reentrant)
            y, link = b(y, link=link)
            return c(y, link=link)[0]

    x, dy = torch.randn(9, 8), torch.randn(9, 6)
    grads = []
    for link in (False, True):
        gm, _, base = fused(model, link=link)
        module = Checkpointed(gm) if link else gm
        step(module, x, dy, base)
        grads.append([p.grad for p in base.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_linked_head_runs_its_hooks_where_it_has_them():
    """A forward hook put on the plain Linear after fuse(): the Linear's own call runs (with its hook),
    unlinked from the block before; the gradients are the same."""
    model = mlp((8, 12, 10, 6), seed=9, head=4)
    gm, report, base = fused(model)
    assert report.linked[-1] == ("6_bn", "8")
    calls = []
    gm.get_submodule("8").register_forward_hook(lambda m, args, out: calls.append(out.shape))
    x, dy = torch.randn(7, 8), torch.randn(7, 4)
    _, g1 = step(gm, x, dy, base)
    _, g0 = step(model, x, dy)
    assert calls == [torch.Size([7, 4])]
    for a, b in zip(g0, g1):
        assert_close_rule_scaled(b, a, a.double(), "f32", "grad")


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_linear_linked_opcheck(device):
    g = torch.Generator().manual_seed(10)
    r = lambda *s: torch.randn(*s, generator=g).to(device).requires_grad_()
    x = r(6, 8)
    y, h, _, mean, invstd = ops.linear_scale_batch_norm_train_linked(
        x, r(12, 8), r(12), None, r(12), r(12), None, None, None, 0.1, 1e-5, "auto", False, "silu")
    args = (y.detach(), r(5, 12), r(5), h.detach().requires_grad_(), mean, invstd, r(12), None, r(12), r(12), 1e-5,
            "silu", 0.01, "auto")
    torch.library.opcheck(ops.linear_linked, args)


def test_grad_runs_is_the_plans_answer():
    """ops.grad_runs: never for fp32, a smooth activation, the sm80 family or another GPU than
    compute 9.0; for bf16 and f16 with a select activation exactly where the build has sm90 grad rows."""
    built = any("_grad_" in name for name in cutlass_fused.built_kernels())
    for dtype in (torch.bfloat16, torch.float16):
        for act in ("none", "relu", "leaky_relu"):
            assert ops.grad_runs("auto", 90, dtype, act) == built
            assert ops.grad_runs("sm90", 90, dtype, act) == built
            assert not ops.grad_runs("sm80", 90, dtype, act)
            assert not ops.grad_runs("auto", 80, dtype, act)
        for act in ("gelu", "gelu_tanh", "silu"):
            assert not ops.grad_runs("auto", 90, dtype, act)
    assert not ops.grad_runs("auto", 90, torch.float32, "relu")
    with cutlass_fused.overrides(stats_gemm=False):
        assert not ops.grad_runs("auto", 90, torch.bfloat16, "relu")
    with pytest.raises(ValueError, match="family"):
        ops.grad_runs("sm70", 90, torch.bfloat16, "relu")


@pytest.mark.skipif(not HOPPER, reason="the grad kernels are sm90's")
@pytest.mark.parametrize("family,act,dtype,grad", [("sm90", "relu", torch.bfloat16, True),
                                                   ("sm90", "gelu", torch.bfloat16, False),
                                                   ("sm90", "relu", torch.float32, False),
                                                   ("sm80", "relu", torch.bfloat16, False)])
def test_linked_model_runs_the_grad_gemm_where_it_links(family, act, dtype, grad):
    """A linked bf16 relu block's backward runs the grad GEMM; where the plan has no grad kernel
    the layer does not link, and its backward is the unlinked one's (no grad kernel)."""
    model = mlp((256, 512, 384, 256), seed=11, acts=(act, act)).to("cuda", dtype)
    gm, _, _ = fused(model)
    x = torch.randn(512, 256, device="cuda", dtype=dtype)
    with cutlass_fused.use_kernel_family(family):
        y = gm(x)
        _, names = cuda_kernels(lambda: y.backward(torch.randn_like(y)))
    assert any("_grad_" in n for n in names) == grad


def test_a_link_takes_its_own_y_alone():
    """A Link given with another x than its y is refused: its gradient would never reach that x."""
    model = mlp((8, 12, 10, 6), seed=12, head=3)
    gm, _, _ = fused(model)
    a, b = [m for m in gm.modules() if isinstance(m, cutlass_fused.LinearBatchNorm1d)][:2]
    x = torch.randn(5, 8)
    y, link = a(x, link=True)
    with pytest.raises(ValueError, match="expected x to be the y of the layer whose Link is given"):
        b(y.clone(), link=link)
    with pytest.raises(ValueError, match="expected x to be the y of the layer whose Link is given"):
        cutlass_fused.functional.linear_after(y + 0, link, nn.Linear(12, 3))


def test_linked_blocks_keep_batch_norms_rules():
    """momentum=None (the cumulative average), affine=False and track_running_stats=False in linked
    blocks, and a projector called on two views (each call its own links): the unfused model's
    gradients and running stats."""

    class TwoViews(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Sequential(nn.Linear(8, 12), nn.BatchNorm1d(12, momentum=None), nn.ReLU(),
                                      nn.Linear(12, 10, bias=False), nn.BatchNorm1d(10, affine=False),
                                      nn.LeakyReLU(0.1), nn.Linear(10, 6),
                                      nn.BatchNorm1d(6, track_running_stats=False))

        def forward(self, a, b):
            return self.proj(a) * self.proj(b)

    torch.manual_seed(13)
    model = TwoViews()
    gm, report, base = fused(model)
    assert len(report.fused) == 6 and len(report.linked) == 4, report
    a, b, dy = torch.randn(9, 8), torch.randn(9, 8), torch.randn(9, 6)
    for _ in range(2):  # the cumulative momentum's second step
        for m in (model, gm):
            m.zero_grad(set_to_none=True)
            m(a, b).backward(dy)
    for (name, p), q in zip(model.named_parameters(), base.parameters()):
        assert_close_rule_scaled(q.grad, p.grad, p.grad.double(), "f32", name)
    for (name, t), u in zip(model.named_buffers(), base.buffers()):
        torch.testing.assert_close(u, t, msg=name)
