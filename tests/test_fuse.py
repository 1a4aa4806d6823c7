"""cutlass_fused.fuse: which chains it rewrites, which it leaves alone and why, and that the
rewritten model computes what the original does (outputs, gradients, running stats)."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cutlass_fused
from cutlass_fused.seed import SeedModel as Seed
from common import FAMILIES, FAMILY_IDS, assert_close_rule, assert_close_rule_scaled, precision


class Case(nn.Module):
    """fc, scale and bn, combined by `forward(self, x)`: one chain per test."""

    def __init__(self, forward, n_in=8, n_out=6, scale_shape=None, bn_features=None, scale_buffer=False):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)
        s = torch.randn(scale_shape or (n_out,))
        if scale_buffer:
            self.register_buffer("scale", s)
        else:
            self.scale = nn.Parameter(s)
        self.bn = nn.BatchNorm1d(bn_features or n_out)
        self.fn = forward

    def forward(self, x):
        return self.fn(self, x)


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return self.scale * x


class Net(nn.Module):
    """Two chains in submodules (one through a Sequential with a Scale module) and a plain head."""

    def __init__(self):
        super().__init__()
        self.block = Seed(8, 6)
        self.seq = nn.Sequential(nn.Linear(6, 5), Scale(5), nn.BatchNorm1d(5), nn.ReLU())
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.seq(self.block(x)))


def check_matches(model, shape, device="cpu", family="auto", steps=(True, True, False), wrap=None, **fuse_kwargs):
    """fuse(model) against fp32 and float64 copies of the unfused model over train/eval steps on
    fresh data: outputs, every gradient and every buffer, within 2x PyTorch's fp32 error plus a floor.
    wrap: what calls the fused model (torch.compile, say)."""
    model = model.to(device)
    same, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    fused, report = cutlass_fused.fuse(model, **fuse_kwargs)
    call = fused if wrap is None else wrap(fused)
    with precision(device, family, "f32"):
        for i, training in enumerate(steps):
            for m in (fused, same, ref):
                m.train(training)
                m.zero_grad()
            x, dy = torch.randn(shape, device=device), None
            ys = []
            for m, dtype in ((call, torch.float32), (same, torch.float32), (ref, torch.float64)):
                y = m(x.to(dtype))
                dy = torch.randn_like(y) if dy is None else dy
                y.backward(dy.to(dtype))
                ys.append(y.detach())
            assert_close_rule(*ys, "f32", f"step {i} output")
            for name, p in model.named_parameters():  # fused's gradients land on the model's parameters
                r = ref.get_parameter(name).grad
                if r is None:
                    assert p.grad is None, f"step {i}: {name} got a gradient it should not"
                    continue
                assert_close_rule_scaled(p.grad, same.get_parameter(name).grad, r, "f32", f"step {i} d{name}")
    for name, b in model.named_buffers():
        if b.is_floating_point():
            assert_close_rule_scaled(b, same.get_buffer(name), ref.get_buffer(name), "f32", name)
        else:
            assert torch.equal(b, same.get_buffer(name)), name
    return fused, report


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("bn", [{}, {"affine": False}, {"track_running_stats": False}, {"momentum": None}],
                         ids=["default", "affine_false", "no_running_stats", "momentum_none"])
def test_kernelbench_model(device, family, bn):
    torch.manual_seed(0)
    fused, report = check_matches(Seed(40, 24, **bn), (33, 40), device, family)
    assert [(f.linear, f.scale, f.bn, f.name) for f in report.fused] == [("gemm", "scale", "bn", "gemm_scale_bn")]
    assert report.skipped == []
    assert isinstance(fused.gemm_scale_bn, cutlass_fused.LinearScaleBatchNorm1d)


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_nested_model(device, family):
    torch.manual_seed(0)
    _, report = check_matches(Net(), (17, 8), device, family)
    assert [(f.linear, f.scale, f.bn) for f in report.fused] == [("block.gemm", "block.scale", "block.bn"),
                                                                 ("seq.0", "seq.1.scale", "seq.2")]
    assert [s.linear for s in report.skipped] == ["head"]


FORMS = {
    "h*s": lambda m, x: m.bn(m.fc(x) * m.scale),
    "s*h": lambda m, x: m.bn(m.scale * m.fc(x)),
    "torch.mul": lambda m, x: m.bn(torch.mul(m.fc(x), m.scale)),
    "torch.mul_swapped": lambda m, x: m.bn(torch.mul(m.scale, m.fc(x))),
    "h.mul": lambda m, x: m.bn(m.fc(x).mul(m.scale)),
    "s.mul": lambda m, x: m.bn(m.scale.mul(m.fc(x))),
}


@pytest.mark.parametrize("form", FORMS)
def test_multiplication_forms(form):
    torch.manual_seed(0)
    fused, report = check_matches(Case(FORMS[form]), (9, 8))
    assert len(report.fused) == 1 and report.skipped == []
    assert [n.op for n in fused.graph.nodes] == ["placeholder", "call_module", "output"]


def test_frozen_parameters_get_no_gradient():
    torch.manual_seed(0)
    model = Seed(8, 6)
    model.gemm.weight.requires_grad_(False)
    model.bn.bias.requires_grad_(False)
    _, report = check_matches(model, (9, 8))
    assert len(report.fused) == 1


def add_hook(where):
    def setup(m):
        mod = getattr(m, where)
        mod.register_forward_hook(lambda _, __, out: out * 2)
    return setup


# name: (forward, Case arguments, input shape, setup, reason)
LEFT_ALONE = {
    "relu_between": (lambda m, x: m.bn(torch.relu(m.fc(x)) * m.scale), {}, (9, 8), None,
                     "fc (nn.Linear): its output goes to relu, not to a BatchNorm1d or a multiplication by a scale"),
    "output_reused": (lambda m, x: (lambda h: m.bn(h * m.scale) + h)(m.fc(x)), {}, (9, 8), None,
                      "fc (nn.Linear): its output has another user: add; the fused layer would not keep it"),
    "product_reused": (lambda m, x: (lambda z: m.bn(z) + z)(m.fc(x) * m.scale), {}, (9, 8), None,
                       "fc (nn.Linear) -> mul: the BN's input has another user: add"),
    "no_scale_reused": (lambda m, x: (lambda h: m.bn(h) + h)(m.fc(x)), {}, (9, 8), None,
                        "fc (nn.Linear): the BN's input has another user: add"),
    "scale_1xN": (FORMS["h*s"], {"scale_shape": (1, 6)}, (9, 8), None, "scale has shape (1, 6), not (6,)"),
    "scale_buffer": (FORMS["h*s"], {"scale_buffer": True}, (9, 8), None, "multiplied by scale, not an nn.Parameter"),
    "times_activation": (lambda m, x: m.bn(m.fc(x) * x[:, :6]), {}, (9, 8), None, "multiplied by getitem"),
    "layer_norm": (lambda m, x: F.layer_norm(m.fc(x) * m.scale, (6,)), {}, (9, 8), None,
                   "the product with scale goes to F.layer_norm, not to an nn.BatchNorm1d"),
    "tanh_between": (lambda m, x: m.bn(torch.tanh(m.fc(x))), {}, (9, 8), None,
                     "its output goes to tanh, not to a BatchNorm1d or a multiplication by a scale"),
    "other_dimension": (FORMS["h*s"], {"bn_features": 5}, (4, 5, 8), None,
                        "bn has num_features=5 but the Linear has out_features=6"),
    "hooked_linear": (FORMS["h*s"], {}, (9, 8), add_hook("fc"), "fc (nn.Linear): has a forward hook, which"),
    "hooked_bn": (FORMS["h*s"], {}, (9, 8), add_hook("bn"),
                  "fc (nn.Linear) -> mul -> bn (nn.BatchNorm1d): bn has a forward hook, which"),
    "hooked_bn_no_scale": (lambda m, x: m.bn(m.fc(x)), {}, (9, 8), add_hook("bn"),
                           "fc (nn.Linear) -> bn (nn.BatchNorm1d): bn has a forward hook"),
}


@pytest.mark.parametrize("case", LEFT_ALONE)
def test_left_alone_with_reason(case):
    forward, kwargs, shape, setup, reason = LEFT_ALONE[case]
    torch.manual_seed(0)
    model = Case(forward, **kwargs)
    if setup:
        setup(model)
    _, report = check_matches(model, shape)
    assert report.fused == []
    assert [s.linear for s in report.skipped] == ["fc"]
    assert reason in report.skipped[0].reason, report


def test_linear_called_twice():
    """Each call is its own chain: the one into bn fuses, sharing fc with the other call."""
    torch.manual_seed(0)
    fused, report = check_matches(Case(lambda m, x: m.bn(m.fc(x) * m.scale) + m.fc(x)), (9, 8))
    assert [f.linear for f in report.fused] == ["fc"]
    assert [(s.linear, s.reason) for s in report.skipped] == [
        ("fc", "fc (nn.Linear): its output goes to add, not to a BatchNorm1d or a multiplication by a scale")]
    assert fused.fc is fused.fc_scale_bn.gemm


def test_shares_parameters_and_buffers():
    torch.manual_seed(0)
    model = Net()
    fused, _ = cutlass_fused.fuse(model)
    layer = fused.block_gemm_scale_bn
    assert layer.gemm is model.block.gemm and layer.scale is model.block.scale and layer.bn is model.block.bn
    # Every tensor once, and the same tensors as the model's: checkpoints go through `model`.
    ours = fused.state_dict(keep_vars=True).values()
    assert sorted(map(id, ours)) == sorted(map(id, model.state_dict(keep_vars=True).values()))
    other = Net()
    other.block.bn.running_mean.normal_()
    model.load_state_dict(other.state_dict())
    x = torch.randn(5, 8)
    torch.testing.assert_close(fused.eval()(x), other.eval()(x))


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_fused_model_saves_and_loads(device, family):
    """torch.save of the fused model (as a whole, not its state_dict) loads back, with its fused
    layers, leaf modules and tensors, and computes what it did: fx re-traces the saved code with the
    tracer class it recorded, built with no arguments."""
    torch.manual_seed(0)
    model = nn.Sequential(Seed(8, 6), nn.ReLU(), cutlass_fused.LinearScaleBatchNorm1d(6, 5), Seed(5, 4))
    fused, report = cutlass_fused.fuse(model.to(device), leaf_modules=(nn.ReLU,))
    buf = io.BytesIO()
    torch.save(fused, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    names = [f.name for f in report.fused]
    assert names and all(isinstance(loaded.get_submodule(n), cutlass_fused.LinearScaleBatchNorm1d) for n in names)
    assert loaded.get_submodule(names[0]).activation == "relu"
    assert isinstance(loaded.get_submodule("2"), cutlass_fused.LinearScaleBatchNorm1d)
    weight = loaded.get_submodule(names[0]).gemm.weight
    assert weight is not fused.get_submodule(names[0]).gemm.weight and weight.device.type == device
    x = torch.randn(7, 8, device=device)
    with cutlass_fused.use_kernel_family(family):
        for mode in (True, False):  # batch statistics, then the running ones (updated once by the first)
            assert torch.equal(loaded.train(mode)(x), fused.train(mode)(x))


def test_keeps_the_models_mode():
    torch.manual_seed(0)
    model = Seed(8, 6).eval()
    fused, _ = cutlass_fused.fuse(model)
    assert not fused.training and not fused.gemm_scale_bn.bn.training
    check_matches(model, (9, 8), steps=(False, True, False))


def test_fused_layers_stay_leaves():
    """Traced into, a fused layer's train/eval branch would be frozen at the mode it had while tracing."""
    torch.manual_seed(0)
    model = nn.Sequential(cutlass_fused.LinearScaleBatchNorm1d(8, 6), Seed(6, 4))
    fused, report = check_matches(model, (9, 8), steps=(True, False, True, False))
    assert [f.linear for f in report.fused] == ["1.gemm"]
    assert isinstance(fused.get_submodule("0"), cutlass_fused.LinearScaleBatchNorm1d)


