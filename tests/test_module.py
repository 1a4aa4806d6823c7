"""LinearScaleBatchNorm1d against the seed model (KernelBench level 2, problems 33/39)."""
import pytest
import torch
from torch import nn

import cutlass_fused
from cutlass_fused.seed import SeedModel as Seed
from common import FAMILIES, FAMILY_IDS, max_err


def test_state_dict_keys_and_round_trip():
    seed, ours = Seed(24, 16), cutlass_fused.LinearScaleBatchNorm1d(24, 16)
    assert list(ours.state_dict()) == list(seed.state_dict())
    assert set(ours.state_dict()) == {"gemm.weight", "gemm.bias", "scale", "bn.weight", "bn.bias",
                                      "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    seed.bn.running_mean.normal_()
    ours.load_state_dict(seed.state_dict())
    back = Seed(24, 16)
    back.load_state_dict(ours.state_dict())
    for k, v in seed.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


def test_from_modules_shares_parameters():
    seed = Seed(8, 4)
    ours = cutlass_fused.LinearScaleBatchNorm1d.from_modules(seed.gemm, seed.scale, seed.bn)
    assert ours.gemm.weight is seed.gemm.weight and ours.scale is seed.scale
    assert ours.bn.running_mean is seed.bn.running_mean
    ours(torch.randn(5, 8))
    assert seed.bn.num_batches_tracked.item() == 1
    with pytest.raises(ValueError, match="size 4"):
        cutlass_fused.LinearScaleBatchNorm1d.from_modules(seed.gemm, nn.Parameter(torch.randn(3)), seed.bn)


@pytest.mark.parametrize("bn", [{}, {"affine": False}, {"track_running_stats": False}])
def test_reset_parameters_redraws_as_construction(bn):
    """reset_parameters gives, from the same RNG state, the tensors a new layer would have; a layer
    made by from_modules resets the modules it shares."""
    torch.manual_seed(5)
    fresh = cutlass_fused.LinearScaleBatchNorm1d(12, 7, **bn)
    used = cutlass_fused.LinearScaleBatchNorm1d(12, 7, **bn)
    used(torch.randn(9, 12))  # running stats and num_batches_tracked move
    with torch.no_grad():
        for p in used.parameters():
            p.add_(1)
    torch.manual_seed(5)
    used.reset_parameters()
    assert list(used.state_dict()) == list(fresh.state_dict())
    for k, v in fresh.state_dict().items():
        assert torch.equal(used.state_dict()[k], v), k
    seed = Seed(12, 7)
    shared = cutlass_fused.LinearScaleBatchNorm1d.from_modules(seed.gemm, seed.scale, seed.bn)
    before = seed.scale.detach().clone()
    shared.reset_parameters()
    assert not torch.equal(seed.scale, before) and shared.scale is seed.scale


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("bn", [{}, {"affine": False}, {"track_running_stats": False}, {"momentum": None}],
                         ids=["default", "affine_false", "no_running_stats", "momentum_none"])
def test_module_matches_seed(device, family, bn):
    torch.manual_seed(0)
    seed = Seed(40, 24, **bn).to(device).double()
    ours = cutlass_fused.LinearScaleBatchNorm1d(40, 24, **bn).to(device)
    ours.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in seed.state_dict().items()})
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with cutlass_fused.use_kernel_family(family):
            for train in (True, True, True, False):
                seed.train(train), ours.train(train)
                x = torch.randn(33, 40, device=device)
                assert max_err(ours(x), seed(x.double())) < 1e-4
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    for k, v in seed.state_dict().items():
        assert max_err(ours.state_dict()[k], v) < 1e-5, k


class Unscaled(nn.Module):
    """bn(gemm(x)): LinearBatchNorm1d's unfused model."""

    def __init__(self, in_features, out_features, bias=True, **bn):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features, bias=bias)
        self.bn = nn.BatchNorm1d(out_features, **bn)

    def forward(self, x):
        return self.bn(self.gemm(x))


def test_layer_without_scale_takes_the_same_arguments():
    import inspect
    sig = lambda cls: list(inspect.signature(cls.__init__).parameters.items())
    assert sig(cutlass_fused.LinearBatchNorm1d) == sig(cutlass_fused.LinearScaleBatchNorm1d)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("bn", [{}, {"affine": False}, {"track_running_stats": False}])
def test_layer_without_scale_state_dict(bias, bn):
    """Its state_dict is the scaled layer's without `scale`, the unfused model's; construction
    draws as the unfused model does, so one seed gives both the same tensors."""
    torch.manual_seed(3)
    ours = cutlass_fused.LinearBatchNorm1d(24, 16, bias=bias, **bn)
    torch.manual_seed(3)
    ref = Unscaled(24, 16, bias=bias, **bn)
    scaled = cutlass_fused.LinearScaleBatchNorm1d(24, 16, bias=bias, **bn)
    assert list(ours.state_dict()) == list(ref.state_dict()) == [k for k in scaled.state_dict() if k != "scale"]
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    assert ours.scale is None and "scale" not in dict(ours.named_parameters())
    ref.bn.running_mean.normal_() if bn.get("track_running_stats", True) else None
    ours.load_state_dict(ref.state_dict())
    torch.manual_seed(4)
    ours.reset_parameters()
    torch.manual_seed(4)
    fresh = cutlass_fused.LinearBatchNorm1d(24, 16, bias=bias, **bn)
    for k, v in fresh.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_layer_without_scale_from_modules(device, family):
    torch.manual_seed(0)
    ref = Unscaled(40, 24, bias=False).to(device)
    ours = cutlass_fused.LinearBatchNorm1d.from_modules(ref.gemm, ref.bn, activation="relu")
    assert ours.gemm is ref.gemm and ours.bn is ref.bn and ours.scale is None
    with cutlass_fused.use_kernel_family(family):
        x = torch.randn(33, 40, device=device)
        before = ref.bn.running_mean.clone()
        y = ours(x)
        assert not torch.equal(ref.bn.running_mean, before) and ref.bn.num_batches_tracked.item() == 1
        ref.eval()
        ours.eval()
        assert max_err(ours(x), torch.relu(ref(x))) < 1e-4
    with pytest.raises(ValueError, match="expected bn of size 24, but got 5"):
        cutlass_fused.LinearBatchNorm1d.from_modules(ref.gemm, nn.BatchNorm1d(5))
    with pytest.raises(TypeError, match="expects an nn.Linear and an nn.BatchNorm1d"):
        cutlass_fused.LinearBatchNorm1d.from_modules(ref.gemm, nn.LayerNorm(24))
    assert y.shape == (33, 24)
