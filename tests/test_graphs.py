"""cutlass_fused.graphed_step: a fused model's whole training step replayed as CUDA graphs trains as
the same step run eagerly, over changing batches and sizes and across changes the graphs cannot
see (a learning rate, a frozen weight, the model's mode); its bad arguments; on the CPU, fn as is."""
import copy
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cutlass_fused
from common import FAMILIES, needs_cuda

CUDA_FAMILIES = [f for d, f in FAMILIES if d == "cuda"]


def mlp(width=64, blocks=2, classes=7):
    layers = [m for _ in range(blocks) for m in (nn.Linear(width, width, bias=False), nn.BatchNorm1d(width), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(width, classes))


class Trainer:
    """fuse(model) on its own copy, AdamW, and the step as a user writes it."""

    def __init__(self, base, device, amp, capturable=True):
        self.model, report = cutlass_fused.fuse(copy.deepcopy(base).to(device))
        assert len(report.fused) == 2
        self.amp, self.device = amp, device
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, capturable=capturable)

    def step(self, x, target):
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.amp):
            loss = F.cross_entropy(self.model(x), target)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


def batches(sizes, device, width=64, classes=7):
    g = torch.Generator(device=device).manual_seed(1)
    return [(torch.randn(m, width, device=device, generator=g),
             torch.randint(0, classes, (m,), device=device, generator=g)) for m in sizes]


def assert_same_training(graphed, eager, got, want):
    """The same losses a step, and the same parameters and buffers after them."""
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    want_state = eager.model.state_dict()
    for k, v in graphed.model.state_dict().items():
        torch.testing.assert_close(v, want_state[k], rtol=1e-5, atol=1e-6, msg=k)


@needs_cuda
@pytest.mark.parametrize("family", CUDA_FAMILIES)
@pytest.mark.parametrize("amp", [False, True], ids=["f32", "amp-bf16"])
def test_graphed_step_trains_as_eager(family, amp):
    """Batches of 32, then a short one of 24, then 32 again: two graphs, each captured after its
    warm-up calls; every call is one step on its own batch, as eagerly, and each returned loss is
    its own (a replay does not overwrite the last one's)."""
    torch.manual_seed(0)
    base = mlp()
    graphed, eager = Trainer(base, "cuda", amp), Trainer(base, "cuda", amp)
    step = cutlass_fused.graphed_step(graphed.step, graphed.model, graphed.opt, warmup=2)
    data = batches([32] * 5 + [24] * 4 + [32] * 3, "cuda")
    with cutlass_fused.use_kernel_family(family), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = [step(x, t) for x, t in data]  # kept, as a user keeps the losses
        want = [eager.step(x, t).detach() for x, t in data]
    assert len(step.graphs) == 2
    # An output kept with its autograd graph (the capture's, or a warm-up's) keeps the AccumulateGrad
    # nodes made on its stream, which torch warns of at the next backward on another stream.
    assert not [w for w in seen if "AccumulateGrad" in str(w.message)]
    assert not any(loss.requires_grad for loss in got)
    assert_same_training(graphed, eager, got, want)
    # The unfused model in the same precision, for scale: the fused steps track it.
    ref = copy.deepcopy(base).cuda()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, capturable=True)
    for (x, t), loss in zip(data[:3], got[:3]):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            r = F.cross_entropy(ref(x), t)
        r.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss, r.detach(), rtol=2e-2 if amp else 1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("family", CUDA_FAMILIES)
