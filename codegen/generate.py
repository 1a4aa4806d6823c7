"""Emit csrc/generated from codegen/kernels.py with cutlass_cppgen (nvidia-cutlass 4.2).

    python -m codegen.generate            # (re)write csrc/generated
    python -m codegen.generate --check    # exit 1 if csrc/generated is stale

The generated sources are committed, so building the extension needs only the
CUTLASS headers, not cutlass_cppgen; CI runs --check to keep them honest.

What it writes: kernels.inc, the registry (an X-macro over the rows); per group
of rows (Kernel.group: family, mode, schedule, and dtype but where Kernel.generic)
a header <group>.cuh with the kernel's types once, as a class template `Gemm` on
what varies between the group's rows (sm90: CTA tile, cluster, epilogue tile, and
the element type where generic; sm80: threadblock tile, warp tile, stages, and
the element type where generic), and its fusion_args (the EVT's arguments, built
from the traced epilogue's DAG); per
row a small <name>.cu (the name CMake globs) that instantiates it, names the
kernel type after the row and specialises kernel_entry<KernelId::name>. The
header is emitted from the group's first row; every row must give the same text
once its tile, cluster and epilogue tile are made parameters, and, in a generic
group, its own emission must equal the template with its element type put back
(instantiate), so that a row that differs in anything else fails here instead of
compiling as another row's kernel.

cutlass_cppgen emits the kernel's type definitions; we write the host side
(csrc/kernels/*_launch.cuh) and patch the emitted text in six documented ways,
each asserted to match exactly so that a new cutlass_cppgen cannot silently
change what we build (Z is the traced epilogue's output; train kernels run
with a null `a`, so there Z = h = x W^T + b):
  1. statistics in fp64 of Z as stored: the node forming Z rounds its sum to
     the output dtype (cutlass_fused::plus_rounded_to_*), so the statistics
     describe exactly the values the finalize normalizes, as in PyTorch where
     BN sees the rounded tensor; the two row reductions, the square, and the
     topological DAG (which stores every intermediate as Array<ElementCompute>,
     so a float there would round Z^2 to fp32 before the fp64 sum) get
     ElementCompute = double,
  2. D = take_last(Zsq, 0, Z) instead of multiply_add(Zsq, 0, Z), so D is Z
     exactly and an fp32 overflow of Z*Z can never turn D into 0*inf = NaN,
  3. sm90: the collective gets Kernel.epi_tile where set, and
     EpilogueDescriptor gets the CTA tile; cutlass_cppgen passes the
     cluster tile (measured harmless to patch, and it matches the collective),
  4. sm90 train: the reductions become non-final (`plus`, FinalReduction =
     false): each CTA writes its tile's fp64 column partials and our own kernel
     sums them in a fixed order. CUTLASS's atomic path cannot zero an fp64
     output (fill_workspace static-asserts on 8-byte types), and this path is
     deterministic and leaves room for a cross-rank all-reduce (SyncBN),
  5. sm90 f32x3: the mainloop becomes cutlass_fused::PromotedMainloop (see
     csrc/kernels/promoted_mainloop.h),
  6. f32x3 stats: the column reductions, u = h - shift, u^2 and the DAG get
     ElementCompute = double, so the per-CTA partials (which a non-final
     reduction writes in its compute type) are fp64 sums of an fp32 h.
"""
import argparse
import difflib
import os
import re
import sys
import tempfile
from pathlib import Path

from codegen import epilogues
from codegen.kernels import KERNELS, Kernel

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "csrc" / "generated"
_DTYPES = {"bf16": "bf16", "f16": "f16", "tf32": "f32", "f32x3": "f32"}


def _cutlass():
    # Importing cutlass_cppgen writes compiled_cache.db into the cwd.
    os.chdir(tempfile.mkdtemp(prefix="cutlass_fused_gen_"))
    import cutlass_cppgen
    cutlass_cppgen._nvcc_version = cutlass_cppgen.nvcc_version()
    return cutlass_cppgen


