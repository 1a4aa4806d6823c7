"""Forward results against a float64 reference of the unfused model."""
import contextlib
import os

import pytest
import torch

import cutlass_fused
from codegen.kernels import KERNELS
from cutlass_fused.ops import ops
from common import (END_TO_END_BATCH, FAMILIES, FAMILY_IDS, HOPPER, MODES, assert_close_rule, batch_norm,
                    cuda_kernels, max_err, params, precision, reference_h, reference_z, shape_cases)

# (batch, in_features, out_features): aligned, unaligned K and N, tiny, 1 feature.
SHAPES = [(256, 512, 384), (3, 769, 1000), (1000, 1000, 769), (2, 5125, 40), (5, 1, 1), (1000, 64, 8)]


def run_steps(device, family, mode, shape, training, momentum, steps, affine=True, bias=True, scale=True):
    dtype, _ = MODES[mode]
    m, k, n = shape
    p = params(k, n, device, dtype, bias=bias, affine=affine, seed=m + k + n, scale=scale)
    p64 = {k_: (v.double().cpu() if v is not None else None) for k_, v in p.items()}
    ours = {k_: (v.clone() if v is not None else None) for k_, v in p.items()}
    nbt = torch.zeros((), dtype=torch.long, device=device)
    start = (p["running_mean"], p["running_var"])
    run = {"e2e64": start, "e2e": start, "stage64": start, "stage": start}  # reference running stats
    for step in range(steps):
        x = torch.randn(m, k, device=device).to(dtype)
        with precision(device, family, mode):
            y = cutlass_fused.linear_scale_batch_norm(
                x, ours["weight"], ours["bias"], ours["scale"], ours["bn_weight"], ours["bn_bias"],
                ours["running_mean"], ours["running_var"], training, momentum, 1e-5, nbt)
            h = ops.linear_stats(x, ours["weight"], ours["bias"], family)[0]
        # y has h * scale's promoted dtype, as in the unfused model (fp32 for a 16-bit h and fp32 scale);
        # without a scale h's, as nn.BatchNorm1d returns it.
        y_dtype = dtype if not scale else torch.promote_types(dtype, ours["scale"].dtype)
        assert y.shape == (m, n) and y.dtype == y_dtype and y.is_contiguous()
        mom = momentum if momentum is not None else 1.0 / (step + 1)
        bn = lambda zz, key: batch_norm(zz, p64 if zz.dtype == torch.float64 else p, run[key], training, mom)
        z64 = reference_z(x.double().cpu(), p64)
        y64, *run["e2e64"] = bn(z64, "e2e64")
        y_t, *run["e2e"] = bn(reference_z(x, p, dtype, mode), "e2e")
        if not training or m >= END_TO_END_BATCH:
            assert_close_rule(y.cpu(), y_t.cpu(), y64, mode, f"y step {step}")
        if training:
            h64 = reference_h(x.double().cpu(), p64)
            assert_close_rule(h.cpu(), reference_h(x, p, dtype, mode).cpu(), h64, mode, f"h step {step}")
            ys64, *run["stage64"] = bn(h.double().cpu() * (p64["scale"] if scale else 1), "stage64")
            ys_t, *run["stage"] = bn(h * p["scale"].to(dtype) if scale else h, "stage")
            assert_close_rule(y.cpu(), ys_t.cpu(), ys64, mode, f"batch norm of our h * scale, step {step}")
            for i, name in enumerate(("running_mean", "running_var")):
                assert_close_rule(ours[name].cpu(), run["stage"][i].cpu(), run["stage64"][i], mode,
                                  f"{name} step {step}")
        else:
            for name in ("running_mean", "running_var"):
                assert torch.equal(ours[name], p[name]), f"eval changed {name}"
    assert nbt.item() == (steps if training else 0)


@pytest.mark.parametrize("device,family,mode,shape", list(shape_cases(SHAPES)))
def test_training(device, family, mode, shape):
    run_steps(device, family, mode, shape, training=True, momentum=0.1, steps=3)


@pytest.mark.parametrize("device,family,mode,shape", list(shape_cases(SHAPES)))
def test_eval(device, family, mode, shape):
    run_steps(device, family, mode, shape, training=False, momentum=0.1, steps=1)


# The layer without a scale (LinearBatchNorm1d; scale=None through every op): the kernels read no
# scale, and y is h's dtype. Odd sizes and batches of 2, 3 and 1000.
NO_SCALE_SHAPES = [(3, 769, 1000), (1000, 1000, 769), (2, 5125, 40), (256, 512, 384)]


