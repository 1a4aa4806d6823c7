"""The kernel table: every CUTLASS kernel we build is one row here.

A row is data, not code, so adding a tile/cluster/schedule variant for the
performance work is one line plus `python -m codegen.generate`. A row becomes
csrc/generated/<name>.cu, a few lines instantiating the class template of its
family and mode (csrc/kernels/gemm/<family>_<mode>.cuh: CUTLASS's builders, the
schedule and the launch) with the row's dtype (csrc/kernels/gemm/dtype.cuh), its
epilogue visitor tree (traced from codegen/epilogues.py into
csrc/generated/evt_<tree>.h: Kernel.epilogue, Kernel.tree), tile, cluster,
epilogue tile and schedule (sm80: tile, warp tile, stages), and a line of
csrc/generated/kernels.inc.

Fields
  family   "sm90" (TMA warp-specialized, sm90a) or "sm80" (mma.sync, runs on sm80+)
  dtype    "bf16", "f16", "tf32" (fp32 in/out, TF32 math), "f32x3" (fp32, 3xTF32 math:
           in-kernel on sm80; on sm90 TF32 math over split operands, with promotion),
           "e4m3" (FP8 operands, bf16 bias and h or y; sm90 only)
  mode     "eval"   y = (acc + b)*a + c, nothing else (fp16: h and z = h*s rounded
                    to fp16 on the way, as the unfused model rounds them; also the
                    sm80 training GEMM, followed by our column-statistics kernel)
           "stats"  sm90: A and B swapped: D' = W x^T (features x batch, stored
                    column-major, which is h row-major), h = acc + b, and per-CTA
                    partial sums of u = h - shift and u^2 per feature, laid out
                    (ceil(batch / tile_n), round_up(features, tile_m)): fp32
                    ("partial"), fp64 for f32x3 ("partial64"); tile is
                    (features, batch, K).
                    sm80: not swapped (tile (batch, features, K)); fp32 partial sums
                    of h and h^2 laid out (ceil(batch / tile_m), round_up(features, tile_m))
           "grad"   sm90, 16-bit: the dX GEMM of the Linear after a layer, swapped as "stats"
                    (D' = W2^T dz^T, g row-major), with that layer's BN-backward sums: g = dy
                    times the activation's derivative, per-CTA fp32 partial sums of g and
                    g (h - mean_h) laid out as "stats"' (csrc/kernels/gemm/sm90_grad.cuh)
  tile     CTA tile (M, N, K)
  cluster  sm90 cluster shape
  schedule sm90 kernel schedule: "TmaWarpSpecializedCooperative",
           "TmaWarpSpecializedPingpong" or, for e4m3, "TmaWarpSpecializedCooperativeFP8FastAccum"
           and "TmaWarpSpecializedPingpongFP8FastAccum"
           (csrc/kernels/gemm/sm90_kernel.cuh)
  warps    sm80 warp count (M, N, K)
  stages   sm80 mainloop stages (sm90 carves out what the epilogue leaves)
  epi_tile sm90 epilogue tile (M, N); None is EpilogueTileAuto
  promote  sm90 f32x3 and e4m3: MMAs (k = 8 each for TF32, 32 for e4m3) the tensor
           cores accumulate before the sum is added into the fp32 accumulator (a
           launch argument of the promoted mainloop; a multiple of a k-tile's MMAs);
           None: the mainloop's default (CUTLASS's 4 for e4m3)
"""
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Kernel:
    family: str
    dtype: str
    mode: str
    tile: tuple
    cluster: tuple = (1, 1, 1)
    schedule: str = "TmaWarpSpecializedCooperative"
    warps: tuple = (2, 2, 1)
    stages: int | None = None
    epi_tile: tuple | None = None
    promote: int | None = None
    # The row the plan starts from for its (family, math, mode): exactly one a group (generate
    # checks); the others are candidates that find_kernel's rules, kTunedKernels or the tuner take.
    # Not in the row's repr: the generated kernel's first line, which the flag does not change.
    default: bool = field(default=False, repr=False)

    @property
    def stats(self) -> str:
        """Where the kernel leaves its column statistics: partial, partial64 or none."""
        if self.mode not in ("stats", "grad"):
            return "none"
        return "partial64" if self.dtype == "f32x3" else "partial"

    @property
    def name(self) -> str:
        t = "x".join(map(str, self.tile))
        c = "x".join(map(str, self.cluster))
        tail = f"c{c}" if self.family == "sm90" else f"s{self.stages}"
        if "Pingpong" in self.schedule:
            tail += "_pingpong"
        if self.fast_accum:
            tail += "_fastacc"
        if self.promote:
            tail += f"_p{self.promote}"
        if self.epi_tile:
            tail += "_e" + "x".join(map(str, self.epi_tile))
        return f"{self.family}_{self.dtype}_{self.mode}_{t}_{tail}"

    @property
    def fast_accum(self) -> bool:
        """An FP8 schedule that accumulates in the tensor cores alone (no promotion)."""
        return self.schedule.endswith("FP8FastAccum")

    @property
    def math(self) -> str:
        """The GEMM's math as the plan names it (csrc/kernels/types.h, KernelDtype): the dtype, or
        e4m3_fast for an e4m3 row that accumulates in the tensor cores alone."""
        return "e4m3_fast" if self.fast_accum else self.dtype

    @property
    def epilogue(self) -> str:
        """The function of codegen/epilogues.py that its visitor tree is traced from."""
        if self.mode == "stats":
            return "stats" if self.family == "sm90" else "stats_unswapped"
        if self.mode == "grad":
            return "grad_sums"
        return "evaluate_rounded" if self.dtype == "f16" else "evaluate"

    @property
    def swapped(self) -> bool:
        """Whether the kernel computes W x^T (sm90 stats, grad: a feature is a row of its tile)."""
        return self.family == "sm90" and self.mode in ("stats", "grad")

    @property
    def tree_dtype(self) -> str:
        """The dtype its tree is traced for: e4m3's epilogue is bf16's (csrc/kernels/gemm/dtype.cuh),
        and eval's is fp32's ("f32") for TF32 and 3xTF32 alike (only their statistics differ: fp64
        tile sums for 3xTF32)."""
        dtype = {"e4m3": "bf16"}.get(self.dtype, self.dtype)
        return "f32" if self.mode == "eval" and dtype in ("tf32", "f32x3") else dtype

    @property
    def tree(self) -> str:
        """Its traced tree: csrc/generated/evt_<tree>.h, one a family, mode and tree_dtype."""
        return f"{self.family}_{self.mode}_{self.tree_dtype}"

    @property
    def header(self) -> str:
        """The class template its .cu instantiates (include path under csrc/)."""
        return f"kernels/gemm/{self.family}_{self.mode}.cuh"


