"""LinearScaleBatchNorm1d: a drop-in for `bn(linear(x) * scale)` with the same state_dict."""
import copy

import torch
from torch import nn

from . import _activation
from . import _family
from .fp8 import DelayedState
from .fp8 import e4m3_kernels, eval_e4m3, train_e4m3
from .fp8 import check as fp8_check
from .fp8 import operands as fp8_operands
from .functional import linear_scale_batch_norm
from .sync_batch_norm import pickled_group, should_sync, sync_linear_scale_batch_norm


class LinearScaleBatchNorm1d(nn.Module):
    """`BatchNorm1d(Linear(x) * scale)`, then `activation`; parameters live in `gemm`, `scale` and
    `bn`, as in the unfused model, so checkpoints load either way.

    `activation`: None, "relu", "leaky_relu" (with `negative_slope`), "gelu", "gelu_tanh" (GELU
    with approximate="tanh") or "silu", applied in the normalizing kernel. `output_dtype`: y's
    dtype; None keeps the unfused model's (h * scale's: fp32 under autocast with an fp32 scale),
    a 16-bit dtype rounds y once from that value (what the next Linear would cast it to).

    `fp8`: None or a cutlass_fused.Float8Recipe: x and W rounded to e4m3 under per-tensor scales
    before the GEMM (cutlass_fused/fp8.py): the sm90 e4m3 kernels where _runs_e4m3 says, else
    emulated on the 16-bit kernels (CUDA refuses a recipe without emulate=True where the build has no
    e4m3 kernels). An attribute: set it on a fused layer.
    A delayed-scaling recipe adds the buffers `fp8_amax_history` and `fp8_scale` (state_dict), which
    training forwards update.

    `process_group`: None (the default) normalizes each process's batch alone; a
    process group (e.g. `torch.distributed.group.WORLD`) makes training use the
    statistics of the group's whole batch, as nn.SyncBatchNorm does, when
    torch.distributed is initialized and the group has more than one rank
    (cutlass_fused/sync_batch_norm.py). `convert_sync_batchnorm` sets it on a model.
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
        self._set_output(activation, negative_slope, output_dtype)
        fp8_check(fp8, torch.device("cpu"))  # a bad recipe fails before any allocation
        kw = {"device": device, "dtype": dtype}
        self.gemm = nn.Linear(in_features, out_features, bias=bias, **kw)
        self.scale = nn.Parameter(torch.randn(out_features, **kw))
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum, affine=affine,
                                 track_running_stats=track_running_stats, **kw)
        self.process_group = process_group
        self.fp8 = fp8

    def reset_parameters(self):
        """nn.Linear's and nn.BatchNorm1d's reset_parameters (the latter's running stats too), and
        scale drawn again from N(0, 1): construction's draws, in construction's order."""
        self.gemm.reset_parameters()
        with torch.no_grad():
            self.scale.normal_()
        self.bn.reset_parameters()

    def __deepcopy__(self, memo):
        """The default deep copy, but sharing the process group: a communicator is neither copied
        nor picklable, and the copy (an EMA model's, say) synchronizes over the same ranks. A model
        after nn.SyncBatchNorm.convert_sync_batchnorm copies too (its group is None there)."""
        if self.process_group is not None:
            memo[id(self.process_group)] = self.process_group
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

    @classmethod
    def from_modules(cls, linear: nn.Linear, scale: nn.Parameter, bn: nn.BatchNorm1d, process_group=None,
                     activation=None, negative_slope=0.01, output_dtype=None) -> "LinearScaleBatchNorm1d":
        """A layer that shares `linear`'s, `scale`'s and `bn`'s parameters and buffers."""
        # nn.SyncBatchNorm too: nn.SyncBatchNorm.convert_sync_batchnorm may have replaced our bn.
        if not isinstance(linear, nn.Linear) or not isinstance(bn, (nn.BatchNorm1d, nn.SyncBatchNorm)):
            raise TypeError("cutlass_fused: from_modules expects (nn.Linear, nn.Parameter, nn.BatchNorm1d)")
        if scale.shape != (linear.out_features,) or bn.num_features != linear.out_features:
            raise ValueError(f"cutlass_fused: expected scale and bn of size {linear.out_features}, but got "
                             f"{tuple(scale.shape)} and {bn.num_features}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._set_output(activation, negative_slope, output_dtype)
        self.gemm, self.scale, self.bn = linear, scale, bn
        self.process_group = process_group
        self.fp8 = None
        return self

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
        if should_sync(self.process_group, True):
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
        """Whether the e4m3 ops take x and W for a recipe without emulate: bf16 x and
        W (or under bf16 autocast an fp32 W and an fp32 or bf16 x), on the CPU or where e4m3_kernels
        says and the sm90 family is in force (the sm80 family, forced on a Hopper GPU, has no e4m3
        kernels: its FP8 calls run emulated)."""
        w = self.gemm.weight
        if x.device.type == "cuda" and (_family.current() == "sm80" or not e4m3_kernels(x.device)):
            return False
        history, scale = self._buffers.get("fp8_amax_history"), self._buffers.get("fp8_scale")
        if scale is not None and not history.dtype == scale.dtype == torch.float32:
            return False  # a delayed state cast by module.to(dtype): the ops keep it in fp32 only
        amp = torch.is_autocast_enabled(x.device.type)
        if amp:
            # x in bf16 too: the previous fused block's y under autocast (fuse()'s output_dtype).
            return (torch.get_autocast_dtype(x.device.type) == torch.bfloat16 and w.dtype == torch.float32
                    and x.dtype in (torch.float32, torch.bfloat16))
        return x.dtype == w.dtype == torch.bfloat16

    def forward(self, x):
        bn = self.bn
        output_dtype = self._output_dtype(x)
        # nn.BatchNorm1d's own rules for which statistics to use and update.
        track = bn.training and bn.track_running_stats
        use_batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
        keep_running = not bn.training or bn.track_running_stats
        running_mean = bn.running_mean if keep_running else None
        running_var = bn.running_var if keep_running else None
        nbt = bn.num_batches_tracked if track else None
        recipe = self.fp8
        state = None if recipe is None else self._fp8_state()
        if self._runs_e4m3(x, use_batch_stats, output_dtype):
            return train_e4m3(x, self.gemm.weight, self.gemm.bias, self.scale, bn.weight, bn.bias, running_mean,
                              running_var, nbt, bn.momentum, bn.eps, _family.current(), self.activation,
                              self.negative_slope, recipe.margin, output_dtype, recipe.backward, state,
                              recipe.amax_compute_algo, recipe.fast_accum)
        if self._runs_e4m3_eval(x, use_batch_stats):
            return eval_e4m3(x, self.gemm.weight, self.gemm.bias, self.scale, bn.weight, bn.bias, running_mean,
                             running_var, bn.eps, _family.current(), self.activation, self.negative_slope,
                             recipe.margin, output_dtype, state, recipe.fast_accum)
        x, weight = fp8_operands(x, self.gemm.weight, recipe, state, update=self.training)
        if should_sync(self.process_group, bn.training):
            return sync_linear_scale_batch_norm(x, weight, self.gemm.bias, self.scale, bn.weight, bn.bias,
                                                running_mean, running_var, bn.momentum, bn.eps, nbt,
                                                self.process_group, self.activation, self.negative_slope,
                                                output_dtype)
        return linear_scale_batch_norm(x, weight, self.gemm.bias, self.scale, bn.weight, bn.bias,
                                       running_mean, running_var, use_batch_stats, bn.momentum, bn.eps, nbt,
                                       self.activation, self.negative_slope, output_dtype)

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
        return out


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """nn.SyncBatchNorm.convert_sync_batchnorm for this layer: every LinearScaleBatchNorm1d in
    `module` becomes one that synchronizes over `process_group` (default: the whole world,
    which needs torch.distributed initialized first), sharing its parameters and buffers.
    Returns `module`, or a new layer when `module` itself is one. Plain BatchNorm layers are
    left to nn.SyncBatchNorm.convert_sync_batchnorm (either order works)."""
    if process_group is None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError("cutlass_fused: convert_sync_batchnorm needs torch.distributed initialized "
                               "(init_process_group) or an explicit process_group")
        process_group = torch.distributed.group.WORLD
    if isinstance(module, LinearScaleBatchNorm1d):
        out = LinearScaleBatchNorm1d.from_modules(module.gemm, module.scale, module.bn, process_group,
                                                  module.activation, module.negative_slope, module.output_dtype)
        out.autocast_output = module.autocast_output
        out.fp8 = module.fp8
        for name in ("fp8_amax_history", "fp8_scale"):  # one delayed-scaling state, shared
            if name in module._buffers:
                out._buffers[name] = module._buffers[name]
        out.train(module.training)
        return out  # its children are the shared Linear and BatchNorm: nothing to convert there
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, process_group))
    return module
