"""SyncBatchNorm for the fused layer: the batch statistics of a whole process group.

Forward: linear_stats gives each rank h and its fp64 column sums; sync_batch_norm_row
packs them as [count, mean(N), M2(N)]; one all_gather of that row per rank;
sync_batch_norm_merge merges the rows by Chan's formula in rank order (so all
ranks hold the same bits, and uneven or single-sample batches merge exactly)
into finalize's and the running stats' sums; then batch_norm_finalize and
update_running_stats; the activation is finalize's. Backward: batch_norm_backward_reduce
(this rank's fp64 sum g and sum g (h - mean_h), g = dy times the activation's
derivative), one all_reduce of them, batch_norm_backward_elemt (dh from the
group's sums, grad_column's formulas in csrc/kernels/bn_backward.cu), then the
linear GEMMs: the kernels of the unsynced backward, its two passes apart. The
parameters' gradients are this rank's sums, as the unfused model under
nn.SyncBatchNorm gives them (DDP averages them), from per-column vectors only
(sync_batch_norm_grads); the linear bias's is not zero on one rank, only summed
over all ranks. The column arithmetic between the collectives is three ops, one
launch each on CUDA (csrc/kernels/sync_stats.h): as ~50 torch ops a layer and
step it made the eager step under DDP host-bound.
"""
import torch
import torch.distributed as dist

from . import _activation, _family
from .frozen import may_cache
from .ops import ops


class _World:
    """A pickled layer's stand-in for the default group (torch.save of a converted model): a
    ProcessGroup cannot be pickled, and the default group of the process that loads the layer
    is the one it means. Resolved at each call, so a layer loaded before init_process_group syncs
    once it is up."""

    def __reduce__(self):
        return "WORLD"  # pickled as this module's global: one instance, unpickled as itself

    def __repr__(self):
        return "cutlass_fused.sync_batch_norm.WORLD"


WORLD = _World()


def resolve_group(process_group):
    """The group a layer's process_group names: WORLD is the default group, or None where
    torch.distributed is not initialized (then nothing syncs, as nn.SyncBatchNorm falls back)."""
    if process_group is WORLD:
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return process_group


def pickled_group(process_group):
    """process_group as a layer's pickled state holds it: WORLD for the default group. Any other
    group cannot be pickled (nor can nn.SyncBatchNorm's); the error says what can."""
    if process_group is None or process_group is WORLD:
        return process_group
    if dist.is_available() and dist.is_initialized() and process_group == dist.group.WORLD:
        return WORLD
    raise TypeError("cutlass_fused: cannot pickle a LinearScaleBatchNorm1d synchronized over a process "
                    "group other than the default one (torch.distributed.group.WORLD); save its state_dict(), "
                    "or pickle the model before convert_sync_batchnorm")


def should_sync(process_group, training: bool) -> bool:
    """nn.SyncBatchNorm's rule: in training, with torch.distributed up and more than one rank in the group."""
    process_group = resolve_group(process_group)
    return (process_group is not None and training and dist.is_available() and dist.is_initialized()
            and dist.get_world_size(process_group) > 1)


def _gather_rows(row, group):
    """(world, len(row)): every rank's row, in rank order, in one collective."""
    world = dist.get_world_size(group)
    if dist.get_backend(group) == "gloo":  # gloo has no single-tensor all_gather in older torch
        rows = [torch.empty_like(row) for _ in range(world)]
        dist.all_gather(rows, row, group)
        return torch.stack(rows)
    out = row.new_empty(world * row.numel())
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, row, group)  # the new name, where torch has it
    return out.view(world, -1)


