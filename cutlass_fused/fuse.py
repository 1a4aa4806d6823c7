"""cutlass_fused.fuse: rewrite each Linear -> [* scale] -> BatchNorm1d [-> activation] of an existing
model into one fused layer (LinearBatchNorm1d, or LinearScaleBatchNorm1d with the scale)."""
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

from .functional import linear_after
from .module import LinearBatchNorm1d, LinearScaleBatchNorm1d

_MULS = (operator.mul, torch.mul)
_LINEARS = (F.linear, torch._C._nn.linear)
_BATCH_NORMS = (F.batch_norm,)
_BATCH_NORM_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
# Which users of h (or of h * scale) may stay: they read only what the fused layer's y has too.
_SHAPE_ATTRS = ("shape", "ndim", "device")
_SHAPE_METHODS = ("size", "dim")


@dataclass(frozen=True)
class Fused:
    name: str    # the fused layer's attribute in the returned module
    linear: str  # the original modules' and parameters' paths in the model ("" for none)
    scale: str
    bn: str
    activation: str = ""        # the absorbed activation's node ("" for none): module path or function
    autocast_output: bool = False  # y in the autocast dtype under autocast: every user is a Linear
    chain: str = ""             # the nodes it replaced, as the report prints them


@dataclass(frozen=True)
class Skipped:
    linear: str  # path of the nn.Linear (or F.linear's weight) whose call was left alone
    reason: str  # what blocked the match, after the chain of nodes matched so far


@dataclass
class FuseReport:
    """What `fuse` replaced (`fused`), which Linear calls it left alone and why (`skipped`), and the
    fused layers it linked (`linked`: (name, next layer's name) pairs, one per call)."""
    fused: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    linked: list = field(default_factory=list)

    def __str__(self):
        lines = [f"cutlass_fused.fuse: fused {len(self.fused)}, left {len(self.skipped)} Linear call(s) alone"]
        # A module called more than once (a head on two views) is one line, with its count.
        fused = [f"  fused  {f.chain}  as {f.name}"
                 + ("  (16-bit y under autocast: its users are Linears)" if f.autocast_output else "")
                 for f in self.fused]
        for line, count in _counts(fused).items():
            lines.append(line + (f"  ({count} calls)" if count > 1 else ""))
        linked = [f"  linked {a} -> {b}  (the BN backward of {a} in the dX GEMM of {b})" for a, b in self.linked]
        for line, count in _counts(linked).items():
            lines.append(line + (f"  ({count} calls)" if count > 1 else ""))
        skipped = [f"  left   {s.reason}" for s in self.skipped]
        for line, count in _counts(skipped).items():
            lines.append(line + (f"  ({count} calls)" if count > 1 else ""))
        return "\n".join(lines)


def _counts(lines):
    """Each line once, in first-seen order, with how often it came."""
    out = {}
    for line in lines:
        out[line] = out.get(line, 0) + 1
    return out


class _Tracer(fx.Tracer):
    # An already fused layer stays one call: traced into, its Python branches on
    # bn.training would be frozen at the mode the model had while tracing.
    # leaf_modules has a default: torch.load of a fused model re-traces its code with a subclass of
    # the recorded tracer class, made with no arguments (fx's _deserialize_graph_module).
    # linear_after (a linked layer's Linear, _link_layers) is recorded as one call when the fused
    # model's own code is traced again (torch.load), not traced into.
    def __init__(self, leaf_modules=()):
        super().__init__(autowrap_functions=(linear_after,))
        self.leaf_types = (LinearBatchNorm1d, *leaf_modules)

    def is_leaf_module(self, m, qualname):
        return isinstance(m, self.leaf_types) or super().is_leaf_module(m, qualname)


class _TracedBatchNorm(nn.BatchNorm1d):
    """The batch norm of an F.batch_norm call, as a module that holds the call's tensors (shared,
    not copied) and its constants. Its mode is the call's `training` argument, which the trace
    fixed (a `self.training` read while tracing), so the model's train() and eval() leave it, as
    they leave the traced graph's call."""

    def train(self, mode=True):
        return self


