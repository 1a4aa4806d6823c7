"""Bad input gets a clear error: PyTorch's words where it has them, naming the argument and what
was expected. The table's error rows (README, "Bad inputs") through the module, the functional
and the ops, in train and eval, on every device; helpers and the other rows in test_bad_inputs.py."""
import pytest
import torch
import torch.nn.functional as F

import cutlass_fused
from cutlass_fused.ops import ops
from common import FLOOR, needs_cuda
from test_bad_inputs import DEVICES, PATHS, VECTORS, compare, copy, grad_out, run, tensors

TRAIN_EVAL = pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])


# -- wrong ndim, in_features mismatch, mixed dtypes, integer or bool input: a clear error -----

FLOAT = r"expected input to be .*float.*, but got "  # CUDA names its three dtypes
BAD_INPUTS = {  # what replaces part of t, and the error's words
    "weight-1d": (lambda t: {"weight": t["weight"].flatten()}, r"expected weight to be 2-D"),
    "weight-3d": (lambda t: {"weight": t["weight"][None]}, r"expected weight to be 2-D"),
    "in_features": (lambda t: {"x": F.pad(t["x"], (0, 1))},
                    r"mat1 and mat2 shapes cannot be multiplied \(8x7 and 6x5\)"),
    "x-bf16": (lambda t: {"x": t["x"].bfloat16()},
               r"expected input and weight to have the same dtype, but got BFloat16 and Float"),
    "weight-f16": (lambda t: {"weight": t["weight"].half()},
                   r"expected input and weight to have the same dtype, but got Float and Half"),
    "int64": (lambda t: {"x": t["x"].long(), "weight": t["weight"].long()}, FLOAT + "Long"),
    "int64-x": (lambda t: {"x": t["x"].long()}, FLOAT + "Long"),  # a float layer fed integers
    "int32": (lambda t: {"x": t["x"].int(), "weight": t["weight"].int()}, FLOAT + "Int"),
    "uint8": (lambda t: {"x": t["x"].byte(), "weight": t["weight"].byte()}, FLOAT + "Byte"),
    "bool": (lambda t: {"x": t["x"] > 0, "weight": t["weight"] > 0}, FLOAT + "Bool"),
}