# sm90: cooperative, cluster 1x2. CTA 128x256 was the best statistics-EVT tile
# measured (docs/decisions.md, "Kernel table"). TF32 halves the K tile
# so a stage costs the same shared memory as the 16-bit one.
#
# Training uses the "stats" kernels below (tile sums of the swapped GEMM, docs/decisions.md, "Statistics route").
# A row reduction of fp64 statistics in the unswapped eval GEMM (the former mode "train")
# measured slower than our ordered column pass over h at every large shape
# (docs/decisions.md, "Statistics route"), and is no longer generated.
_SM90 = [
    # 16-bit: 256x128, cluster 1x2 (cuBLAS's own choice here) measured best or level
    # at 1024x8192^2, 16384x4096^2 and 4096^3 (python -m cutlass_fused.tune; bf16 and f16:
    # docs/decisions.md, "Kernel table"); tf32 keeps the 128x256 tile, untuned.
    Kernel("sm90", "bf16", "eval", (256, 128, 64), (1, 2, 1), default=True),
    Kernel("sm90", "f16", "eval", (256, 128, 64), (1, 2, 1), default=True),
    Kernel("sm90", "tf32", "eval", (128, 256, 32), (1, 2, 1), default=True),
]

# Further bf16 candidates for python -m cutlass_fused.tune: the previous default, and its 2x1
# cluster.
_SM90 += [
    Kernel("sm90", "bf16", "eval", (128, 256, 64), cluster) for cluster in ((1, 2, 1), (2, 1, 1))
]

