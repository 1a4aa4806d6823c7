"""cutlass_fused.fuse on the models users write: Linear -> BatchNorm1d without a scale (bias=False, a
frozen bias, affine=False, track_running_stats=False, momentum=None), F.linear and F.batch_norm,
nn.SyncBatchNorm, the (B, T, C) forms, nested heads called on two views, shape-only users,
Dropout and activations it does not fuse; each against the unfused model (check_matches)."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cutlass_fused
from common import FAMILIES, FAMILY_IDS
from test_fuse import check_matches


class Plain(nn.Module):
    """Linear -> BatchNorm1d (-> ReLU), as users write it; `forward` combines them."""

    def __init__(self, forward=None, n_in=8, n_out=6, bias=True, **bn):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out, bias=bias)
        self.bn = nn.BatchNorm1d(n_out, **bn)
        self.fn = forward or (lambda m, x: F.relu(m.bn(m.fc(x))))

    def forward(self, x):
        return self.fn(self, x)


BN_FORMS = {"default": {}, "bias_false": {"bias": False}, "affine_false": {"affine": False},
            "no_running_stats": {"track_running_stats": False}, "momentum_none": {"momentum": None}}


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("form", BN_FORMS)
def test_without_scale(device, family, form):
    torch.manual_seed(0)
    fused, report = check_matches(Plain(n_in=40, n_out=24, **BN_FORMS[form]), (33, 40), device, family,
                                  steps=(True, True, False, True))
    (f,) = report.fused
    assert (f.linear, f.scale, f.bn, f.activation) == ("fc", "", "bn", "F.relu") and report.skipped == []
    layer = fused.get_submodule(f.name)
    assert type(layer) is cutlass_fused.LinearBatchNorm1d and layer.scale is None and layer.activation == "relu"
    assert [n.op for n in fused.graph.nodes] == ["placeholder", "call_module", "output"]


def test_frozen_bias_gets_no_gradient():
    torch.manual_seed(0)
    model = Plain()
    model.fc.bias.requires_grad_(False)  # SimSiam freezes one Linear's bias
    _, report = check_matches(model, (9, 8))
    assert len(report.fused) == 1


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_the_issue_mlp(device, family):
    """The ordinary MLP of the report that fused nothing before: both blocks now, linked to each other
    and to the head, which stays a Linear."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(),
                          nn.Linear(64, 64, bias=False), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
    _, report = check_matches(model, (16, 64), device, family)
    assert str(report).splitlines() == [
        "cutlass_fused.fuse: fused 2, left 1 Linear call(s) alone",
        "  fused  0 (nn.Linear) -> 1 (nn.BatchNorm1d) -> 2 (nn.ReLU)  as 0_bn",
        "  fused  3 (nn.Linear) -> 4 (nn.BatchNorm1d) -> 5 (nn.ReLU)  as 3_bn",
        "  linked 0_bn -> 3_bn  (the BN backward of 0_bn in the dX GEMM of 3_bn)",
        "  linked 3_bn -> 6  (the BN backward of 3_bn in the dX GEMM of 6)",
        "  left   6 (nn.Linear): its output goes to the model's output, not to a BatchNorm1d or a "
        "multiplication by a scale"]


class Functional(nn.Module):
    """F.linear and F.batch_norm over the module's own tensors, `training` from self.training or
    fixed at `training`."""

    def __init__(self, training=None, affine=True, running=True, bias=True):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 8) / 8 ** 0.5)
        self.b = nn.Parameter(torch.randn(6)) if bias else None
        self.g = nn.Parameter(1 + 0.1 * torch.randn(6)) if affine else None
        self.beta = nn.Parameter(0.1 * torch.randn(6)) if affine else None
        if running:
            self.register_buffer("rm", 0.1 * torch.randn(6))
            self.register_buffer("rv", 1 + 0.1 * torch.rand(6))
        else:
            self.rm = self.rv = None
        self.training_arg = training

    def forward(self, x):
        training = self.training if self.training_arg is None else self.training_arg
        h = F.linear(x, self.w, self.b)
        return F.relu(F.batch_norm(h, self.rm, self.rv, self.g, self.beta, training, 0.2, 1e-4))


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("kwargs", [{}, {"affine": False, "bias": False}, {"running": False, "training": True}],
                         ids=["default", "no_affine_no_bias", "no_running_stats"])
