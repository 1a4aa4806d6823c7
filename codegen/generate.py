"""Emit csrc/generated from codegen/kernels.py and codegen/epilogues.py.

    python -m codegen.generate            # (re)write csrc/generated
    python -m codegen.generate --check    # exit 1 if csrc/generated is stale

What it writes:
  - evt_<family>_<mode>_<dtype>.h, one a visitor tree (Kernel.tree): the tree that
    cutlass_cppgen traces from the row's epilogue function (codegen/trace.py), as a struct
    templated on the CTA tile (sm90) or the epilogue's thread map (sm80), with the tree's
    Arguments built from GemmEvtArgs;
  - kernels.inc, the registry (an X-macro over the rows, which csrc/kernels/table.h and
    types.h expand);
  - per row a small <name>.cu (the name CMake globs) that instantiates the class template of
    the row's family and mode (csrc/kernels/gemm/<family>_<mode>.cuh: the mainloop, schedule
    and launch) with the row's dtype, tree, tile, cluster, epilogue tile and schedule (sm80:
    tile, warp tile, stages), names the kernel type after the row and specialises
    kernel_entry<KernelId::name>.

The sources are committed, so the build needs only the CUTLASS headers; CI runs --check,
which traces every tree again, to keep them honest.
"""
import argparse
import difflib
import sys
from pathlib import Path

from codegen import epilogues, trace
from codegen.kernels import KERNELS, Kernel

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "csrc" / "generated"
_DTYPES = ("bf16", "f16", "tf32", "f32x3", "e4m3")  # the structs of csrc/kernels/gemm/dtype.cuh
_SCHEDULES = {"TmaWarpSpecializedCooperative": "gemm::Cooperative",  # csrc/kernels/gemm/sm90_kernel.cuh
              "TmaWarpSpecializedPingpong": "gemm::Pingpong",
              "TmaWarpSpecializedCooperativeFP8FastAccum": "gemm::CooperativeFP8FastAccum",
              "TmaWarpSpecializedPingpongFP8FastAccum": "gemm::PingpongFP8FastAccum"}


def _shape(kind: str, dims) -> str:
    if kind == "cute":
        return "cute::Shape<" + ", ".join(f"cute::_{d}" for d in dims) + ">"
    return "cutlass::gemm::GemmShape<" + ", ".join(map(str, dims)) + ">"


def check_row(k: Kernel) -> None:
    """Refuse a row that its family's template would build as something else."""
    def bad(why):
        raise SystemExit(f"generate: {k.name}: {why} (codegen/kernels.py)")
    if k.dtype not in _DTYPES:
        bad(f"dtype {k.dtype!r} is none of {', '.join(_DTYPES)}")
    if k.family not in ("sm90", "sm80"):
        bad(f"family {k.family!r} is neither sm90 nor sm80")
    if not (ROOT / "csrc" / k.header).is_file():
        bad(f"no template csrc/{k.header} for family {k.family}, mode {k.mode}")
    if k.promote and not (k.family == "sm90" and k.dtype in ("f32x3", "e4m3")):
        bad("promote is for the sm90 f32x3 and e4m3 (promoted) mainloops only")
    mmas = k.tile[2] // 32  # an e4m3 k-tile's MMAs (k = 32 each)
    if k.promote and k.dtype == "e4m3" and (k.fast_accum or mmas == 0 or k.promote % mmas):
        bad("an e4m3 promote needs the promoted mainloop and a multiple of the k-tile's MMAs (tile K / 32)")
    if k.fast_accum and k.dtype != "e4m3":
        bad("the FP8 fast-accumulation schedule is for e4m3 rows only")
    if k.mode == "grad" and (k.family != "sm90" or k.dtype not in ("bf16", "f16")):
        bad("grad rows are sm90 16-bit kernels only (the swapped GEMM's column reductions)")
    if k.dtype == "e4m3" and k.family != "sm90":
        bad("e4m3 rows are sm90 kernels only (Hopper's FP8 tensor cores)")
    if k.family == "sm90":
        if k.schedule not in _SCHEDULES:
            bad(f"schedule {k.schedule!r} is none of {', '.join(_SCHEDULES)}")
        if k.stages is not None or k.warps != Kernel.warps:
            bad("stages and warps are sm80's (sm90 carves its stages out of what the epilogue leaves)")
    else:
        if k.stages is None or any(t % w for t, w in zip(k.tile, k.warps)):
            bad("an sm80 row needs stages and a warp count that divides its tile")
        if k.cluster != Kernel.cluster or k.schedule != Kernel.schedule or k.epi_tile:
            bad("cluster, schedule and epi_tile are sm90's")