# The training GEMM with the statistics in its epilogue (mode "stats", swapped A
# and B): 128 features x 256 batch rows, cuBLAS's 256x128 turned around; the
# cluster pairs CTAs along the features, which share the x tile.
_SM90 += [Kernel("sm90", "bf16", "stats", (128, 256, 64), (2, 1, 1), default=True)]
# Further statistics candidates for the tuner: no cluster, the cluster along the
# batch (CTAs share the W tile), 256 features x 128 batch rows, and a 128x128
# tile that find_kernel takes for batches too small for 128x256 to fill the GPU.
# That one has no cluster: its 2x1 cluster was slower at 256 and 512 x 8192^2, and K tiles of
# 128 (3 stages) slower or level (docs/decisions.md, "Small batches").
_SM90 += [Kernel("sm90", "bf16", "stats", (128, 256, 64), c) for c in ((1, 1, 1), (1, 2, 1))]
_SM90 += [Kernel("sm90", "bf16", "stats", (256, 128, 64), c) for c in ((2, 1, 1), (1, 2, 1))]
_SM90 += [Kernel("sm90", "bf16", "stats", (128, 128, 64), (1, 1, 1))]
# TF32 (fp32 allowed to use TF32): the tf32 eval tile turned around. Its fp32
# tile sums are far more precise than TF32's own error; fp32 without TF32
# (f32x3, below) needs fp64 tile sums to match PyTorch's fp32 statistics.
# (Its cluster along the batch, as f32x3 takes below, was faster at 1024x8192^2 only, slower at
# 16384x4096^2 and 4096^3: not kept; docs/decisions.md, "Kernel table".)
_SM90 += [Kernel("sm90", "tf32", "stats", (128, 256, 32), (2, 1, 1), default=True)]

# fp16: bf16's default statistics tile and its small-batch one. Its tile sums are of the rounded
# fp16 h, as bf16's are; where h overflows they are infinite, and where z = h * scale could
# overflow (the tail bounds every |z| by sqrt(sum h^2) |scale|) the column takes the exact pass,
# which emulates that overflow (csrc/kernels/bn_train.cu, gemm_sums_trusted).
_SM90 += [Kernel("sm90", "f16", "stats", (128, 256, 64), (2, 1, 1), default=True),
          Kernel("sm90", "f16", "stats", (128, 128, 64), (1, 1, 1))]
# fp16 tuner candidates: the statistics tile without a cluster (plan.cpp's kTunedKernels
# takes it at 1024 x 8192^2), bf16's 256x128 statistics tile, and the previous eval default.
_SM90 += [Kernel("sm90", "f16", "stats", (128, 256, 64), (1, 1, 1)),
          Kernel("sm90", "f16", "stats", (256, 128, 64), (1, 2, 1)),
          Kernel("sm90", "f16", "eval", (128, 256, 64), (1, 2, 1))]

# Smaller 16-bit tiles for problems too small to fill the GPU with the default's
# tiles (batch <= 256 at 8192 features: 64 CTAs of 256x128 on 132 SMs).
# find_kernel switches to them by tile count (csrc/kernels/plan.cpp).
_SM90 += [Kernel("sm90", dt, "eval", tile, (1, 2, 1))
          for dt in ("bf16", "f16") for tile in ((128, 128, 64), (128, 64, 64))]