@pytest.mark.parametrize("device,family", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@TRAIN_EVAL
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input(device, family, path, training, case):
    change, words = BAD_INPUTS[case]
    t = tensors(device)
    t.update(change(t))
    with cutlass_fused.use_kernel_family(family), pytest.raises(RuntimeError, match=words):
        run("ours", path, t, training)


# -- x not 2-D: the module and the functional as the unfused model (nn.BatchNorm1d takes a 3-D
# input's dim 1 as its channels: PyTorch's result, or PyTorch's error); the ops take 2-D x only ----

NOT_2D = {
    "1d": lambda x: x[0],                                   # ValueError: expected 2D or 3D input
    "3d": lambda x: x.view(2, 4, 6),                        # running_mean should contain 4 elements not 5
    "3d-channels": lambda x: torch.cat([x, x[:2]]).view(2, 5, 6),  # dim 1 is out_features: a result
    "4d": lambda x: x.view(2, 2, 2, 6),                     # ValueError: expected 2D or 3D input
}


@pytest.mark.parametrize("device,family", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@TRAIN_EVAL
@pytest.mark.parametrize("scaled", [True, False], ids=["scale", "no_scale"])
@pytest.mark.parametrize("case", list(NOT_2D))
def test_input_not_2d(device, family, path, training, scaled, case):
    t = tensors(device)
    t["x"] = NOT_2D[case](t["x"])
    if not scaled:
        t["scale"] = None
    with cutlass_fused.use_kernel_family(family):
        if path != "op":
            compare(path, t, training)
            return
        with pytest.raises(RuntimeError, match=rf"expected input to be 2-D \(batch, in_features\), but got {t['x'].dim()}-D"):
            run("ours", path, t, training)


# -- tensors on different devices, CPU/CUDA mixed: a clear error -------------------------------

MOVED = [(path, training, name) for path in PATHS for training in (True, False)
         for name in ("x", "weight") + VECTORS + (("nbt",) if path == "module" and training else ())]


@needs_cuda
@pytest.mark.parametrize("home", ["cuda", "cpu"])
@pytest.mark.parametrize("path,training,name", MOVED, ids=[f"{p}-{'train' if t else 'eval'}-{n}" for p, t, n in MOVED])
def test_mixed_devices(home, path, training, name):
    # Everything on `home` but one tensor. With x the odd one out, weight is named.
    t = tensors(home)
    t[name] = t[name].to("cpu" if home == "cuda" else "cuda")
    named = "weight" if name == "x" else "num_batches_tracked" if name == "nbt" else name
    gpu = f"cuda:{torch.cuda.current_device()}"  # not always cuda:0 (conftest.py)
    on, got = (gpu, "cpu") if home == "cuda" else ("cpu", gpu)
    if name == "x":  # x is "input": the error names weight, on x's device
        on, got = got, on
    with pytest.raises(RuntimeError, match=rf"expected {named} to be on {on} like input, but got {got}"):
        run("ours", path, t, training)


# -- running stats of the wrong size or dtype: a clear error -----------------------------------

def update_op(t):
    """The split ops' running-stats update (SyncBatchNorm's path) on t."""
    _, stats = ops.linear_stats(t["x"], t["weight"], t["bias"], "auto")
    ops.update_running_stats(stats, t["scale"], t["x"].shape[0], t["running_mean"], t["running_var"], None, 0.1)


# Every path in train and eval, and the split ops' update (training only).
PATH_MODES = [(p, tr) for p in PATHS for tr in (True, False)] + [("update_op", True)]
MODE_IDS = [f"{p}-{'train' if tr else 'eval'}" for p, tr in PATH_MODES]


@pytest.mark.parametrize("device,family", DEVICES)
@pytest.mark.parametrize("path,training", PATH_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", ["running_mean", "running_var"])
@pytest.mark.parametrize("size", [6, 1])
def test_running_stats_size(device, family, path, training, name, size):
    t = tensors(device)
    t[name] = t[name].new_ones(size)
    with cutlass_fused.use_kernel_family(family):
        if path in ("module", "functional"):  # PyTorch refuses too: ours must in its words
            compare(path, t, training)
            return
        with pytest.raises(RuntimeError, match=rf"{name} should contain 5 elements not {size}"):
            update_op(t) if path == "update_op" else run("ours", path, t, training)


# z = h * scale in float32: PyTorch's batch norm takes running stats in z's dtype only. The
# split update does not know z's dtype: it refuses only what no layer could take.
DTYPE_CASES = [(p, tr, dt) for p, tr in PATH_MODES for dt in (torch.float64, torch.bfloat16, torch.int64, torch.bool)
               if p != "update_op" or not dt.is_floating_point]


@pytest.mark.parametrize("device,family", DEVICES)
@pytest.mark.parametrize("path,training,dtype", DTYPE_CASES,
                         ids=[f"{p}-{'train' if tr else 'eval'}-{str(dt)[6:]}" for p, tr, dt in DTYPE_CASES])
@pytest.mark.parametrize("name", ["running_mean", "running_var"])
def test_running_stats_dtype(device, family, path, training, dtype, name):
    t = tensors(device)
    t[name] = t[name].to(dtype)
    if device == "cpu" and path != "update_op":
        with pytest.raises(RuntimeError):  # PyTorch refuses them too ("mixed dtype", "expected scalar type")
            run("torch", path, copy(t), training)
    got = {torch.float64: "Double", torch.bfloat16: "BFloat16", torch.int64: "Long", torch.bool: "Bool"}[dtype]
    with cutlass_fused.use_kernel_family(family):
        with pytest.raises(RuntimeError, match=rf"expected {name} to have dtype .*Float.*, but got {got}"):
            update_op(t) if path == "update_op" else run("ours", path, t, training)


@pytest.mark.parametrize("device,family", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@TRAIN_EVAL
def test_float32_running_stats_of_a_bf16_layer(device, family, path, training):
    # z in bfloat16: PyTorch also takes the batch norm's vectors all in float32, and so must we.
    t = tensors(device, dtype=torch.bfloat16)
    for k in ("bn_weight", "bn_bias", "running_mean", "running_var"):
        t[k] = t[k].float()
    with cutlass_fused.use_kernel_family(family):
        compare(path, t, training, dy=grad_out(8, device), floor=FLOOR["bf16"])


# -- a compute capability below 8.0, or a build without the kernel family: a clear error ------

@needs_cuda
@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_kernel_family_runs_or_is_named(family):
    # Runs (and is right) where the GPU and the build have the family; else the error says why.
    cc = torch.cuda.get_device_capability()
    built = any(name.startswith(family + "_") for name in cutlass_fused.built_kernels())
    if cc < (8, 0):
        words = r"needs an Ampere \(compute capability 8\.0\) or newer GPU"
    elif family == "sm90" and cc != (9, 0):
        words = r"family 'sm90' needs compute capability 9\.0"
    elif not built:
        words = rf"this build has no {family} \w+ \w+ kernel; rebuild with that architecture"
    else:
        words = None
    with cutlass_fused.use_kernel_family(family):
        for training in (True, False):
            if words is None:
                compare("functional", tensors("cuda"), training, dy=grad_out(8, "cuda"))
            else:
                with pytest.raises(RuntimeError, match=words):
                    run("ours", "functional", tensors("cuda"), training)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@TRAIN_EVAL
def test_unknown_family_to_the_op(device, training):
    # The ops take the family as a string: a wrong one is named on every device.
    t = tensors(device)
    args = [t[k] for k in ("x", "weight", "bias", "scale", "bn_weight", "bn_bias", "running_mean", "running_var")]
    with pytest.raises(RuntimeError, match=r"expected family to be 'auto', 'sm90' or 'sm80', but got 'sm70'"):
        if training:
            ops.linear_scale_batch_norm_train(*args, None, 0.1, 1e-5, "sm70")
        else:
            ops.linear_scale_batch_norm_eval(*args, 1e-5, "sm70")


# -- the layer's own arguments ------------------------------------------------------------------

@pytest.mark.parametrize("device,family", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@TRAIN_EVAL
@pytest.mark.parametrize("name", ["bias", "scale", "bn_weight", "bn_bias"])
@pytest.mark.parametrize("size", [3, 1])  # 1 would broadcast if unchecked
def test_vector_size(device, family, path, training, name, size):
    t = tensors(device)
    t[name] = t[name][:size]
    with cutlass_fused.use_kernel_family(family):
        with pytest.raises(RuntimeError, match=rf"expected {name} to have shape \[5\]"):
            run("ours", path, t, training)


@pytest.mark.parametrize("device,family", DEVICES)
def test_eval_needs_running_stats(device, family):
    t = tensors(device)
    t["running_mean"] = t["running_var"] = None
    with cutlass_fused.use_kernel_family(family):
        with pytest.raises(RuntimeError, match="running_mean must be defined in evaluation mode"):
            run("ours", "functional", t, False)


@pytest.mark.parametrize("device,family", DEVICES)
def test_cumulative_momentum_needs_counter(device, family):
    with cutlass_fused.use_kernel_family(family), pytest.raises(ValueError, match="num_batches_tracked"):
        run("ours", "functional", tensors(device), True, momentum=None)


def test_unknown_family():
    with pytest.raises(ValueError, match="kernel family"):
        with cutlass_fused.use_kernel_family("sm70"):
            pass


@pytest.mark.parametrize("device,family", DEVICES)
@pytest.mark.parametrize("case", ["sums-shape", "sums-dtype", "sums-strided", "count-numel", "count-dtype"])
def test_sync_backward_sums_and_count(device, family, case):
    """batch_norm_backward_elemt names `sums` or `count` and what it expected of them."""
    x, w, v = torch.randn(8, 6, device=device), torch.randn(5, 6, device=device), lambda: torch.randn(5, device=device)
    _, h, _, mean, invstd = ops.linear_scale_batch_norm_train(x, w, v(), v(), v(), v(), None, None, None, 0.1, 1e-5,
                                                              family)
    dy = torch.randn_like(h)
    sums = ops.batch_norm_backward_reduce(dy, h, mean, invstd, v(), v(), 1e-5)
    count = torch.tensor([8.0], device=device, dtype=torch.float64)
    bad = {"sums-shape": (sums[:, :4], count), "sums-dtype": (sums.float(), count),
           "sums-strided": (sums.t().contiguous().t(), count), "count-numel": (sums, count.repeat(2)),
           "count-dtype": (sums, count.float())}[case]
    words = (r"expected sums to be a contiguous float64 tensor of shape \[2, 5\]" if case.startswith("sums")
             else r"expected count to be a float64 tensor of one element")
    with pytest.raises(RuntimeError, match=words):
        ops.batch_norm_backward_elemt(dy, h, mean, invstd, v(), v(), *bad, 1e-5)
