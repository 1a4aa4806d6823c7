"""Our passes over cutlass_cppgen's epilogue IR, run after its own (codegen/trace.py says why
each is needed). Each function returns a pass class for the frontend's additional_passes; each
pass changes nodes' implementations, whose type declarations the emitter then writes, and none
edits emitted text. trace.py imports this after cutlass_cppgen (its import has a side effect).
"""
from cutlass_library import DataType, DataTypeSize, DataTypeTag

from cutlass_cppgen.backend.evt.backend.sm80_nodes import Sm80ComputeImpl, Sm80RowReductionImpl
from cutlass_cppgen.backend.evt.backend.sm90_nodes import Sm90ColumnReductionImpl, Sm90RowBroadcastImpl
from cutlass_cppgen.backend.evt.ir import ComputeNode, TopoVisitorNode
from cutlass_cppgen.backend.evt.passes import PassDAG2Tree, PassFixElementD, PassGetImpl
from cutlass_cppgen.backend.evt.passes.pass_manager import EVTPassBase
from cutlass_cppgen.backend.library import FloatRoundStyleTag


def metas(dag_ir):
    """(graph, node meta, its implementation or None) of every node, those inside topological
    visitors' subgraphs too."""
    todo = [dag_ir]
    while todo:
        g = todo.pop()
        for m in g.node_metas_topological_order():
            yield g, m, getattr(m, "underlying_impl", None)
            if isinstance(m, TopoVisitorNode):
                todo.append(m.subgraph)


def is_reduction(impl) -> bool:
    return hasattr(impl, "gmem_reduce_fn")


class _Pass(EVTPassBase):
    dependencies = [PassGetImpl, PassDAG2Tree, PassFixElementD]


class Sm90PartialColReduction(Sm90ColumnReductionImpl):
    """A per-CTA partial (FinalReduction = false): each CTA writes its row of sums, which the
    training tail adds in a fixed order, so the sums are deterministic and need no zeroing;
    CUTLASS static-asserts an atomic reduction to be final, hence plus. The output's
    alignment (a 16-byte access) and EnableNullptr are the template's defaults, spelled because
    the parameter after them is not."""

    @property
    def type_decl(self):
        return f"""
using {self.name_camel} = cutlass::epilogue::fusion::Sm90ColReduction<
    cutlass::plus, cutlass::plus, cutlass::plus, 0 /* Stages */,
    typename EpilogueDescriptor::TileShape, {DataTypeTag[self.element]},
    {DataTypeTag[self.element_compute]}, {FloatRoundStyleTag[self.round_style]},
    {self.stride_mnl},
    {128 // DataTypeSize[self.element]} /* Alignment */, true /* EnableNullptr */, false /* FinalReduction */
>;
"""


class Sm80ComputeWithArgs(Sm80ComputeImpl):
    """CUTLASS 2.x's VisitorCompute passes its functor no Arguments; ours does
    (csrc/kernels/gemm/sm80_nodes.cuh), as sm90's Sm90Compute does natively."""

    @property
    def type_decl(self):
        return f"""
using {self.name_camel} = cutlass_fused::gemm::VisitorComputeWithArgs<
    {self.fn.tag}, {DataTypeTag[self.element_output]}, {DataTypeTag[self.element_compute]}
>;
"""


class Sm90FoldBroadcast(Sm90RowBroadcastImpl):
    """A vector of the fold, which the epilogue makes from the layer's raw vectors when the plan
    asks, or reads as the row broadcast does (csrc/kernels/gemm/sm90_fold.cuh)."""

    @property
    def type_decl(self):
        return f"""
using {self.name_camel} = cutlass_fused::gemm::Sm90FoldBroadcast<
    typename EpilogueDescriptor::TileShape, cutlass_fused::FoldPart::{self.name}
>;
"""


def partial_sums(is_partial):
    """sm90: partial_sum's reductions become Sm90PartialColReduction; sm80: each CTA stores its
    sums (the functor is already store_partial) at its row of the partials, whose stride is a
    runtime value (the tracer gives a (1, N) output a zero M stride)."""

    class PartialSums(_Pass):
        def call(self):
            for _, m, impl in metas(self.dag_ir):
                if not is_reduction(impl) or not is_partial(impl.gmem_reduce_fn):
                    continue
                if isinstance(impl, Sm90ColumnReductionImpl):
                    impl.__class__ = Sm90PartialColReduction
                elif isinstance(impl, Sm80RowReductionImpl):
                    impl.stride = tuple(impl.stride[:-2]) + (2, 1)  # any stride but 0 or 1 is a runtime one
                    impl.stride_dtype = "int64_t"
                else:
                    raise SystemExit(f"trace: partial_sum {m.name} is a {type(impl).__name__}; only a "
                                     "reduction over the batch (a feature's sums) is partial")
    return PartialSums


def sums_compute(element: str, h_op):
    """The sums' nodes (the reductions, and the compute nodes between the node forming h, whose
    functor is h_op, and them: not h, nor D) and the topological visitor's intermediates (it keeps
    every node's value in its compute type) in the statistics' type: fp64 tile sums of an fp32 h
    for f32x3."""
    el = getattr(DataType, element)

    class SumsCompute(_Pass):
        def call(self):
            for g, m, impl in metas(self.dag_ir):
                if isinstance(m, TopoVisitorNode):
                    m.subgraph.element_compute = el
                if is_reduction(impl):
                    impl.element_compute = el
                    for c in _branch(g, m.name, h_op):
                        c.element_compute = c.element_output = el
    return SumsCompute


def _branch(g, reduction, h_op):
    """The implementations of the compute nodes that feed a reduction, back to h."""
    out, todo = [], list(g.get_all_inputs(reduction))
    while todo:
        m = g.get_node_meta(todo.pop())
        if isinstance(m, ComputeNode) and m.fn is not h_op:
            out.append(m.underlying_impl)
            todo += g.get_all_inputs(m.name)
    return out


def sm80_arguments():
    class Sm80Arguments(_Pass):
        def call(self):
            for _, m, impl in metas(self.dag_ir):
                if isinstance(impl, Sm80ComputeImpl) and getattr(m.fn, "arguments", False):
                    impl.__class__ = Sm80ComputeWithArgs
    return Sm80Arguments


def sm80_stored_h_in_fp32(h_op):
    """sm80 statistics trees: h, formed by h_op (rounded_plus: already rounded to D's type), keeps
    its fp32 value for the sums after it. CUTLASS's PassFixElementD gives the producer of D D's
    type, which sm90's store of D needs (it converts nothing); sm80's D is an aux store that
    converts itself, so for a rounded h the round trip through D's type is exact and only costs
    conversions (128 instructions in the bf16 kernel). Any other producer keeps D's type, so that
    sums after it are of D as stored."""

    class Sm80StoredH(_Pass):
        def call(self):
            if not any(is_reduction(impl) for _, _, impl in metas(self.dag_ir)):
                return
            m = self.dag_ir.get_node_meta(self.dag_ir.get_all_inputs("D")[0])
            if isinstance(m, ComputeNode) and m.fn is h_op:
                m.underlying_impl.element_output = m.underlying_impl.element_compute
    return Sm80StoredH


def fold_broadcast(parts):
    class FoldBroadcast(_Pass):
        def call(self):
            for _, m, impl in metas(self.dag_ir):
                if isinstance(impl, Sm90RowBroadcastImpl) and m.name in parts:
                    impl.__class__ = Sm90FoldBroadcast
    return FoldBroadcast
