"""The bad-input table (README, "Bad inputs"), one section per row: ours against the unfused
model (nn.Linear -> * scale -> nn.BatchNorm1d, or F.linear / F.batch_norm) on the same tensors,
through the module, the functional and the ops, in train and eval, on every device."""
import re

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import cutlass_fused
from cutlass_fused.ops import ops
from cutlass_fused.seed import SeedModel
from common import FAMILIES, FLOOR


def devices():
    """(device, family) for the CPU and both CUDA families, the CUDA ones skipped where they cannot run."""
    out = [pytest.param("cpu", "auto", id="cpu")]
    for family in ("sm80", "sm90"):
        skip = pytest.mark.skipif(("cuda", family) not in FAMILIES, reason=f"needs a GPU that runs {family}")
        out.append(pytest.param("cuda", family, id=f"cuda-{family}", marks=skip))
    return out


DEVICES = devices()
PATHS = ["module", "functional", "op"]
VECTORS = ("bias", "scale", "bn_weight", "bn_bias", "running_mean", "running_var")
PARAMS = ("weight", "bias", "scale", "bn_weight", "bn_bias")
# Our state's names in the modules (ours and SeedModel have the unfused model's state_dict).
MODULE_NAMES = {"weight": "gemm.weight", "bias": "gemm.bias", "scale": "scale", "bn_weight": "bn.weight",
                "bn_bias": "bn.bias", "running_mean": "bn.running_mean", "running_var": "bn.running_var",
                "nbt": "bn.num_batches_tracked"}


def tensors(device, m=8, k=6, n=5, dtype=torch.float32, seed=0):
    """x and the layer's state, as a freshly initialized layer might hold them."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    t = dict(x=r(m, k), weight=r(n, k) / k ** 0.5, bias=r(n), scale=r(n), bn_weight=1 + 0.1 * r(n),
             bn_bias=0.1 * r(n), running_mean=0.1 * r(n), running_var=1 + 0.1 * r(n).abs())
    t = {key: v.to(device, dtype) for key, v in t.items()}
    t["nbt"] = torch.tensor(3, device=device)
    return t


def grad_out(m, device, n=5):
    """A fixed random gradient of y."""
    return torch.randn(m, n, generator=torch.Generator().manual_seed(1)).to(device)


def copy(t, grad=False, device=None, dtype=None):
    """Contiguous copies of t (a reference's own), floating ones in dtype when given, x and the
    parameters requiring grad when asked."""
    out = {}
    for k, v in t.items():
        if v is None:  # the layer without a scale
            out[k] = v
            continue
        v = v.detach().to(device or v.device, dtype if dtype and v.is_floating_point() else v.dtype, copy=True)
        out[k] = v.contiguous().requires_grad_(grad and k in PARAMS + ("x",))
    return out


class Unscaled(torch.nn.Module):
    """The unfused layer without a scale, `bn(gemm(x))`: LinearBatchNorm1d's reference."""

    def __init__(self, in_features, out_features, **bn_kwargs):
        super().__init__()
        self.gemm = torch.nn.Linear(in_features, out_features)
        self.bn = torch.nn.BatchNorm1d(out_features, **bn_kwargs)

    def forward(self, x):
        return self.bn(self.gemm(x))


def run(impl, path, t, training, momentum=0.1, eps=1e-5):
    """y of ours (impl "ours") or of the unfused model ("torch") on t; t's running stats (and, for
    the module, num_batches_tracked) are updated in place. The "op" path's reference is F's.
    t["scale"] None: the layer without a scale."""
    scaled = t["scale"] is not None
    if path == "module":
        ours = cutlass_fused.LinearScaleBatchNorm1d if scaled else cutlass_fused.LinearBatchNorm1d
        kind = ours if impl == "ours" else SeedModel if scaled else Unscaled
        layer = kind(1, 1, momentum=momentum, eps=eps).to("meta")
        layer.train(training)
        names = {k: v for k, v in MODULE_NAMES.items() if scaled or k != "scale"}
        return functional_call(layer, {names[k]: t[k] for k in names}, (t["x"],))
    args = [t[k] for k in ("x", "weight", "bias", "scale", "bn_weight", "bn_bias", "running_mean", "running_var")]
    if impl == "torch":
        x, w, b, s, bw, bb, rm, rv = args
        z = F.linear(x, w, b)
        return F.batch_norm(z if s is None else z * s, rm, rv, bw, bb, training, momentum, eps)
    if path == "functional":
        return cutlass_fused.linear_scale_batch_norm(*args, training, momentum, eps)
    family = cutlass_fused._family.current()
    if training:
        return ops.linear_scale_batch_norm_train(*args, None, momentum, eps, family)[0]
    return ops.linear_scale_batch_norm_eval(*args, eps, family)


def assert_same(ours, same, ref64, what, floor, which_nonfinite=True):
    """NaN and +-Inf where PyTorch in the same precision has them (with which_nonfinite=False,
    only non-finite values where it has them); elsewhere an error against float64 within 2x
    PyTorch's own plus floor (relative to the values' size)."""
    assert ours.dtype == same.dtype and ours.shape == same.shape, f"{what}: {ours.dtype} {ours.shape}"
    ours, same = ours.detach().cpu().double(), same.detach().cpu().double()
    masks = (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)) if which_nonfinite else \
        (("non-finite", lambda t: ~torch.isfinite(t)),)
    for name, mask in masks:
        assert torch.equal(mask(ours), mask(same)), f"{what}: {name} at {mask(ours)}, PyTorch at {mask(same)}"
    ok = torch.isfinite(same) & torch.isfinite(ref64)
    if ok.any():
        err = lambda a: (a[ok] - ref64[ok]).abs().max().item()
        bound = 2 * err(same) + floor * max(1.0, ref64[ok].abs().max().item())
        assert err(ours) <= bound, f"{what}: error {err(ours):.3g} > {bound:.3g} (PyTorch's {err(same):.3g})"