def _emit(cg, k: Kernel) -> tuple[str, list[str], object]:
    from cutlass_library import DataType, KernelScheduleType, EpilogueScheduleType, LayoutType
    cc = 90 if k.family == "sm90" else 80
    # A cached registry per cc: building one costs ~20 s for cc 80.
    cg._option_registry = _REGISTRIES.setdefault(cc, cg.OptionRegistry(cc))
    el = getattr(DataType, _DTYPES[k.dtype])
    f32 = DataType.f32
    swapped = k.mode == "stats"  # D' = W x^T, column-major: h's memory
    out_layout = LayoutType.ColumnMajor if swapped else LayoutType.RowMajor
    plan = cg.op.Gemm(element=el, layout_A=LayoutType.RowMajor, layout_B=LayoutType.ColumnMajor,
                      layout_C=out_layout, element_accumulator=f32,
                      element_C=el, element_D=el, cc=cc, kernel_cc=cc)
    if k.dtype == "f32x3" and k.family == "sm80":
        plan.math_operation = cg.MathOperation.multiply_add_fast_f32
    M, N = 256, 512
    T = cg.Tensor
    ex = {"accum": T(element=f32, shape=(M, N), layout_tag=LayoutType.RowMajor),
          # The linear bias in the input dtype, as the layer holds it: no cast per call.
          "b": T(element=el, shape=(1, N), layout_tag=LayoutType.RowMajor),
          "a": T(element=f32, shape=(1, N), layout_tag=LayoutType.RowMajor),
          "c": T(element=f32, shape=(1, N), layout_tag=LayoutType.RowMajor),
          "D": T(element=el, shape=(M, N), layout_tag=LayoutType.RowMajor)}
    if swapped:
        fn = epilogues.stats
        col = {"shape": (N, 1), "layout_tag": LayoutType.ColumnMajor}
        ex = {"accum": T(element=f32, shape=(N, M), layout_tag=out_layout),
              "b": T(element=el, **col), "shift": T(element=f32, **col),
              "u_sum": T(element=f32, **col), "u_sumsq": T(element=f32, **col),
              "D": T(element=el, shape=(N, M), layout_tag=out_layout)}
    elif k.mode.startswith("train"):
        fn = epilogues.train
        for s in ("col_sum", "col_sumsq"):
            ex[s] = T(element=DataType.f64, shape=(1, N), layout_tag=LayoutType.RowMajor)
    elif k.dtype == "f16":
        fn = epilogues.evaluate_rounded
        ex["s"] = T(element=f32, shape=(1, N), layout_tag=LayoutType.RowMajor)
    else:
        fn = epilogues.evaluate
    if k.family == "sm90":
        plan.tile_description = {
            "threadblock_shape": [t * c for t, c in zip(k.tile, k.cluster)],
            "cluster_shape": list(k.cluster),
            "kernel_schedule": getattr(KernelScheduleType, k.schedule),
            # Ping-pong's epilogue schedule is the plain warp-specialized one.
            "epilogue_schedule": getattr(EpilogueScheduleType, k.schedule.replace("Pingpong", "")),
        }
    else:
        plan.tile_description = {"threadblock_shape": list(k.tile), "warp_count": list(k.warps),
                                 "stages": k.stages}
    plan.epilogue_visitor = cg.epilogue.trace(fn, ex, cc=cc)
    op = plan.construct()
    return op.rt_module.emit(), list(op.rt_module.emitter.includes), op.epilogue_functor.graph


_REGISTRIES: dict = {}


def _sub(pattern, repl, text, count, what):
    new, n = re.subn(pattern, repl, text)
    if n != count:
        raise SystemExit(f"generate: patch '{what}' matched {n} times, expected {count}; "
                         "cutlass_cppgen output changed, review codegen/generate.py")
    return new


