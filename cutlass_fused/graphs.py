"""cutlass_fused.graphed_step: a whole training step (forward, backward, optimizer) as one CUDA graph.

Why: a step of small layers is bound by the host, which issues each kernel after the GPU has run
the last one; replayed as one graph it runs at the GPU's pace (docs/decisions.md, "Training step").
torch.compile(mode="reduce-overhead") and torch.cuda.make_graphed_callables graph the forward and
the backward but leave the optimizer and the loss outside.

A graph replays the kernels it captured on the tensors it captured. So a step is one graph per
signature of its arguments (each tensor's shape, dtype, device; every other argument's value), and
the graphs are dropped when what the step closes over changes in a way a graph cannot see: a
module's mode, a parameter or buffer replaced, a parameter's requires_grad, an optimizer's
hyperparameters (a scheduler's float learning rate), the optimizer's parameters.
"""
import collections

import torch
from torch.utils import _pytree as pytree


class GraphedStep:
    """The callable graphed_step returns. Each call with a new signature runs `warmup` steps
    eagerly (on a side stream, as torch.cuda.graph asks), each a real step on its own arguments; the
    next call with it is captured and replayed, and every later one copies its tensors into the
    captured inputs and replays. A call returns fn's result with each tensor detached, and copied
    out of the graph, so that the next replay does not overwrite it."""

    def __init__(self, fn, modules, optimizers, warmup, max_graphs):
        self.fn, self.modules, self.optimizers = fn, modules, optimizers
        self.warmup, self.max_graphs = warmup, max_graphs
        self.graphs = collections.OrderedDict()  # signature -> Captured, least recently used first
        self.warm = collections.Counter()  # signature -> eager calls so far
        self.state = None

    def __call__(self, *args):
        key = signature(args)
        device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
        if device is None or torch.cuda.is_current_stream_capturing():
            return detached(self.fn(*args))  # nothing on a GPU to capture (the CPU), or in a user's own capture
        state = self.state_now()
        if state != self.state:
            self.graphs.clear()
            self.warm.clear()
            self.state = state
        captured = self.graphs.get(key)
        if captured is None and self.warm[key] < self.warmup:
            check_autocast(device)
            check_capturable(self.optimizers)
            self.warm[key] += 1
            # Detached, as a replay's: a loss kept with its autograd graph keeps this call's
            # AccumulateGrad nodes, made on the side stream, alive into the next call.
            return detached(on_side_stream(lambda: self.fn(*args), device))
        if captured is None:
            check_autocast(device)
            captured = self.graphs[key] = Captured(self.fn, args, device)
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        return captured.replay(args)

    def state_now(self):
        """What the step closes over that its graphs hold fixed: each module's mode and the identity,
        storage and requires_grad of its parameters and buffers; each optimizer's parameters and its
        hyperparameters other than tensors (a tensor learning rate is read by the graph itself)."""
        mods = tuple((m.training,) + tuple((id(t), t.data_ptr(), t.requires_grad)
                                           for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
                     for module in self.modules for m in module.modules())
        opts = tuple(tuple((id(p), p.data_ptr()) for p in group["params"])
                     + tuple((k, v) for k, v in group.items() if k != "params" and not isinstance(v, torch.Tensor))
                     for opt in self.optimizers for group in opt.param_groups)
        return mods, opts


class Captured:
    """One signature's graph: its input tensors (copies of the capturing call's), and fn's result."""

    def __init__(self, fn, args, device):
        self.inputs = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.graph(self.graph):
            # Detached: an output kept with its autograd graph would keep the AccumulateGrad nodes
            # made on the capture's stream for the next eager call (another signature's warm-up).
            self.out = detached(fn(*self.inputs))

    def replay(self, args):
        for static, a in zip(self.inputs, args):
            if isinstance(a, torch.Tensor):
                static.copy_(a)
        self.graph.replay()
        return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, self.out)


def detached(out):
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


