"""Trace codegen/epilogues.py with CUTLASS's Python interface into visitor-tree C++.

cutlass_cppgen (nvidia-cutlass 4.2, CUTLASS's "legacy Python API") parses an epilogue
function into a DAG, runs its passes over it, and its emitter (FusionCallbacks) writes the
visitor tree's C++ types. What the interface cannot say is added at its two extension points,
never by editing the emitted text:
  - named operations (ops()): calls in epilogues.py that become compute nodes or reductions whose
    C++ functors are ours (csrc/kernels/evt_extra.h). The frontend learns their names, and
    the nodes' op_tag their C++ names.
  - passes (additional_passes of the frontend, run after CUTLASS's own), each on the IR's nodes:
      partial_sums    a partial_sum is a per-CTA partial, not an atomic add into one vector:
                      sm90 FinalReduction = false with plus, sm80 our store_partial at a runtime
                      row stride (csrc/kernels/gemm/sm80_nodes.cuh);
      sums_compute    the sums' nodes compute in the dtype's statistics type (fp64 for f32x3);
      sm80_arguments  sm80's compute node of an operation with runtime arguments (the
                      activation) is our VisitorComputeWithArgs; CUTLASS 2.x's takes none;
      sm80_stored_h_in_fp32  sm80's statistics read h in fp32, not through D's type (its store
                      converts; sm90's does not, hence CUTLASS's PassFixElementD);
      fold_broadcast  sm90 eval reads a, c, s and g through Sm90FoldBroadcast, which makes the
                      fold in the epilogue where the plan asks (csrc/kernels/gemm/sm90_fold.cuh).
The epilogue descriptor and sm80's thread map, which the emitted types name, are made from the
template parameters of the generated struct (generate.py), not text put in.

Tracing and emitting a tree need no GPU, no nvcc and no cuda-python: only a GEMM plan
(op.Gemm) asks for them, and the generator builds none; the kernel around the tree is ours
(csrc/kernels/gemm/). Importing cutlass_cppgen writes compiled_cache.db into the working
directory, so it is imported from a temporary one.
"""
import os
import tempfile
from dataclasses import dataclass

# The element type of the epilogue's bias and output, for a dtype of codegen/kernels.py or a tree's
# (Kernel.tree: "f32", eval's of TF32 and 3xTF32): e4m3's epilogue is bf16's (csrc/kernels/gemm/dtype.cuh).
ELEMENT = {"bf16": "bf16", "f16": "f16", "tf32": "f32", "f32x3": "f32", "f32": "f32", "e4m3": "bf16"}
CTYPE = {"bf16": "cutlass::bfloat16_t", "f16": "cutlass::half_t", "f32": "float"}
# The type of the statistics' nodes and per-CTA sums (dtype.cuh's StatsCompute).
SUMS = {"f32x3": "f64"}

