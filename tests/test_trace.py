"""codegen's epilogues, traced by cutlass_cppgen (CPU only; nothing is compiled): what our named
operations and passes make of each tree, the Arguments the generator builds for it, and the
committed csrc/generated being what the Python epilogues trace to."""
import re

import pytest

pytest.importorskip("cutlass_cppgen", reason="nvidia-cutlass (scripts/setup.sh installs it)")

from codegen import epilogues, generate, trace  # noqa: E402
from codegen.kernels import KERNELS, Kernel  # noqa: E402


def tree(family, mode, dtype):
    k = Kernel(family, dtype, mode, (128, 128, 64), warps=(2, 2, 1), stages=None if family == "sm90" else 3)
    decls, root, dag = trace.trace(getattr(epilogues, k.epilogue), dtype, family, swapped=k.swapped)
    return decls, root, dag


def node(decls, name):
    """The template arguments of `using name = ...<...>;`, whitespace collapsed."""
    m = re.search(rf"using {name} = [\w:]+<(.*?)>;\n", decls, re.S)
    assert m, f"no node {name} in\n{decls}"
    return " ".join(m.group(1).split())


def test_generated_sources_are_what_the_epilogues_trace_to():
    files = generate.expected()
    for name, text in files.items():
        assert (generate.OUT / name).read_text() == text, f"csrc/generated/{name} is stale: python -m codegen.generate"
    trees = {n for n in files if n.startswith("evt_")}
    assert trees == {f"evt_{k.tree}.h" for k in KERNELS}


@pytest.mark.parametrize("dtype", ["bf16", "f16", "tf32", "f32x3"])
def test_sm90_stats_sums_are_deterministic_per_cta_partials(dtype):
    decls, root, _ = tree("sm90", "stats", dtype)
    assert "atomic" not in decls
    for sums in ("USum", "USumsq"):
        args = node(decls, sums)
        assert args.startswith("cutlass::plus, cutlass::plus, cutlass::plus, 0")
        assert args.endswith("4 /* Alignment */, true /* EnableNullptr */, false /* FinalReduction */")
    assert root.startswith("Dag")


def test_f32x3_sums_are_fp64_and_h_and_d_stay_fp32():
    decls, root, _ = tree("sm90", "stats", "f32x3")
    assert "cutlass::minus, double, double" in node(decls, "Compute1")      # u = h - shift
    assert "cutlass::multiplies, double, double" in node(decls, "Compute4")  # u * (u + 0)
    assert "float, double, cutlass::FloatRoundStyle" in node(decls, "USum")  # fp64 partials of fp32 outputs
    assert node(decls, "Compute0").startswith("cutlass::plus, float, float")  # h
    assert node(decls, "Compute6").startswith("cutlass_fused::take_last, float, float")  # D = h
    assert node(decls, root).startswith("double,")  # the DAG keeps its values in fp64
    # tf32 keeps fp32 sums
    assert "double" not in tree("sm90", "stats", "tf32")[0]


@pytest.mark.parametrize("dtype,plus", [("bf16", "cutlass_fused::plus_rounded_to_bf16"),
                                        ("f16", "cutlass_fused::plus_rounded_to_f16"), ("tf32", "cutlass::plus")])
def test_h_is_rounded_to_the_stored_type_before_the_sums(dtype, plus):
    for family in ("sm90", "sm80"):
        decls, _, _ = tree(family, "stats", dtype)
        assert node(decls, "Compute0").startswith(plus + ",")


