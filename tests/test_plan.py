"""The plan (csrc/kernels/plan.cpp), asked on the CPU about any problem on any GPU: one test a rule.

Every choice a CUDA call makes comes from this one function; tests/test_selection.py checks on a
GPU that the kernels it names are the ones that run. The expected rows and numbers here are the
measured decisions of docs/decisions.md.
"""
import pytest
import torch

import cutlass_fused
from cutlass_fused import plan

H100 = dict(capability=(9, 0), sm_count=132)
A100 = dict(capability=(8, 0), sm_count=108)
# The 16-bit dtypes as the kernel table's row names spell them (codegen/kernels.py).
ROW_DTYPE = {torch.bfloat16: "bf16", torch.float16: "f16"}


def test_family_by_capability_and_request():
    assert plan(1024, 1024, 1024, **H100)["family"] == "sm90"
    for cc in [(8, 0), (8, 6), (8, 9), (10, 0), (12, 0)]:  # sm90a code runs on 9.0 only
        assert plan(1024, 1024, 1024, capability=cc)["family"] == "sm80"
    assert plan(1024, 1024, 1024, family="sm80", **H100)["family"] == "sm80"
    with pytest.raises(RuntimeError, match=r"family 'sm90' needs compute capability 9\.0, but .* has 8\.6"):
        plan(1024, 1024, 1024, family="sm90", capability=(8, 6))
    with pytest.raises(RuntimeError, match=r"needs an Ampere \(compute capability 8\.0\) or newer GPU"):
        plan(1024, 1024, 1024, capability=(7, 5))
    with pytest.raises(RuntimeError, match="expected family to be 'auto', 'sm90' or 'sm80', but got 'sm70'"):
        plan(1024, 1024, 1024, family="sm70")


@pytest.mark.parametrize("family", ["sm90", "sm80"])
def test_math_follows_torch_mm(family):
    """fp32 takes TF32 exactly when torch.mm would; without it, 3xTF32: split operands through the
    TF32 kernel on sm90, in-kernel on sm80 with the infinity fix."""
    f32 = dict(dtype=torch.float32, family=family, **H100)
    assert plan(64, 64, 64, dtype=torch.bfloat16, family=family, **H100)["math"] == "bf16"
    assert plan(64, 64, 64, dtype=torch.float16, family=family, **H100)["math"] == "f16"
    assert plan(64, 64, 64, allow_tf32=True, **f32)["math"] == "tf32"
    got = plan(64, 64, 64, allow_tf32=False, mode="eval", **f32)
    assert got["math"] == "f32x3"
    assert (got["split"], got["inf_fix"]) == ((True, False) if family == "sm90" else (False, True))
    assert not got["remainder"]


@pytest.mark.parametrize("family", ["sm90", "sm80"])
def test_fp32_statistics_gemm_reads_the_operands_and_their_remainders(family):
    """sm90's 3xTF32 statistics GEMM takes x and the weight unsplit beside their remainders, and
    rewrites what an infinite row of either reaches (csrc/kernels/remainder_mainloop.h); its eval
    GEMM, and sm80's training (the eval kernel and the infinity fix), split as before."""
    got = plan(1024, 8192, 8192, dtype=torch.float32, allow_tf32=False, family=family, **H100)
    assert got["math"] == "f32x3"
    if family == "sm90":
        assert got["stats_gemm"] and (got["split"], got["remainder"], got["inf_fix"]) == (True, True, True)
    else:
        assert (got["split"], got["remainder"], got["inf_fix"]) == (False, False, True)


# (batch, features, in_features) -> the eval GEMM: the default row where its tiles fill half the
# SMs, else the largest tile that does, else the one with the most CTAs (test_selection's shapes).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,tile", [((4096, 8192, 1024), "256x128x64_c1x2x1"),
                                        ((256, 8192, 1024), "128x128x64_c1x2x1"),
                                        ((128, 512, 1024), "128x64x64_c1x2x1")])
