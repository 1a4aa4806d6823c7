"""The layers: LinearBatchNorm1d, a drop-in for `bn(linear(x))`, and LinearScaleBatchNorm1d, for
`bn(linear(x) * scale)`; each with the unfused model's state_dict."""
import copy

import torch
from torch import nn

from . import _activation
from . import _family
from .fp8 import DelayedState
from .fp8 import e4m3_kernels, eval_e4m3, train_e4m3
from .fp8 import check as fp8_check
from .fp8 import operands as fp8_operands
from .functional import linear_scale_batch_norm, links, train_linked
from .sync_batch_norm import WORLD, pickled_group, should_sync, sync_linear_scale_batch_norm


class LinearBatchNorm1d(nn.Module):
    """`BatchNorm1d(Linear(x))`, then `activation`, as one GEMM and one kernel; the parameters live
    in `gemm` (an nn.Linear) and `bn` (an nn.BatchNorm1d, or an nn.SyncBatchNorm that fuse() found),
    as in the unfused model, so checkpoints load either way. It follows nn.BatchNorm1d's rules on
    `training`, `track_running_stats`, `affine` and `momentum=None`; with `bias=False` there is no
    linear bias. LinearScaleBatchNorm1d adds a per-column scale between the two.

    x is (batch, in_features). Any other shape runs as the unfused model runs it, in PyTorch's own
    ops: nn.BatchNorm1d takes a 3-D input's dim 1 as its channels, and refuses 1-D input with its
    ValueError. (cutlass_fused.fuse's (B, T, C) form, a BatchNorm over the channels of a sequence,
    runs fused on x.reshape(-1, in_features): `channels_last`.)

    `activation`: None, "relu", "leaky_relu" (with `negative_slope`), "gelu", "gelu_tanh" (GELU
    with approximate="tanh") or "silu", applied in the normalizing kernel. `output_dtype`: y's
    dtype; None keeps the unfused model's (with a scale, h * scale's: fp32 under autocast with an
    fp32 scale; without, h's, as nn.BatchNorm1d returns it), a 16-bit dtype rounds y once from that
    value (what the next Linear would cast it to).

    `fp8`: None or a cutlass_fused.Float8Recipe: x and W rounded to e4m3 under per-tensor scales
    before the GEMM (cutlass_fused/fp8.py): the sm90 e4m3 kernels where _runs_e4m3 says, else
    emulated on the 16-bit kernels (CUDA refuses a recipe without emulate=True where the build has no
    e4m3 kernels). An attribute: set it on a fused layer.
    A delayed-scaling recipe adds the buffers `fp8_amax_history` and `fp8_scale` (state_dict), which
    training forwards update.

    `process_group`: None (the default) normalizes each process's batch alone, unless `bn` is an
    nn.SyncBatchNorm, whose own process_group (or the whole world) it then follows; a process group
    (e.g. `torch.distributed.group.WORLD`) makes training use the statistics of the group's whole
    batch, as nn.SyncBatchNorm does, when torch.distributed is initialized and the group has more
    than one rank (cutlass_fused/sync_batch_norm.py). `convert_sync_batchnorm` sets it on a model.
    """

    @property
    def fp8(self):
        # "fp8": the plain attribute of layers pickled before it was a property
        return self.__dict__.get("_fp8", self.__dict__.get("fp8"))

    @fp8.setter
    def fp8(self, recipe):
        recipe = fp8_check(recipe, torch.device("cpu"))  # its type now; CUDA's refusal at the call
        self.__dict__["_fp8"] = recipe
        if recipe is not None and recipe.delayed:
            # The state stays across a recipe of the same history length; another starts afresh.
            old = self._buffers.get("fp8_amax_history")
            if old is None or old.shape[0] != recipe.amax_history_len:
                for name, t in DelayedState.buffers(recipe, self.gemm.weight.device).items():
                    self.register_buffer(name, t)
        else:
            for name in ("fp8_amax_history", "fp8_scale"):
                self._buffers.pop(name, None)

    def _fp8_state(self):
        if "fp8_scale" not in self._buffers:
            return None
        return DelayedState(self.fp8_amax_history, self.fp8_scale)

    def __init__(self, in_features, out_features, bias=True, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None, process_group=None, activation=None,
                 negative_slope=0.01, output_dtype=None, fp8=None):
        super().__init__()
        self._build(in_features, out_features, bias, eps, momentum, affine, track_running_stats, device, dtype,
                    process_group, activation, negative_slope, output_dtype, fp8, with_scale=False)

    def _build(self, in_features, out_features, bias, eps, momentum, affine, track_running_stats, device, dtype,
               process_group, activation, negative_slope, output_dtype, fp8, with_scale):
        """The construction both layers share, in the unfused model's order of draws: the Linear,
        the scale (N(0, 1)) where there is one, then the BatchNorm."""
        self._set_output(activation, negative_slope, output_dtype)
        fp8_check(fp8, torch.device("cpu"))  # a bad recipe fails before any allocation
        kw = {"device": device, "dtype": dtype}
        self.gemm = nn.Linear(in_features, out_features, bias=bias, **kw)
        # None (LinearBatchNorm1d) is registered too, as nn.Linear's bias=False is: no state_dict entry.
        self.register_parameter("scale", nn.Parameter(torch.randn(out_features, **kw)) if with_scale else None)
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum, affine=affine,
                                 track_running_stats=track_running_stats, **kw)
        self.process_group = process_group
        self.fp8 = fp8

    def reset_parameters(self):
        """nn.Linear's and nn.BatchNorm1d's reset_parameters (the latter's running stats too), and
        a scale drawn again from N(0, 1): construction's draws, in construction's order."""
        self.gemm.reset_parameters()
        if self.scale is not None:
            with torch.no_grad():
                self.scale.normal_()
        self.bn.reset_parameters()

    def __deepcopy__(self, memo):
        """The default deep copy, but sharing the process group: a communicator is neither copied
        nor picklable, and the copy (an EMA model's, say) synchronizes over the same ranks. A model
        after nn.SyncBatchNorm.convert_sync_batchnorm copies too (its group is None there)."""
        for group in (self.process_group, getattr(self.bn, "process_group", None)):
            if group is not None:
                memo[id(group)] = group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        return new

    def __getstate__(self):
        """Pickling (torch.save of the model): the default group becomes sync_batch_norm.WORLD,
        which the loading process resolves to its own; another group is refused by name."""
        state = super().__getstate__()
        if "process_group" in state:
            state["process_group"] = pickled_group(state["process_group"])
        return state

    def _set_output(self, activation, negative_slope, output_dtype):
        self.activation, self.negative_slope = _activation.check(activation, negative_slope)
        if output_dtype is not None and not (isinstance(output_dtype, torch.dtype) and output_dtype.is_floating_point):
            raise ValueError(f"cutlass_fused: expected output_dtype to be None or a floating-point torch.dtype, "
                             f"but got {output_dtype!r}")
        self.output_dtype = output_dtype
        # Set by cutlass_fused.fuse where every user of y is a Linear: under autocast (and with no
        # output_dtype) y comes in the autocast dtype, the bits that Linear would cast it to.
        self.autocast_output = False
        # Set by cutlass_fused.fuse for its (B, T, C) forms: ((method, args), (method, args)), the
        # moves of the channels to dim 1 and back around the BatchNorm; x is then (B, T, in_features).
        self.channels_last = None

    @classmethod
    def from_modules(cls, linear: nn.Linear, bn: nn.BatchNorm1d, process_group=None, activation=None,
                     negative_slope=0.01, output_dtype=None) -> "LinearBatchNorm1d":
        """A layer that shares `linear`'s and `bn`'s parameters and buffers."""
        return cls._shared(linear, None, bn, process_group, activation, negative_slope, output_dtype)

    @classmethod
    def _shared(cls, linear, scale, bn, process_group, activation, negative_slope, output_dtype):
        # nn.SyncBatchNorm too: nn.SyncBatchNorm.convert_sync_batchnorm may have replaced our bn.
        if not isinstance(linear, nn.Linear) or not isinstance(bn, (nn.BatchNorm1d, nn.SyncBatchNorm)):
            raise TypeError(f"cutlass_fused: {cls.__name__}.from_modules expects an nn.Linear and an "
                            f"nn.BatchNorm1d, but got {type(linear).__name__} and {type(bn).__name__}")
        n = linear.out_features
        if bn.num_features != n or (scale is not None and scale.shape != (n,)):
            got = f"{bn.num_features}" if scale is None else f"{tuple(scale.shape)} and {bn.num_features}"
            raise ValueError(f"cutlass_fused: expected {'bn' if scale is None else 'scale and bn'} of size {n}, "
                             f"but got {got}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._set_output(activation, negative_slope, output_dtype)
        self.gemm, self.bn = linear, bn
        if scale is None:
            self.register_parameter("scale", None)
        else:
            self.scale = scale
        self.process_group = process_group
        self.fp8 = None
        return self

    def _group(self, bn=None):
        """The process group training syncs over (where should_sync says): the layer's own, else an
        nn.SyncBatchNorm's (its None meaning the whole world, as there). bn: self.bn, where the
        caller holds it already."""
        bn = self.bn if bn is None else bn
        if self.process_group is not None or not isinstance(bn, nn.SyncBatchNorm):
            return self.process_group
        return bn.process_group if bn.process_group is not None else WORLD

    def _output_dtype(self, x):
        if self.output_dtype is None and self.autocast_output and torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return self.output_dtype

    def _runs_e4m3(self, x, use_batch_stats, output_dtype):
        """Whether this call runs the e4m3 training op (fp8.train_e4m3): training with batch
        statistics on one process, where _e4m3_takes(x); either scaling. Other FP8 calls run the
        emulated path: the same values at the 16-bit kernels' speed."""
        r = self.fp8
        if r is None or r.emulate or not use_batch_stats or not self.bn.training:
            return False
        if should_sync(self._group(), True):
            return False
        return self._e4m3_takes(x)

    def _runs_e4m3_eval(self, x, use_batch_stats):
        """Whether this call runs the e4m3 eval op (fp8.eval_e4m3): eval with the running statistics,
        no gradient asked for (the op has no autograd: inference), where _e4m3_takes(x)."""
        r = self.fp8
        if r is None or r.emulate or use_batch_stats:
            return False
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            return False
        return self._e4m3_takes(x)

    def _e4m3_takes(self, x):
        """Whether the e4m3 ops take x and W for a recipe without emulate: the operands reach the
        GEMM in bf16 (bf16 x and W, or under bf16 autocast an fp32 W and an fp32 or bf16 x), the
        delayed state (if any) is fp32, and, on CUDA, the plan runs the e4m3 route there
        (fp8.e4m3_kernels: the sm90 family in force and its e4m3 rows built; the sm80 family,
        forced on a Hopper GPU, has none, and its FP8 calls run emulated). The CPU runs the e4m3
        ops' reference."""
        w = self.gemm.weight
        history, scale = self._buffers.get("fp8_amax_history"), self._buffers.get("fp8_scale")
        if scale is not None and not history.dtype == scale.dtype == torch.float32:
            return False  # a delayed state cast by module.to(dtype): the ops keep it in fp32 only
        if torch.is_autocast_enabled(x.device.type):
            # x in bf16 too: the previous fused block's y under autocast (fuse()'s output_dtype).
            operands = torch.get_autocast_dtype(x.device.type)
            if not (w.dtype == torch.float32 and x.dtype in (torch.float32, torch.bfloat16)):
                return False
        elif x.dtype == w.dtype:
            operands = x.dtype
        else:
            return False
        if x.device.type == "cuda":
            return e4m3_kernels(x.device, _family.current(), operands)
        return operands == torch.bfloat16

    def forward(self, x, link=False):
        """y for x. `link` (cutlass_fused.fuse sets it where this layer's y is the next fused layer's
        x alone): True for the first of such layers, else the previous one's Link, or None where it
        had none; the call then returns (y, this layer's Link or None), and in training the next
        layer's backward runs this one's BN backward in its dX GEMM (functional.train_linked)."""
        if link is not False:
            return self._linked(x, None if link is True else link)
        moves = self.channels_last
        if moves is not None and x.dim() == 3 and not (self.bn.training and x.shape[0] * x.shape[1] == 1):
            # The (B, T, C) form: statistics over B and T, as the BatchNorm over dim 1 of the moved
            # tensor takes them.
            y = self._fused(x.reshape(-1, x.shape[-1]))
            return y.view(*x.shape[:-1], y.shape[-1])
        if moves is not None or x.dim() != 2:
            return self._unfused(x)
        return self._fused(x)

    def _linked(self, x, prev):
        """(y, Link) from train_linked where this call trains with batch statistics on the plain
        route (one process, no FP8 recipe, 2-D x of two rows or more, eps > 0, autograd recording),
        outside FSDP, where functional.links says, else (the plain call's y, None). FSDP (either
        version marks the modules it manages) may free this layer's parameters after its forward,
        before the next layer's backward would read its BN vectors."""
        if getattr(self, "_is_fsdp_managed_module", False) or not links(x, self.activation):
            return self.forward(x), None
        bn, gemm = self.bn, self.gemm
        use_batch_stats, running_mean, running_var, nbt = self._bn_args(bn)
        if not (use_batch_stats and torch.is_grad_enabled() and self.fp8 is None and self.channels_last is None
                and x.dim() == 2 and x.shape[0] > 1 and bn.eps > 0 and not should_sync(self._group(bn), bn.training)):
            return self.forward(x), None
        return train_linked(x, gemm.weight, gemm.bias, self.scale, bn.weight, bn.bias, running_mean, running_var,
                            bn.momentum, bn.eps, nbt, self.activation, self.negative_slope, self._output_dtype(x),
                            prev)

    @staticmethod
    def _bn_args(bn):
        """nn.BatchNorm1d's own rules for which statistics to use and update: (use_batch_stats,
        running_mean, running_var, num_batches_tracked)."""
        training, mean, var = bn.training, bn.running_mean, bn.running_var
        track = training and bn.track_running_stats
        use_batch_stats = training or (mean is None and var is None)
        keep_running = not training or bn.track_running_stats
        return (use_batch_stats, mean if keep_running else None, var if keep_running else None,
                bn.num_batches_tracked if track else None)

    def _fused(self, x):
        # Each submodule, parameter and buffer read once: nn.Module's attribute lookup costs about a
        # microsecond of host time a read, and a small layer is bound by the host (docs/decisions.md,
        # "Known gaps": the small step eagerly).
        bn, gemm = self.bn, self.gemm
        output_dtype = self._output_dtype(x)
        use_batch_stats, running_mean, running_var, nbt = self._bn_args(bn)
        recipe = self.fp8
        if recipe is None:
            return self._run(x, bn, gemm, gemm.weight, use_batch_stats, running_mean, running_var, nbt,
                             output_dtype)
        state = self._fp8_state()
        if self._runs_e4m3(x, use_batch_stats, output_dtype):
            return train_e4m3(x, gemm.weight, gemm.bias, self.scale, bn.weight, bn.bias, running_mean,
                              running_var, nbt, bn.momentum, bn.eps, _family.current(), self.activation,
                              self.negative_slope, recipe.margin, output_dtype, recipe.backward, state,
                              recipe.amax_compute_algo, recipe.fast_accum)
        if self._runs_e4m3_eval(x, use_batch_stats):
            return eval_e4m3(x, gemm.weight, gemm.bias, self.scale, bn.weight, bn.bias, running_mean,
                             running_var, bn.eps, _family.current(), self.activation, self.negative_slope,
                             recipe.margin, output_dtype, state, recipe.fast_accum)
        x, weight = fp8_operands(x, gemm.weight, recipe, state, update=self.training)
        return self._run(x, bn, gemm, weight, use_batch_stats, running_mean, running_var, nbt, output_dtype)

    def _run(self, x, bn, gemm, weight, use_batch_stats, running_mean, running_var, nbt, output_dtype):
        """linear_scale_batch_norm, or its synchronized form where should_sync says, with weight as the
        GEMM takes it (rounded, under an emulated FP8 recipe)."""
        group = self._group(bn)
        if group is not None and should_sync(group, bn.training):
            return sync_linear_scale_batch_norm(x, weight, gemm.bias, self.scale, bn.weight, bn.bias,
                                                running_mean, running_var, bn.momentum, bn.eps, nbt, group,
                                                self.activation, self.negative_slope, output_dtype)
        return linear_scale_batch_norm(x, weight, gemm.bias, self.scale, bn.weight, bn.bias,
                                       running_mean, running_var, use_batch_stats, bn.momentum, bn.eps, nbt,
                                       self.activation, self.negative_slope, output_dtype)

    def _unfused(self, x):
        """The unfused model's own computation, in PyTorch's ops, for the inputs the fused layer does
        not take (not 2-D; fuse()'s (B, T, C) form given another shape): PyTorch's result, or its
        error. The BatchNorm runs as the module it is, with its checks and its process group."""
        recipe = self.fp8
        x, weight = fp8_operands(x, self.gemm.weight, recipe, None if recipe is None else self._fp8_state(),
                                 update=self.training)
        h = torch.nn.functional.linear(x, weight, self.gemm.bias)
        if self.scale is not None:
            h = h * self.scale
        to_channels, back = self.channels_last or (None, None)
        if to_channels:
            h = getattr(h, to_channels[0])(*to_channels[1])
        y = self.bn(h)
        if back:
            y = getattr(y, back[0])(*back[1])
        y = _activation.apply(y, self.activation, self.negative_slope)
        output_dtype = self._output_dtype(x)
        return y if output_dtype is None else y.to(output_dtype)

    def extra_repr(self):
        out = f"in_features={self.gemm.in_features}, out_features={self.gemm.out_features}"
        if self.activation != "none":
            out += f", activation={self.activation!r}"
            if self.activation == "leaky_relu":
                out += f", negative_slope={self.negative_slope}"
        if self.output_dtype is not None:
            out += f", output_dtype={self.output_dtype}"
        if self.fp8 is not None:
            out += f", fp8={self.fp8}"
        if self.channels_last is not None:
            out += ", channels_last"
        return out


class LinearScaleBatchNorm1d(LinearBatchNorm1d):
    """`BatchNorm1d(Linear(x) * scale)`, then `activation`: LinearBatchNorm1d with a per-column
    `scale` (an nn.Parameter of out_features, drawn from N(0, 1)) between the Linear and the
    BatchNorm, as KernelBench's seed model has it. Its parameters live in `gemm`, `scale` and `bn`."""

    def __init__(self, in_features, out_features, bias=True, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None, process_group=None, activation=None,
                 negative_slope=0.01, output_dtype=None, fp8=None):
        nn.Module.__init__(self)
        self._build(in_features, out_features, bias, eps, momentum, affine, track_running_stats, device, dtype,
                    process_group, activation, negative_slope, output_dtype, fp8, with_scale=True)

    @classmethod
    def from_modules(cls, linear: nn.Linear, scale: nn.Parameter, bn: nn.BatchNorm1d, process_group=None,
                     activation=None, negative_slope=0.01, output_dtype=None) -> "LinearScaleBatchNorm1d":
        """A layer that shares `linear`'s, `scale`'s and `bn`'s parameters and buffers."""
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"cutlass_fused: LinearScaleBatchNorm1d.from_modules expects a scale tensor, but got "
                            f"{type(scale).__name__}")
        return cls._shared(linear, scale, bn, process_group, activation, negative_slope, output_dtype)


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """nn.SyncBatchNorm.convert_sync_batchnorm for the fused layers: every LinearBatchNorm1d and
    LinearScaleBatchNorm1d in `module` becomes one that synchronizes over `process_group` (default:
    the whole world, which needs torch.distributed initialized first), sharing its parameters and
    buffers. Returns `module`, or a new layer when `module` itself is one. Plain BatchNorm layers are
    left to nn.SyncBatchNorm.convert_sync_batchnorm (either order works)."""
    if process_group is None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError("cutlass_fused: convert_sync_batchnorm needs torch.distributed initialized "
                               "(init_process_group) or an explicit process_group")
        process_group = torch.distributed.group.WORLD
    if isinstance(module, LinearBatchNorm1d):
        out = type(module)._shared(module.gemm, module.scale, module.bn, process_group, module.activation,
                                   module.negative_slope, module.output_dtype)
        out.autocast_output = module.autocast_output
        out.channels_last = module.channels_last
        out.fp8 = module.fp8
        for name in ("fp8_amax_history", "fp8_scale"):  # one delayed-scaling state, shared
            if name in module._buffers:
                out._buffers[name] = module._buffers[name]
        out.train(module.training)
        return out  # its children are the shared Linear and BatchNorm: nothing to convert there
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, process_group))
    return module