def _patch(k: Kernel, src: str) -> str:
    """Apply the documented patches."""
    if k.mode.startswith("train"):
        red = "Sm90RowReduction" if k.family == "sm90" else "VisitorRowReduction"
        src = _sub(rf"(using ColSum(?:sq)? = cutlass::epilogue::\w+::{red}<[^;]*?double,\s*)float,",
                   r"\1double,", src, 2, "fp64 reduction compute")
        # The square: the two compute nodes defined between ColSum's EVT and ColSumsq.
        head, mid, tail = re.split(r"(using EVTColSum = [^;]*;)", src)
        body, rest = tail.split("using ColSumsq", 1)
        body = _sub(r"(Compute<\s*cutlass::(?:plus|multiplies)), float, float,",
                    r"\1, double, double,", body, 2, "fp64 square")
        src = head + mid + body + "using ColSumsq" + rest
        src = _sub(r"cutlass::multiply_add,", "cutlass_fused::take_last,", src, 1, "D = Z")
        src = _sub(r"(TopologicalVisitor<\s*)float,", r"\1double,", src, 1, "fp64 DAG intermediates")
        z_evt = re.search(r"using EVTColSum = \S+<\s*ColSum,\s*(\w+)>;", src).group(1)
        z_node = re.search(rf"using {z_evt} = \S+<\s*(\w+),", src).group(1)
        if k.dtype in ("bf16", "f16"):
            src = _sub(rf"(using {z_node} = \S+<\s*)cutlass::plus,", rf"\1cutlass_fused::plus_rounded_to_{k.dtype},",
                       src, 1, "Z rounded to the output dtype")
        if k.family == "sm90":
            src = _sub(r"cutlass::atomic_add,", "cutlass::plus,", src, 2, "non-atomic partials")
            src = _sub(r"(using ColSum(?:sq)? = cutlass::epilogue::fusion::Sm90RowReduction<[^;]*?"
                       r"cute::Stride<cute::Int<0>, cute::Int<1>, cute::Int<0>>)\s*>;",
                       r"\1,\n    2 /* Alignment */, true /* EnableNullptr */, false /* FinalReduction */\n>;",
                       src, 2, "non-final reduction")
    if k.mode == "stats":
        src = _sub(r"cutlass::atomic_add, 0,", "cutlass::plus, 0,", src, 2, "non-atomic partials")
        src = _sub(r"(using USum(?:sq)? = cutlass::epilogue::fusion::Sm90ColReduction<[^;]*?"
                   r"cute::Stride<cute::Int<1>, cute::Int<0>, cute::Int<0>>)\s*>;",
                   r"\1,\n    4 /* Alignment */, true /* EnableNullptr */, false /* FinalReduction */\n>;",
                   src, 2, "non-final column reduction")  # OOB checks stay: rows past the batch would add b
        src = _sub(r"cutlass::multiply_add,", "cutlass_fused::take_last,", src, 1, "D = H")
        if k.dtype == "f32x3":
            # fp64 tile sums (patch 6): u = h - shift, u^2, the reductions' compute type (which
            # a non-final reduction also writes) and the DAG's intermediates, so that the
            # sums of an fp32 h are as exact as our fp64 pass over it.
            src = _sub(r"(using USum(?:sq)? = cutlass::epilogue::fusion::Sm90ColReduction<[^;]*?EpilogueDescriptor::"
                       r"TileShape, float,\s*)float,", r"\1double,", src, 2, "fp64 tile sums")
            head, tail = src.split("using USum =", 1)
            head = _sub(r"(Compute<\s*cutlass::minus), float, float,", r"\1, double, double,", head, 1, "fp64 u")
            body, rest = tail.split("using USumsq", 1)
            body = _sub(r"(Compute<\s*cutlass::(?:plus|multiplies)), float, float,", r"\1, double, double,", body, 2,
                        "fp64 u^2")
            src = head + "using USum =" + body + "using USumsq" + rest
            src = _sub(r"(TopologicalVisitor<\s*)float,", r"\1double,", src, 1, "fp64 DAG intermediates")
        # H rounded to the output dtype before the sums: the statistics are of the h that is
        # stored, as the exact pass over h computes them.
        if k.dtype in ("bf16", "f16"):
            h_node = re.search(r"using \w+ = \S+EVT<\s*(\w+),\s*Accum,\s*B>;", src).group(1)
            src = _sub(rf"(using {h_node} = \S+<\s*)cutlass::plus,", rf"\1cutlass_fused::plus_rounded_to_{k.dtype},",
                       src, 1, "H rounded to the output dtype")
    if k.mode == "eval" and k.dtype == "f16":
        # h and z = h * scale rounded to fp16 (epilogues.evaluate_rounded).
        h_node = re.search(r"using \w+ = \S+EVT<\s*(\w+),\s*Accum,\s*B>;", src).group(1)
        src = _sub(rf"(using {h_node} = \S+<\s*)cutlass::plus,", r"\1cutlass_fused::plus_rounded_to_f16,",
                   src, 1, "H rounded to fp16")
        z_node = re.search(rf"using \w+ = \S+EVT<\s*(\w+),\s*\w+,\s*S>;", src).group(1)
        src = _sub(rf"(using {z_node} = \S+<\s*)cutlass::multiplies,", r"\1cutlass_fused::multiplies_rounded_to_f16,",
                   src, 1, "Z rounded to fp16")
    if k.epi_tile:
        shape = ", ".join(f"cute::_{t}" for t in k.epi_tile)
        src = _sub(r"(cute::Shape<cute::_\d+,cute::_\d+,cute::_\d+>,\s*)cutlass::epilogue::collective::EpilogueTileAuto",
                   rf"\1cute::Shape<{shape}>", src, 1, "epilogue tile")
    if k.family == "sm90" and k.dtype == "f32x3":
        src = _sub(r"(using CollectiveMainloop =\s*)(typename cutlass::gemm::collective::CollectiveBuilder<[^;]*>::CollectiveOp);",
                   r"\1cutlass_fused::PromotedMainloop<\2>;", src, 1, "promoted mainloop")
    if k.family == "sm90":
        big = ", ".join(f"_{t * c}" for t, c in zip(k.tile, k.cluster))
        cta = ", ".join(f"_{t}" for t in k.tile)
        src = _sub(rf"EpilogueDescriptor<\s*cute::Shape<{big}>", f"EpilogueDescriptor<\n  cute::Shape<{cta}>",
                   src, 1, "CTA epilogue tile")
    return src


