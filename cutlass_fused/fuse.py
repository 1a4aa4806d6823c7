"""cutlass_fused.fuse: rewrite `bn(linear(x) * scale)` in an existing model to LinearScaleBatchNorm1d."""
import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from .module import LinearScaleBatchNorm1d

_MULS = (operator.mul, torch.mul)


@dataclass(frozen=True)
class Fused:
    name: str    # the new LinearScaleBatchNorm1d's attribute in the returned module
    linear: str  # the original modules' and parameter's paths in the model
    scale: str
    bn: str


@dataclass(frozen=True)
class Skipped:
    linear: str  # path of the nn.Linear whose call was left alone
    reason: str


@dataclass
class FuseReport:
    """What `fuse` replaced (`fused`) and which nn.Linear calls it left alone and why (`skipped`)."""
    fused: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def __str__(self):
        lines = [f"cutlass_fused.fuse: fused {len(self.fused)}, left {len(self.skipped)} nn.Linear call(s) alone"]
        lines += [f"  fused  {f.linear} -> * {f.scale} -> {f.bn}  as {f.name}" for f in self.fused]
        lines += [f"  left   {s.linear}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


class _Tracer(fx.Tracer):
    # An already fused layer stays one call: traced into, its Python branches on
    # bn.training would be frozen at the mode the model had while tracing.
    def __init__(self, leaf_modules):
        super().__init__()
        self.leaf_types = (LinearScaleBatchNorm1d, *leaf_modules)

    def is_leaf_module(self, m, qualname):
        return isinstance(m, self.leaf_types) or super().is_leaf_module(m, qualname)


def fuse(model: nn.Module, leaf_modules=()) -> tuple[fx.GraphModule, FuseReport]:
    """Trace `model` with torch.fx and replace each `bn(linear(x) * scale)` by
    `LinearScaleBatchNorm1d.from_modules(linear, scale, bn)`.

        fused, report = cutlass_fused.fuse(model)
        print(report)

    A match is an nn.Linear call whose only user multiplies it (`*`, torch.mul or
    `.mul`, either order) by an nn.Parameter of shape [out_features], whose product
    goes only to an nn.BatchNorm1d with num_features == out_features; none of the
    three modules may have hooks (the fused layer would skip them). Every other
    nn.Linear call is left alone and listed in `report.skipped` with the reason.

    Returns a new fx.GraphModule and a FuseReport. The fused layers share the
    model's parameters and buffers (no copies), so training either one trains
    both, and `model.state_dict()` keeps its original keys; the returned module
    names each fused layer's tensors under its new attribute (`report.fused[i].name`).
    The fused layer takes 2-D input (batch, features) and raises on other shapes.

    Tracing runs `model.forward` once with symbolic inputs: Python control flow
    on `self.training` or on tensor values is either frozen into the graph or
    cannot be traced. For the latter `fuse` raises RuntimeError; pass the
    classes of the submodules that cannot be traced as `leaf_modules` (they are
    then called as they are, not searched), or fuse the traceable parts alone.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"cutlass_fused.fuse: expected an nn.Module, got {type(model).__name__}")
    tracer = _Tracer(tuple(leaf_modules))
    try:
        graph = tracer.trace(model)
    except Exception as err:
        raise RuntimeError(
            f"cutlass_fused.fuse: torch.fx cannot trace {type(model).__name__} ({type(err).__name__}: {err}). "
            "Pass the classes of the submodules it cannot trace as leaf_modules=(...), or fuse the "
            "traceable submodules one by one.") from err
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    report = FuseReport()
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.Linear):
            match = _match(gm, node)
            if isinstance(match, str):
                report.skipped.append(Skipped(node.target, match))
            else:
                report.fused.append(_replace(gm, *match))
    _drop_unused(gm, model, report)
    gm.graph.lint()
    gm.recompile()
    return gm, report


def _match(gm, linear_node):
    """(linear node, mul node, scale node, bn node), or why this call is not a match."""
    linear = gm.get_submodule(linear_node.target)
    if type(linear) is not nn.Linear:
        return f"is a {type(linear).__name__}, a subclass of nn.Linear that may compute something else"
    if _has_hooks(linear):
        return "has hooks, which the fused layer would not call"
    if len(linear_node.args) != 1 or linear_node.kwargs:
        return "is called with keyword or extra arguments"
    mul = _only_user(linear_node)
    if isinstance(mul, str):
        return f"its output {mul}"
    if not _is_mul(mul):
        return f"its output goes to {_describe(mul)}, not to a multiplication"
    other = mul.args[1] if mul.args[0] is linear_node else mul.args[0]
    scale = _attr(gm, other)
    if not isinstance(scale, nn.Parameter):
        what = f"{other.target}, not an nn.Parameter" if isinstance(other, fx.Node) and other.op == "get_attr" \
            else _describe(other)
        return f"its output is multiplied by {what}"
    if scale.shape != (linear.out_features,):
        return f"its scale {other.target} has shape {tuple(scale.shape)}, not ({linear.out_features},)"
    bn_node = _only_user(mul)
    if isinstance(bn_node, str):
        return f"the product with {other.target} {bn_node}"
    bn = gm.get_submodule(bn_node.target) if bn_node.op == "call_module" else None
    if isinstance(bn, nn.SyncBatchNorm):
        return (f"{bn_node.target} is an nn.SyncBatchNorm: fuse before nn.SyncBatchNorm.convert_sync_batchnorm, "
                "then use cutlass_fused.convert_sync_batchnorm")
    if type(bn) is not nn.BatchNorm1d or bn_node.args != (mul,) or bn_node.kwargs:
        return f"the product with {other.target} goes to {_describe(bn_node)}, not to an nn.BatchNorm1d"
    if _has_hooks(bn):
        return f"{bn_node.target} has hooks, which the fused layer would not call"
    if bn.num_features != linear.out_features:
        return (f"{bn_node.target} has num_features={bn.num_features} but the Linear has "
                f"out_features={linear.out_features} (it normalizes another dimension)")
    return linear_node, mul, other, bn_node


def _replace(gm, linear_node, mul, scale_node, bn_node):
    linear, bn = gm.get_submodule(linear_node.target), gm.get_submodule(bn_node.target)
    layer = LinearScaleBatchNorm1d.from_modules(linear, _attr(gm, scale_node), bn)
    layer.training = bn.training  # not .train(): that would also set the shared modules' flags
    base = linear_node.target.replace(".", "_") + "_scale_bn"
    name, i = base, 1
    while hasattr(gm, name):
        name, i = f"{base}_{i}", i + 1
    gm.add_submodule(name, layer)
    with gm.graph.inserting_before(bn_node):
        new = gm.graph.call_module(name, linear_node.args)
    bn_node.replace_all_uses_with(new)
    for n in (bn_node, mul, linear_node):
        gm.graph.erase_node(n)
    if not scale_node.users:
        gm.graph.erase_node(scale_node)
    return Fused(name, linear_node.target, scale_node.target, bn_node.target)


def _drop_unused(gm, model, report):
    """Remove what the fused layers now hold from the module's other paths, so that its
    state_dict lists each tensor once."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    theirs = {id(m) for m in model.modules()}  # never delete from the caller's own modules
    for path in {f.scale for f in report.fused} - used:
        owner_path, _, attr = path.rpartition(".")
        owner = gm.get_submodule(owner_path)
        if owner is gm or id(owner) not in theirs:
            delattr(owner, attr)
    gm.delete_all_unused_submodules()


def _has_hooks(m):
    return any(getattr(m, h) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                        "_backward_pre_hooks"))


def _only_user(node):
    users = list(node.users)
    if len(users) == 1:
        return users[0]
    if not users:
        return "is unused"
    return f"has {len(users)} users ({', '.join(_describe(u) for u in users)})"


def _is_mul(node):
    return len(node.args) == 2 and not node.kwargs and (
        (node.op == "call_function" and node.target in _MULS) or (node.op == "call_method" and node.target == "mul"))


def _attr(gm, node):
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return operator.attrgetter(node.target)(gm)
    return None


def _describe(x):
    if not isinstance(x, fx.Node):
        return repr(x)
    if x.op == "call_module":
        return x.target
    if x.op == "call_function":
        return getattr(x.target, "__name__", str(x.target))
    if x.op == "call_method":
        return f".{x.target}()"
    if x.op == "output":
        return "the model's output"
    return str(x.target)