@pytest.mark.parametrize("device,family,mode,shape", list(shape_cases(NO_SCALE_SHAPES)))
def test_training_without_scale(device, family, mode, shape):
    run_steps(device, family, mode, shape, training=True, momentum=0.1, steps=2, scale=False)


@pytest.mark.parametrize("device,family,mode,shape", list(shape_cases(NO_SCALE_SHAPES)))
def test_eval_without_scale(device, family, mode, shape):
    run_steps(device, family, mode, shape, training=False, momentum=0.1, steps=1, scale=False)


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("mode", ["bf16", "f32"])
def test_cumulative_momentum(device, family, mode):
    run_steps(device, family, mode, (64, 96, 72), training=True, momentum=None, steps=4)


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_no_affine_no_bias(device, family):
    for scale in (True, False):  # SimSiam's last layer: no bias, no affine, no scale
        run_steps(device, family, "f32", (33, 40, 24), True, 0.1, 2, affine=False, bias=False, scale=scale)
        run_steps(device, family, "f32", (33, 40, 24), False, 0.1, 1, affine=False, bias=False, scale=scale)
    run_steps(device, family, "bf16", (512, 256, 264), True, None, 3, affine=False, bias=False, scale=False)


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("mode", ["bf16", "f16", "f32", "tf32"])
def test_robust_variance(device, family, mode):
    """A column whose mean is 1000x its std: plain fp32 sum/sum-of-squares loses the variance.

    The statistics describe h as the layer stores it (rounded to the input
    dtype), so the reference is the float64 variance of that h times scale; in
    fp32 it is also checked against the exact float64 product.
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
        h, stats = ops.linear_stats(x, p["weight"], bias, family)
        ops.update_running_stats(stats, scale, m, rm, rv, None, 1.0)
    # In 16-bit, z's 8-11 bit mantissa can make a column constant: variance 0, matched exactly.
    rel = lambda got, want: ((got.double() - want).abs() / want.clamp_min(1e-300)).max().item()
    assert rel(rv, (h.double() * scale.double()).var(0)) <= 1e-3
    if mode == "f32":
        exact = ((z64 + bias.double()) * scale.double()).var(0)
        assert rel(rv, exact) <= 1e-3


@pytest.mark.parametrize("device,family", FAMILIES, ids=FAMILY_IDS)
def test_deterministic(device, family):
    """Under torch.use_deterministic_algorithms(True) three runs agree to the bit, and are right:
    y and the running stats against float64 of the unfused model (2x PyTorch's bf16 error plus a
    floor), and each family's column statistics (linear_stats: the ordered fp64 pass on sm80 and
    the CPU) against float64 sums of its h."""
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
                h, stats = ops.linear_stats(x, p["weight"], p["bias"], family)
                outs.append((y, rm, rv, h, stats))
    finally:
        torch.use_deterministic_algorithms(False)
    for out in outs[1:]:
        for name, a, b in zip(("y", "running_mean", "running_var", "h", "stats"), out, outs[0]):
            assert torch.equal(a, b), name
    y, rm, rv, h, stats = outs[0]
    p64 = {k_: v.double().cpu() for k_, v in p.items()}
    y64, rm64, rv64 = batch_norm(reference_z(x.double().cpu(), p64), p64,
                                 (p64["running_mean"], p64["running_var"]), True)
    y_t, rm_t, rv_t = batch_norm(reference_z(x, p), p, (p["running_mean"], p["running_var"]), True)
    assert_close_rule(y.cpu(), y_t.cpu(), y64, "bf16", "y")
    assert_close_rule(rm.cpu(), rm_t.cpu(), rm64, "bf16", "running_mean")
    assert_close_rule(rv.cpu(), rv_t.cpu(), rv64, "bf16", "running_var")
    h64 = h.double().cpu()
    for i, want in enumerate((h64.sum(0), (h64 * h64).sum(0))):
        # fp64 sums of bf16 values: exact but for fp64 rounding.
        assert (stats[i].cpu() - want).abs().max() <= 1e-12 * want.abs().max(), f"stats[{i}]"


def test_cpu_matches_reference_float64():
    """The CPU path in float64 is the reference computation itself, to rounding."""
    p = params(20, 12, "cpu", torch.float64, param_dtype=torch.float64)
    x = torch.randn(9, 20, dtype=torch.float64)
    y_ref, rm_ref, rv_ref = batch_norm(reference_z(x, p), p, (p["running_mean"], p["running_var"]), True)
    y = cutlass_fused.linear_scale_batch_norm(x, p["weight"], p["bias"], p["scale"], p["bn_weight"], p["bn_bias"],
                                              p["running_mean"], p["running_var"], True)
    assert max_err(y, y_ref) < 1e-12
    assert max_err(p["running_mean"], rm_ref) < 1e-12 and max_err(p["running_var"], rv_ref) < 1e-12


# The training op runs the statistics, normalization and running-stat update
# in one kernel on CUDA; the split ops (SyncBatchNorm's path) run them as
# separate kernels in the same order of summation, so both must agree to the
# bit. The shapes make the fused kernel's grid smaller than its work (5125
# unaligned columns), take 32 row chunks (16384 rows), or a single chunk; 16-bit
# batches of at most 128 rows (2 and 100) take the small-batch kernel, whose
# sums must follow the same order, in 16-byte groups (24) or single columns (777).
# (The statistics GEMM, whose sums are fp32, is off here: test_stats_gemm.)
FUSED_SHAPES = [(1000, 96, 5125), (16384, 64, 256), (2, 40, 24), (333, 128, 130), (100, 64, 777)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_fused_train_matches_split_ops(shape, dtype, momentum, override):
    override(stats_gemm=False)
    m, k, n = shape
    p = params(k, n, "cuda", dtype, seed=m)
    x = torch.randn(m, k, device="cuda").to(dtype)
    rm, rv = p["running_mean"].clone(), p["running_var"].clone()
    nbt = torch.tensor(4, device="cuda")
    y, h, stats, mean, invstd = ops.linear_scale_batch_norm_train(
        x, p["weight"], p["bias"], p["scale"], p["bn_weight"], p["bn_bias"], rm, rv, nbt, momentum, 1e-5, "auto")
    h2, stats2 = ops.linear_stats(x, p["weight"], p["bias"], "auto")
    y2, mean2, invstd2 = ops.batch_norm_finalize(h2, stats2, p["scale"], m, p["bn_weight"], p["bn_bias"], 1e-5)
    rm2, rv2, nbt2 = p["running_mean"].clone(), p["running_var"].clone(), torch.tensor(5, device="cuda")
    ops.update_running_stats(stats2, p["scale"], m, rm2, rv2, nbt2, momentum)
    for name, a, b in [("h", h, h2), ("stats", stats, stats2), ("y", y, y2), ("mean", mean, mean2),
                       ("invstd", invstd, invstd2), ("running_mean", rm, rm2), ("running_var", rv, rv2),
                       ("num_batches_tracked", nbt, nbt2)]:
        assert torch.equal(a, b), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", [f for d, f in FAMILIES if d == "cuda"])
@pytest.mark.parametrize("training,frozen,launches", [(True, False, 2), (False, False, None), (False, True, 1)],
                         ids=["train", "eval", "eval-frozen"])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_launches_per_forward(family, training, frozen, launches, activation):
    """Training: the GEMM and one kernel for everything after it. Eval: the GEMM alone on sm90,
    whose epilogue makes the fold; on sm80 the fold kernel and the GEMM, or inside frozen_weights(),
    where the fold is kept, the GEMM alone. The activation adds no launch: the tail, or the eval
    GEMM's epilogue, applies it. (bf16, aligned: no padding or casts.)"""
    launches = launches or (1 if family == "sm90" else 2)
    layer = cutlass_fused.LinearScaleBatchNorm1d(256, 512, device="cuda", dtype=torch.bfloat16,
                                                 activation=activation).train(training)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    scope = cutlass_fused.frozen_weights(layer) if frozen else contextlib.nullcontext()
    with cutlass_fused.use_kernel_family(family), torch.no_grad(), scope:
        layer(x)
        torch.cuda.synchronize()
        _, kernels = cuda_kernels(lambda: layer(x))
    if cutlass_fused._overrides.current().poison:  # the test-only NaN fills of each output
        kernels = [k for k in kernels if "FillFunctor" not in k]
    assert len(kernels) == launches, kernels


