"""torch.library.opcheck on every op, on every device."""
import pytest
import torch

import cutlass_fused
from codegen.kernels import KERNELS
from cutlass_fused.ops import ops
from common import CUDA

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
DTYPES = [torch.float32, torch.bfloat16]


def samples(device, dtype, m=7, k=13, n=10):
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    v = lambda: torch.randn(n, device=device)
    return x, w, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_stats(device, dtype, bias):
    x, w, v = samples(device, dtype)
    torch.library.opcheck(ops.linear_stats, (x, w, v() if bias else None, "auto"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_finalize(device, dtype, affine):
    x, w, v = samples(device, dtype)
    h, stats = ops.linear_stats(x, w, v(), "auto")
    bn = (v(), v()) if affine else (None, None)
    torch.library.opcheck(ops.batch_norm_finalize, (h, stats, v(), x.shape[0], *bn, 1e-5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cumulative", [False, True])
def test_update_running_stats(device, cumulative):
    x, w, v = samples(device, torch.float32)
    h, stats = ops.linear_stats(x, w, v(), "auto")
    nbt = torch.tensor(3, device=device) if cumulative else None
    torch.library.opcheck(ops.update_running_stats, (stats, v(), x.shape[0], v(), v().abs() + 1, nbt, None if cumulative else 0.1))


def cast_cases(device):
    """cast_linear_inputs' (x, weight, bias) cases: fp32 operands (odd sizes; an x view 4 bytes off
    its storage, whose loads cannot be 16-byte), a 16-bit x that needs no cast, no bias, a
    transposed x, an fp16 weight under bf16, and fp64 (which autocast leaves alone)."""
    f = lambda *shape, dtype=torch.float32: torch.randn(*shape, device=device, dtype=dtype)
    yield f(7, 13), f(10, 13), f(10)
    yield f(1000 * 13 + 1)[1:].view(1000, 13), f(769, 13), f(769)
    yield f(3, 13, dtype=torch.bfloat16), f(10, 13), None
    yield f(13, 7).t(), f(10, 13, dtype=torch.float16), f(10, dtype=torch.float64)


def special_values(device):
    """NaN, the infinities, a subnormal, fp16's overflow and a tie of each 16-bit dtype, among
    random values: a weight of 5125 elements (not a whole number of 16-byte loads)."""
    w = torch.randn(5125, device=device)
    w[:7] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, 65520.0, 1 + 2**-8, 1 + 2**-11])
    return torch.randn(2, 5125, device=device), w.view(1, 5125), w[:1].clone()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_linear_inputs(device, dtype):
    """opcheck, and each output's bits those of t.to(dtype) where autocast casts t (floating point,
    not fp64, not already dtype), else empty."""
    for x, w, b in cast_cases(device):
        torch.library.opcheck(ops.cast_linear_inputs, (x, w, b, dtype))
    for x, w, b in [*cast_cases(device), special_values(device)]:
        for t, out in zip((x, w, b), ops.cast_linear_inputs(x, w, b, dtype)):
            if t is not None and t.dtype not in (torch.float64, dtype):
                ref = t.to(dtype)
                assert out.dtype == dtype and out.shape == t.shape and out.stride() == ref.stride()
                assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
            else:
                assert out.shape == (0,) and out.dtype == dtype


def test_cast_linear_inputs_refuses_other_dtypes():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="expected dtype to be torch.bfloat16 or torch.float16"):
        ops.cast_linear_inputs(x, x, None, torch.float32)


def grad_inputs(device, dtype, affine=True):
    """Arguments of the train/eval ops, with every float input requiring grad."""
    x, w, v = samples(device, dtype)
    leaf = lambda t: t.detach().requires_grad_()
    bn = (leaf(v()), leaf(v())) if affine else (None, None)
    return leaf(x), leaf(w), leaf(v()), leaf(v()), bn, v


def running(device, v, tracked, momentum):
    """(running_mean, running_var, num_batches_tracked, momentum) for the train op."""
    if not tracked:
        return None, None, None, momentum
    return v(), v().abs() + 1, torch.tensor(3, device=device), momentum


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("tracked,momentum", [(True, 0.1), (True, None), (False, 0.1)])
def test_linear_scale_batch_norm_train(device, dtype, affine, tracked, momentum):
    x, w, b, s, bn, v = grad_inputs(device, dtype, affine)
    args = (x, w, b, s, *bn, *running(device, v, tracked, momentum), 1e-5, "auto")
    torch.library.opcheck(ops.linear_scale_batch_norm_train, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_norm_backward(device, dtype):
    x, w, v = samples(device, dtype)
    _, h, _, mean, invstd = ops.linear_scale_batch_norm_train(x, w, v(), v(), v(), v(), None, None, None, 0.1, 1e-5,
                                                              "auto")
    torch.library.opcheck(ops.batch_norm_backward, (torch.randn_like(h), h, mean, invstd, v(), v(), 1e-5))
    torch.library.opcheck(ops.batch_norm_backward, (torch.randn_like(h), h, mean, invstd, v(), v(), 1e-5),
                          {"linear_bias_dtype": dtype})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_sync_backward_passes(device, dtype, activation):
    x, w, v = samples(device, dtype)
    bn = (v(), v())
    _, h, _, mean, invstd = ops.linear_scale_batch_norm_train(x, w, v(), v(), *bn, None, None, None, 0.1, 1e-5,
                                                              "auto", activation=activation)
    common = (torch.randn_like(h), h, mean, invstd, v(), bn[0])
    act = (1e-5, bn[1], activation, 0.01)
    sums = ops.batch_norm_backward_reduce(*common, *act)
    torch.library.opcheck(ops.batch_norm_backward_reduce, (*common, *act))
    count = torch.tensor([2.0 * x.shape[0]], device=device, dtype=torch.float64)
    torch.library.opcheck(ops.batch_norm_backward_elemt, (*common, sums, count, *act))
    stats = ops.linear_stats(x, w, v(), "auto")[1]
    torch.library.opcheck(ops.batch_norm_finalize, (h, stats, v(), x.shape[0], *bn, 1e-5, activation, 0.01))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("affine", [True, False])
def test_sync_column_ops(device, affine):
    x, w, v = samples(device, torch.float32)
    h, stats = ops.linear_stats(x, w, v(), "auto")
    torch.library.opcheck(ops.sync_batch_norm_row, (stats, x.shape[0]))
    row = ops.sync_batch_norm_row(stats, x.shape[0])
    rows = torch.stack([row, ops.sync_batch_norm_row(stats * 2, 2 * x.shape[0])])
    torch.library.opcheck(ops.sync_batch_norm_merge, (rows,))
    merged, _, count = ops.sync_batch_norm_merge(rows)
    _, mean, invstd = ops.batch_norm_finalize(h, merged, v(), 1, None, None, 1e-5)
    sums = torch.randn(2, h.shape[1], device=device, dtype=torch.float64)
    torch.library.opcheck(ops.sync_batch_norm_grads,
                          (sums / 2, sums, row, count, mean, invstd, v(), v() if affine else None))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_scale_batch_norm_eval(device, dtype):
    x, w, b, s, bn, v = grad_inputs(device, dtype)
    torch.library.opcheck(ops.linear_scale_batch_norm_eval, (x, w, b, s, *bn, v(), v().abs() + 1, 1e-5, "auto"))


@pytest.mark.parametrize("device", DEVICES)
def test_matmul(device):
    a, b = torch.randn(7, 13, device=device), torch.randn(13, 10, device=device)
    torch.library.opcheck(ops.matmul, (a, b, "auto"))


def test_kernel_names_are_the_tables_rows():
    """kernel_names() lists exactly the kernel table's rows of each family built (a family is
    built whole or not at all), and a machine with a GPU has the sm80 family at least."""
    names = cutlass_fused.built_kernels()
    if not names:
        if CUDA:
            pytest.fail("a CUDA GPU is here but this build has no kernels")
        pytest.skip("a CPU-only build has no CUDA kernels to list (CMake found no CUDA torch or nvcc)")
    families = {name.split("_")[0] for name in names}
    assert families <= {"sm80", "sm90"}, families
    assert sorted(names) == sorted(k.name for k in KERNELS if k.family in families)
    if CUDA:
        assert "sm80" in families


def fp8_devices():
    """The FP8 op's devices: the CPU, and a GPU of the sm90 family in a build with the e4m3 rows."""
    return ["cpu"] + (["cuda"] if CUDA and cutlass_fused.fp8.e4m3_kernels(torch.device("cuda")) else [])


@pytest.mark.parametrize("device", fp8_devices())
@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast_accum"])
def test_linear_scale_batch_norm_train_fp8(device, fast_accum):
    # K a multiple of 16 (e4m3's 16-byte rows) and M, N of 8: no padding of the operands.
    x, w, v = samples(device, torch.float32, m=8, k=16, n=16)
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    rm, rv = v(), v().abs() + 1
    args = (x8, w8, v(), v(), v(), v(), rm, rv, torch.tensor(3, device=device), 0.1, 1e-5, "auto")
    # Not test_schema: it multiplies the inputs, which float8 tensors do not support; the schema's
    # mutations are checked below instead.
    torch.library.opcheck(ops.linear_scale_batch_norm_train_fp8, args, {"fast_accum": fast_accum},
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                                      "test_aot_dispatch_dynamic"))
    before = [t.clone() for t in args[:8]]
    versions = [rm._version, rv._version]
    ops.linear_scale_batch_norm_train_fp8(*args, fast_accum=fast_accum)
    assert rm._version > versions[0] and rv._version > versions[1]
    assert not torch.equal(rm, before[6]) and not torch.equal(rv, before[7])
    for t, b in zip(args[:6], before[:6]):  # the inputs the schema says are read only
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn \
            else torch.equal(t, b)


@pytest.mark.parametrize("device", fp8_devices())
@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast_accum"])
def test_linear_scale_batch_norm_eval_fp8(device, fast_accum):
    x, w, v = samples(device, torch.float32, m=8, k=16, n=16)
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    args = (x8, w8, v(), v(), v(), v(), v(), v().abs() + 1, 1e-5, "auto", "relu")
    # Not test_schema, as for linear_scale_batch_norm_train_fp8: the inputs are checked below.
    torch.library.opcheck(ops.linear_scale_batch_norm_eval_fp8, args, {"fast_accum": fast_accum},
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                                      "test_aot_dispatch_dynamic"))
    before = [t.clone() for t in args[:8]]
    ops.linear_scale_batch_norm_eval_fp8(*args, fast_accum=fast_accum)
    for t, b in zip(args[:8], before):  # every tensor input is read only
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn \
            else torch.equal(t, b)