# Arguments of the traced epilogues' tensors, by the names codegen/epilogues.py gives them.
_TENSORS = {
    "a": "{p.a, 1.f}", "c": "{p.c}", "s": "{p.s, 1.f}",   # row broadcasts; nullptr reads 1 (a, s) or 0
    "b": "{static_cast<ElementOut const*>(p.b)}",   # the bias, in the input dtype
    "col_sum": "{p.col_sum}", "col_sumsq": "{p.col_sumsq}",
    "shift": "{p.shift}", "u_sum": "{p.u_sum}", "u_sumsq": "{p.u_sumsq}",  # stats kernels; null shift reads 0
    "D": "{static_cast<ElementOut*>(p.out), {p.ldo, cute::_1{}, cute::_0{}}}",  # sm80 stores D in the EVT
}
_CTYPE = {"bf16": "cutlass::bfloat16_t", "f16": "cutlass::half_t", "tf32": "float", "f32x3": "float"}
_BITS = {"bf16": 16, "f16": 16, "tf32": 32, "f32x3": 32}


def fusion_args(graph, k: Kernel) -> str:
    """The EVT's Arguments as a brace initialiser, from the traced epilogue's DAG (the IR that
    cutlass_cppgen emits the visitor types from, walked as its emitter walks it).

    A node with inputs is an Sm*EVT<Node, Children...>, which takes {children..., node}; a
    topological visitor takes its ops' arguments in its subgraph's order, an op that stands
    for an outer node (disabled in the subgraph) taking that node's. Compute nodes, the
    accumulator and scalar immediates take `{}` (value-initialised: our 0.0 literals are zeros).
    """
    from cutlass_cppgen.backend.evt.ir import ComputeNode, TopoVisitorNode

    def leaf(meta):
        if meta.name in _TENSORS:
            return _TENSORS[meta.name].replace("ElementOut", "Element" if k.generic else _CTYPE[k.dtype])
        impl = type(meta.underlying_impl).__name__
        if isinstance(meta, ComputeNode) or impl.endswith(("AccumulatorImpl", "ScalarBroadcastImpl")):
            return "{}"
        raise SystemExit(f"generate: no arguments known for EVT node {meta.name} ({impl})")

    def args(n):
        meta = graph.get_node_meta(n)
        if isinstance(meta, TopoVisitorNode):
            sub = meta.subgraph
            return "{ " + ", ".join(args(s) if sub.get_node_meta(s).disabled else leaf(sub.get_node_meta(s))
                                    for s in sub.nodes_topological_order()[:-1]) + " }"
        if graph.in_degree(n) > 0:
            return "{ " + ", ".join([args(c) for c in graph.get_all_inputs(n)] + [leaf(meta)]) + " }"
        return leaf(meta)
    # The visitor the collective runs: sm90 stores D itself (the visitor is D's input), sm80's
    # visitor ends in D's store.
    root = graph.get_all_inputs("D")[0] if k.family == "sm90" else graph.nodes_topological_order()[-1]
    return args(root)