def test_graphed_step_captures_again_after_changes(family):
    """A learning rate set as a scheduler sets it (a float), a weight frozen, a parameter's storage
    replaced, the model put in eval mode: each makes the next call capture again, so the steps stay
    the eager steps."""
    torch.manual_seed(0)
    base = mlp()
    graphed, eager = Trainer(base, "cuda", False), Trainer(base, "cuda", False)
    step = cutlass_fused.graphed_step(graphed.step, graphed.model, graphed.opt, warmup=1)
    data = batches([32] * 16, "cuda")
    changes = {
        4: lambda t: t.opt.param_groups[0].__setitem__("lr", 3e-3),
        7: lambda t: next(t.model.parameters()).requires_grad_(False),
        10: lambda t: setattr(list(t.model.parameters())[-1], "data", list(t.model.parameters())[-1].data.clone()),
        13: lambda t: t.model.eval(),
    }
    got, want = [], []
    with cutlass_fused.use_kernel_family(family):
        for i, (x, t) in enumerate(data):
            if i in changes:
                changes[i](graphed)
                changes[i](eager)
            got.append(step(x, t))
            want.append(eager.step(x, t).detach())
    assert len(step.graphs) == 1
    assert_same_training(graphed, eager, got, want)


@needs_cuda
def test_graphed_step_refuses_what_it_cannot_capture():
    """Autocast's cache around the calls, and an optimizer without capturable=True (before any step
    has run); a region without the cache runs."""
    torch.manual_seed(0)
    base = mlp()
    (x, t), = batches([16], "cuda")
    trainer = Trainer(base, "cuda", False)
    step = cutlass_fused.graphed_step(trainer.step, trainer.model, trainer.opt)
    with torch.autocast("cuda", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="cache_enabled=False"):
        step(x, t)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        assert torch.isfinite(step(x, t))
    plain = Trainer(base, "cuda", False, capturable=False)
    before = copy.deepcopy(plain.model.state_dict())
    step = cutlass_fused.graphed_step(plain.step, plain.model, plain.opt)
    with pytest.raises(ValueError, match="capturable=True"):
        step(x, t)
    for k, v in plain.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_graphed_step_on_the_cpu_is_the_step():
    torch.manual_seed(0)
    base = mlp()
    graphed, eager = Trainer(base, "cpu", False, capturable=False), Trainer(base, "cpu", False, capturable=False)
    step = cutlass_fused.graphed_step(graphed.step, graphed.model, graphed.opt, warmup=1)
    data = batches([8, 8, 8, 5], "cpu")
    got = [step(x, t) for x, t in data]
    want = [eager.step(x, t).detach() for x, t in data]
    assert not step.graphs
    assert_same_training(graphed, eager, got, want)


def test_graphed_step_bad_arguments():
    step = cutlass_fused.graphed_step(lambda *a: None)
    with pytest.raises(ValueError, match="argument 0 not to require grad"):
        step(torch.ones(2, requires_grad=True))
    with pytest.raises(TypeError, match=r"argument 1 to be a tensor or a hashable value .*, but got list"):
        step(torch.ones(2), [1])
    with pytest.raises(ValueError, match="warmup to be an int of at least 1, but got 0"):
        cutlass_fused.graphed_step(lambda: None, warmup=0)
    with pytest.raises(ValueError, match="max_graphs"):
        cutlass_fused.graphed_step(lambda: None, max_graphs=0)
    with pytest.raises(TypeError, match="modules to be nn.Modules, but got str"):
        cutlass_fused.graphed_step(lambda: None, ["model"])
    with pytest.raises(TypeError, match="optimizers to be torch.optim optimizers, but got Linear"):
        cutlass_fused.graphed_step(lambda: None, (), [nn.Linear(2, 2)])



@needs_cuda
def test_readme_graphed_step_block():
    """The README's graphed_step example, run as a user pastes it over a fused model and a loader:
    the steps train (the loss falls on a repeated batch) and two batch sizes make two graphs."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block, = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "graphed_step(train_step" in b]
    torch.manual_seed(0)
    model, _ = cutlass_fused.fuse(mlp().cuda())
    x, target = torch.randn(64, 64), torch.randint(0, 7, (64,))
    scope = {"torch": torch, "F": F, "cutlass_fused": cutlass_fused, "model": model, "losses": [],
             "loader": [(x, target)] * 12 + [(x[:40], target[:40])] * 5}
    exec(compile(block + "    losses.append(loss)\n", "README.md", "exec"), scope)
    losses = scope["losses"]
    assert len(losses) == 17 and losses[11] < losses[0]
    assert len(scope["step"].graphs) == 2