def test_sm80_sums_store_each_ctas_partials_at_a_runtime_row_stride():
    decls, _, _ = tree("sm80", "stats", "bf16")
    for sums in ("USum", "USumsq"):
        args = node(decls, sums)
        assert args.startswith("cutlass::plus, cutlass_fused::gemm::store_partial,")
        assert args.endswith("cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>")
    assert node(decls, "Compute2").startswith("cutlass::square,")
    # h keeps its fp32 value for the sums (its aux store converts; evt_passes.sm80_stored_h_in_fp32)
    assert node(decls, "Compute0").startswith("cutlass_fused::plus_rounded_to_bf16, float, float")
    eval_decls, _, _ = tree("sm80", "eval", "bf16")
    assert node(eval_decls, "Compute2") == "cutlass_fused::plus_activated, cutlass::bfloat16_t, float"


def test_the_activation_is_a_runtime_argument_on_both_families():
    sm90, _, _ = tree("sm90", "eval", "bf16")
    assert node(sm90, "Compute2").startswith("cutlass_fused::plus_activated, cutlass::bfloat16_t, float")
    sm80, _, _ = tree("sm80", "eval", "bf16")
    assert "cutlass_fused::gemm::VisitorComputeWithArgs<" in sm80
    assert node(sm80, "Compute2") == "cutlass_fused::plus_activated, cutlass::bfloat16_t, float"


def test_sm90_eval_reads_the_fold_through_its_broadcast_and_sm80_through_cutlass_rows():
    sm90, _, _ = tree("sm90", "eval", "f16")
    for name, part in (("G", "g"), ("S", "s"), ("C", "c")):
        assert node(sm90, name) == f"typename EpilogueDescriptor::TileShape, cutlass_fused::FoldPart::{part}"
    assert re.search(r"using B = cutlass::epilogue::fusion::Sm90RowBroadcast<", sm90)  # b is a plain row
    sm80, _, _ = tree("sm80", "eval", "f16")
    assert "FoldBroadcast" not in sm80


# The Arguments the kernels had when these trees were written by hand (csrc/kernels/gemm/ before
# the trees were traced): the generated initialisers must nest the same way.
HAND_WRITTEN = {
    ("sm90", "stats"): "{{{}, {static_cast<Element const*>(p.b)}, {}}, {}, {}, {p.shift}, {}, {p.u_sum}, {}, {}, "
                       "{p.u_sumsq}, {}}",
    ("sm90", "eval"): "{{{{}, {static_cast<Element const*>(p.b)}, {}}, {{p.a, 1.f}, p.fold}, {}}, "
                      "{{p.c}, p.fold}, {p.act, p.slope}}",
    ("sm80", "eval"): "{{{{{}, {static_cast<Element const*>(p.b)}, {}}, {p.a, 1.f}, {}}, {p.c}, {p.act, p.slope}}, "
                      "{static_cast<Element*>(p.out), {p.ldo, cute::_1{}, cute::_0{}}}}",
}


@pytest.mark.parametrize("family,mode", sorted(HAND_WRITTEN))
def test_arguments_nest_as_the_tree(family, mode):
    _, _, dag = tree(family, mode, "bf16")
    assert generate.tree_arguments(dag, family) == HAND_WRITTEN[family, mode]


def test_fp16_eval_takes_s_then_g_then_c():
    _, _, dag = tree("sm90", "eval", "f16")
    assert generate.tree_arguments(dag, "sm90") == (
        "{{{{}, {static_cast<Element const*>(p.b)}, {}}, {{p.s, 1.f}, p.fold}, {}}, {{p.a, 1.f}, p.fold}, "
        "{{p.c}, p.fold}, {p.act, p.slope}}")


def test_an_unknown_operation_or_tensor_is_refused_by_name():
    def calls_unknown(accum, b):
        D = frobnicate(accum, b)  # noqa: F821 (the tracer reads the source)
        return D

    with pytest.raises(SystemExit, match="calls frobnicate, which is neither CUTLASS's nor one of"):
        trace.trace(calls_unknown, "bf16", "sm90")

    def reads_unknown(accum, bias2):
        D = accum + bias2
        return D

    with pytest.raises(RuntimeError, match="Example input for bias2 is not provided"):
        trace.trace(reads_unknown, "bf16", "sm90")
