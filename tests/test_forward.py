"""Forward results against a float64 reference of the unfused model."""
import pytest
import torch

import cutlass_fused
from cutlass_fused.ops import ops
from common import FAMILIES, FAMILY_IDS, MODES, assert_close_rule, max_err, params, precision, reference

# (batch, in_features, out_features): aligned, unaligned K and N, tiny, 1 feature.
SHAPES = [(256, 512, 384), (3, 769, 1000), (1000, 1000, 769), (2, 5125, 40), (5, 1, 1), (1000, 64, 8)]


def modes_for(device):
    return ["bf16", "f16", "f32", "tf32"] if device == "cuda" else ["bf16", "f32"]


def cases():
    for (device, family), fid in zip(FAMILIES, FAMILY_IDS):
        for mode in modes_for(device):
            for shape in SHAPES:
                yield pytest.param(device, family, mode, shape, id=f"{fid}-{mode}-{'x'.join(map(str, shape))}")


def run_steps(device, family, mode, shape, training, momentum, steps, affine=True, bias=True):
    dtype, _ = MODES[mode]
    m, k, n = shape
    p = params(k, n, device, dtype, bias=bias, affine=affine, seed=m + k + n)
    ours = {k_: (v.clone() if v is not None else None) for k_, v in p.items()}
    nbt = torch.zeros((), dtype=torch.long, device=device)
    ref_rm, ref_rv = p["running_mean"].double().cpu(), p["running_var"].double().cpu()
    torch_rm, torch_rv = p["running_mean"].clone(), p["running_var"].clone()
    for step in range(steps):
        x = torch.randn(m, k, device=device).to(dtype)
        with precision(device, family, mode):
            y = cutlass_fused.linear_scale_batch_norm(
                x, ours["weight"], ours["bias"], ours["scale"], ours["bn_weight"], ours["bn_bias"],
                ours["running_mean"], ours["running_var"], training, momentum, 1e-5, nbt)
            mom = momentum if momentum is not None else 1.0 / (step + 1)
            p64 = {k_: (v.double().cpu() if v is not None else None) for k_, v in p.items()}
            p64["running_mean"], p64["running_var"] = ref_rm, ref_rv
            y64, ref_rm, ref_rv = reference(x.double().cpu(), p64, training, mom)
            pt = dict(p, running_mean=torch_rm, running_var=torch_rv)
            y_t, torch_rm, torch_rv = reference(x, pt, training, mom, dtype=dtype)
        assert y.shape == (m, n) and y.dtype == dtype and y.is_contiguous()
        assert_close_rule(y.cpu(), y_t.cpu(), y64, mode, f"y step {step}")
        assert_close_rule(ours["running_mean"].cpu(), torch_rm.cpu(), ref_rm, mode, f"running_mean step {step}")
        assert_close_rule(ours["running_var"].cpu(), torch_rv.cpu(), ref_rv, mode, f"running_var step {step}")
    assert nbt.item() == (steps if training else 0)


@pytest.mark.parametrize("device,family,mode,shape", list(cases()))
def test_training(device, family, mode, shape):
    run_steps(device, family, mode, shape, training=True, momentum=0.1, steps=3)


@pytest.mark.parametrize("device,family,mode,shape", list(cases()))
def test_eval(device, family, mode, shape):
    run_steps(device, family, mode, shape, training=False, momentum=0.1, steps=1)


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("mode", ["bf16", "f32"])
def test_cumulative_momentum(device, family, mode):
    run_steps(device, family, mode, (64, 96, 72), training=True, momentum=None, steps=4)


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_no_affine_no_bias(device, family):
    run_steps(device, family, "f32", (33, 40, 24), training=True, momentum=0.1, steps=2, affine=False, bias=False)
    run_steps(device, family, "f32", (33, 40, 24), training=False, momentum=0.1, steps=1, affine=False, bias=False)


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("mode", ["bf16", "f16", "f32", "tf32"])
def test_robust_variance(device, family, mode):
    """A column whose mean is 1000x its std: plain fp32 sum/sum-of-squares loses the variance.

    The statistics describe z as the layer stores it (rounded to the input dtype,
    as PyTorch's BN sees it), so the reference is the float64 variance of that z;
    in fp32 z is also checked against the exact float64 product.
    """
    if device == "cpu" and mode in ("f16", "tf32"):
        pytest.skip("the CPU path has no tf32 and is the same code for f16 as for bf16")
    dtype, _ = MODES[mode]
    m, k, n = 512, 64, 48
    p = params(k, n, device, dtype, seed=7)
    x = torch.randn(m, k, device=device).to(dtype)
    z64 = torch.nn.functional.linear(x.double(), p["weight"].double())  # std ~1
    bias = (1000 * z64.std(0)).float()  # mean = 1000 x std, through the bias
    scale = torch.randn(n, device=device).float()
    rm, rv = torch.zeros(n, device=device), torch.ones(n, device=device)
    with precision(device, family, mode):
        z, stats = ops.linear_scale_stats(x, p["weight"], bias, scale, family, False)
        ops.batch_norm_finalize(z, stats, m, None, None, rm, rv, None, 1.0, 1e-5)
    # In 16-bit, z's 8-11 bit mantissa can make a column constant: variance 0, matched exactly.
    rel = lambda got, want: ((got.double() - want).abs() / want.clamp_min(1e-300)).max().item()
    assert rel(rv, z.double().var(0)) <= 1e-3
    if mode == "f32":
        exact = ((z64 + bias.double()) * scale.double()).var(0)
        assert rel(rv, exact) <= 1e-3


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_deterministic(device, family):
    m, k, n = 1000, 256, 264
    p = params(k, n, device, torch.bfloat16)
    x = torch.randn(m, k, device=device).bfloat16()
    outs = []
    torch.use_deterministic_algorithms(True)
    try:
        with cutlass_fused.use_kernel_family(family):
            for _ in range(3):
                rm, rv = p["running_mean"].clone(), p["running_var"].clone()
                y = cutlass_fused.linear_scale_batch_norm(x, p["weight"], p["bias"], p["scale"], p["bn_weight"],
                                                          p["bn_bias"], rm, rv, True)
                outs.append((y, rm, rv))
    finally:
        torch.use_deterministic_algorithms(False)
    for y, rm, rv in outs[1:]:
        assert torch.equal(y, outs[0][0]) and torch.equal(rm, outs[0][1]) and torch.equal(rv, outs[0][2])


def test_cpu_matches_reference_float64():
    """The CPU path in float64 is the reference computation itself, to rounding."""
    p = params(20, 12, "cpu", torch.float64, param_dtype=torch.float64)
    x = torch.randn(9, 20, dtype=torch.float64)
    y_ref, rm_ref, rv_ref = reference(x, p, True)
    y = cutlass_fused.linear_scale_batch_norm(x, p["weight"], p["bias"], p["scale"], p["bn_weight"], p["bn_bias"],
                                              p["running_mean"], p["running_var"], True)
    assert max_err(y, y_ref) < 1e-12
    assert max_err(p["running_mean"], rm_ref) < 1e-12 and max_err(p["running_var"], rv_ref) < 1e-12