@pytest.mark.parametrize("device", fp8_devices())
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast_accum"])
def test_linear_scale_batch_norm_eval_e4m3(device, scaling, fast_accum):
    x, w, v = samples(device, torch.bfloat16, m=8, k=16, n=16)
    fp8_scale = torch.tensor([0.5, 4.0], device=device) if scaling == "delayed" else None
    args = (x, w, v(), v(), v(), v(), v(), v().abs() + 1, 1e-5, "auto", "relu", 0.01, None, 0, False, fp8_scale)
    # Not test_schema: its check multiplies the inner FP8 op's float8 inputs (as above).
    torch.library.opcheck(ops.linear_scale_batch_norm_eval_e4m3, args, {"fast_accum": fast_accum},
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                                      "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_e4m3(device, dtype):
    t = 5 * torch.randn(7, 13, device=device, dtype=dtype)
    torch.library.opcheck(ops.quantize_e4m3, (t, 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_quantize_transposed(device, dtype, fp8_dtype):
    t = 5 * torch.randn(7, 13, device=device, dtype=dtype)
    torch.library.opcheck(ops.quantize_transposed, (t, fp8_dtype, 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["e4m3", "e4m3-transposed", "e5m2-transposed"])
def test_quantize_with_scale(device, dtype, form):
    t = 5 * torch.randn(7, 13, device=device, dtype=dtype)
    fp8_dtype = torch.float8_e5m2 if form.startswith("e5m2") else torch.float8_e4m3fn
    # Not test_schema: it multiplies the outputs, which float8 tensors do not support.
    torch.library.opcheck(ops.quantize_with_scale, (t, torch.tensor(4.0, device=device), fp8_dtype,
                                                    form.endswith("transposed")),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                                      "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_operand_scales(device, dtype, bias):
    _, _, v = samples(device, dtype)
    s = lambda e: torch.tensor(2.0 ** e, device=device)
    torch.library.opcheck(ops.fp8_operand_scales, (s(3), s(-5), v().to(dtype) if bias else None, v().to(dtype)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e5m2", [True, False])
def test_fp8_backward_scales(device, dtype, e5m2):
    _, _, v = samples(device, dtype)
    s = lambda e: torch.tensor(2.0 ** e, device=device)
    torch.library.opcheck(ops.fp8_backward_scales, (v().to(dtype), s(3), s(-5), s(7) if e5m2 else None,
                                                    torch.float32 if e5m2 else None, dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_fp8_record(device, algo):
    history, scale = torch.rand(4, 2, device=device), torch.ones(2, device=device)
    args = (history, scale, torch.tensor(3.0, device=device), torch.tensor(0.5, device=device), 1, algo)
    torch.library.opcheck(ops.fp8_record, args)
    versions = [history._version, scale._version]
    ops.fp8_record(*args)
    assert history._version > versions[0] and scale._version > versions[1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
def test_fp8_delayed_operands(device, dtype, bias, transposed):
    x, w, v = samples(device, dtype)
    args = (x, w, v().to(dtype) if bias else None, v().to(dtype), torch.rand(4, 2, device=device),
            torch.tensor([0.5, 4.0], device=device), 1, "max", transposed)
    # Not test_schema: it multiplies the outputs, which float8 tensors do not support; the in-place
    # state is checked by its versions here and its values in test_fp8.
    torch.library.opcheck(ops.fp8_delayed_operands, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                                      "test_aot_dispatch_dynamic"))
    versions = [args[4]._version, args[5]._version]
    ops.fp8_delayed_operands(*args)
    assert args[4]._version > versions[0] and args[5]._version > versions[1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_scale", [False, True], ids=["no-scale", "scale"])
def test_dequantize(device, dtype, with_scale):
    t8 = (5 * torch.randn(7, 13, device=device)).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.25, device=device) if with_scale else None
    # Not test_schema: it multiplies the inputs, which float8 tensors do not support.
    torch.library.opcheck(ops.dequantize, (t8, scale, dtype),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                                      "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("device", fp8_devices())
@pytest.mark.parametrize("backward", ["bf16", "e5m2"])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast_accum"])
def test_linear_scale_batch_norm_train_e4m3(device, backward, scaling, fast_accum):
    x, w, v = samples(device, torch.bfloat16, m=8, k=16, n=16)
    rm, rv = v(), v().abs() + 1
    # Delayed scaling: the layer's state (history, scales), updated in place.
    state = (torch.rand(3, 2, device=device), torch.tensor([0.5, 4.0], device=device), "max") \
        if scaling == "delayed" else ()
    args = (x.requires_grad_(), w.requires_grad_(), v(), v(), v(), v(), rm, rv, torch.tensor(3, device=device), 0.1,
            1e-5, "auto", "relu", 0.01, None, 0, backward, False, *state)
    # Not test_schema: its check multiplies the inner FP8 op's float8 inputs, which torch does not
    # support (as for linear_scale_batch_norm_train_fp8 above); the mutations are checked below.
    torch.library.opcheck(ops.linear_scale_batch_norm_train_e4m3, args, {"fast_accum": fast_accum},
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                                      "test_aot_dispatch_dynamic"))
    written = [rm, rv, *state[:2]]
    versions = [t._version for t in written]
    before = [t.clone() for t in written]
    ops.linear_scale_batch_norm_train_e4m3(*args, fast_accum=fast_accum)
    for t, version, b in zip(written, versions, before):
        assert t._version > version and not torch.equal(t, b)


# The layer without a scale (scale None: no kernel reads one), and a 0-dim scale (one value for
# every column, as `h * scale` broadcasts it: the FP8 ops' alpha beside a layer without a scale),
# through every op that takes a scale.
SCALES = {"none": lambda device: None, "0-dim": lambda device: torch.tensor(1.5, device=device, requires_grad=True)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_ops_without_a_per_column_scale(device, dtype, scale):
    x, w, b, _, bn, v = grad_inputs(device, dtype)
    s = SCALES[scale](device)
    args = (x, w, b, s, *bn, *running(device, v, True, 0.1), 1e-5, "auto")
    torch.library.opcheck(ops.linear_scale_batch_norm_train, args, {"activation": "relu"})
    torch.library.opcheck(ops.linear_scale_batch_norm_eval, (x, w, b, s, *bn, v(), v().abs() + 1, 1e-5, "auto"))
    s = None if s is None else s.detach()
    xd, wd = x.detach(), w.detach()
    h, stats = ops.linear_stats(xd, wd, v(), "auto")
    torch.library.opcheck(ops.batch_norm_finalize, (h, stats, s, xd.shape[0], v(), v(), 1e-5))
    torch.library.opcheck(ops.update_running_stats, (stats, s, xd.shape[0], v(), v().abs() + 1, None, 0.1))
    _, h, _, mean, invstd = ops.linear_scale_batch_norm_train(xd, wd, v(), s, v(), v(), None, None, None, 0.1, 1e-5,
                                                              "auto")
    common = (torch.randn_like(h), h, mean, invstd, s, v())
    torch.library.opcheck(ops.batch_norm_backward, (*common, 1e-5), {"linear_bias_dtype": dtype})
    sums = ops.batch_norm_backward_reduce(*common, 1e-5)
    torch.library.opcheck(ops.batch_norm_backward_reduce, (*common, 1e-5))
    count = torch.tensor([float(xd.shape[0])], device=device, dtype=torch.float64)
    torch.library.opcheck(ops.batch_norm_backward_elemt, (*common, sums, count, 1e-5))
    row = ops.sync_batch_norm_row(stats, xd.shape[0])
    torch.library.opcheck(ops.sync_batch_norm_grads, (sums / 2, sums, row, count, mean, invstd, s, v()))


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_operand_scales_without_a_scale(device):
    """Without a scale, sc is alpha itself: a 0-dim fp32 tensor, 1 / (s_x s_w)."""
    s = lambda e: torch.tensor(2.0 ** e, device=device)
    torch.library.opcheck(ops.fp8_operand_scales, (s(3), s(-5), torch.randn(10, device=device), None))
    b, sc = ops.fp8_operand_scales(s(3), s(-5), None, None)
    assert sc.shape == () and sc.dtype == torch.float32 and sc.item() == 4.0 and b.shape == (0,)