# At 256 rows of 8192 -> 8192 the pair of CTAs along the batch shares W's tile (the operand
# that streams from memory there) instead of x's, faster than c1x2 there (plan.cpp's
# kTunedKernels). It lost at 128, 384 and 512 rows and at 256 x 4096^2,
# and a 1x4 cluster of 128x64 tiles lost everywhere (docs/decisions.md, "Kernel table").
_SM90 += [Kernel("sm90", "bf16", "eval", (128, 128, 64), (2, 1, 1))]
# 128x256 without a cluster: kTunedKernels takes it for bf16 eval at 512 rows of 8192^2
# (plan.cpp). 256x128 without one was level at 512 rows (docs/decisions.md, "Tuned exceptions").
_SM90 += [Kernel("sm90", "bf16", "eval", (128, 256, 64), (1, 1, 1))]
# 192-wide tiles, as cuBLAS runs at 384 and 768 rows of 8192^2 (nvjet 128x192): where the
# 256-wide tiles leave a quarter padding or a partial wave, find_kernel's rule takes them
# (csrc/kernels/plan.cpp, slot_use). Statistics: 128 features x 192 batch rows; eval: 128 batch
# rows x 192 features (a wgmma N of 192; an M of 192 would not split over the cooperative
# schedule's two warp groups). Without a cluster: with one (stats 2x1, eval 1x2) they ran slower
# at the six shapes tried (docs/decisions.md, "Kernel table"). fp16 takes them where bf16 does,
# faster than the 256-wide rows (docs/decisions.md, "Small batches").
_SM90 += [Kernel("sm90", dt, mode, (128, 192, 64), (1, 1, 1)) for dt in ("bf16", "f16") for mode in ("stats", "eval")]

# sm90 fp32 without TF32: the TF32 kernel run over operands split for 3xTF32
# (the binding splits them, K tripled) with accumulator promotion
# (csrc/kernels/promoted_mainloop.h). Promotion keeps a second accumulator, so
# the CTA tile is halved to 128x128 to stay within the register budget. A train
# kernel (fp64 statistics in a row reduction) spilled and ran slower than the eval
# kernel plus a separate column-statistics pass (docs/decisions.md, "fp32 on sm90").
_SM90 += [Kernel("sm90", "f32x3", "eval", (128, 128, 32), (1, 2, 1), promote=p, default=p == 8) for p in (8, 4)]
# Tuned (docs/decisions.md, "fp32 on sm90"): clusters 2x1, 1x1 and 2x2
# were level with 1x2 or slower, tiles 128x192 and ping-pong 64x128 slower.
# A 64-deep fp32 K tile (128 KiB of operands a stage) leaves no room for
# two stages. Promoting every 8 MMAs instead of 4 ran the GEMM faster at
# 16384x4096^2 (level at 1024x8192^2). With the small products first along K
# (csrc/kernels/tf32x3.h) its error is under SGEMM's at K = 48 to 16384, where
# promoting every 4 exceeds it at some K (docs/decisions.md, "fp32 on sm90"); 4 stays as a candidate.
# Its training GEMM with the statistics in the epilogue (mode "stats", swapped
# operands: the eval tile turned around). Its tile sums are fp64 (a column
# reduction keeps two rows a thread, which the row reduction above could not
# afford), as exact as our fp64 pass over h, so only non-finite columns take
# that pass. The cluster pairs CTAs along the batch, which share the W tile:
# faster than the pair sharing the x tile (kept as a candidate) or no cluster
# (benchmarks/kernels.py stats_ab; docs/decisions.md, "fp32 on sm90").
_SM90 += [Kernel("sm90", "f32x3", "stats", (128, 128, 32), c, promote=8, default=c == (1, 2, 1))
          for c in ((1, 2, 1), (2, 1, 1))]