def test_eval_kernel_by_batch(shape, tile, dtype):
    name = ROW_DTYPE[dtype]
    assert plan(*shape, dtype=dtype, mode="eval", **H100)["kernel"] == f"sm90_{name}_eval_{tile}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_the_sms_is_counted_on_the_gpu_at_hand(dtype):
    # Training at 256 x 8192: 64 CTAs of the 128x256 statistics tile. Half of 132 SMs wants 66, half
    # of 108 only 54, so 108 SMs keep the default and 132 take the small-batch tile. (Eval there, in
    # 256x128 tiles, fills 108 SMs' half too, but slot_use then takes the 128x192 tile.)
    name = ROW_DTYPE[dtype]
    assert plan(256, 8192, 1024, dtype=dtype, capability=(9, 0), sm_count=108)["kernel"] == \
        f"sm90_{name}_stats_128x256x64_c2x1x1"
    assert plan(256, 8192, 1024, dtype=dtype, **H100)["kernel"] == f"sm90_{name}_stats_128x128x64_c1x1x1"
    assert plan(256, 8192, 1024, dtype=dtype, mode="eval", capability=(9, 0), sm_count=108)["kernel"] == \
        f"sm90_{name}_eval_128x192x64_c1x1x1"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,kernel,stats", [((1024, 8192, 1024), "stats_128x256x64_c2x1x1", True),
                                                ((256, 8192, 1024), "stats_128x128x64_c1x1x1", True),
                                                ((128, 8192, 1024), "eval_128x64x64_c1x2x1", False)])