def test_functional_forms(device, family, kwargs):
    """training=self.training follows the model's train() and eval(), as the unfused model's call does."""
    torch.manual_seed(0)
    fused, report = check_matches(Functional(**kwargs), (9, 8), device, family, steps=(True, False, True, False))
    (f,) = report.fused
    assert (f.linear, f.bn, f.name) == ("F.linear(w)", "F.batch_norm", "w_bn")
    # Each tensor once, under the fused layer: the model's own paths for them are gone from fused.
    assert all(k.startswith("w_bn.") for k in fused.state_dict())


def test_functional_without_running_stats_that_could_run_in_eval_is_left():
    """PyTorch refuses F.batch_norm without running stats in eval: not fused where the model's mode
    reaches its training argument."""
    _, report = cutlass_fused.fuse(Functional(running=False))
    assert report.fused == [] and "absent where it can run in eval" in report.skipped[0].reason


def test_functional_fixed_training_stays_fixed():
    """F.batch_norm(training=True) written as a constant keeps training in eval, as the call does."""
    torch.manual_seed(0)
    model = Functional(training=True)
    fused, _ = check_matches(model, (9, 8), steps=(True, False, False))
    assert fused.w_bn.bn.training and not fused.training


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_sync_batch_norm_module(device, family):
    """nn.SyncBatchNorm, as convert_sync_batchnorm leaves a model: fused, and without a process group
    up it normalizes each process's batch, as nn.SyncBatchNorm does (the synced runs:
    test_sync_batch_norm.py)."""
    torch.manual_seed(0)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(Plain(n_in=40, n_out=24))
    fused, report = check_matches(model, (33, 40), device, family)
    (f,) = report.fused
    layer = fused.get_submodule(f.name)
    assert isinstance(layer.bn, nn.SyncBatchNorm) and layer.bn is model.bn
    assert layer._group() is cutlass_fused.sync_batch_norm.WORLD  # nn.SyncBatchNorm's None: the whole world


SEQUENCE_FORMS = {
    "transpose": lambda m, x: m.bn(m.fc(x).transpose(1, 2)).transpose(1, 2),
    "transpose_2_1_relu_after": lambda m, x: F.relu(m.bn(m.fc(x).transpose(2, 1)).transpose(2, 1)),
    "transpose_relu_inside": lambda m, x: torch.relu(m.bn(m.fc(x).transpose(1, 2))).transpose(1, 2),
    "permute": lambda m, x: m.bn(m.fc(x).permute(0, 2, 1)).permute(0, 2, 1),
    "torch.transpose": lambda m, x: torch.transpose(m.bn(torch.transpose(m.fc(x), -1, -2)), 1, 2),
}


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("form", SEQUENCE_FORMS)
def test_sequence_forms(device, family, form):
    """A BatchNorm over the channels of (B, T, C): the statistics over B and T, as PyTorch's."""
    torch.manual_seed(0)
    fused, report = check_matches(Plain(SEQUENCE_FORMS[form], n_in=40, n_out=24), (3, 11, 40), device, family)
    (f,) = report.fused
    assert fused.get_submodule(f.name).channels_last is not None
    assert [n.op for n in fused.graph.nodes].count("call_module") == 1


def test_sequence_form_other_shapes_as_pytorch():
    """The fused (B, T, C) layer given another shape raises what the unfused model raises."""
    torch.manual_seed(0)
    for form in ("transpose", "permute"):
        model = Plain(SEQUENCE_FORMS[form])
        fused, _ = cutlass_fused.fuse(model)
        for x in (torch.randn(5, 8), torch.randn(2, 3, 4, 8)):
            with pytest.raises(Exception) as ours:
                fused(x)
            with pytest.raises(type(ours.value)) as theirs:
                model(x)
            assert str(ours.value) == str(theirs.value)