def fuse(model: nn.Module, leaf_modules=(), link=True) -> tuple[fx.GraphModule, FuseReport]:
    """Trace `model` with torch.fx and replace each Linear -> [* scale] -> BatchNorm1d
    [-> activation] chain by one fused layer that shares the model's tensors.

        fused, report = cutlass_fused.fuse(model)
        print(report)

    What it finds:
    - the Linear: an nn.Linear call (bias or none, frozen or not), or F.linear(x, weight, bias)
      with the tensors as the model's parameters or buffers;
    - an optional per-column scale: `*`, torch.mul or `.mul`, either order, by an nn.Parameter of
      shape [out_features] (LinearScaleBatchNorm1d; without one, LinearBatchNorm1d);
    - the BatchNorm: an nn.BatchNorm1d (affine or not, track_running_stats or not, momentum=None
      too), an nn.SyncBatchNorm (as convert_sync_batchnorm leaves it; the fused layer syncs over
      its process group wherever it would), or F.batch_norm with the model's tensors (its
      `training` argument as the trace fixed it), with num_features == out_features;
    - the (B, T, C) form: `bn(linear(x).transpose(1, 2)).transpose(1, 2)` (or permute(0, 2, 1)),
      a BatchNorm over the channels of a sequence, which the layer runs on x.reshape(-1, in_features);
    - an activation that is the BatchNorm's only user: nn.ReLU, nn.LeakyReLU, nn.GELU (either
      approximation), nn.SiLU, and F.relu, F.leaky_relu, F.gelu, F.silu, torch.relu and
      Tensor.relu (in-place forms too); any other activation, and Dropout, stay outside.
    A Linear's output (or the product) may have other users that read only its shape or size. None
    of the modules may have hooks (the fused layer would not call them). A module called twice (a
    head on two views) becomes one fused layer called twice. Every other Linear call is left alone
    and listed in `report.skipped`, with the chain it matched and what blocked it.

    Where every user of a fused layer's output is an nn.Linear or F.linear taking it as its input,
    a layer with a scale emits y in the autocast dtype under torch.autocast: the bits the Linear
    would have cast it to, with no fp32 y in between (a layer without a scale returns h's 16-bit
    dtype there anyway). Outside autocast nothing changes.

    Where a fused layer's output is the input of the next fused layer or of a plain nn.Linear alone
    (an MLP's blocks and its head), the two are linked (`link=False`: never; `report.linked`): in
    training the second one's backward runs the fused layer's BN backward, with its column sums made
    in the dX GEMM's epilogue where the plan has a kernel for it (docs/decisions.md, "Backward":
    linked layers). The gradients are the same.

    Returns a new fx.GraphModule and a FuseReport. The fused layers share the model's parameters
    and buffers (no copies), so training either one trains both, and `model.state_dict()` keeps
    its original keys; the returned module names each fused layer's tensors under its new
    attribute (`report.fused[i].name`). Call fuse before wrapping the model in DDP or FSDP.

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
    follows = _follows_mode(model, graph, leaf_modules)
    report, layers, consumed = FuseReport(), {}, set()
    for node in list(gm.graph.nodes):
        if not _is_linear_call(gm, node):
            continue
        match = _Chain(gm, node, follows).match()
        if isinstance(match, Skipped):
            report.skipped.append(match)
        else:
            report.fused.append(_replace(gm, match, layers, consumed))
    if link:
        report.linked = _link_layers(gm)
    _drop_unused(gm, model, consumed)
    gm.graph.lint()
    gm.recompile()
    return gm, report


def _link_layers(gm):
    """Links each fused layer call whose output is only the input of the next fused layer call (both
    2-D forms: no channels_last) or of a plain nn.Linear call (no hooks): each such fused call gets
    `link=` (True for the first, else the previous call's Link) and returns (y, Link), whose y its
    users take; such a Linear call becomes functional.linear_after(y, link, the Linear). Returns the
    (name, next name) pairs."""
    def plain_call(node, types):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            return False
        m = gm.get_submodule(node.target)
        if types is nn.Linear:
            return type(m) is nn.Linear and not _hook(m)
        return isinstance(m, LinearBatchNorm1d) and m.channels_last is None

    nexts = {}
    for node in gm.graph.nodes:
        users = list(node.users)
        if plain_call(node, LinearBatchNorm1d) and len(users) == 1 and users[0].args[0] is node and (
                plain_call(users[0], LinearBatchNorm1d) or plain_call(users[0], nn.Linear)):
            nexts[node] = users[0]
    pairs = [(a.target, b.target) for a, b in nexts.items()]
    heads = {b for b in nexts.values() if plain_call(b, nn.Linear)}
    members = set(nexts) | set(nexts.values())
    links = {}
    for node in list(gm.graph.nodes):
        if node not in members:
            continue
        if node in heads:
            with gm.graph.inserting_before(node):
                linear = gm.graph.get_attr(node.target)
                head = gm.graph.call_function(linear_after, (node.args[0], links[node], linear))
            node.replace_all_uses_with(head)
            gm.graph.erase_node(node)
            continue
        with gm.graph.inserting_after(node):
            link = gm.graph.call_function(operator.getitem, (node, 1))
        with gm.graph.inserting_after(node):
            y = gm.graph.call_function(operator.getitem, (node, 0))
        node.replace_all_uses_with(y, delete_user_cb=lambda user: user not in (y, link))
        node.kwargs = {"link": links.get(node, True)}
        if node in nexts:
            links[nexts[node]] = link
        else:
            gm.graph.erase_node(link)  # the last one's: no layer after it takes it
    return pairs


def _follows_mode(model, graph, leaf_modules):
    """The F.batch_norm nodes of `graph` whose `training` argument is the model's mode: traced
    again in the other mode, the same graph with that argument flipped (`self.training`, as
    models pass it). The fused layer's batch norm then follows the model's train() and eval();
    any other constant stays as the trace fixed it."""
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target in _BATCH_NORMS]
    if not calls:
        return set()
    mode = model.training
    try:
        model.train(not mode)
        other = _Tracer(tuple(leaf_modules)).trace(model)
    except Exception:
        return set()
    finally:
        model.train(mode)
    nodes, others = list(graph.nodes), list(other.nodes)
    if [(n.op, n.target) for n in nodes] != [(n.op, n.target) for n in others]:
        return set()  # the mode changes the graph itself: no argument to follow
    out = set()
    for a, b in zip(nodes, others):
        if a in calls:
            ta, tb = ((_bind(n, _BATCH_NORM_ARGS) or {}).get("training", False) for n in (a, b))
            if ta is mode and tb is (not mode):
                out.add(a)
    return out


def _is_linear_call(gm, node):
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), nn.Linear)
    return node.op == "call_function" and node.target in _LINEARS


class _Chain:
    """One Linear call's chain, matched node by node: match() gives the chain (this object, its
    fields set) or a Skipped that names the chain so far and what blocked it."""

    def __init__(self, gm, linear_node, follows=frozenset()):
        self.gm, self.linear_node, self.follows = gm, linear_node, follows
        self.nodes = [linear_node]      # the chain's nodes in order, as the report names them
        self.linear = None              # the nn.Linear (a holder for F.linear's tensors)
        self.scale = self.scale_path = None
        self.bn = self.bn_node = None
        self.act_node, self.activation = None, (None, 0.01)
        self.moves = None               # the (B, T, C) form's two moves: (method, args) each
        self.shape_users = []           # users of h or h * scale that read its shape only
        self.attrs = []                 # get_attr paths of F.linear's and F.batch_norm's tensors

    def skip(self, reason):
        chain = " -> ".join(_describe(self.gm, n) for n in self.nodes)
        return Skipped(_path_of(self.gm, self.linear_node), f"{chain}: {reason}")

    def match(self):
        gm = self.gm
        why = self._linear()
        if why:
            return self.skip(why)
        out_features = self.linear.out_features
        what = "its output"
        user = self._only_user(self.linear_node, what, shape_users=True)
        if isinstance(user, str):
            return self.skip(user)
        if _is_mul(user):
            why = self._scale(user, out_features)
            if why:
                return self.skip(why)
            self.nodes.append(user)
            what = f"the product with {self.scale_path}"
            user = self._only_user(user, what, shape_users=True)
            if isinstance(user, str):
                return self.skip(user)
        to_channels = _move(user)
        if to_channels is not None:
            self.nodes.append(user)
            what = "the moved output"
            user = self._only_user(user, what)
            if isinstance(user, str):
                return self.skip(user)
        why = self._batch_norm(user, what, out_features)
        if why:
            return self.skip(why)
        self.bn_node = last = user
        last = self._take_activation(last)
        if to_channels is not None:
            back = self._only_user(last, "the BatchNorm's output")
            if isinstance(back, str) or _move(back) is None:
                what = back if isinstance(back, str) else f"the BatchNorm's output goes to {_describe(gm, back)}"
                return self.skip(f"{what}, not back to (B, T, C) by the inverse move")
            self.nodes.append(back)
            self.moves = (to_channels, _move(back))
            last = back
            if self.act_node is None:
                last = self._take_activation(last)
        self.last = last
        return self

    def _take_activation(self, node):
        """The activation after `node` into the chain where there is one we fuse; the chain's last node."""
        act, activation = _activation_after(self.gm, node)
        if act is None:
            return node
        self.nodes.append(act)
        self.act_node, self.activation = act, activation
        return act

    def _linear(self):
        """Why the Linear call cannot start a chain ("" where it can); sets self.linear."""
        gm, node = self.gm, self.linear_node
        if node.op == "call_module":
            linear = gm.get_submodule(node.target)
            if type(linear) is not nn.Linear:
                return f"a {type(linear).__name__}, a subclass of nn.Linear that may compute something else"
            hook = _hook(linear)
            if hook:
                return f"has {hook}, which the fused layer would not call"
            if len(node.args) != 1 or node.kwargs:
                return "called with keyword or extra arguments"
            self.linear, self.x = linear, node.args[0]
            return ""
        args = _bind(node, ("input", "weight", "bias"))
        if args is None or "weight" not in args:
            return "F.linear called with arguments it cannot bind"
        weight, bias = self._tensor(args["weight"], "weight"), self._tensor(args.get("bias"), "bias")
        for t in (weight, bias):
            if isinstance(t, str):
                return t
        if weight is None or weight.dim() != 2 or (bias is not None and bias.shape != (weight.shape[0],)):
            return "F.linear's weight and bias are not a 2-D weight and its [out_features] bias"
        holder = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(holder)
        holder.out_features, holder.in_features = weight.shape
        _hold(holder, "weight", weight)
        _hold(holder, "bias", bias)
        self.linear, self.x = holder, args["input"]
        return ""

    def _tensor(self, arg, what):
        """The model's tensor that get_attr `arg` reads (None for None), or why not."""
        if arg is None:
            return None
        value = _attr(self.gm, arg)
        if not isinstance(value, torch.Tensor):
            return f"its {what} is {_describe(self.gm, arg)}, not a parameter or buffer of the model"
        self.attrs.append(arg.target)
        return value

    def _only_user(self, node, what, shape_users=False):
        """node's one user, with users that read only its shape set aside (shape_users), or why not."""
        users = list(node.users)
        if shape_users:
            reads = [u for u in users if _reads_shape(u, node)]
            self.shape_users += reads
            users = [u for u in users if u not in reads]
        if len(users) == 1:
            return users[0]
        if not users:
            return f"{what} is unused"
        # Where one user continues the chain, name the others: what the user would have to change.
        nexts = [u for u in users if _is_batch_norm(self.gm, u) or _is_mul(u) or _move(u) is not None]
        if len(nexts) == 1:
            others = [_describe(self.gm, u) for u in users if u is not nexts[0]]
            subject = "the BN's input" if _is_batch_norm(self.gm, nexts[0]) else what
            return (f"{subject} has {'another user' if len(others) == 1 else 'other users'}: {', '.join(others)}; "
                    "the fused layer would not keep it")
        others = [_describe(self.gm, u) for u in users]
        return f"{what} has {len(users)} users ({', '.join(others)}); the fused layer would not keep it"

    def _scale(self, mul, out_features):
        """Why `mul` is not a product with a per-column scale ("" where it is); sets the scale."""
        gm = self.gm
        prev = self.nodes[-1]
        other = mul.args[1] if mul.args[0] is prev else mul.args[0]
        scale = _attr(gm, other)
        if not isinstance(scale, nn.Parameter):
            what = f"{other.target}, not an nn.Parameter" if isinstance(other, fx.Node) and other.op == "get_attr" \
                else _describe(gm, other)
            return f"its output is multiplied by {what}"
        if scale.shape != (out_features,):
            return f"its scale {other.target} has shape {tuple(scale.shape)}, not ({out_features},)"
        self.scale, self.scale_path = scale, other.target
        return ""

    def _batch_norm(self, node, what, out_features):
        """Why `node` is not a BatchNorm1d of the chain's last node (`what`) that we can take ("" where
        it is); sets self.bn and appends the node to the chain."""
        gm, bn_input = self.gm, self.nodes[-1]
        if node.op == "call_function" and node.target in _BATCH_NORMS:
            return self._functional_batch_norm(node, bn_input, out_features)
        bn = gm.get_submodule(node.target) if node.op == "call_module" else None
        if type(bn) not in (nn.BatchNorm1d, nn.SyncBatchNorm) or node.args != (bn_input,) or node.kwargs:
            scaled = self.scale is not None or len(self.nodes) > 1
            target = "an nn.BatchNorm1d" if scaled else "a BatchNorm1d or a multiplication by a scale"
            return f"{what} goes to {_describe(gm, node)}, not to {target}"
        self.nodes.append(node)
        hook = _hook(bn)
        if hook:
            return f"{node.target} has {hook}, which the fused layer would not call"
        if bn.num_features != out_features:
            return (f"{node.target} has num_features={bn.num_features} but the Linear has "
                    f"out_features={out_features} (it normalizes another dimension)")
        self.bn = bn
        return ""

    def _functional_batch_norm(self, node, bn_input, out_features):
        args = _bind(node, _BATCH_NORM_ARGS)
        self.nodes.append(node)
        if args is None or args.get("input") is not bn_input:
            return "F.batch_norm called with arguments it cannot bind"
        tensors = {k: self._tensor(args.get(k), k) for k in ("running_mean", "running_var", "weight", "bias")}
        for t in tensors.values():
            if isinstance(t, str):
                return t
        training, momentum, eps = args.get("training", False), args.get("momentum", 0.1), args.get("eps", 1e-5)
        if not (isinstance(training, bool) and isinstance(momentum, (int, float)) and isinstance(eps, (int, float))):
            return "its training, momentum and eps are not constants of the trace"
        running = tensors["running_mean"] is not None
        if running != (tensors["running_var"] is not None) or (not running and (not training or node in self.follows)):
            return ("its running stats are one without the other, or absent where it can run in eval (PyTorch "
                    "refuses that call)")
        if any(t is not None and t.shape != (out_features,) for t in tensors.values()):
            return f"its tensors are not of the Linear's out_features={out_features}"
        # A `training` that is the model's mode (self.training) follows it: a plain BatchNorm1d.
        kind = nn.BatchNorm1d if node in self.follows else _TracedBatchNorm
        bn = kind.__new__(kind)
        nn.Module.__init__(bn)
        bn.num_features, bn.eps, bn.momentum = out_features, float(eps), float(momentum)
        bn.affine = tensors["weight"] is not None or tensors["bias"] is not None
        bn.track_running_stats = running
        for name, t in tensors.items():
            _hold(bn, name, t)
        bn.register_buffer("num_batches_tracked", None)
        bn.training = training
        self.bn = bn
        return ""


