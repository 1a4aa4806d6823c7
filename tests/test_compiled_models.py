"""Fused models under torch.compile and CUDA graphs, as users run them: torch.compile(fuse(model))
against the unfused eager model (outputs, gradients, running stats, under the 2x rule against
float64), no graph break in a fused layer, one recompilation at most for a changing batch, and
torch.cuda.make_graphed_callables and mode="reduce-overhead" over a fused model."""
import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import cutlass_fused
from common import FAMILIES, FAMILY_IDS, assert_close_rule, assert_close_rule_scaled, needs_cuda, precision
from test_fuse import check_matches


def mlp(width=48, blocks=2, classes=5):
    """Linear(bias=False) -> BatchNorm1d -> ReLU blocks and a head: the plain MLP users write."""
    layers = [m for _ in range(blocks) for m in (nn.Linear(width, width, bias=False), nn.BatchNorm1d(width), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(width, classes))


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_compiled_fused_model_matches_unfused(device, family):
    """torch.compile (Inductor, fullgraph) of fuse(model): train and eval steps against the unfused
    model in fp32 and float64, with no graph break and one graph a mode."""
    torch.manual_seed(0)
    fused, report = check_matches(mlp(), (33, 48), device, family, steps=(True, True, False),
                                  wrap=lambda m: torch.compile(m, fullgraph=True))
    assert len(report.fused) == 2
    assert not counters["graph_break"], dict(counters["graph_break"])


# The step benchmark's precisions: (parameter dtype, autocast dtype or None, the error rule's mode).
STEP_PRECISIONS = {"amp-bf16": (torch.float32, torch.bfloat16, "bf16"), "bf16": (torch.bfloat16, None, "bf16"),
                   "tf32": (torch.float32, None, "tf32"), "f32": (torch.float32, None, "f32")}


@needs_cuda
@pytest.mark.parametrize("family", [f for d, f in FAMILIES if d == "cuda"])
@pytest.mark.parametrize("name", list(STEP_PRECISIONS))
def test_compiled_fused_model_each_precision(family, name):
    """torch.compile (Inductor) of fuse(model), in each step precision (amp-bf16: fp32 parameters under
    bf16 autocast, whose casts the training op makes itself), against the unfused model eagerly in
    the same precision and in float64: the output, x's and every parameter's gradient and the
    running stats after two training steps, under the 2x rule."""
    device = "cuda"
    dt, amp, mode = STEP_PRECISIONS[name]
    torch.manual_seed(0)
    model = mlp(64, 2).to(device, dt)
    same, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    fused, _ = cutlass_fused.fuse(model)
    compiled = torch.compile(fused, fullgraph=True)
    with precision(device, family, mode):
        for step in range(2):
            x = torch.randn(96, 64, device=device)
            outs, grads = [], []
            # the fused model's parameters are model's, in model's order
            for m, owner, xdt, cast in ((compiled, model, dt, amp), (same, same, dt, amp),
                                        (ref, ref, torch.float64, None)):
                xi = x.to(xdt).detach().requires_grad_()
                with torch.autocast(device, dtype=cast or torch.bfloat16, enabled=cast is not None):
                    y = m(xi)
                y.float().square().mean().backward()
                outs.append(y.detach().double())
                grads.append([xi.grad] + [q.grad for q in owner.parameters()])
                owner.zero_grad(set_to_none=True)
            assert_close_rule(*outs, mode, f"step {step} output")
            for i, gs in enumerate(zip(*grads)):
                assert_close_rule_scaled(*gs, mode, f"step {step} gradient {i}")
    for (name_, b), s, r in zip(model.named_buffers(), same.buffers(), ref.buffers()):
        if b.is_floating_point():
            assert_close_rule_scaled(b, s, r, mode, name_)
        else:
            assert torch.equal(b, s), name_
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_no_graph_break_in_fused_layers(device, family):
    torch.manual_seed(0)
    fused, _ = cutlass_fused.fuse(mlp().to(device))
    with cutlass_fused.use_kernel_family(family):
        explained = torch._dynamo.explain(fused)(torch.randn(16, 48, device=device))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_changing_batch_recompiles_once(device, family):
    """A short last batch and other sizes: the second size recompiles with a symbolic batch
    (automatic dynamic shapes), and every later size reuses it, on our kernels."""
    torch.manual_seed(0)
    model = mlp().to(device)
    fused, _ = cutlass_fused.fuse(copy.deepcopy(model))
    compiled = torch.compile(fused)
    graphs = []
    with cutlass_fused.use_kernel_family(family):
        for m in (32, 24, 13, 32, 7):
            x = torch.randn(m, 48, device=device)
            y, ref = compiled(x), model(x)
            torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
            y.square().mean().backward()
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] <= 2, f"graphs compiled after each batch size: {graphs}"