# FP8 (issue 33): the training GEMM over e4m3 x and W. The promoted mainloop keeps a second
# accumulator: a compile probe (docs/decisions.md, "FP8 (issue 33)") saw it spill at 128x256 cooperative and
# at 128x128 ping-pong, not at 128x128 cooperative, the default here. K tiles of 128 bytes, as
# bf16's 64. Neither a cluster (2x1 or 1x2) nor a longer promotion interval (promote=8 or 16 MMAs
# against CUTLASS's 4) moved the 128x128 row's GEMM (benchmarks/kernels.py fp8_rows;
# docs/decisions.md, "The e4m3 row's candidates (run on an H100)"), so the table keeps none of them.
_SM90 += [Kernel("sm90", "e4m3", "stats", (128, 128, 128), (1, 1, 1), default=True)]
# Float8Recipe(fast_accum=True): the forward's GEMMs accumulate in the tensor cores alone (math
# "e4m3_fast"), as torchao's and TransformerEngine's forward GEMMs do by default. bf16's statistics
# tile and cluster; the ping-pong 128x128 row is its small-batch tile (find_kernel takes it where
# 128x256 fills fewer than half the SMs), both faster than the promoted row
# (benchmarks/kernels.py fp8_rows).
# Not kept: promoted ping-pong 64x128 and 128x64, slower still
# (docs/decisions.md, "Fast accumulation (run on an H100)").
_SM90 += [Kernel("sm90", "e4m3", "stats", (128, 256, 128), (2, 1, 1), "TmaWarpSpecializedCooperativeFP8FastAccum",
                 default=True),
          Kernel("sm90", "e4m3", "stats", (128, 128, 128), (1, 1, 1), "TmaWarpSpecializedPingpongFP8FastAccum")]
# Its eval GEMM (inference over e4m3 x and W, the fold in the epilogue): the statistics row's tile and
# promoted mainloop, the eval epilogue (bf16 bias and y, fp32 fold vectors); with fast accumulation,
# bf16 eval's 256x128 tile and 1x2 cluster (the fast statistics row turned around), faster than the
# promoted 128x128 (docs/decisions.md, "Fast accumulation (run on an H100)").
_SM90 += [Kernel("sm90", "e4m3", "eval", (128, 128, 128), (1, 1, 1), default=True),
          Kernel("sm90", "e4m3", "eval", (256, 128, 128), (1, 2, 1), "TmaWarpSpecializedCooperativeFP8FastAccum",
                 default=True)]

# The BN backward's sums in the next Linear's dX GEMM (issue 71; mode "grad"): the 16-bit statistics
# tile, 128 features x 256 batch rows, without a cluster (as the statistics rows at 1024 x 8192^2),
# faster than the pair along the features (sharing dz's tile), kept as a bf16 candidate, and than
# 256x128 tiles; 128x128 for batches too small for 128x256 to fill half the GPU. A second read of h
# from global memory (CUTLASS's Stages = 0 aux load) and h as the C operand with a 128x16 epilogue
# tile ran the GEMM slower (docs/decisions.md, "Backward").
_SM90 += [Kernel("sm90", dt, "grad", tile, (1, 1, 1), default=tile == (128, 256, 64))
          for dt in ("bf16", "f16") for tile in ((128, 256, 64), (128, 128, 64))]
_SM90 += [Kernel("sm90", "bf16", "grad", (128, 256, 64), (2, 1, 1))]

# sm80: the tile cutlass_cppgen picks by default for bf16 (256x128x64, 4 warps
# of 64x64, 3 stages), known to run correctly on Hopper too. fp32 kernels use
# K=32 for the same shared-memory budget.
_SM80 = [
    Kernel("sm80", dt, "eval",
           (256, 128, 32 if dt in ("tf32", "f32x3") else 64),
           warps=(4, 2, 1), stages=3, default=True)
    for dt in ("bf16", "f16", "tf32", "f32x3")
]
# sm80's training GEMM with the statistics in its epilogue (issue 32): the eval tile and
# mainloop, not swapped, fp32 per-CTA sums of h and h^2 from a row reduction that stores each
# CTA's partials (csrc/kernels/gemm/sm80_stats.cuh), for the dtypes whose sums are fp32 (bf16,
# fp16, TF32; 3xTF32 would need fp64 partials, and keeps the column pass).
_SM80 += [Kernel("sm80", dt, "stats", (256, 128, 32 if dt == "tf32" else 64), warps=(4, 2, 1), stages=3,
                 default=True) for dt in ("bf16", "f16", "tf32")]

KERNELS = _SM90 + _SM80