def _replace(gm, chain, layers, consumed):
    """Puts the chain's fused layer (the one already made for the same modules and options, where a
    module is called twice) in the chain's place; returns its Fused entry."""
    activation, slope = chain.activation
    last = chain.last
    autocast_output = chain.scale is not None and bool(last.users) and all(
        _is_linear_input(gm, u, last) for u in last.users)
    # The same modules (or, for the functional forms, the same tensors and constants) and options.
    lin, bn = chain.linear, chain.bn
    linear_key = id(lin) if chain.linear_node.op == "call_module" else (id(lin.weight), id(lin.bias))
    bn_key = id(bn) if chain.bn_node.op == "call_module" else (
        id(bn.weight), id(bn.bias), id(bn.running_mean), id(bn.running_var), bn.eps, bn.momentum, bn.training)
    key = (linear_key, id(chain.scale), bn_key, activation, slope, autocast_output, chain.moves)
    name = layers.get(key)
    if name is None:
        if chain.scale is None:
            layer = LinearBatchNorm1d.from_modules(chain.linear, chain.bn, activation=activation, negative_slope=slope)
        else:
            layer = LinearScaleBatchNorm1d.from_modules(chain.linear, chain.scale, chain.bn, activation=activation,
                                                        negative_slope=slope)
        layer.autocast_output = autocast_output
        layer.channels_last = chain.moves
        layer.training = chain.bn.training  # not .train(): that would also set the shared modules' flags
        weight = _bind(chain.linear_node, ("input", "weight", "bias")) or {}
        stem = chain.linear_node.target if chain.linear_node.op == "call_module" else weight["weight"].target
        base = stem.replace(".", "_") + ("_scale_bn" if chain.scale is not None else "_bn")
        name, i = base, 1
        while hasattr(gm, name):
            name, i = f"{base}_{i}", i + 1
        gm.add_submodule(name, layer)
        layers[key] = name
    with gm.graph.inserting_before(chain.linear_node):
        new = gm.graph.call_module(name, (chain.x,))
    last.replace_all_uses_with(new)
    for user in chain.shape_users:  # h's shape is y's: (batch, out_features), or (B, T, C) in both forms
        user.replace_input_with(user.args[0], new)
    described = " -> ".join(_describe(gm, n) for n in chain.nodes)
    linear_path = _path_of(gm, chain.linear_node)
    for n in reversed(chain.nodes):
        gm.graph.erase_node(n)
    for n in list(gm.graph.nodes):  # the get_attr nodes the chain read, now unused
        if n.op == "get_attr" and not n.users and (n.target == chain.scale_path or n.target in chain.attrs):
            gm.graph.erase_node(n)
    consumed.update(chain.attrs + ([chain.scale_path] if chain.scale_path else []))
    bn_path = chain.bn_node.target if chain.bn_node.op == "call_module" else "F.batch_norm"
    return Fused(name, linear_path, chain.scale_path or "", bn_path,
                 _describe(gm, chain.act_node) if chain.act_node is not None else "", autocast_output, described)