def compare(path, t, training, dy=None, floor=1e-5, **kw):
    """Ours on t against the unfused model on copies of t (in t's precision and in float64): y,
    the running stats, num_batches_tracked and, given dy, every gradient. Where PyTorch refuses
    the input, ours must refuse it in the same words."""
    same, ref64 = copy(t, dy is not None), copy(t, dy is not None, "cpu", torch.float64)
    try:
        y_same = run("torch", path, same, training, **kw)
    except (RuntimeError, ValueError) as e:
        with pytest.raises(type(e), match=re.escape(str(e).splitlines()[0])):
            run("ours", path, t, training, **kw)
        return
    y64 = run("torch", path, ref64, training, **kw)
    if dy is not None:
        for k in PARAMS + ("x",):
            t[k].requires_grad_()
    y = run("ours", path, t, training, **kw)
    assert_same(y, y_same, y64, "y", floor)
    for k in ("running_mean", "running_var", "nbt"):
        # PyTorch's own batch mean of a column holding an Inf is Inf on the CPU (a sum) but Inf or
        # NaN on CUDA (Welford's updates, by element order): either is "not finite" here.
        assert_same(t[k], same[k], ref64[k], k, floor, which_nonfinite=False)
    if dy is not None:
        for out, d in ((y, dy), (y_same, dy), (y64, dy.cpu().double())):
            out.backward(d.to(out.dtype))
        for k in PARAMS + ("x",):
            assert_same(t[k].grad, same[k].grad, ref64[k].grad, f"d {k}", floor)


# -- non-contiguous, transposed or sliced x / weight / vectors: a right answer -----------------

def strided(t, name, how):
    """t[name] with the same values laid out as `how` says (a view of a bigger or transposed tensor)."""
    v = t[name]
    if how == "transposed":
        out = v.t().contiguous().t()
    elif how == "sliced":  # every other element of a twice as long last dimension
        out = torch.stack([v, torch.full_like(v, float("nan"))], -1).select(-1, 0)
    elif how == "rows":  # every other row
        out = torch.stack([v, torch.full_like(v, float("nan"))], 1).select(1, 0)
    else:  # "offset": rows one element longer, starting one element in: no row is 16-byte aligned
        out = F.pad(v, (1, 0))[:, 1:]
    assert torch.equal(out, v) and not out.is_contiguous()
    t[name] = out