class DataDependent(nn.Module):
    # Branches on the data, so torch.fx cannot trace it. Not on x.sum(): a training BN's
    # output sums to ~0, and rounding picked the branch differently for ours and the reference.
    def forward(self, x):
        return x if x.abs().sum() > 0 else -x


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Seed(8, 6)
        self.flip = DataDependent()

    def forward(self, x):
        return self.flip(self.block(x))


def test_untraceable_model_raises_clear_error():
    with pytest.raises(RuntimeError, match="torch.fx cannot trace Untraceable .*leaf_modules"):
        cutlass_fused.fuse(Untraceable())
    with pytest.raises(TypeError, match="expected an nn.Module"):
        cutlass_fused.fuse(lambda x: x)


def test_leaf_modules_skip_untraceable_parts():
    torch.manual_seed(0)
    _, report = check_matches(Untraceable(), (9, 8), leaf_modules=(DataDependent,))
    assert [f.linear for f in report.fused] == ["block.gemm"]


def test_report_prints_readably():
    model = nn.Sequential(Seed(8, 6), nn.Linear(6, 2))
    _, report = cutlass_fused.fuse(model)
    assert str(report) == (
        "cutlass_fused.fuse: fused 1, left 1 Linear call(s) alone\n"
        "  fused  0.gemm (nn.Linear) -> mul -> 0.bn (nn.BatchNorm1d)  as 0_gemm_scale_bn  (16-bit y under "
        "autocast: its users are Linears)\n"
        "  linked 0_gemm_scale_bn -> 1  (the BN backward of 0_gemm_scale_bn in the dX GEMM of 1)\n"
        "  left   1 (nn.Linear): its output goes to the model's output, not to a BatchNorm1d or a multiplication "
        "by a scale")