# Activations fuse() absorbs: module types and functions, each to the layer's activation name
# and slope (from the call's arguments, see _activation_after).
_ACT_FUNCTIONS = {F.relu: "relu", torch.relu: "relu", torch.relu_: "relu", F.relu_: "relu",
                  F.leaky_relu: "leaky_relu", F.leaky_relu_: "leaky_relu", F.gelu: "gelu", F.silu: "silu"}
_ACT_METHODS = {"relu": "relu", "relu_": "relu"}


def _activation_after(gm, node_before):
    """(the node of the activation that is node_before's only user, (name, negative_slope)), or
    (None, (None, 0.01)) where there is none we can take whole."""
    none = None, (None, 0.01)
    users = list(node_before.users)
    if len(users) != 1:
        return none
    node = users[0]
    args, kwargs = list(node.args), dict(node.kwargs)
    if not args or args[0] is not node_before:
        return none
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        if _hook(m) or len(args) != 1 or kwargs:
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


def _move(node):
    """(method, args) where `node` swaps dims 1 and 2 of a (B, T, C) tensor (transpose(1, 2),
    either order or from the end, torch.transpose, permute(0, 2, 1), torch.permute), else None."""
    if not isinstance(node, fx.Node) or node.kwargs:
        return None
    if node.op == "call_method" and node.target in ("transpose", "swapaxes", "swapdims") or \
            node.op == "call_function" and node.target is torch.transpose:
        dims = node.args[1:]
        if len(dims) == 2 and all(isinstance(d, int) for d in dims) and {d % 3 for d in dims} == {1, 2}:
            return ("transpose", tuple(dims))
        return None
    if node.op == "call_method" and node.target == "permute" or node.op == "call_function" and node.target is torch.permute:
        dims = node.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        if len(dims) == 3 and all(isinstance(d, int) for d in dims) and tuple(d % 3 for d in dims) == (0, 2, 1):
            return ("permute", tuple(dims))
    return None