NONCONTIGUOUS = ([("x", h) for h in ("transposed", "sliced", "rows", "offset")]
                 + [("weight", h) for h in ("transposed", "sliced", "offset")]
                 + [(v, "sliced") for v in VECTORS])


@pytest.mark.parametrize("device,family", DEVICES)
@pytest.mark.parametrize("path", ["module", "functional"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name,how", NONCONTIGUOUS, ids=[f"{n}-{h}" for n, h in NONCONTIGUOUS])
def test_non_contiguous(device, family, path, training, name, how):
    # Strided running stats must be updated through the view: compare reads them there.
    t = tensors(device)
    strided(t, name, how)
    with cutlass_fused.use_kernel_family(family):
        compare(path, t, training, dy=grad_out(8, device))


# -- batch 1 in training; batch 0 in training and eval: PyTorch's behaviour ------------------

@pytest.mark.parametrize("device,family", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_batch_of_one_in_training(device, family, path):
    # PyTorch's words, with the batch norm's input size (batch, out_features).
    words = r"Expected more than 1 value per channel when training, got input size "
    exc, size = (RuntimeError, r"\[1, 5\]") if path == "op" else (ValueError, r"torch\.Size\(\[1, 5\]\)")
    for impl in ("torch", "ours"):
        if impl == "torch" and path == "op":
            continue
        with cutlass_fused.use_kernel_family(family), pytest.raises(exc, match=words + size):
            run(impl, path, tensors(device, m=1), True)


@pytest.mark.parametrize("device,family", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_batch_of_one_in_eval(device, family, path):
    with cutlass_fused.use_kernel_family(family):
        compare(path, tensors(device, m=1), False, dy=grad_out(1, device))


@pytest.mark.parametrize("device,family", DEVICES)
@pytest.mark.parametrize("path", ["module", "functional"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_empty_batch(device, family, path, training):
    # PyTorch returns an empty y, leaves the running stats alone (the module still counts the
    # batch) and gives zero gradients.
    with cutlass_fused.use_kernel_family(family):
        compare(path, tensors(device, m=0), training, dy=grad_out(0, device))


@pytest.mark.parametrize("device,family", DEVICES)
def test_empty_batch_eval_op(device, family):
    with cutlass_fused.use_kernel_family(family):
        compare("op", tensors(device, m=0), False, dy=grad_out(0, device))


# -- NaN / Inf in the input or the weights: propagates as in PyTorch, running stats too -------

NONFINITE = [("x", (0, 0), float("nan")), ("x", (2, 1), float("inf")), ("weight", (1, 2), float("nan")),
             ("weight", (3, 0), -float("inf")), ("bias", (4,), float("nan")), ("bias", (0,), float("inf"))]


@pytest.mark.parametrize("device,family", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name,at,value", NONFINITE, ids=[f"{n}-{v}" for n, _, v in NONFINITE])
def test_nan_and_inf(device, family, path, training, name, at, value):
    # (On the sm80 family, CUTLASS's in-kernel 3xTF32 split of an infinite fp32 operand makes
    # inf - inf = NaN; csrc/kernels/inf_fix.h rewrites the outputs that infinity reaches.)
    t = tensors(device)
    t[name][at] = value
    with cutlass_fused.use_kernel_family(family):
        compare(path, t, training, dy=grad_out(8, device))


# -- fp16 overflow of Z: the same as the unfused model -----------------------------------------

def overflowing(device, where, params_dtype, running_var):
    """An fp16 layer whose column 0 overflows fp16: z = h * scale ("z"; h ~ 10, scale 3e4) or h
    itself ("h"; h ~ 1e5). scale and the batch norm's vectors in params_dtype (fp32: z is fp32).
    running_var[0] = 6e4 keeps the exact eval y of that column ~1e3, within fp16's range."""
    t = tensors(device, dtype=torch.float16)
    for k in VECTORS[1:]:  # not the linear bias: F.linear refuses one of another dtype
        t[k] = t[k].to(params_dtype)
    if where == "z":
        t["bias"][0], t["scale"][0] = 10, 3e4
    else:
        t["weight"][0] = 0
        t["weight"][0, 0] = 2e4
        t["x"][:, 0] = 5
    t["running_var"][0] = running_var
    return t


@pytest.mark.parametrize("device,family", DEVICES)
@pytest.mark.parametrize("path", ["module", "functional"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("where", ["z", "h"])
@pytest.mark.parametrize("params_dtype", [torch.float16, torch.float32], ids=["f16-params", "f32-params"])
@pytest.mark.parametrize("running_var", [1.0, 6e4], ids=["rv1", "rv6e4"])
def test_fp16_overflow(device, family, path, training, where, params_dtype, running_var):
    t = overflowing(device, where, params_dtype, running_var)
    with cutlass_fused.use_kernel_family(family):
        compare(path, t, training, floor=FLOOR["f16"])


# -- eps <= 0, negative momentum, momentum > 1: PyTorch's behaviour ---------------------------

HYPER = [dict(eps=0.0), dict(eps=-1e-3), dict(momentum=-0.5), dict(momentum=1.5), dict(momentum=1.0),
         dict(momentum=0.0)]


@pytest.mark.parametrize("device,family", DEVICES)
@pytest.mark.parametrize("path", ["module", "functional"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("hyper", HYPER, ids=[f"{k}={v}" for h in HYPER for k, v in h.items()])
def test_eps_and_momentum(device, family, path, training, hyper):
    # PyTorch refuses eps <= 0 in training and eps < 0 in eval (F.batch_norm's ValueError, torch
    # 2.13). Column 0 is constant (variance 0: only eps keeps 1 / std finite).
    t = tensors(device)
    t["weight"][0], t["bias"][0] = 0, 0
    with cutlass_fused.use_kernel_family(family):
        compare(path, t, training, dy=grad_out(8, device), **hyper)


@pytest.mark.parametrize("device,family", DEVICES)
def test_op_eps_zero_is_invstd_zero_on_a_constant_column(device, family):
    """The training op with eps = 0 (F.batch_norm refuses it from some torch version on; older ones,
    and torch.batch_norm itself, take it): where a column's variance is 0 too, PyTorch's InvStd gives
    1 / std = 0, so y there is the BN bias, and its gradients are 0, not 0 * inf = NaN. The reference
    is PyTorch's CPU path, on both devices: its CUDA batch_norm gave NaN there (torch 2.11, H200), and
    we keep InvStd's finite rule on the GPU too (docs/decisions.md, "Accuracy")."""
    t = tensors(device)
    t["weight"][0], t["bias"][0] = 0, 0
    x, w, b, s, bw, bb = (t[k] for k in ("x", "weight", "bias", "scale", "bn_weight", "bn_bias"))
    x = x.clone().requires_grad_()
    with cutlass_fused.use_kernel_family(family):
        y, _, _, _, invstd = ops.linear_scale_batch_norm_train(x, w, b, s, bw, bb, None, None, None, 0.1, 0.0,
                                                                family)
    z = (F.linear(x.detach().double(), w.double(), b.double()) * s.double()).cpu()
    ref = torch.batch_norm(z, bw.double().cpu(), bb.double().cpu(), None, None, True, 0.1, 0.0, False).to(device)
    assert torch.equal(ref[:, 0], bb[0].double().expand(8)), "PyTorch's own: the bias"
    assert invstd[0].item() == 0 and torch.isfinite(invstd[1:]).all()
    assert torch.equal(y[:, 0], bb[0].expand(8))
    assert (y.double() - ref).abs().max().item() < 1e-4
    y.backward(grad_out(8, device))
    assert torch.isfinite(x.grad).all()