def test_training_takes_the_statistics_gemm_where_it_fills_half_the_gpu(shape, kernel, stats, dtype):
    name = ROW_DTYPE[dtype]
    got = plan(*shape, dtype=dtype, **H100)
    assert (got["kernel"], got["stats_gemm"]) == (f"sm90_{name}_{kernel}", stats)
    if stats:  # one fp32 row of sums a batch tile, the features rounded to whole tiles
        tile_m, tile_n = map(int, kernel.split("_")[1].split("x")[:2])
        assert (got["sum_tiles"], got["sum_ld"], got["sum_bytes"]) == (-(-shape[0] // tile_n), shape[1], 4)


def test_statistics_gemm_on_both_families_and_can_be_turned_off():
    # sm80 (bf16): not swapped; one fp32 row of sums a 256-row batch tile, the features rounded up
    # to whole batch tiles (csrc/kernels/gemm/sm80_stats.cuh's partials_ld).
    got = plan(4000, 1000, 1024, family="sm80", **H100)
    assert got["stats_gemm"] and got["kernel"] == "sm80_bf16_stats_256x128x64_s3"
    assert (got["sum_tiles"], got["sum_ld"], got["sum_bytes"]) == (16, 1024, 4)
    assert plan(4000, 1000, 1024, dtype=torch.float16, family="sm80", **H100)["kernel"] == \
        "sm80_f16_stats_256x128x64_s3"
    assert plan(4000, 1000, 1024, dtype=torch.float32, allow_tf32=True, family="sm80", **H100)["kernel"] == \
        "sm80_tf32_stats_256x128x32_s3"
    # Too few CTAs (4 x 8 of 132 SMs), or 3xTF32 (its sums would need fp64 partials): the eval GEMM.
    assert not plan(1000, 1000, 1024, family="sm80", **H100)["stats_gemm"]
    assert not plan(4000, 1000, 1024, dtype=torch.float32, allow_tf32=False, family="sm80", **H100)["stats_gemm"]
    with cutlass_fused.overrides(stats_gemm=False):
        got = plan(1024, 8192, 1024, **H100)
    assert not got["stats_gemm"] and got["kernel"] == "sm90_bf16_eval_256x128x64_c1x2x1"
    # fp32 without TF32: fp64 sums (the f32x3 rows are "partial64").
    assert plan(1024, 8192, 8192, dtype=torch.float32, allow_tf32=False, **H100)["sum_bytes"] == 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tuned_kernels_by_shape(dtype):
    name = ROW_DTYPE[dtype]
    assert plan(1024, 8192, 8192, dtype=dtype, **H100)["kernel"] == f"sm90_{name}_stats_128x256x64_c1x1x1"
    assert plan(1024, 8192 - 64, 8192, dtype=dtype, **H100)["kernel"] == f"sm90_{name}_stats_128x256x64_c2x1x1"
    assert plan(512, 8192, 8192, dtype=dtype, **H100)["kernel"] == f"sm90_{name}_stats_128x256x64_c1x1x1"
    assert plan(512, 8192, 8192 - 64, dtype=dtype, **H100)["kernel"] == f"sm90_{name}_stats_128x256x64_c2x1x1"
    want = "eval_128x128x64_c2x1x1" if dtype == torch.bfloat16 else "eval_128x128x64_c1x2x1"
    assert plan(256, 8192, 8192, dtype=dtype, mode="eval", **H100)["kernel"] == f"sm90_{name}_{want}"


# (batch, in, out) -> the kernel where slot_use replaces the default, in both 16-bit dtypes, each
# measured ahead in bf16, most in fp16 too (H100, in CUDA graphs, docs/decisions.md, "Small batches"):
# - the 128x192 rows where the 256-wide tiles pad a batch of 3 x 2^k rows or leave a partial wave;
# - 128x128 where 128 rows half fill the default's 256-row tile, every CTA alike, since down to 3/4
#   of its useful area is weighed there (128 x 8192 -> 12288 eval 1.496 -> 1.071, train 1.385 ->
#   1.204 x mm); not at 64 rows, less than half useful (128x192 1.095, 128x128 1.134), nor at 320
#   rows, where only the last row of tiles pads (128x192 1.409, 128x128 1.786).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,mode,kernel", [((384, 8192, 8192), "eval", "eval_128x192x64_c1x1x1"),
                                               ((384, 8192, 8192), "train", "stats_128x192x64_c1x1x1"),
                                               ((768, 8192, 8192), "eval", "eval_128x192x64_c1x1x1"),
                                               ((768, 8192, 8192), "train", "stats_128x192x64_c1x1x1"),
                                               ((1536, 4096, 4096), "train", "stats_128x192x64_c1x1x1"),
                                               ((1536, 4096, 4096), "eval", "eval_128x192x64_c1x1x1"),
                                               ((1024, 6144, 6144), "eval", "eval_128x192x64_c1x1x1"),
                                               ((3072, 3072, 3072), "train", "stats_128x192x64_c1x1x1"),
                                               ((128, 8192, 12288), "eval", "eval_128x128x64_c1x2x1"),
                                               ((128, 8192, 12288), "train", "stats_128x128x64_c1x1x1"),
                                               ((128, 4096, 10240), "eval", "eval_128x128x64_c1x2x1"),
                                               ((64, 4096, 16384), "eval", "eval_128x192x64_c1x1x1"),
                                               ((320, 4096, 12288), "eval", "eval_128x192x64_c1x1x1"),
                                               ((320, 4096, 12288), "train", "stats_128x192x64_c1x1x1")])