class Head(nn.Module):
    """A nested projector called on two views, then a head on both: Linear(bias=False) blocks, the
    last BatchNorm without affine (SimSiam's)."""

    def __init__(self):
        super().__init__()
        self.projector = nn.Sequential(nn.Linear(8, 12, bias=False), nn.BatchNorm1d(12), nn.ReLU(inplace=True),
                                       nn.Linear(12, 12, bias=False), nn.BatchNorm1d(12, affine=False))
        self.out = nn.Linear(24, 3)

    def forward(self, x):
        a, b = x.chunk(2)
        return self.out(torch.cat([self.projector(a), self.projector(b)], 1))


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_head_on_two_views(device, family):
    """One fused layer per module, called once a view: the running stats move twice a step, as the
    unfused model's, and the state_dict holds each tensor once."""
    torch.manual_seed(0)
    model = Head()
    fused, report = check_matches(model, (2 * 17, 8), device, family)
    assert [f.name for f in report.fused] == ["projector_0_bn", "projector_3_bn"] * 2
    assert "(2 calls)" in str(report)
    assert model.projector[1].num_batches_tracked.item() == 2 * 2  # two training steps, two views each
    ours = fused.state_dict(keep_vars=True).values()
    assert sorted(map(id, ours)) == sorted(map(id, model.state_dict(keep_vars=True).values()))


def test_shape_only_users_still_fuse():
    """Other users of the BN's input that read only its shape or size take the fused output's."""
    torch.manual_seed(0)

    def forward(m, x):
        h = m.fc(x)
        return m.bn(h) * (h.shape[0] / h.size(1)) + h.dim() + h.size(-1)
    fused, report = check_matches(Plain(forward), (9, 8))
    assert len(report.fused) == 1 and report.skipped == []


def test_dropout_after_and_other_activations_outside():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.5),
                          nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2))
    fused, report = cutlass_fused.fuse(model)
    assert [(f.name, f.activation) for f in report.fused] == [("0_bn", "2 (nn.ReLU)"), ("4_bn", "")]
    targets = [n.target for n in fused.graph.nodes if n.op == "call_module"]
    assert targets == ["0_bn", "3", "4_bn", "6", "7"]  # the Dropout and the Tanh stay
    model.eval(), fused.eval()  # no Dropout masks: the two compute the same
    x = torch.randn(5, 8)
    torch.testing.assert_close(fused(x), model(x))
    model.train(), fused.train()
    torch.manual_seed(3)
    y = fused(x)
    torch.manual_seed(3)
    torch.testing.assert_close(y, model(x))  # the same masks: the fused layers draw no random numbers


def test_blocked_chains_say_what_to_change():
    """A Linear whose output reaches a BatchNorm but cannot fuse is named with the chain matched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6))
    model[1].register_forward_hook(lambda *_: None)
    _, report = cutlass_fused.fuse(model)
    assert str(report).splitlines()[1] == ("  left   0 (nn.Linear) -> 1 (nn.BatchNorm1d): 1 has a forward hook, "
                                           "which the fused layer would not call")

    class Reused(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.bn, self.b = nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)

        def forward(self, x):
            h = self.a(x)
            return self.bn(h), self.b(h)
    _, report = cutlass_fused.fuse(Reused())
    assert report.skipped[0].reason == ("a (nn.Linear): the BN's input has another user: b (nn.Linear); "
                                        "the fused layer would not keep it")


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("form", ["plain", "functional", "sequence"])
def test_saves_and_loads_every_form(device, family, form):
    torch.manual_seed(0)
    model, x = {"plain": (Plain(n_in=8, n_out=6, bias=False), torch.randn(5, 8)),
                "functional": (Functional(), torch.randn(5, 8)),
                "sequence": (Plain(SEQUENCE_FORMS["transpose"]), torch.randn(3, 7, 8))}[form]
    fused, report = cutlass_fused.fuse(model.to(device))
    buf = io.BytesIO()
    torch.save(fused, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    x = x.to(device)
    with cutlass_fused.use_kernel_family(family):
        for mode in (True, False):
            assert torch.equal(loaded.train(mode)(x), fused.train(mode)(x))
    assert type(loaded.get_submodule(report.fused[0].name)) is cutlass_fused.LinearBatchNorm1d


def test_training_either_model_trains_both():
    torch.manual_seed(0)
    model = Plain()
    fused, _ = cutlass_fused.fuse(model)
    opt = torch.optim.SGD(fused.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    fused(torch.randn(9, 8)).square().mean().backward()
    opt.step()
    after = model.state_dict()
    assert list(after) == list(before)  # the model's own keys
    assert not torch.equal(after["fc.weight"], before["fc.weight"])
    assert after["bn.num_batches_tracked"].item() == 1