def _template(k: Kernel, src: str) -> tuple[str, list[str]]:
    """A row's patched types as the body of its group's class template.

    Returns the body and the row's template arguments: its tile, cluster and
    epilogue tile (sm80: tile, warp tile, stages) become the template's
    parameters, and cutlass_cppgen's kernel (named after the tile) becomes
    GemmKernel; its named type, which profiles show, is the row's own
    (render). Each replacement is counted, as the patches are.
    """
    op = re.search(r"struct (\w+)_type :", src).group(1)
    src = _sub(rf"// Gemm operator {op}\n", "", src, 1, "template: kernel name comment")
    src = _sub(rf"\n// Define named type\nstruct {op}_type :\s*public {op}_base {{ }};\n", "", src, 1,
               "template: named kernel type")
    src = _sub(rf"\b{op}_base\b", "GemmKernel", src, 1, "template: kernel name")
    if k.family == "sm90":
        # A using-directive cannot stand in a class; the header puts it in the namespace.
        src = _sub(r"using namespace cute;\n", "", src, 1, "template: using namespace cute")
        tile = "cute::Shape<" + ", ".join(f"cute::_{t}" for t in k.tile) + ">"
        cluster = "cute::Shape<" + ",".join(f"cute::_{c}" for c in k.cluster) + ">"
        epi = ("cute::Shape<" + ", ".join(f"cute::_{t}" for t in k.epi_tile) + ">" if k.epi_tile
               else "cutlass::epilogue::collective::EpilogueTileAuto")
        src = _sub(re.escape(tile), "TileShape", src, 2, "template: tile (collectives)")
        # The EpilogueDescriptor's tile as patch 3 writes it (`using namespace cute` spelling).
        cta = "cute::Shape<" + ", ".join(f"_{t}" for t in k.tile) + ">"
        src = _sub(rf"(EpilogueDescriptor<\s*){re.escape(cta)}", r"\1TileShape", src, 1,
                   "template: tile (EpilogueDescriptor)")
        src = _sub(re.escape(cluster), "ClusterShape", src, 2, "template: cluster")
        # Only the collective's epilogue tile: the descriptor keeps its EpilogueTileAuto (patch 3 leaves it).
        src = _sub(rf"(ClusterShape,\s*){re.escape(epi)}", r"\1EpilogueTile", src, 1, "template: epilogue tile")
        return src, [tile, cluster.replace(",", ", "), epi]
    tile = "cutlass::gemm::GemmShape<" + ", ".join(map(str, k.tile)) + ">"
    warp = "cutlass::gemm::GemmShape<" + ", ".join(str(t // w) for t, w in zip(k.tile, k.warps)) + ">"
    src = _sub(re.escape(tile), "ThreadblockShape", src, 2, "template: threadblock tile")
    src = _sub(re.escape(warp), "WarpShape", src, 2, "template: warp tile")
    src = _sub(rf"(GemmIdentityThreadblockSwizzle<1>,\s*){k.stages},", r"\1Stages,", src, 1, "template: stages")
    return src, [tile, warp, str(k.stages)]


_PARAMS = {"sm90": "class TileShape, class ClusterShape, class EpilogueTile",
           "sm80": "class ThreadblockShape, class WarpShape, int Stages"}
_STORED_PLUS = "cutlass_fused::stored<Element>::template plus"


def _generic(k: Kernel, body: str) -> str:
    """A 16-bit row's template body made generic in the element type (Kernel.generic): its
    element type becomes Element, the builders' alignment (elements a 16-byte access)
    Alignment, and the node that rounds the stored output to it (patch 1) the rounding that
    Element's output takes (cutlass_fused::stored: none for fp32). The 16-bit type's name
    appears nowhere else; instantiate() checks every row of the group against the result."""
    if _BITS[k.dtype] != 16:
        raise SystemExit(f"generate: group {k.group} is emitted from its first row, {k.name}, which must have a "
                         "16-bit element type (its name marks the element's places)")
    body = _sub(re.escape(f"cutlass_fused::plus_rounded_to_{k.dtype}"), _STORED_PLUS, body,
                1 if k.mode == "stats" else 0, "template: rounding to the element type")
    if k.family == "sm90":
        body = _sub(re.escape(_CTYPE[k.dtype]), "Element", body, 8, "template: element type")
        return _sub(r"((?:StrideC|StrideD|RowMajor|ColumnMajor), )8,", r"\1Alignment,", body, 4, "template: alignment")
    body = _sub(re.escape(_CTYPE[k.dtype]), "Element", body, 7, "template: element type")
    body = _sub(r"((?:kNone|RowMajor), )8,", r"\1Alignment,", body, 3, "template: alignment (operands)")
    body = _sub(r"(OutputTileThreadLayout<\s*ThreadblockShape,\s*WarpShape,\s*Element,\s*)8,", r"\1Alignment,", body, 1,
                "template: alignment (epilogue)")
    return _sub(re.escape("cutlass::gemm::GemmShape<16, 8, 16>"), "InstructionShape", body, 1,
                "template: MMA instruction shape")


def instantiate(body: str, k: Kernel) -> str:
    """A generic template body with row k's element type put in, as its own emission spells it."""
    op = f"cutlass_fused::plus_rounded_to_{k.dtype}" if _BITS[k.dtype] == 16 else "cutlass::plus"
    body = body.replace(_STORED_PLUS, op)
    body = re.sub(r"(?<=[ \n])Alignment(?=,)", str(128 // _BITS[k.dtype]), body)
    body = re.sub(r"\bInstructionShape\b", f"cutlass::gemm::GemmShape<16, 8, {256 // _BITS[k.dtype]}>", body)
    return re.sub(r"\bElement\b", _CTYPE[k.dtype], body)


def header(k: Kernel, graph, body: str, includes: list[str]) -> str:
    """The group's header from row k's patched types and their template body: the
    same text for every row of the group (expected() checks)."""
    inc = "\n".join(f"#include \"{i}\"" for i in includes)
    promoted = "\n#include \"kernels/promoted_mainloop.h\"" if k.family == "sm90" and k.dtype == "f32x3" else ""
    cute = "using namespace cute;\n\n" if k.family == "sm90" else ""
    params = ("class Element, " if k.generic else "") + _PARAMS[k.family]
    element = ("// Elements a 16-byte access: the builders' alignment of A, B and D.\n"
               "static constexpr int Alignment = 128 / cutlass::sizeof_bits<Element>::value;\n" if k.generic else "")
    if k.generic and k.family == "sm80":  # mma.sync: k = 16 for 16-bit operands, 8 for TF32
        element += ("using InstructionShape = cutlass::gemm::GemmShape<16, 8, 256 / "
                    "cutlass::sizeof_bits<Element>::value>;\n")
    element += "\n" if element else ""
    return f"""\
// Generated by `python -m codegen.generate` from codegen/kernels.py. Do not edit.
// The kernel types of the rows of group {k.group}, templated on what varies between them;
// each row's csrc/generated/<name>.cu instantiates Gemm with its own.
#pragma once
{inc}
#include "kernels/{k.family}_launch.cuh"{promoted}

namespace cutlass_fused::gen::{k.group} {{
{cute}template <{params}>
struct Gemm {{
{element}{body.strip()}

static {k.family}::Fusion<GemmKernel> fusion_args(GemmEvtArgs const& p) {{
  return {fusion_args(graph, k)};
}}
}};
}}  // namespace cutlass_fused::gen::{k.group}
"""


def render(k: Kernel, args: list[str]) -> str:
    """The row's .cu: its group's template instantiated with the row's arguments.

    The kernel gets a type of its own in the row's namespace, as cutlass_cppgen's
    named type had: the row's name is then in the CUDA kernel's name, which is
    how profiles (and tests/test_selection.py, test_stats_gemm.py) tell the kernels apart.
    """
    promote = f", {k.promote}" if k.promote else ""
    sep = ",\n" + " " * len(f"using Gemm = {k.group}::Gemm<")
    return f"""\
// Generated by `python -m codegen.generate` from codegen/kernels.py. Do not edit.
// {k}
#include "generated/{k.group}.cuh"

namespace cutlass_fused::gen::{k.name} {{
using Gemm = {k.group}::Gemm<{sep.join(args)}>;
struct Kernel : Gemm::GemmKernel {{ }};

inline char const* name() {{ return "{k.name}"; }}
}}  // namespace cutlass_fused::gen::{k.name}

namespace cutlass_fused {{
template <>
KernelEntry const& kernel_entry<KernelId::{k.name}>() {{
  namespace g = gen::{k.name};
  return {k.family}::Launch<g::Kernel, &g::Gemm::fusion_args, &g::name{promote}>::entry();
}}
}}  // namespace cutlass_fused
"""


def registry() -> str:
    rows = " \\\n".join(f"  X({k.name}, {k.family}, {k.dtype}, {k.mode}, {k.stats}, "
                         f"{k.tile[0]}, {k.tile[1]}, {k.tile[2]})" for k in KERNELS)
    return ("// Generated by `python -m codegen.generate` from codegen/kernels.py. Do not edit.\n"
            "// X(name, family, dtype, mode, stats, tile_m, tile_n, tile_k)\n"
            "#define CUTLASS_FUSED_KERNELS(X) \\\n" + rows + "\n")


def expected(only: str = "") -> dict[str, str]:
    cg = _cutlass()
    files = {"kernels.inc": registry()}
    first: dict[str, Kernel] = {}  # group -> the row its header was emitted from
    generic: dict[str, str] = {}   # group -> its body templated on the element type too
    for k in KERNELS:
        if only not in k.name:
            continue
        emitted, includes, graph = _emit(cg, k)
        src = _patch(k, emitted)
        body, args = _template(k, src)
        if k.generic:
            if k.group not in generic:
                generic[k.group] = _generic(k, body)
            if instantiate(generic[k.group], k) != body:
                # The template with this row's element type would not be the kernel it emitted.
                sys.stderr.writelines(difflib.unified_diff(instantiate(generic[k.group], k).splitlines(True),
                                                           body.splitlines(True), k.group, k.name, n=1))
                raise SystemExit(f"generate: {k.name} differs from its group's template {k.group} in more than "
                                 "the element type; give it its own group (Kernel.generic)")
            body, args = generic[k.group], [_CTYPE[k.dtype]] + args
        h = header(k, graph, body, includes)
        name = f"{k.group}.cuh"
        if files.setdefault(name, h) != h:
            # Built from its group's header, this row would silently be another kernel.
            sys.stderr.writelines(difflib.unified_diff(files[name].splitlines(True), h.splitlines(True),
                                                       first[k.group].name, k.name, n=1))
            raise SystemExit(f"generate: {k.name} differs from {first[k.group].name} in more than the "
                             f"template parameters of {name}; give it its own group (Kernel.group)")
        first.setdefault(k.group, k)
        files[f"{k.name}.cu"] = render(k, args)
        print(f"generate: {k.name}", file=sys.stderr)
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if csrc/generated is stale")
    ap.add_argument("--only", default="", help="regenerate only kernels whose name contains this")
    args = ap.parse_args()
    if args.check and args.only:
        ap.error("--check compares every kernel; drop --only")
    files = expected(args.only)
    have = {p.name: p.read_text() for p in OUT.glob("*") if p.is_file()}
    if args.check:
        stale = sorted(set(files) ^ set(have) | {n for n in files if have.get(n) != files[n]})
        for n in stale:
            sys.stdout.writelines(difflib.unified_diff(have.get(n, "").splitlines(True),
                                                       files.get(n, "").splitlines(True), n, n, n=1))
        if stale:
            print(f"generate --check: stale: {', '.join(stale)}; run `python -m codegen.generate`")
            return 1
        print(f"generate --check: {len(files)} files up to date")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for n in set(have) - set(files) if not args.only else ():
        (OUT / n).unlink()
    for n, text in files.items():
        (OUT / n).write_text(text)
    print(f"generate: wrote {len(files)} files to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