def test_tiles_by_slot_use(shape, mode, kernel, dtype):
    m, k, n = shape
    name = ROW_DTYPE[dtype]
    assert plan(m, n, k, dtype=dtype, mode=mode, **H100)["kernel"] == f"sm90_{name}_{kernel}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tuned_training_gemms_where_128x128_beats_the_rule(dtype):
    """kTunedKernels' 640 x 8192^2 and 1024 x 6144^2 entries; a neighbour (K - 64) keeps the rule's."""
    name = ROW_DTYPE[dtype]
    for m, n in [(640, 8192), (1024, 6144)]:
        assert plan(m, n, n, dtype=dtype, **H100)["kernel"] == f"sm90_{name}_stats_128x128x64_c1x1x1"
        assert plan(m, n, n - 64, dtype=dtype, **H100)["kernel"] != f"sm90_{name}_stats_128x128x64_c1x1x1"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_192_wide_tiles_not_where_the_default_fills_its_waves(dtype):
    """Powers of two keep the default and the small-batch tiles: at 256 rows 128x192 would fill
    132 SMs' CTAs but be a third padding."""
    name = ROW_DTYPE[dtype]
    for m, k, n, mode, kernel in [(1024, 8192, 8192, "eval", "eval_256x128x64_c1x2x1"),
                                  (4096, 4096, 4096, "train", "stats_128x256x64_c2x1x1"),
                                  (16384, 4096, 4096, "train", "stats_128x256x64_c2x1x1"),
                                  (256, 1024, 8192, "eval", "eval_128x128x64_c1x2x1"),
                                  (256, 1024, 8192, "train", "stats_128x128x64_c1x1x1"),
                                  (128, 8192, 8192, "train", "eval_128x64x64_c1x2x1")]:
        assert plan(m, n, k, dtype=dtype, mode=mode, **H100)["kernel"] == f"sm90_{name}_{kernel}", (m, k, n, mode)


def test_tile_order():
    # 16-bit: swizzle 8 where a wave then reads at most 0.65 of the operand rows it reads without.
    assert plan(16384, 8192, 8192, mode="eval", **H100)["swizzle"] == 8
    assert plan(16384, 4096, 4096, mode="eval", **H100)["swizzle"] == 1  # 0.81 there: level, not taken
    # fp32 takes kTunedOrders alone: KernelBench's 16384 x 4096^2, with and without TF32 ...
    for tf32 in (False, True):
        assert plan(16384, 4096, 4096, dtype=torch.float32, allow_tf32=tf32, **H100)["swizzle"] == 8
    # ... and nothing elsewhere (swizzle 8 would pad 1024 x 8192^2's grid with empty tiles).
    assert plan(1024, 8192, 8192, dtype=torch.float32, allow_tf32=False, **H100)["swizzle"] == 1
    assert plan(16384, 8192, 8192, mode="eval", family="sm80", **H100)["swizzle"] == 1  # sm80: no scheduler
    with cutlass_fused.overrides(swizzle=4, raster="n"):
        got = plan(16384, 8192, 8192, mode="eval", **H100)
    assert (got["swizzle"], got["raster"]) == (4, "n")


@pytest.mark.parametrize("shape,tail", [((128, 8192), "small"), ((256, 8192), "slab"), ((512, 8192), "slab"),
                                        ((1024, 8192), "cooperative"), ((256, 4096), "cooperative"),
                                        ((256, 777), "cooperative")])
def test_training_tail_by_shape(shape, tail):
    """16-bit h in registers at <= 128 rows; a shared-memory slab of every row at 129-512 rows where
    slabs of 64-byte rows fill the GPU (4096 columns would need 32-byte rows; 777 has no 16-byte
    groups); the cooperative kernel for the rest."""
    got = plan(shape[0], shape[1], 1024, **H100)
    assert got["tail"] == tail
    assert (got["pieces"] >= 4) == (tail == "slab")


def test_training_tail_without_a_momentum_or_in_fp32():
    # momentum=None: every block reads num_batches_tracked after the increment -> cooperative only.
    assert plan(128, 8192, 1024, cumulative=True, **H100)["tail"] == "cooperative"
    assert plan(256, 8192, 1024, cumulative=True, **H100)["tail"] == "cooperative"
    for tf32 in (False, True):
        assert plan(256, 8192, 1024, dtype=torch.float32, allow_tf32=tf32, **H100)["tail"] == "cooperative"


def test_forced_tails():
    with cutlass_fused.overrides(tail="small"):
        assert plan(200, 8192, 1024, **H100)["tail"] == "small"  # up to 256 rows when asked for
        with pytest.raises(RuntimeError, match="small training tail needs 16-bit h, at most 256 rows"):
            plan(300, 8192, 1024, **H100)
    with cutlass_fused.overrides(tail="slab"):
        assert plan(256, 4096, 1024, **H100)["tail"] == "slab"  # any grid when asked for
        with pytest.raises(RuntimeError, match="slab training tail needs 16-byte aligned columns"):
            plan(256, 777, 1024, **H100)
    with cutlass_fused.overrides(tail="cooperative"):
        assert plan(128, 8192, 1024, **H100)["tail"] == "cooperative"