def _steps(model, opt, xs, amp):
    out = []
    for x in xs:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp, cache_enabled=False):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.detach().clone())
    return torch.stack(out)


@needs_cuda
@pytest.mark.parametrize("family", [f for d, f in FAMILIES if d == "cuda"])
@pytest.mark.parametrize("amp", [False, True], ids=["f32", "amp-bf16"])
def test_make_graphed_callables(family, amp):
    """torch.cuda.make_graphed_callables over a fused model (autocast with cache_enabled=False, as its
    docs ask; AdamW capturable): the graphed forward and backward replay on new inputs and train as
    the fused model does eagerly, and the losses track the unfused model's within the 2x rule."""
    torch.manual_seed(0)
    model = mlp(64, 2).cuda()
    fused, _ = cutlass_fused.fuse(copy.deepcopy(model))
    graphed_src, _ = cutlass_fused.fuse(copy.deepcopy(model))
    xs = [torch.randn(32, 64, device="cuda") for _ in range(6)]
    with cutlass_fused.use_kernel_family(family), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp,
                                                                  cache_enabled=False):
        graphed = torch.cuda.make_graphed_callables(graphed_src, (torch.randn(32, 64, device="cuda"),))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True)
            for k, m in (("fused", fused), ("graphed", graphed_src), ("eager", model))}
    with cutlass_fused.use_kernel_family(family):
        got = _steps(graphed, opts["graphed"], xs, amp)
        want = _steps(fused, opts["fused"], xs, amp)
        ref = _steps(model, opts["eager"], xs, amp)
    # The same kernels in the same order: the graph replays the fused model's steps.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got, ref, atol=5e-2 if amp else 1e-4, rtol=5e-2 if amp else 1e-4)
    # The parameters, trained by the replays. Not the running stats: make_graphed_callables's warm-up
    # iterations are real training forwards, which move them, as for any BatchNorm it graphs.
    for (name, a), b in zip(fused.named_parameters(), graphed_src.parameters()):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-3, msg=name)


@needs_cuda
@pytest.mark.parametrize("family", [f for d, f in FAMILIES if d == "cuda"])
def test_reduce_overhead_fused_model(family):
    """torch.compile(fuse(model), mode="reduce-overhead"): the replayed graphs train as the unfused
    model does, under the 2x rule against float64 of the unfused model: the losses, and after the
    steps every parameter and buffer."""
    torch.manual_seed(0)
    model = mlp(64, 2).cuda()
    ref64, src = copy.deepcopy(model).double(), copy.deepcopy(model)
    fused, _ = cutlass_fused.fuse(src)  # shares src's tensors, under src's keys
    compiled = torch.compile(fused, mode="reduce-overhead")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (fused, model, ref64)]
    g = torch.Generator(device="cuda").manual_seed(1)
    with precision("cuda", family, "f32"):
        for i in range(5):
            x = torch.randn(32, 64, device="cuda", generator=g)
            losses = []
            for m, opt, dt in ((compiled, opts[0], torch.float32), (model, opts[1], torch.float32),
                               (ref64, opts[2], torch.float64)):
                torch.compiler.cudagraph_mark_step_begin()
                loss = m(x.to(dt)).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach().clone().reshape(1))
            assert_close_rule_scaled(losses[0].cpu(), losses[1].cpu(), losses[2].cpu(), "f32", f"loss {i}")
    same = model.state_dict()
    for name, r in ref64.state_dict().items():
        if r.is_floating_point():
            assert_close_rule_scaled(src.state_dict()[name].cpu(), same[name].cpu(), r.cpu(), "f32", name)
        else:
            assert torch.equal(src.state_dict()[name], same[name]), name