# What each tensor of an epilogue is at runtime: its Arguments in the kernel's visitor tree,
# from GemmEvtArgs p (csrc/kernels/gemm_evt.h). `Element` is the tree's element type. A null
# pointer reads the value given after it (1 for a multiplier, else 0).
ARGUMENTS = {
    "sm90": {
        "b": "{static_cast<Element const*>(p.b)}",
        "shift": "{p.shift}",
        "a": "{{p.a, 1.f}, p.fold}", "c": "{{p.c}, p.fold}",   # fold broadcasts (evt_passes.fold_broadcast)
        "s": "{{p.s, 1.f}, p.fold}", "g": "{{p.a, 1.f}, p.fold}",
        "u_sum": "{p.u_sum}", "u_sumsq": "{p.u_sumsq}",
        "r": "{static_cast<Element const*>(p.r), Element(0), {p.ldr, cute::_1{}, cute::_0{}}}",  # an aux load
        # grad_sums: h row-major is a column-major (feature, batch) aux load of the swapped tile
        "h": "{static_cast<Element const*>(p.r), Element(0), {cute::_1{}, p.ldr, cute::_0{}}}",
        "h2": "{static_cast<Element const*>(p.r), Element(0), {cute::_1{}, p.ldr, cute::_0{}}}",
        "shift2": "{p.shift}", "mul": "{p.mul}", "beta": "{p.beta}",
    },
    "sm80": {
        "b": "{static_cast<Element const*>(p.b)}",
        "a": "{p.a, 1.f}", "c": "{p.c}", "s": "{p.s, 1.f}", "g": "{p.a, 1.f}",
        # a CTA's partial sums land on its row of the partials (sm80_nodes.cuh's partials_stride)
        "u_sum": "{static_cast<float*>(p.u_sum), 0.f, gemm::partials_stride<OutputTileThreadMap>(p.n)}",
        "u_sumsq": "{static_cast<float*>(p.u_sumsq), 0.f, "
                   "gemm::partials_stride<OutputTileThreadMap>(p.n)}",
        "D": "{static_cast<Element*>(p.out), {p.ldo, cute::_1{}, cute::_0{}}}",
    },
}
# sm90 eval's vectors of the fold, by name: Sm90FoldBroadcast makes them (FoldPart, eval_fold.cuh).
FOLD_PARTS = ("a", "c", "s", "g")


@dataclass(frozen=True)
class Op:
    """A named operation of epilogues.py: a compute node whose functor is `tag`, or a reduction
    (a sum over the batch, left as per-CTA partials: evt_passes.partial_sums)."""
    tag: str = ""
    reduction: bool = False
    arguments: bool = False  # the functor takes runtime Arguments (ActivationArgs)


def ops(element: str) -> dict[str, Op]:
    """The named operations, for a tree of this element type."""
    rounded = {"bf16": "cutlass_fused::plus_rounded_to_bf16", "f16": "cutlass_fused::plus_rounded_to_f16"}
    return {
        # op(inputs) rounded once to a 16-bit output type and widened back (evt_extra.h's
        # rounded_to), so that the sums are of h as stored and fp16 eval overflows where the
        # unfused model does; fp32 keeps what it computes.
        "rounded_plus": Op(rounded.get(element, "cutlass::plus")),
        "rounded_multiplies": Op("cutlass_fused::multiplies_rounded_to_f16" if element == "f16"
                                 else "cutlass::multiplies"),
        "take_last": Op("cutlass_fused::take_last"),
        # grad_sums' g (the activation a runtime value) and g (h - mean_h): evt_extra.h
        "bn_grad": Op(f"cutlass_fused::bn_grad_{element}", arguments=True),
        "times_centered": Op("cutlass_fused::times_centered"),
        "square": Op("cutlass::square"),
        "plus_activated": Op("cutlass_fused::plus_activated", arguments=True),
        "multiply_add_activated": Op("cutlass_fused::multiply_add_activated", arguments=True),
        "partial_sum": Op(reduction=True),
    }


class _Partial:
    """The memory reduction of a partial_sum, as op_tag names it: sm90's plus (the reduction's
    workspace path), sm80's store of each CTA's sums (sm80_nodes.cuh's store_partial)."""
    def __init__(self, tag):
        self.tag = tag


_STATE: dict = {}


def _cutlass():
    """cutlass_cppgen, with our operations' C++ names registered."""
    if "cg" not in _STATE:
        cwd = os.getcwd()
        os.chdir(tempfile.mkdtemp(prefix="cutlass_fused_trace_"))
        try:
            import cutlass_cppgen
        finally:
            os.chdir(cwd)
        # The emitters name a node's functor with op_tag, which each module imports by name.
        from cutlass_cppgen.backend import library
        from cutlass_cppgen.backend.evt.backend import sm80_nodes, sm90_nodes
        for mod in (library, sm80_nodes, sm90_nodes):
            mod.op_tag = lambda op, default=mod.op_tag: op.tag if isinstance(op, (Op, _Partial)) else default(op)
        _STATE["cg"] = cutlass_cppgen
    return _STATE["cg"]


