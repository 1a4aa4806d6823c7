"""The running stats' version counters, and the eval fold kept on them inside frozen_weights().

Our running-stat updates bump the buffers' versions (nn.BatchNorm1d's does not,
torch 2.11-2.13), since autograd's saved-tensor check and the eval fold kept inside
frozen_weights() (csrc/derived_cache.h) both rely on them. (That the kept fold makes the
eval forward one launch is tests/test_forward.py::test_launches_per_forward; writes of
every kind outside the scope are tests/test_writes.py.)
"""
import pytest
import torch

import cutlass_fused
from cutlass_fused.seed import SeedModel as Seed
from common import CUDA, FAMILIES, max_err

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def pair(device, n_in=24, n_out=16):
    """The seed model and ours with the same state, on device, fp32."""
    torch.manual_seed(0)
    seed = Seed(n_in, n_out).to(device)
    ours = cutlass_fused.LinearScaleBatchNorm1d(n_in, n_out, device=device)
    ours.load_state_dict(seed.state_dict())
    return seed, ours


@pytest.mark.parametrize("device", DEVICES)
def test_training_step_bumps_running_stat_versions(device):
    _, ours = pair(device)
    bn = ours.bn
    before = [t._version for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    ours(torch.randn(8, 24, device=device))
    with torch.no_grad():
        ours(torch.randn(8, 24, device=device))
    with torch.inference_mode():  # skips Autograd but not ADInplaceOrView
        ours(torch.randn(8, 24, device=device))
    after = [t._version for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    assert all(a == b + 3 for a, b in zip(after, before)), (before, after)


@pytest.mark.parametrize("device", DEVICES)
def test_eval_backward_after_a_training_step_refuses_stale_running_stats(device):
    """The eval graph saved the running stats, then a training step changed them in place.

    Here we are stricter than nn.BatchNorm1d, whose update does not bump the
    versions (torch 2.11-2.13): its eval backward then silently uses the new
    running stats with the old forward. Ours raises autograd's usual error.
    """
    _, ours = pair(device)
    ours.eval()
    y = ours(torch.randn(8, 24, device=device, requires_grad=True))
    ours.train()
    ours(torch.randn(8, 24, device=device))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", [f for d, f in FAMILIES if d == "cuda"])
def test_eval_fold_follows_every_change(family):
    """Eval inside frozen_weights() after each kind of change to the vectors the fold is made of
    that their versions see."""
    seed, ours = pair("cuda", 64, 40)
    seed.eval(), ours.eval()
    x = torch.randn(32, 64, device="cuda")
    changes = [
        lambda m: None,
        lambda m: m.bn.running_var.mul_(3.0),
        lambda m: m.scale.detach().add_(0.5),
        lambda m: m.bn.weight.detach().mul_(-2.0),
        lambda m: m.bn.bias.detach().add_(1.0),
        lambda m: m.load_state_dict({**m.state_dict(), "bn.running_mean": torch.randn(40)}),
        lambda m: m.bn.__setattr__("eps", 0.5),
    ]
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with cutlass_fused.use_kernel_family(family), torch.no_grad(), cutlass_fused.frozen_weights(ours):
            for i, change in enumerate(changes):
                torch.manual_seed(i)
                change(seed)
                torch.manual_seed(i)
                change(ours)
                assert max_err(ours(x), seed(x)) < 1e-4, i
            # A training step under inference_mode, then eval again.
            seed.train(), ours.train()
            with torch.inference_mode():
                xt = torch.randn(32, 64, device="cuda")
                seed(xt), ours(xt)
            seed.eval(), ours.eval()
            assert max_err(ours(x), seed(x)) < 1e-4
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