def template_args(k: Kernel) -> list[str]:
    """The arguments of the row's class template, in its parameters' order."""
    tree = f"gen::evt::{k.tree}"
    if k.family == "sm90":
        epi = _shape("cute", k.epi_tile) if k.epi_tile else "cutlass::epilogue::collective::EpilogueTileAuto"
        return [f"gemm::dtype::{k.dtype}", tree, _shape("cute", k.tile), _shape("cute", k.cluster), epi,
                _SCHEDULES[k.schedule]]
    warp = [t // w for t, w in zip(k.tile, k.warps)]
    return [f"gemm::dtype::{k.dtype}", tree, _shape("gemm", k.tile), _shape("gemm", warp), str(k.stages)]


def tree_arguments(dag, family: str) -> str:
    """The traced tree's Arguments as a brace initialiser, walked as the emitter walks the DAG.

    A node with inputs is an Sm*EVT<Node, Children...>, which takes {children..., node}; a
    topological visitor takes its nodes' arguments in its subgraph's order (a node emitted as an
    EVT of its own taking that EVT's). A tensor takes what trace.ARGUMENTS gives its name, a node
    of an operation with runtime arguments the activation, the other compute nodes, the
    accumulator and the literals {} (value-initialised: zero).
    """
    from cutlass_cppgen.backend.evt.ir import ComputeNode, TopoVisitorNode

    def leaf(meta):
        if meta.name in trace.ARGUMENTS[family]:
            return trace.ARGUMENTS[family][meta.name]
        if isinstance(meta, ComputeNode) and getattr(meta.fn, "arguments", False):
            return "{p.act, p.slope}"
        impl = type(meta.underlying_impl).__name__
        if isinstance(meta, ComputeNode) or impl.endswith(("AccumulatorImpl", "ScalarBroadcastImpl")):
            return "{}"
        raise SystemExit(f"generate: no arguments known for visitor node {meta.name} ({impl}); "
                         "name it in codegen/trace.py's ARGUMENTS")

    def args(n):
        meta = dag.get_node_meta(n)
        if isinstance(meta, TopoVisitorNode):
            sub = meta.subgraph
            return "{" + ", ".join(args(s) if sub.get_node_meta(s).disabled else leaf(sub.get_node_meta(s))
                                   for s in sub.nodes_topological_order()[:-1]) + "}"
        if dag.in_degree(n) > 0:
            return "{" + ", ".join([args(c) for c in dag.get_all_inputs(n)] + [leaf(meta)]) + "}"
        return leaf(meta)

    # sm90's collective stores D itself (the tree is D's input); sm80's tree ends in D's store.
    root = dag.get_all_inputs("D")[0] if family == "sm90" else dag.nodes_topological_order()[-1]
    return args(root)


_TREE_INCLUDES = {"sm90": "kernels/gemm/sm90_nodes.cuh", "sm80": "kernels/gemm/sm80_nodes.cuh"}


def render_tree(k: Kernel) -> str:
    """csrc/generated/evt_<tree>.h: the traced tree of row k's family, mode and dtype."""
    return tree_header(k.tree, k.epilogue, k.family, k.tree_dtype, swapped=k.swapped)


def tree_header(name: str, epilogue: str, family: str, dtype: str, swapped: bool = False) -> str:
    """The header of struct gen::evt::<name>: codegen/epilogues.py's function `epilogue`, traced
    for a family and dtype (a kernel table's, or "f32")."""
    decls, root, dag = trace.trace(getattr(epilogues, epilogue), dtype, family, swapped=swapped)
    element = trace.CTYPE[trace.ELEMENT[dtype]]
    if family == "sm90":
        param = "class CtaTile, class EpilogueTile, class Schedule"
        # No C operand: the kernels' epilogue reads what it needs itself (sm90_kernel.cuh).
        bind = ("using EpilogueDescriptor = cutlass::epilogue::collective::detail::EpilogueDescriptor<\n"
                "      CtaTile, EpilogueTile, void, Element, Schedule>;")
        why = ("make the epilogue descriptor that the emitted types name: the CTA tile (not cutlass_cppgen's\n"
               "// cluster tile), the epilogue tile and the epilogue schedule, for a kernel with no C operand")
    else:
        param, bind = "class Map", "using OutputTileThreadMap = Map;"
        why = "are the epilogue's thread map (OutputTileThreadLayout), which the emitted types name"
    body = "\n".join(("  " + line).rstrip() for line in decls.strip().splitlines())
    return f"""\
// Generated by `python -m codegen.generate`: codegen/epilogues.py's {epilogue}, traced by
// cutlass_cppgen for {family} and {dtype} (codegen/trace.py). Do not edit.
#pragma once

#include "{_TREE_INCLUDES[family]}"

namespace cutlass_fused::gen::evt {{
// Its parameters {why}.
template <{param}>
struct {name} {{
  using Element = {element};
  {bind}
{body}

  using Tree = {root};
  static typename Tree::Arguments args(GemmEvtArgs const& p) {{
    return {tree_arguments(dag, family)};
  }}
}};
}}  // namespace cutlass_fused::gen::evt
"""


def render(k: Kernel) -> str:
    """The row's .cu: its family's template instantiated with the row's arguments.

    The kernel gets a type of its own in the row's namespace: the row's name is then
    in the CUDA kernel's name, which is how profiles (and tests/test_selection.py,
    test_stats_gemm.py) tell the kernels apart.
    """
    gemm = f"gemm::{k.family}_{k.mode}::Gemm<"
    promote = f", {k.promote}" if k.promote else ""
    sep = ",\n" + " " * len(f"using Gemm = {gemm}")
    return f"""\
// Generated by `python -m codegen.generate` from codegen/kernels.py. Do not edit.
// {k}
#include "generated/evt_{k.tree}.h"
#include "{k.header}"

namespace cutlass_fused::gen::{k.name} {{
using Gemm = {gemm}{sep.join(template_args(k))}>;
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


def check_defaults(rows) -> None:
    """Refuse a table whose (family, math, mode) has no default row or more than one: the plan
    starts from that row (find_kernel)."""
    groups = {}
    for k in rows:
        groups.setdefault((k.family, k.math, k.mode), []).append(k)
    for (family, math, mode), group in groups.items():
        defaults = [k.name for k in group if k.default]
        if len(defaults) != 1:
            raise SystemExit(f"generate: the rows of ({family}, {math}, {mode}) need one default=True, not "
                             f"{len(defaults)}: {', '.join(defaults or [k.name for k in group])} (codegen/kernels.py)")


def registry() -> str:
    rows = " \\\n".join(f"  X({k.name}, {k.family}, {k.math}, {k.mode}, {k.stats}, "
                         f"{k.tile[0]}, {k.tile[1]}, {k.tile[2]}, {str(k.default).lower()})" for k in KERNELS)
    return ("// Generated by `python -m codegen.generate` from codegen/kernels.py. Do not edit.\n"
            "// X(name, family, math, mode, stats, tile_m, tile_n, tile_k, is_default)\n"
            "#define CUTLASS_FUSED_KERNELS(X) \\\n" + rows + "\n")


def expected() -> dict[str, str]:
    names = [k.name for k in KERNELS]
    if len(set(names)) != len(names):
        raise SystemExit(f"generate: rows named alike: {sorted({n for n in names if names.count(n) > 1})} "
                         "(codegen/kernels.py); each kernel_entry must be defined once")
    for k in KERNELS:
        check_row(k)
    check_defaults(KERNELS)
    trees = {}
    for k in KERNELS:
        if f"evt_{k.tree}.h" not in trees:
            trees[f"evt_{k.tree}.h"] = render_tree(k)
    return {"kernels.inc": registry()} | trees | {f"{k.name}.cu": render(k) for k in KERNELS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if csrc/generated is stale")
    args = ap.parse_args()
    files = expected()
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
    for n in set(have) - set(files):
        (OUT / n).unlink()
    for n, text in files.items():
        (OUT / n).write_text(text)
    print(f"generate: wrote {len(files)} files to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