def signature(args):
    key = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                raise ValueError(f"graphed_step: expected argument {i} not to require grad (a step's arguments are "
                                 "its data; the graph copies them into its own inputs), but it does")
            key.append((tuple(a.shape), a.dtype, a.device))
        else:
            try:
                hash(a)
            except TypeError:
                raise TypeError(f"graphed_step: expected argument {i} to be a tensor or a hashable value (it is "
                                f"part of the graph's key), but got {type(a).__name__}") from None
            key.append((type(a), a))
    return tuple(key)


def check_autocast(device):
    # Autocast's cache would hand the capture the casts an eager call made before it, so that every
    # replay would read those weights, stale after the first optimizer step. A region fn enters
    # itself begins and ends inside each call, and its cache with it.
    if torch.is_autocast_enabled(device.type) and torch.is_autocast_cache_enabled():
        raise RuntimeError("graphed_step: expected to be called outside torch.autocast, or inside one with "
                           "cache_enabled=False: its cache would keep casts of the weights from before the capture. "
                           "Enter autocast inside the step function instead.")


def check_capturable(optimizers):
    # Checked before the eager calls, so that a step that cannot be captured fails before it has
    # trained; on the CPU, where nothing is captured, capturable=True is not asked for.
    for opt in optimizers:
        for g, group in enumerate(opt.param_groups):
            if group.get("capturable") is False:
                raise ValueError(f"graphed_step: expected optimizers made with capturable=True (the step's "
                                 f"optimizer.step() is captured), but {type(opt).__name__}'s param group {g} has "
                                 "capturable=False")


def on_side_stream(fn, device):
    """fn() on a new stream that starts after the current stream's work and that the current stream
    then waits for: the warm-up torch.cuda.graph asks for before a capture. Returns fn's result."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        out = fn()
    current.wait_stream(side)
    return out


def graphed_step(fn, modules=(), optimizers=(), warmup=3, max_graphs=4):
    """`fn(*args)`, a whole training step, as a replayed CUDA graph when its tensors are on a GPU.

    fn is the step as it runs eagerly: the forward (under `torch.autocast` entered inside fn), the
    loss, `backward()`, `optimizer.step()`, and `zero_grad(set_to_none=True)` before or after. Pass
    the batch as arguments (tensors on the GPU); the graph reads everything else fn touches where the
    capture found it. `modules` and `optimizers` (one or a sequence of each) are what fn trains: a
    change to a module's mode, parameters or buffers, or to an optimizer's hyperparameters, makes
    the next call capture again (so a scheduler's float learning rate recaptures each time it moves;
    give the optimizer `lr=torch.tensor(...)` and the graph reads it). Optimizers must be made with
    `capturable=True` where they take it.

    The first `warmup` calls of each signature (tensor shapes, dtypes and devices, and the other
    arguments' values) run eagerly, the next is captured, later ones replay: each call is one step
    on its own arguments. A step with a new batch size is a new graph; `max_graphs` of them are
    kept, the least recently used dropped past that. A call returns fn's result with its tensors
    detached (a replay's copied out of the graph). On the CPU, fn runs eagerly.

        step = cutlass_fused.graphed_step(train_step, model, opt)
        for x, target in loader:
            loss = step(x.cuda(), target.cuda())
    """
    modules = (modules,) if isinstance(modules, torch.nn.Module) else tuple(modules)
    optimizers = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
    for i, m in enumerate(modules):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"graphed_step: expected modules to be nn.Modules, but got {type(m).__name__} at {i}")
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"graphed_step: expected optimizers to be torch.optim optimizers, but got "
                            f"{type(opt).__name__}")
    if not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"graphed_step: expected warmup to be an int of at least 1, but got {warmup!r}")
    if not isinstance(max_graphs, int) or max_graphs < 1:
        raise ValueError(f"graphed_step: expected max_graphs to be an int of at least 1, but got {max_graphs!r}")
    return GraphedStep(fn, modules, optimizers, warmup, max_graphs)
