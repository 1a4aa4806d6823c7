"""The layer under torch.autocast behaves like the unfused model under autocast: the GEMM in
the autocast dtype, statistics and running stats in fp32, y and gradients in the same dtypes,
and errors against float64 within 2x the unfused autocast model's plus the dtype's floor."""
import copy

import pytest
import torch

import cutlass_fused
from cutlass_fused.seed import SeedModel as Seed
from common import FAMILIES, FAMILY_IDS, assert_close_rule, assert_close_rule_scaled

CASES = [pytest.param(d, f, dt, id=f"{i}-{dt}") for (d, f), i in zip(FAMILIES, FAMILY_IDS)
         for dt in (["bf16", "f16"] if d == "cuda" else ["bf16"])]
DT = {"bf16": torch.bfloat16, "f16": torch.float16}


class Unscaled(torch.nn.Module):
    """bn(gemm(x)): LinearBatchNorm1d's unfused model."""

    def __init__(self, k, n):
        super().__init__()
        self.gemm, self.bn = torch.nn.Linear(k, n), torch.nn.BatchNorm1d(n)

    def forward(self, x):
        return self.bn(self.gemm(x))


def models(device, k=96, n=72, scaled=True):
    torch.manual_seed(0)
    unfused, layer = (Seed, cutlass_fused.LinearScaleBatchNorm1d) if scaled else (Unscaled,
                                                                                   cutlass_fused.LinearBatchNorm1d)
    seed = unfused(k, n).to(device)
    ours = layer(k, n, device=device)
    ours.load_state_dict(seed.state_dict())
    ref = unfused(k, n).double()
    ref.load_state_dict(seed.state_dict())
    return seed, ours, ref