@pytest.mark.parametrize("shape,dtype,kernels", [
    ((256, 8192), torch.bfloat16, "slab"),
    ((768, 8192), torch.bfloat16, "cooperative"),    # one item a block: 32 column groups x 8 chunks <= 2 x 132
    ((1024, 8192), torch.bfloat16, "cooperative"),   # 8 chunks (limits::grad_rows): 37.1 -> 31.9 us
    ((16384, 4096), torch.float16, "cooperative"),   # 16 groups x 16 chunks
    ((768, 8192), torch.float32, "cooperative"),     # 64 groups x 4 chunks: 48.6 -> 38.9 us (H100)
    ((512, 8192), torch.float32, "passes"),          # the slab's rows: the slab is for 16 bits only
    ((600, 262144), torch.bfloat16, "passes"),       # 1024 column groups alone: some blocks take three
    ((600, 76800), torch.bfloat16, "passes"),        # 300 column groups: more items than 2 x 132 blocks
    ((256, 777), torch.bfloat16, "passes")])
def test_backward_kernels_by_shape(shape, dtype, kernels):
    assert plan(*shape, 0, dtype=dtype, mode="backward", **H100)["backward"] == kernels


@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "gelu", "gelu_tanh", "silu"])
def test_backward_with_an_activation(activation):
    """With an activation the cooperative kernel holds two blocks an SM (it spilled under three)
    and takes one item a block, past the slab's rows: 2 x 132 SMs at most (16384 x 4096: 16 column
    groups x 16 chunks); wider layers and the slab's rows keep their kernels. fp32 too, gelu,
    gelu_tanh and silu included since their arithmetic is fp32 (activation.cuh)."""
    for shape in [(768, 8192), (1024, 8192), (4096, 4096), (16384, 4096)]:
        assert plan(*shape, 0, mode="backward", activation=activation, **H100)["backward"] == "cooperative"
        assert plan(*shape, 0, dtype=torch.float32, mode="backward", activation=activation,
                    **H100)["backward"] == "cooperative"
    assert plan(600, 131072, 0, mode="backward", activation=activation, **H100)["backward"] == "passes"
    assert plan(256, 8192, 0, mode="backward", activation=activation, **H100)["backward"] == "slab"


def test_backward_with_an_unknown_activation():
    with pytest.raises(ValueError, match="activation"):
        plan(768, 8192, 0, mode="backward", activation="tanh", **H100)


def test_backward_with_an_fp32_dy_or_unaligned_data():
    """dy in fp32 (y's dtype under autocast) or an unaligned dy: the two passes, and neither one-pass
    kernel can be forced."""
    for kw in (dict(y_dtype=torch.float32), dict(aligned=False)):
        assert plan(256, 8192, 0, mode="backward", **kw, **H100)["backward"] == "passes"
        with cutlass_fused.overrides(backward="slab"), pytest.raises(RuntimeError, match="slab backward needs"):
            plan(256, 8192, 0, mode="backward", **kw, **H100)
        with cutlass_fused.overrides(backward="cooperative"), \
                pytest.raises(RuntimeError, match="cooperative backward needs"):
            plan(256, 8192, 0, mode="backward", **kw, **H100)