def _frontend(fn, named: dict, cc: int):
    """CUTLASS's Python frontend for fn, knowing our operations' names."""
    from cutlass_cppgen.backend.evt.frontend import PythonASTFrontend
    from cutlass_cppgen.backend.library import FunctionalOp
    partial = _Partial("cutlass::plus" if cc >= 90 else "cutlass_fused::gemm::store_partial")

    class Frontend(PythonASTFrontend):
        __call__ = staticmethod(fn)

        def ast_op_to_bindings(self, op):
            if op in named:
                # A reduction is a (register, memory) pair of functors, as CUTLASS's sum is.
                return (FunctionalOp.Plus, partial) if named[op].reduction else named[op]
            try:
                return PythonASTFrontend.ast_op_to_bindings(op)
            except KeyError:
                raise SystemExit(f"trace: {fn.__name__} calls {op}, which is neither CUTLASS's nor one of "
                                 f"codegen/trace.py's named operations ({', '.join(named)})") from None

    return Frontend


def _examples(cg, element: str, swapped: bool) -> dict:
    """An example of every tensor an epilogue may name. Their shapes decide what the tracer
    makes of them: swapped (sm90 stats: a feature is a row of accum), a vector is a column and
    its sums are column reductions; otherwise a vector is a row of accum's columns."""
    from cutlass_library import DataType, LayoutType
    el, f32 = getattr(DataType, element), DataType.f32
    M, N = 256, 512
    if swapped:
        mat = {"shape": (N, M), "layout_tag": LayoutType.ColumnMajor}
        vec = {"shape": (N, 1), "layout_tag": LayoutType.ColumnMajor}
    else:
        mat = {"shape": (M, N), "layout_tag": LayoutType.RowMajor}
        vec = {"shape": (1, N), "layout_tag": LayoutType.RowMajor}
    vectors = ("shift", "a", "c", "s", "g", "u_sum", "u_sumsq", "mul", "beta", "shift2")
    ex = {n: cg.Tensor(element=f32, **vec) for n in vectors}
    ex |= {n: cg.Tensor(element=el, **mat) for n in ("D", "r", "h", "h2")}
    return ex | {"accum": cg.Tensor(element=f32, **mat), "b": cg.Tensor(element=el, **vec)}


def trace(fn, dtype: str, family: str, swapped: bool = False):
    """Epilogue fn traced for a dtype of the kernel table and a family: the tree's C++ declarations
    (the emitter's), the name of the visitor the kernel runs, and the DAG it was emitted from."""
    cc = 90 if family == "sm90" else 80
    cg = _cutlass()
    from cutlass_cppgen.backend.evt.backend.emitter_base import FusionCallbacks
    from cutlass_library import DataType
    named = ops(ELEMENT[dtype])
    front = _frontend(fn, named, cc)(cc, element_compute=DataType.f32,
                                      additional_passes=_passes(family, dtype, named))
    front.trace(_examples(cg, ELEMENT[dtype], swapped))
    # sm90's collective epilogue stores D itself (emit_CD=False); sm80's tree ends in D's store.
    decls, root = FusionCallbacks(front.dag_ir, cc, emit_CD=cc < 90).emit()
    return decls, root, front.dag_ir


def _passes(family: str, dtype: str, named: dict) -> list:
    from codegen import evt_passes
    out = [evt_passes.partial_sums(lambda fn: isinstance(fn, _Partial))]
    if dtype in SUMS:
        out.append(evt_passes.sums_compute(SUMS[dtype], named["rounded_plus"]))
    if family == "sm80":
        out += [evt_passes.sm80_arguments(), evt_passes.sm80_stored_h_in_fp32(named["rounded_plus"])]
    else:
        out.append(evt_passes.fold_broadcast(FOLD_PARTS))
    return out