@pytest.mark.parametrize("device,family,dt", CASES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("scaled", [True, False], ids=["scale", "no_scale"])
def test_forward_and_backward_match_unfused_autocast(device, family, dt, train, scaled):
    """With a scale, y is fp32 (h * scale promotes); without one, y is the autocast dtype, as
    nn.BatchNorm1d returns a 16-bit h's."""
    seed, ours, ref = models(device, scaled=scaled)
    for mod in (seed, ours, ref):
        mod.train(train)
    x = torch.randn(128, 96)
    dy = torch.randn(128, 72)
    xs = {k: x.to(device).clone().requires_grad_() for k in ("seed", "ours")}
    x64 = x.double().requires_grad_()
    with cutlass_fused.use_kernel_family(family):
        with torch.autocast(device, dtype=DT[dt]):
            y_seed, y_ours = seed(xs["seed"]), ours(xs["ours"])
        (y_seed.float() * dy.to(device)).sum().backward()
        (y_ours.float() * dy.to(device)).sum().backward()
    y64 = ref(x64)
    (y64 * dy.double()).sum().backward()
    assert y_ours.dtype == y_seed.dtype == (torch.float32 if scaled else DT[dt])
    assert_close_rule(y_ours.cpu(), y_seed.cpu(), y64.detach(), dt, "y")
    if train:
        for name in ("running_mean", "running_var"):
            a, b = getattr(ours.bn, name), getattr(seed.bn, name)
            assert a.dtype == b.dtype == torch.float32
            assert_close_rule(a.cpu(), b.cpu(), getattr(ref.bn, name).detach(), dt, name)
    grads = [("x", xs["ours"].grad, xs["seed"].grad, x64.grad)]
    for (name, p), q, r in zip(ours.named_parameters(), seed.parameters(), ref.parameters()):
        grads.append((name, p.grad, q.grad, r.grad))
    for name, g_ours, g_seed, g_ref in grads:
        if g_ref is None or (not train and name == "gemm.bias" and g_seed is None):
            continue
        assert g_ours is not None and g_ours.dtype == g_seed.dtype, name
        assert_close_rule_scaled(g_ours, g_seed, g_ref, dt, f"d{name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", [f for d, f in FAMILIES if d == "cuda"])
def test_grad_scaler_fp16_steps(family):
    """A few fp16 mixed-precision SGD steps with a GradScaler track the unfused model."""
    seed, ours, _ = models("cuda", 64, 48)
    opt = {k: torch.optim.SGD(m.parameters(), lr=0.05) for k, m in (("seed", seed), ("ours", ours))}
    scaler = {k: torch.amp.GradScaler("cuda") for k in opt}
    target = torch.randn(96, 48, device="cuda")
    losses = {k: [] for k in opt}
    with cutlass_fused.use_kernel_family(family):
        for _ in range(5):
            x = torch.randn(96, 64, device="cuda")
            for k, m in (("seed", seed), ("ours", ours)):
                opt[k].zero_grad()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = ((m(x) - target) ** 2).mean()
                scaler[k].scale(loss).backward()
                scaler[k].step(opt[k])
                scaler[k].update()
                losses[k].append(loss.item())
    for a, b in zip(losses["ours"], losses["seed"]):
        assert abs(a - b) <= 2e-2 * max(1.0, abs(b)), (losses["ours"], losses["seed"])
    for (name, p), q in zip(ours.named_parameters(), seed.parameters()):
        assert p.dtype == torch.float32
        assert (p - q).abs().max().item() <= 2e-2, name


def _reaches(fn, target, seen=None):
    """Whether autograd node `fn` leads to the AccumulateGrad of `target`, and through which nodes."""
    seen = set() if seen is None else seen
    for nxt, _ in fn.next_functions:
        if nxt is None or nxt in seen:
            continue
        seen.add(nxt)
        if getattr(nxt, "variable", None) is target:
            return [type(fn).__name__]
        path = _reaches(nxt, target, seen)
        if path:
            return [type(fn).__name__] + path
    return None


@pytest.mark.parametrize("device,family,dt", CASES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_training_weight_cast_is_the_layers_own(device, family, dt, bias):
    """Under autocast the training op casts its fp32 x, weight and bias itself (autocast.cpp,
    cast_linear_inputs): each gradient reaches them from the op's own node, in their own dtype,
    with no recorded cast between (whose backward was a 16 -> 32-bit copy of dW). Without a graph
    to record (no_grad, inference_mode, a frozen weight) autocast casts them, and the layer runs."""
    _, ours, _ = models(device)
    if not bias:
        ours.gemm.bias = None
    params = [p for p in (ours.gemm.weight, ours.gemm.bias) if p is not None]
    x = torch.randn(64, 96, device=device)
    with cutlass_fused.use_kernel_family(family), torch.autocast(device, dtype=DT[dt]):
        y = ours(x.requires_grad_())
        for p in params + [x]:
            path = _reaches(y.grad_fn, p)
            assert path is not None and not any("ToCopy" in n for n in path), path
        y.float().square().sum().backward()
        assert all(p.grad.dtype == torch.float32 for p in params + [x])
        assert ours.gemm.weight.grad.abs().sum() > 0
        with torch.no_grad():
            a = ours(x)
        with torch.inference_mode():
            b = ours(x)
        ours.gemm.weight.requires_grad_(False)
        c = ours(x)
        ours.gemm.weight.requires_grad_(True)
    for t in (a, b, c):
        assert t.shape == (64, 72) and torch.isfinite(t).all()


def test_mixed_dtypes_outside_autocast_still_refused():
    """The layer's own cast of the weight is autocast's alone: outside it, a 16-bit input with an
    fp32 weight is refused as F.linear refuses it."""
    _, ours, _ = models("cpu")
    with pytest.raises(RuntimeError, match="expected input and weight to have the same dtype"):
        ours(torch.randn(8, 96, dtype=torch.bfloat16, requires_grad=True))


def test_deferred_cast_under_compile():
    """torch.compile (aot_eager) traces the layer's own weight cast under autocast: y and every
    gradient equal eager's (the CPU runs both through the same ops)."""
    _, ours, _ = models("cpu")
    twin = copy.deepcopy(ours)
    compiled = torch.compile(twin, backend="aot_eager")
    x = torch.randn(64, 96)
    dy = torch.randn(64, 72)
    outs = []
    for m in (ours, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        (y.float() * dy).sum().backward()
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    for (name, p), q in zip(ours.named_parameters(), twin.parameters()):
        assert q.grad is not None and q.grad.dtype == p.grad.dtype == torch.float32, name
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name