@pytest.mark.skipif(not HOPPER, reason="the sm90 family's eval kernels")
@pytest.mark.parametrize("shape", [(1000, 96, 769), (3, 64, 1000), (300, 5125, 96)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", ["bf16", "f16", "tf32", "f32"])
@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no_affine"])
def test_eval_fold_in_the_epilogue(shape, mode, activation, affine):
    """sm90 eval makes the fold (a = scale w invstd, c = b - mean w invstd; fp16: w invstd and scale
    apart) in its epilogue, a CTA's columns at a time (csrc/kernels/gemm/sm90_fold.cuh); with
    cache=True (frozen_weights()) it reads the fold kernel's vectors instead. Both call fold_value:
    y is the same bits, padded columns (769, 1000) and partial tiles included. The vectors are in
    the data's dtype (an fp32 scale beside 16-bit data takes the fp32 route, fold kernel only).
    No fold kernel without the cache (the profile). The plan takes this route up to two tiles a CTA
    (test_plan.py, test_eval_routes), as all three shapes here are."""
    m, k, n = shape
    dtype = MODES[mode][0]
    assert cutlass_fused.plan(m, n, k, dtype=dtype, mode="eval", family="sm90", allow_tf32=mode == "tf32",
                              sm_count=torch.cuda.get_device_properties(0).multi_processor_count)["fold_in_epilogue"]
    p = params(k, n, "cuda", dtype, affine=affine, seed=m + n, param_dtype=dtype)
    x = torch.randn(m, k, device="cuda").to(dtype)

    def eval_y(cache):
        return ops.linear_scale_batch_norm_eval(x, p["weight"], p["bias"], p["scale"], p["bn_weight"], p["bn_bias"],
                                                p["running_mean"], p["running_var"], 1e-5, "sm90", cache, activation,
                                                0.01)

    with precision("cuda", "sm90", mode):
        try:
            kept = eval_y(True)
        finally:
            ops.clear_cache()
        made = eval_y(False)
        torch.cuda.synchronize()
        _, kernels = cuda_kernels(lambda: eval_y(False))
    assert torch.isfinite(made).all()
    assert torch.equal(made, kept)
    if os.environ.get("CUTLASS_FUSED_NO_PROFILER"):  # compute-sanitizer holds CUPTI (scripts/sanitize.sh)
        return
    # Beside the GEMM only the operands' padding copies and 3xTF32 split, the poison fills and y's narrowing.
    assert not [name for name in kernels if "fold_eval" in name], kernels
    assert len([name for name in kernels if "_eval_" in name]) == 1, kernels


@pytest.mark.skipif(not HOPPER, reason="the sm90 family's eval kernels")
@pytest.mark.parametrize("mode", ["bf16", "f16"])
def test_eval_fold_in_the_epilogue_under_capture(mode):
    """Inside frozen_weights() (cache=True) a CUDA graph being captured keeps nothing, so the
    epilogue makes the fold: the graph replays one GEMM, not the fold kernel and the GEMM, and y
    has the bits of the fold kernel's vectors kept outside the capture."""
    m, k, n = 300, 96, 769
    dtype = MODES[mode][0]
    p = params(k, n, "cuda", dtype, seed=m + n, param_dtype=dtype)
    x = torch.randn(m, k, device="cuda").to(dtype)

    def eval_y():
        return ops.linear_scale_batch_norm_eval(x, p["weight"], p["bias"], p["scale"], p["bn_weight"], p["bn_bias"],
                                                p["running_mean"], p["running_var"], 1e-5, "sm90", True, "relu",
                                                0.01)

    try:
        kept = eval_y()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eval_y()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = eval_y()
        graph.replay()
        torch.cuda.synchronize()
        _, kernels = cuda_kernels(graph.replay)
    finally:
        ops.clear_cache()
    assert torch.isfinite(kept).all()
    assert torch.equal(captured, kept)
    assert not [name for name in kernels if "fold_eval" in name], kernels
    assert len([name for name in kernels if "_eval_" in name]) == 1, kernels


# Every eval row of the kernel table (the defaults, the small-batch tiles and the tuner's candidates),
# forced in turn, against float64: partial tiles of rows and columns (1000 x 769), and 3 rows. The
# e4m3 rows serve the FP8 op (test_fp8). The row's own kernel must be the one that ran.
EVAL_KERNELS = [k for k in KERNELS if k.mode == "eval" and k.dtype != "e4m3"]


@pytest.mark.skipif(not HOPPER, reason="the table's kernels run on an sm90 GPU")
@pytest.mark.parametrize("kernel", EVAL_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("shape", [(1000, 96, 769), (3, 64, 1000)], ids=lambda s: "x".join(map(str, s)))
def test_each_eval_kernel(kernel, shape, override):
    if kernel.name not in cutlass_fused.built_kernels():
        pytest.skip(f"{kernel.name} is not in this build")
    override(kernel=kernel.name)
    mode = {"f32x3": "f32"}.get(kernel.dtype, kernel.dtype)
    if os.environ.get("CUTLASS_FUSED_NO_PROFILER"):  # compute-sanitizer holds CUPTI (scripts/sanitize.sh)
        run_steps("cuda", kernel.family, mode, shape, training=False, momentum=0.1, steps=1)
        return
    _, kernels = cuda_kernels(
        lambda: run_steps("cuda", kernel.family, mode, shape, training=False, momentum=0.1, steps=1))
    assert any(f"{kernel.name}::" in name for name in kernels), kernels


# The training tails (overrides(tail=...)) must write the same bits, with the statistics GEMM's
# sums (16-bit and fp32 at the three larger shapes take it) and without them (stats_gemm=False), and
# for columns whose tile sums are not trusted (a bias 1000x their spread sends them to the exact
# pass). Slab rows of 128, 64 and 32 bytes (at most 512, 1024 and 2048 rows); a last slab with
# some columns (1032) or a slab wider than the layer (24); 200 and 3 rows take the small tail too.
TAIL_SHAPES = [(512, 64, 4096), (1000, 96, 8192), (2000, 64, 2048), (200, 32, 1032), (3, 40, 24)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", TAIL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", ["bf16", "f16", "f32", "tf32"])
@pytest.mark.parametrize("stats", ["1", "0"])
@pytest.mark.parametrize("large_mean", [False, True], ids=["spread", "large_mean"])
def test_training_tails_agree(shape, mode, stats, large_mean, override):
    override(stats_gemm=stats == "1")
    m, k, n = shape
    dtype = MODES[mode][0]
    # Parameters in the data's dtype give y that dtype (fp16: the tail emulates z's overflow).
    p = params(k, n, "cuda", dtype, seed=m + n, param_dtype=dtype if large_mean else torch.float32)
    if large_mean:
        p["bias"][::3] += 1000
    x = torch.randn(m, k, device="cuda").to(dtype)
    tails = ["cooperative", "slab"] + (["small"] if dtype != torch.float32 and m <= 256 else [])
    out = {}
    with precision("cuda", "auto", mode):
        for tail in tails:
            override(tail=tail)
            rm, rv, nbt = p["running_mean"].clone(), p["running_var"].clone(), torch.tensor(4, device="cuda")
            out[tail] = (*ops.linear_scale_batch_norm_train(x, p["weight"], p["bias"], p["scale"], p["bn_weight"],
                                                            p["bn_bias"], rm, rv, nbt, 0.1, 1e-5, "auto"),
                         rm, rv, nbt)
    names = ("y", "h", "stats", "mean", "invstd", "running_mean", "running_var", "num_batches_tracked")
    assert torch.isfinite(out["cooperative"][0]).all()
    for tail in tails[1:]:
        for name, a, b in zip(names, out["cooperative"], out[tail]):
            assert torch.equal(a, b), f"{tail}: {name}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_forced_tail_that_cannot_run(override):
    """A forced tail that cannot take the problem is an error, never a silent fallback."""
    p = params(16, 777, "cuda", torch.bfloat16)
    x = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    args = (x, p["weight"], p["bias"], p["scale"], p["bn_weight"], p["bn_bias"], p["running_mean"].clone(),
            p["running_var"].clone(), None, 0.1, 1e-5, "auto")
    override(tail="slab")  # 777 columns: no 16-byte groups
    with pytest.raises(RuntimeError, match="slab training tail needs 16-byte aligned columns"):
        ops.linear_scale_batch_norm_train(*args)


def test_an_unknown_override_is_refused_by_name():
    """Any device: the value is checked where it is set, and the error lists the valid ones."""
    with pytest.raises(ValueError, match="expected tail to be 'auto', 'cooperative', 'slab' or 'small', but got 'fast'"):
        with cutlass_fused.overrides(tail="fast"):
            pass
    with pytest.raises(ValueError, match="expected backward to be 'auto', 'passes', 'slab' or 'cooperative'"):
        with cutlass_fused.overrides(backward="both"):
            pass
    with pytest.raises(ValueError, match="expected kernel to be 'auto' or a row of the kernel table"):
        with cutlass_fused.overrides(kernel="sm90_bf16_eval_1x1x1"):
            pass
    with pytest.raises(ValueError, match="unknown override 'tails'"):
        with cutlass_fused.overrides(tails="slab"):
            pass
    assert cutlass_fused._overrides.current().tail == "auto"  # a refused value leaves nothing behind
