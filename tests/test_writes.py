"""Every write to a layer's tensors takes effect at the next forward, as in PyTorch, which keeps
nothing between calls: through `.data` in place (an EMA teacher's update) and by assigning a new
tensor to `.data`, `copy_` under no_grad, `load_state_dict`, and `torch.func.functional_call` with
other tensors. Each write goes to the weight, the linear bias, scale, the batch norm's affine
parameters and its running stats in turn, in train and eval, under grad, no_grad and
inference_mode, on the CPU and every CUDA family, and each next forward is held to the error rule
against the unfused model on the same tensors. (On 829254b the eval fold and the sm90 fp32
weight split, kept on version counters that `.data` writes do not bump, failed the in-place
`.data` cases.) Inside cutlass_fused.frozen_weights() the values derived from the weights are
kept (one launch for eval), and every write but an in-place one through `.data` is still seen.
"""
import contextlib

import pytest
import torch

import cutlass_fused
from cutlass_fused.seed import SeedModel as Seed
from common import (CUDA, FAMILIES, FAMILY_IDS, MODES, assert_close_rule, batch_norm, max_err, modes_for, precision,
                    reference_z)

TARGETS = ["gemm.weight", "gemm.bias", "scale", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"]
WRITES = ["data_inplace", "data_assign", "copy_no_grad", "load_state_dict", "functional_call"]
GRAD = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
# (batch, in, out): over END_TO_END_BATCH rows, so that y is held to the rule end to end; unaligned K and N.
M, K, N = 96, 77, 40


def cases():
    for (device, family), fid in zip(FAMILIES, FAMILY_IDS):
        for mode in modes_for(device):
            yield pytest.param(device, family, mode, id=f"{fid}-{mode}")


def layer(device, dtype, seed=0):
    torch.manual_seed(seed)
    ours = cutlass_fused.LinearScaleBatchNorm1d(K, N, device=device, dtype=dtype)
    with torch.no_grad():  # every vector away from its 0 / 1 start, so that a write to it shows
        ours.gemm.bias.normal_()
        ours.bn.weight.normal_(1.0, 0.3)
        ours.bn.bias.normal_(0.0, 0.5)
        ours.bn.running_mean.normal_(0.0, 0.5)
        ours.bn.running_var.uniform_(0.5, 2.0)
    return ours


def factor(name):
    """What a write multiplies a tensor by: exact in every precision, every element moved by
    its own size (running_var kept positive), and the values kept O(1) over the test's writes."""
    return 2.0 if name == "bn.running_var" else -1.0


def write(ours, name, how):
    """Applies `how` to the tensor `name` of `ours`; returns the next forward (a function of x) and
    the tensors it reads (name -> tensor; for functional_call, with the substitute)."""
    mod_name, _, attr = name.rpartition(".")
    t = getattr(ours.get_submodule(mod_name), attr)
    v = t.detach() * factor(name)
    used = {**dict(ours.named_parameters()), **dict(ours.named_buffers())}
    if how == "data_inplace":
        t.data.mul_(factor(name))
    elif how == "data_assign":
        t.data = v
    elif how == "copy_no_grad":
        with torch.no_grad():
            t.copy_(v)
    elif how == "load_state_dict":
        ours.load_state_dict({**ours.state_dict(), name: v})
    else:
        used[name] = v
        return (lambda x: torch.func.functional_call(ours, {name: v}, (x,))), used
    return ours, used


def reference(used, x, training, mode, momentum=0.1, eps=1e-5):
    """(y, running_mean, running_var) of the unfused model on `used`'s values, in float64 and in
    the layer's own precision (PyTorch's same-precision path)."""
    p = {"weight": used["gemm.weight"], "bias": used["gemm.bias"], "scale": used["scale"],
         "bn_weight": used["bn.weight"], "bn_bias": used["bn.bias"]}
    p = {k: v.detach().clone() for k, v in p.items()}
    running = (used["bn.running_mean"].detach().clone(), used["bn.running_var"].detach().clone())
    p64 = {k: v.double().cpu() for k, v in p.items()}
    run64 = tuple(t.double().cpu() for t in running)
    out64 = batch_norm(reference_z(x.double().cpu(), p64), p64, run64, training, momentum, eps)
    out = batch_norm(reference_z(x, p, x.dtype, mode), p, running, training, momentum, eps)
    return out64, out


def check_step(ours_out, used, before, ref, training, mode, what):
    (y64, rm64, rv64), (y_t, rm_t, rv_t) = ref
    assert_close_rule(ours_out.detach().float().cpu(), y_t.float().cpu(), y64, mode, f"{what}: y")
    if training:
        for key, got, same, want in (("bn.running_mean", used["bn.running_mean"], rm_t, rm64),
                                     ("bn.running_var", used["bn.running_var"], rv_t, rv64)):
            assert_close_rule(got.detach().float().cpu(), same.float().cpu(), want, mode, f"{what}: {key}")
    else:
        for key in ("bn.running_mean", "bn.running_var"):
            assert torch.equal(used[key], before[key]), f"{what}: eval changed {key}"


def run_writes(device, family, mode, training, grad, how, scope):
    dtype = MODES[mode][0]
    ours = layer(device, dtype).train(training)
    g = torch.Generator().manual_seed(1)
    x_of = lambda: torch.randn(M, K, generator=g).to(device, dtype)
    with precision(device, family, mode), scope(ours):
        with GRAD[grad]():
            ours(x_of())  # what a call may keep, kept
        for name in TARGETS:
            forward, used = write(ours, name, how)
            # The values the forward reads, taken before it (a training forward updates the running stats).
            before = {k: v.detach().clone() for k, v in used.items()}
            x = x_of()
            with GRAD[grad]():
                y = forward(x)
            check_step(y, used, before, reference(before, x, training, mode), training, mode, f"{how} to {name}")


@pytest.mark.parametrize("device,family,mode", list(cases()))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("grad", list(GRAD))
@pytest.mark.parametrize("how", WRITES)
def test_write_takes_effect(device, family, mode, training, grad, how):
    run_writes(device, family, mode, training, grad, how, lambda m: contextlib.nullcontext())


# Inside frozen_weights() what is derived from the tensors is kept, and every write that PyTorch's
# version counters see is still seen (an in-place `.data` write is the scope's promise).
@pytest.mark.parametrize("device,family,mode", list(cases()))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("how", ["data_assign", "copy_no_grad", "load_state_dict", "functional_call"])
def test_frozen_scope_sees_visible_writes(device, family, mode, training, how):
    run_writes(device, family, mode, training, "no_grad", how, cutlass_fused.frozen_weights)


@pytest.mark.parametrize("device,family,mode", list(cases()))
def test_teacher_updated_between_frozen_scopes(device, family, mode):
    """The EMA-teacher loop: the teacher runs inside frozen_weights(), and is updated through
    `.data` between scopes; leaving a scope drops what it kept, so each scope sees the update."""
    dtype = MODES[mode][0]
    student, teacher = layer(device, dtype, seed=0).eval(), layer(device, dtype, seed=1).eval()
    x = torch.randn(M, K, device=device).to(dtype)
    with precision(device, family, mode), torch.no_grad():
        for step in range(3):
            with cutlass_fused.frozen_weights(teacher):
                y = teacher(x)
                assert torch.equal(y, teacher(x)), "a kept value changed the result"
            used = {**dict(teacher.named_parameters()), **dict(teacher.named_buffers())}
            check_step(y, used, {k: v.clone() for k, v in used.items()}, reference(used, x, False, mode), False, mode,
                       f"step {step}")
            for p_t, p_s in zip(teacher.parameters(), student.parameters()):
                p_t.data.mul_(0.5).add_(p_s.data, alpha=0.5)


def test_frozen_scope_keeps_only_its_tensors():
    from cutlass_fused.frozen import may_cache
    a, b = layer("cpu", torch.float32), layer("cpu", torch.float32, seed=1)
    assert not may_cache(a.gemm.weight)
    with cutlass_fused.frozen_weights(a):
        assert may_cache(a.gemm.weight, a.gemm.bias, None, a.bn.running_var)
        assert not may_cache(a.gemm.weight, b.scale)
        with cutlass_fused.frozen_weights(b.scale):
            assert may_cache(a.gemm.weight, b.scale)
        assert not may_cache(b.scale)
    assert not may_cache(a.gemm.weight)


def test_frozen_scope_bad_arguments():
    with pytest.raises(TypeError, match="frozen_weights expects the modules or tensors it freezes"):
        with cutlass_fused.frozen_weights():
            pass
    with pytest.raises(TypeError, match="frozen_weights expects modules or tensors, but got int"):
        with cutlass_fused.frozen_weights(3):
            pass


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", [f for d, f in FAMILIES if d == "cuda"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_infinity_written_through_data(family, training):
    """fp32 without TF32: an infinity written into the weight through `.data` after a forward
    reaches y as in the unfused model (the sm80 family's infinite-row flags of the weight are
    made anew, as its sm90 split is)."""
    torch.manual_seed(0)
    ref = Seed(K, N).cuda().train(training)
    ours = layer("cuda", torch.float32).train(training)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(M, K, device="cuda")
    with precision("cuda", family, "f32"), torch.no_grad():
        ours(x), ref(x)
        for m in (ours, ref):
            m.gemm.weight.data[3, 5] = float("inf")
        y, y_ref = ours(x), ref(x)
    for what, mask in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        assert torch.equal(mask(y), mask(y_ref)), f"{what} at {mask(y).nonzero().tolist()}"
    finite = torch.isfinite(y_ref)
    assert max_err(y[finite], y_ref[finite]) < 1e-4