class SyncFunction(torch.autograd.Function):
    """y = act(BN(h * scale)) (BN(h) where scale is None) with the group's statistics; also returns
    update_running_stats' sums (count 2)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale, bn_weight, bn_bias, eps, group, family, activation, negative_slope):
        h, stats = ops.linear_stats(x, weight, bias, family, may_cache(weight, bias))
        row = ops.sync_batch_norm_row(stats, x.shape[0])
        merged, running_stats, count = ops.sync_batch_norm_merge(_gather_rows(row, group))
        y, mean_h, invstd = ops.batch_norm_finalize(h, merged, scale, 1, bn_weight, bn_bias, eps, activation,
                                                    negative_slope)
        ctx.save_for_backward(x, weight, h, mean_h, invstd, scale, bn_weight, bn_bias, count, row)
        ctx.group, ctx.family, ctx.eps = group, family, eps
        ctx.activation, ctx.negative_slope = activation, negative_slope
        ctx.dtypes = (None if bias is None else bias.dtype, None if bn_bias is None else bn_bias.dtype)
        ctx.mark_non_differentiable(running_stats)
        ctx.set_materialize_grads(False)  # no zeros launched for running_stats' gradient, which is never used
        return y, running_stats

    @staticmethod
    def backward(ctx, dy, *_):
        x, weight, h, mean_h, invstd, scale, bn_weight, bn_bias, count, row = ctx.saved_tensors
        bn = (mean_h, invstd, scale, bn_weight)
        act = (ctx.eps, bn_bias, ctx.activation, ctx.negative_slope)
        local = ops.batch_norm_backward_reduce(dy, h, *bn, *act)
        sums = local.clone()
        # Every rank reaches here (nn.SyncBatchNorm's rule), whichever gradients it needs.
        dist.all_reduce(sums, group=ctx.group)
        need = ctx.needs_input_grad
        out = [None] * 11
        if need[0] or need[1]:
            dh = ops.batch_norm_backward_elemt(dy, h, *bn, sums, count, *act)
            # fp32 through our matmul op, which keeps the forward's precision (csrc/autograd.cpp).
            mm = (lambda p, r: ops.matmul(p, r, ctx.family)) if dh.dtype == torch.float32 else torch.mm
            if need[0]:
                out[0] = mm(dh, weight)
            if need[1]:
                out[1] = mm(dh.t(), x)
        if any(need[2:6]):
            grads = ops.sync_batch_norm_grads(local, sums, row, count, mean_h, invstd, scale, bn_weight)
            dtypes = (ctx.dtypes[0], None if scale is None else scale.dtype,
                      None if bn_weight is None else bn_weight.dtype, ctx.dtypes[1])
            wanted = {dtype for i, dtype in enumerate(dtypes, 2) if need[i]}
            if len(wanted) == 1:  # one cast of all four where the dtypes agree (the usual case)
                grads = grads.to(wanted.pop())
            for i, (g, dtype) in enumerate(zip(grads.unbind(), dtypes), 2):
                if need[i]:
                    out[i] = g.to(dtype)
        return tuple(out)


def _autocast(t, device_type):
    """t as F.linear's autocast casts it (csrc/autocast.cpp): floating, non-fp64 tensors to the autocast dtype."""
    if t is None or not torch.is_autocast_enabled(device_type) or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(torch.get_autocast_dtype(device_type))


def sync_linear_scale_batch_norm(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, momentum,
                                 eps, num_batches_tracked, process_group, activation=None, negative_slope=0.01,
                                 output_dtype=None):
    """The training forward of linear_scale_batch_norm with the statistics of `process_group`'s whole batch.

    Running stats (when given) take the group's mean and unbiased variance, and
    num_batches_tracked (when given) +1, as nn.SyncBatchNorm; momentum=None is
    the cumulative average. The activation is fused as in linear_scale_batch_norm;
    an output_dtype is a cast of y afterwards.
    """
    activation, negative_slope = _activation.check(activation, negative_slope)
    process_group = resolve_group(process_group)
    if x.dim() != 2:
        raise ValueError(f"cutlass_fused: expected 2-D input (batch, in_features), but got {x.dim()}-D")
    dev = x.device.type
    x, weight, bias = (_autocast(t, dev) for t in (x, weight, bias))
    with torch.autocast(dev, enabled=False):
        y, running_stats = SyncFunction.apply(x, weight, bias, scale, bn_weight, bn_bias, eps, process_group,
                                              _family.current(), activation, negative_slope)
        if running_mean is not None:
            if num_batches_tracked is not None:
                num_batches_tracked.add_(1)
            # Count 2: running_stats are the sums whose count / (count - 1) correction gives the
            # group's unbiased var (sync_batch_norm_merge).
            ops.update_running_stats(running_stats, scale, 2, running_mean, running_var, num_batches_tracked,
                                     None if momentum is None else float(momentum))
    return y if output_dtype is None else y.to(output_dtype)