def _reads_shape(user, value):
    """Whether `user` reads only value's shape: .shape, .ndim, .device, .size(...), .dim()."""
    if user.op == "call_function" and user.target is getattr:
        return len(user.args) == 2 and user.args[0] is value and user.args[1] in _SHAPE_ATTRS
    if user.op == "call_method" and user.target in _SHAPE_METHODS:
        return user.args[0] is value and value not in user.args[1:] and value not in user.kwargs.values()
    return False


def _is_linear_input(gm, node, value):
    """Whether `node` is an nn.Linear (exactly) or F.linear call whose input is `value` alone,
    which under autocast casts its input to the autocast dtype first."""
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        return type(m) is nn.Linear and node.args == (value,) and not node.kwargs
    if node.op == "call_function" and node.target in _LINEARS:
        return bool(node.args) and node.args[0] is value and value not in node.args[1:] \
            and value not in node.kwargs.values()
    return False


def _drop_unused(gm, model, consumed):
    """Remove what the fused layers now hold from the module's other paths, so that its
    state_dict lists each tensor once."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    theirs = {id(m) for m in model.modules()}  # never delete from the caller's own modules
    for path in consumed - used:
        owner_path, _, attr = path.rpartition(".")
        owner = gm.get_submodule(owner_path)
        if (owner is gm or id(owner) not in theirs) and hasattr(owner, attr):
            delattr(owner, attr)
    gm.delete_all_unused_submodules()


def _hold(module, name, t):
    """Registers the model's tensor `t` (or None) on `module` as what it is there: a parameter, or
    a buffer."""
    if t is None or isinstance(t, nn.Parameter):
        module.register_parameter(name, t)
    else:
        module.register_buffer(name, t)


def _bind(node, names):
    """A call_function node's arguments by `names` (positional, then keywords), or None."""
    if len(node.args) > len(names) or set(node.kwargs) - set(names):
        return None
    bound = dict(zip(names, node.args))
    if set(bound) & set(node.kwargs):
        return None
    bound.update(node.kwargs)
    return bound