def test_eval_routes():
    # A 16-bit layer with an fp32 scale (autocast): h from the GEMM, y in one fp32 pass.
    assert plan(64, 64, 64, mode="eval", y_dtype=torch.float32, **H100)["eval_in_fp32"]
    assert not plan(64, 64, 64, mode="eval", **H100)["eval_in_fp32"]
    # The all-fp16 eval kernels round z = h * scale themselves: the fold keeps scale apart.
    assert plan(64, 64, 64, dtype=torch.float16, mode="eval", **H100)["fold_scale_apart"]
    assert not plan(64, 64, 64, dtype=torch.bfloat16, mode="eval", **H100)["fold_scale_apart"]
    # sm90 makes the fold in the eval epilogue up to two tiles a CTA (its latency is paid a tile),
    # the fold kernel past that, on sm80 and on the fp32 route.
    for m, n, k in [(128, 8192, 8192), (512, 8192, 8192), (1024, 8192, 8192), (3, 769, 1000)]:
        assert plan(m, n, k, mode="eval", **H100)["fold_in_epilogue"], (m, n, k)
    for m, n, k in [(16384, 4096, 4096), (4096, 4096, 4096)]:
        assert not plan(m, n, k, mode="eval", **H100)["fold_in_epilogue"], (m, n, k)
    assert not plan(128, 8192, 8192, mode="eval", family="sm80", **H100)["fold_in_epilogue"]
    # Where frozen_weights() keeps the fold, the kept fold costs no launch: the fold kernel's route.
    assert not plan(128, 8192, 8192, mode="eval", fold_kept=True, **H100)["fold_in_epilogue"]
    assert not plan(128, 8192, 8192, mode="eval", y_dtype=torch.float32, **H100)["fold_in_epilogue"]
    assert not plan(128, 8192, 8192, mode="train", **H100)["fold_in_epilogue"]


def test_matmul_has_its_own_gemm_only_for_sm90_3xtf32():
    f32 = dict(dtype=torch.float32, mode="matmul", **H100)
    assert plan(512, 512, 512, allow_tf32=False, **f32)["kernel"].startswith("sm90_f32x3_eval_")
    assert plan(512, 512, 512, allow_tf32=True, **f32)["kernel"] == ""
    assert plan(512, 512, 512, allow_tf32=False, family="sm80", **f32)["kernel"] == ""


