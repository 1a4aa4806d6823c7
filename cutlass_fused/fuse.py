"""cutlass_fused.fuse: rewrite `bn(linear(x) * scale)` in an existing model to LinearScaleBatchNorm1d."""
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

from .module import LinearScaleBatchNorm1d

_MULS = (operator.mul, torch.mul)


@dataclass(frozen=True)
class Fused:
    name: str    # the new LinearScaleBatchNorm1d's attribute in the returned module
    linear: str  # the original modules' and parameter's paths in the model
    scale: str
    bn: str
    activation: str = ""        # the absorbed activation's node ("" for none): module path or function
    autocast_output: bool = False  # y in the autocast dtype under autocast: every user is a Linear


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
        lines += [f"  fused  {f.linear} -> * {f.scale} -> {f.bn}" + (f" -> {f.activation}" if f.activation else "")
                  + f"  as {f.name}" + ("  (16-bit y under autocast: its users are Linears)" if f.autocast_output
                                         else "") for f in self.fused]
        lines += [f"  left   {s.linear}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


class _Tracer(fx.Tracer):
    # An already fused layer stays one call: traced into, its Python branches on
    # bn.training would be frozen at the mode the model had while tracing.
    # leaf_modules has a default: torch.load of a fused model re-traces its code with a subclass of
    # the recorded tracer class, made with no arguments (fx's _deserialize_graph_module).
    def __init__(self, leaf_modules=()):
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

    An activation that is the BatchNorm output's only user goes into the layer too:
    nn.ReLU, nn.LeakyReLU, nn.GELU (either approximation), nn.SiLU, and F.relu,
    F.leaky_relu, F.gelu, F.silu, torch.relu and Tensor.relu (in-place forms too).
    Where every user of a fused layer's output is an nn.Linear or F.linear taking it
    as its input, the layer emits y in the autocast dtype under torch.autocast: the
    bits the Linear would have cast it to, with no fp32 y in between. Outside
    autocast nothing changes.

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
    act_node, (activation, slope) = _activation_after(gm, bn_node)
    last = act_node or bn_node
    layer = LinearScaleBatchNorm1d.from_modules(linear, _attr(gm, scale_node), bn, activation=activation,
                                                negative_slope=slope)
    layer.autocast_output = bool(last.users) and all(_is_linear_input(gm, u, last) for u in last.users)
    layer.training = bn.training  # not .train(): that would also set the shared modules' flags
    base = linear_node.target.replace(".", "_") + "_scale_bn"
    name, i = base, 1
    while hasattr(gm, name):
        name, i = f"{base}_{i}", i + 1
    gm.add_submodule(name, layer)
    with gm.graph.inserting_before(bn_node):
        new = gm.graph.call_module(name, linear_node.args)
    last.replace_all_uses_with(new)
    for n in (act_node, bn_node, mul, linear_node):
        if n is not None:
            gm.graph.erase_node(n)
    if not scale_node.users:
        gm.graph.erase_node(scale_node)
    return Fused(name, linear_node.target, scale_node.target, bn_node.target,
                 _describe(act_node) if act_node is not None else "", layer.autocast_output)


# Activations fuse() absorbs: module types and functions, each to the layer's activation name
# and slope (from the call's arguments, see _activation_after).
_ACT_FUNCTIONS = {F.relu: "relu", torch.relu: "relu", torch.relu_: "relu", F.relu_: "relu",
                  F.leaky_relu: "leaky_relu", F.leaky_relu_: "leaky_relu", F.gelu: "gelu", F.silu: "silu"}
_ACT_METHODS = {"relu": "relu", "relu_": "relu"}


def _activation_after(gm, bn_node):
    """(the node of the activation that is bn_node's only user, (name, negative_slope)), or
    (None, (None, 0.01)) where there is none we can take whole."""
    none = None, (None, 0.01)
    users = list(bn_node.users)
    if len(users) != 1:
        return none
    node = users[0]
    args, kwargs = list(node.args), dict(node.kwargs)
    if not args or args[0] is not bn_node:
        return none
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        if _has_hooks(m) or len(args) != 1 or kwargs:
            return none
        if type(m) is nn.ReLU:
            return node, ("relu", 0.01)
        if type(m) is nn.LeakyReLU:
            return node, ("leaky_relu", float(m.negative_slope))
        if type(m) is nn.GELU:
            return node, ("gelu" if m.approximate == "none" else "gelu_tanh", 0.01)
        if type(m) is nn.SiLU:
            return node, ("silu", 0.01)
        return none
    if node.op == "call_method":
        name = _ACT_METHODS.get(node.target)
        return (node, (name, 0.01)) if name and len(args) == 1 and not kwargs else none
    if node.op != "call_function" or node.target not in _ACT_FUNCTIONS:
        return none
    name = _ACT_FUNCTIONS[node.target]
    # The call's own arguments, by the function's signature; inplace changes nothing here.
    params = {"leaky_relu": ("negative_slope", "inplace"), "gelu": ("approximate",)}.get(name, ("inplace",))
    bound = dict(zip(params, args[1:]), **kwargs)
    if set(bound) - set(params) or len(args) - 1 > len(params):
        return none
    if name == "gelu":
        approximate = bound.get("approximate", "none")
        if approximate not in ("none", "tanh"):
            return none
        return node, ("gelu" if approximate == "none" else "gelu_tanh", 0.01)
    slope = bound.get("negative_slope", 0.01)
    if not isinstance(slope, (int, float)):
        return none
    return node, (name, float(slope))


def _is_linear_input(gm, node, value):
    """Whether `node` is an nn.Linear (exactly) or F.linear call whose input is `value` alone,
    which under autocast casts its input to the autocast dtype first."""
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        return type(m) is nn.Linear and node.args == (value,) and not node.kwargs
    if node.op == "call_function" and node.target in (F.linear, torch._C._nn.linear):
        return bool(node.args) and node.args[0] is value and value not in node.args[1:] \
            and value not in node.kwargs.values()
    return False


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