def _hook(m):
    """The kind of hook `m` has ("" for none)."""
    for attr, what in (("_forward_hooks", "a forward hook"), ("_forward_pre_hooks", "a forward pre-hook"),
                       ("_backward_hooks", "a backward hook"), ("_backward_pre_hooks", "a backward pre-hook")):
        if getattr(m, attr, None):
            return what
    return ""


def _is_batch_norm(gm, node):
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)) in (nn.BatchNorm1d, nn.SyncBatchNorm)
    return node.op == "call_function" and node.target in _BATCH_NORMS


def _is_mul(node):
    return len(node.args) == 2 and not node.kwargs and (
        (node.op == "call_function" and node.target in _MULS) or (node.op == "call_method" and node.target == "mul"))


def _attr(gm, node):
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return operator.attrgetter(node.target)(gm)
    return None


def _path_of(gm, linear_node):
    """The Linear's path: its module's, or F.linear's weight's."""
    if linear_node.op == "call_module":
        return linear_node.target
    weight = _bind(linear_node, ("input", "weight", "bias")) or {}
    w = weight.get("weight")
    return f"F.linear({w.target})" if isinstance(w, fx.Node) and w.op == "get_attr" else "F.linear"


def _type_name(m):
    cls = type(m)
    return f"nn.{cls.__name__}" if cls.__module__.startswith("torch.nn") else cls.__qualname__


def _describe(gm, x):
    """A node as the report names it: a module's path and type, a function's or method's name."""
    if not isinstance(x, fx.Node):
        return repr(x)
    if x.op == "call_module":
        return f"{x.target} ({_type_name(gm.get_submodule(x.target))})"
    if x.op == "call_function":
        if x.target in _LINEARS:
            return _path_of(gm, x)
        module = getattr(x.target, "__module__", "") or ""
        name = getattr(x.target, "__name__", str(x.target))
        return f"F.{name}" if module.endswith("nn.functional") else name
    if x.op == "call_method":
        return f".{x.target}()"
    if x.op == "output":
        return "the model's output"
    return str(x.target)