def test_workspace_is_the_sums_then_the_batch_norm_scratch():
    # Training with the statistics GEMM: 2 x tiles x ld fp32 sums, rounded to 256 bytes, then the
    # tail's fp64 partials (2 x chunks x n) and one flag byte a column.
    m, n = 1024, 8192
    got = plan(m, n, 1024, **H100)
    sums = 2 * got["sum_tiles"] * got["sum_ld"] * got["sum_bytes"]
    chunks = -(-m // max(64, -(-m // 256) * 8))
    assert got["workspace"] == -(-sums // 256) * 256 + 2 * 8 * chunks * n + n
    assert plan(128, n, 1024, **H100)["workspace"] == 2 * 8 * 8 * n + n  # no sums; 8 chunks of 16 rows
    assert plan(m, n, 1024, mode="linear", **H100)["workspace"] == 2 * 8 * chunks * n
    assert plan(m, n, 1024, mode="eval", **H100)["workspace"] == 0
    assert plan(m, n, 0, mode="backward", **H100)["workspace"] == 2 * 8 * chunks * n + 2 * 8 * n


def test_a_forced_kernel_serves_only_its_own_problems():
    stats = "sm90_bf16_stats_128x128x64_c1x1x1"
    with cutlass_fused.overrides(kernel=stats):
        assert plan(4096, 8192, 1024, **H100)["kernel"] == stats
        assert plan(4096, 8192, 1024, mode="eval", **H100)["kernel"] == "sm90_bf16_eval_256x128x64_c1x2x1"
        assert plan(4096, 8192, 1024, dtype=torch.float16, **H100)["kernel"] != stats


def test_the_plan_names_rows_on_any_build():
    """The table's rows exist in a CPU build too (only their kernels are missing), so the plan can
    be asked about any GPU; built_kernels() lists the compiled ones."""
    name = plan(4096, 8192, 1024, mode="eval", **H100)["kernel"]
    assert name == "sm90_bf16_eval_256x128x64_c1x2x1"
    if torch.version.cuda is None:
        assert cutlass_fused.built_kernels() == []
    elif torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        assert name in cutlass_fused.built_kernels()


def test_fp8_math_and_rows():
    """The FP8 ops' GEMMs: promoted e4m3 rows by default, the fast-accumulate rows under
    Float8Recipe(fast_accum=True) ("e4m3_fast"), each mode its own; only the sm90 family, only
    training and eval, and the statistics GEMM whatever the grid (e4m3 has no eval kernel plus pass)."""
    for m, n, k in [(16384, 4096, 4096), (4096, 4096, 4096), (1024, 8192, 8192)]:
        train, fast = plan(m, n, k, fp8="e4m3", **H100), plan(m, n, k, fp8="e4m3_fast", **H100)
        assert (train["math"], train["kernel"]) == ("e4m3", "sm90_e4m3_stats_128x128x128_c1x1x1")
        assert (fast["math"], fast["kernel"]) == ("e4m3_fast", "sm90_e4m3_stats_128x256x128_c2x1x1_fastacc")
        assert train["stats_gemm"] and fast["stats_gemm"]
        assert plan(m, n, k, mode="eval", fp8="e4m3", **H100)["kernel"] == "sm90_e4m3_eval_128x128x128_c1x1x1"
        fast_eval = plan(m, n, k, mode="eval", fp8="e4m3_fast", **H100)
        assert fast_eval["kernel"] == "sm90_e4m3_eval_256x128x128_c1x2x1_fastacc"
    assert plan(2, 16, 32, fp8="e4m3_fast", **H100)["stats_gemm"]  # one CTA: still the statistics GEMM
    # A batch that 128x256 tiles leave under half the SMs: the fast rows' ping-pong 128x128 tile.
    small = plan(1000, 1000, 769, fp8="e4m3_fast", **H100)
    assert small["kernel"] == "sm90_e4m3_stats_128x128x128_c1x1x1_pingpong_fastacc"
    assert plan(1000, 1000, 769, fp8="e4m3", **H100)["kernel"] == "sm90_e4m3_stats_128x128x128_c1x1x1"
    with pytest.raises(RuntimeError, match="e4m3 operands need the sm90 family"):
        plan(1024, 1024, 1024, fp8="e4m3", family="sm80", **H100)
    with pytest.raises(RuntimeError, match="taken by the training and eval ops only"):
        plan(1024, 1024, 1024, mode="linear", fp8="e4m3_fast", **H100)
    with pytest.raises(ValueError, match="expected fp8 to be 'none', 'e4m3' or 'e4m3_fast', but got 'e5m2'"):
        plan(1024, 1024, 1024, fp8="e5m2", **H100)
    # A fast row forced where the recipe asks for promotion serves nothing: the plan keeps promotion.
    with cutlass_fused.overrides(kernel="sm90_e4m3_stats_128x256x128_c2x1x1_fastacc"):
        assert plan(4096, 4096, 4096, fp8="e4m3", **H100)["kernel"] == "sm90_e4m3_stats_128x128x128_c1x1x1"


@pytest.mark.parametrize("family", ["sm90", "sm80"])
def test_training_y_is_written_in_x_dtype_or_fp32_and_cast_to_any_other(family):
    """The training kernels write y in x's dtype or fp32; a y asked in another dtype is written in
    z's and cast (y_cast), the binding's only say being the cast the plan names."""
    for x, asked, cast in [(torch.bfloat16, None, False), (torch.bfloat16, torch.float32, False),
                           (torch.bfloat16, torch.float16, True), (torch.bfloat16, torch.float64, True),
                           (torch.float16, torch.float16, False), (torch.float32, torch.bfloat16, True),
                           (torch.float32, torch.float64, True)]:
        got = plan(1000, 769, 512, dtype=x, family=family, output_dtype=asked, **H100)
        assert got["y_cast"] == cast, (x, asked)
    # under autocast (an fp32 z of a 16-bit x) y in fp32 is the kernels' own
    assert not plan(1000, 769, 512, y_dtype=torch.float32, family=family, **H100)["y_cast"]


@pytest.mark.parametrize("family", ["sm90", "sm80"])
def test_eval_y_route_by_the_dtype_asked(family):
    """Eval's epilogue writes y in x's dtype where it is asked in it (y_in_x), except fp16 with an
    fp32 z, whose fold rounds z to fp16 only without one; a wider y of a 16-bit x is formed in fp32
    (eval_in_fp32), and fp16's fold keeps the scale apart exactly where it is not."""
    def route(x, z=None, asked=None):
        got = plan(1000, 769, 512, dtype=x, mode="eval", family=family, y_dtype=z, output_dtype=asked, **H100)
        return got["y_in_x"], got["eval_in_fp32"], got["fold_scale_apart"]

    assert route(torch.bfloat16) == (True, False, False)
    assert route(torch.float16) == (True, False, True)
    assert route(torch.float32) == (True, False, False)
    assert route(torch.bfloat16, torch.float32) == (False, True, False)  # autocast: y in fp32
    assert route(torch.bfloat16, torch.float32, torch.bfloat16) == (True, False, False)
    assert route(torch.float16, torch.float32, torch.float16) == (False, True, False)
    assert route(torch.bfloat16, asked=torch.float32) == (False, False, False)  # z's dtype, then a cast
    assert route(torch.bfloat16, torch.float32, torch.float64) == (False, True, False)


def test_eval_activation_leaves_the_epilogue_only_for_the_inf_fix():
    """The eval epilogue applies the activation, except on sm80's 3xTF32 (fp32 without TF32),
    whose infinity fix rewrites outputs after it."""
    for family in ("sm90", "sm80"):
        for dtype, tf32 in [(torch.bfloat16, False), (torch.float16, False), (torch.float32, True),
                            (torch.float32, False)]:
            got = plan(1000, 769, 512, dtype=dtype, mode="eval", family=family, allow_tf32=tf32,
                       activation="relu", **H100)
            assert got["act_in_epilogue"] == (not got["inf_fix"])
            assert got["inf_fix"] == (family == "sm80" and dtype == torch.float32 and not tf32)


def test_sixteen_byte_groups_need_aligned_data_and_whole_groups_of_columns():
    """The slab kernels read 16-byte groups: the binding says whether the data is aligned, and the
    plan asks n for whole groups (8 bf16 or 4 fp32 columns) itself."""
    assert plan(256, 8192, 0, mode="backward", **H100)["backward"] == "slab"
    assert plan(256, 8192 - 4, 0, mode="backward", **H100)["backward"] == "passes"  # 4 bf16 columns short
    assert plan(256, 8192, 1024, **H100)["tail"] == "slab"
    for kw in (dict(aligned=False), dict(n=8192 - 4)):
        got = plan(**{"m": 256, "n": 8192, "k": 1024, **kw}, **H100)
        assert (got["tail"], got["pieces"]) == ("cooperative", 0), kw


def test_e4m3_route():
    """The e4m3 route (cutlass_fused.fp8.e4m3_kernels asks it, the layer before taking the FP8
    ops): bf16 operands, the sm90 family (auto or forced) on compute 9.0, and a built sm90 e4m3
    row; never the sm80 family, another GPU, or other operands."""
    from cutlass_fused.ops import ops
    built = any(n.startswith("sm90_e4m3_") for n in ops.kernel_names())
    assert ops.e4m3_runs("auto", 90, torch.bfloat16) == built
    assert ops.e4m3_runs("sm90", 90, torch.bfloat16) == built
    for family, cc, dt in [("sm80", 90, torch.bfloat16), ("auto", 80, torch.bfloat16), ("auto", 89, torch.bfloat16),
                           ("auto", 100, torch.bfloat16), ("auto", 90, torch.float16), ("auto", 90, torch.float32),
                           ("sm90", 90, torch.float64)]:
        assert not ops.e4m3_runs(family, cc, dt), (family, cc, dt)
    with pytest.raises(ValueError, match="expected family to be 'auto', 'sm90' or 'sm80', but got 'sm70'"):
        ops.e4m3_runs("sm70", 90, torch.bfloat16)
