"""SyncBatchNorm for the fused layer: the batch statistics of a whole process group.

Forward: linear_stats gives each rank h and its fp64 column sums; one all_gather
of a packed fp64 row [count, mean(N), M2(N)] per rank; every rank merges the rows
by Chan's formula in rank order (so all ranks hold the same bits, and uneven or
single-sample batches merge exactly); then batch_norm_finalize and
update_running_stats; the activation is finalize's. Backward: batch_norm_backward_reduce
(this rank's fp64 sum g and sum g (h - mean_h), g = dy times the activation's
derivative), one all_reduce of them, batch_norm_backward_elemt (dh from the
group's sums, grad_column's formulas in csrc/kernels/bn_backward.cu), then the
linear GEMMs: the kernels of the unsynced backward, its two passes apart. The
parameters' gradients are this rank's sums, as the unfused model under
nn.SyncBatchNorm gives them (DDP averages them), from per-column vectors only
(_local_grads); the linear bias's is not zero on one rank, only summed over all
ranks.
"""
import torch
import torch.distributed as dist

from . import _activation, _family
from .frozen import may_cache
from .ops import ops


def should_sync(process_group, training: bool) -> bool:
    """nn.SyncBatchNorm's rule: in training, with torch.distributed up and more than one rank in the group."""
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


def merge_stats(rows):
    """Chan's pairwise merge of per-rank [count, mean(N), M2(N)] rows, in row order.

    M2 = M2a + M2b + delta^2 na nb / n adds no cancellation, unlike sums of
    squares, so a column whose mean is far above its spread merges exactly
    (Chan, Golub & LeVeque). Ranks with count 0 add nothing.
    """
    n = (rows.shape[1] - 1) // 2
    count, mean, m2 = rows[0, :1], rows[0, 1:n + 1], rows[0, n + 1:]
    for row in rows[1:]:
        nb, mean_b, m2_b = row[:1], row[1:n + 1], row[n + 1:]
        total = count + nb
        delta = mean_b - mean
        frac = nb / total.clamp_min(1)
        mean = mean + delta * frac
        m2 = m2 + m2_b + delta * delta * count * frac
        count = total
    return count, mean, m2


def _sums_for(k, mean, var):
    """Column sums that the split ops turn back into `mean` and the biased `var` for count k.

    The ops take the count as a host int, but the merged count lives on the
    device; reading it would stall the stream once per layer and step. So
    finalize gets k = 1 and update_running_stats k = 2 with a var chosen so
    that its count/(count-1) correction yields the total count's unbiased var.
    """
    return torch.stack([k * mean, k * (var + mean * mean)])


def _local_row(stats, m):
    """This rank's [count, mean, M2] from its fp64 sums. M2 = Q - S mean cancels, but in fp64 it keeps
    ~1e-10 relative at mean/std = 1e3, as the unsynced path's own moments (README, Statistics)."""
    count = stats.new_full((1,), float(m))
    mean = stats[0] / max(m, 1)
    m2 = (stats[1] - stats[0] * mean).clamp_min(0)
    return torch.cat([count, mean, m2])


def _local_grads(local, sums, row, count, mean_h, invstd, scale, bn_weight):
    """This rank's sums of dz and dz h over its rows, from column vectors alone (fp64).

    dz = w istd (g - sdy / count - K (h - mean_h)) with K = s^2 istd^2 q / count, where
    (sdy, q) are the group's sums of g and g (h - mean_h) and `local` this rank's. Its
    row sums need this rank's sum of (h - mean_h) and of its square: m (mean - mean_h)
    and M2 + m (mean - mean_h)^2, from the forward's [count, mean, M2] row.
    """
    n = mean_h.numel()
    m, mean, m2 = row[:1], row[1:n + 1], row[n + 1:]
    s, istd = scale.double(), invstd
    w = torch.ones_like(s) if bn_weight is None else bn_weight.double()
    sdy, q = sums
    k = s * s * istd * istd * q / count
    d = mean - mean_h
    shc, shc2 = m * d, m2 + m * d * d
    dz_sum = w * istd * (local[0] - m * sdy / count - k * shc)
    dzhc_sum = w * istd * (local[1] - sdy / count * shc - k * shc2)
    return dz_sum, dzhc_sum


class SyncFunction(torch.autograd.Function):
    """y = act(BN(h * scale)) with the group's statistics; also returns the merged (count, mean_h, M2)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale, bn_weight, bn_bias, eps, group, family, activation, negative_slope):
        h, stats = ops.linear_stats(x, weight, bias, family, may_cache(weight, bias))
        row = _local_row(stats, x.shape[0])
        count, mean, m2 = merge_stats(_gather_rows(row, group))
        y, mean_h, invstd = ops.batch_norm_finalize(h, _sums_for(1, mean, m2 / count), scale, 1, bn_weight,
                                                    bn_bias, eps, activation, negative_slope)
        ctx.save_for_backward(x, weight, h, mean_h, invstd, scale, bn_weight, bn_bias, count, row)
        ctx.group, ctx.family, ctx.eps = group, family, eps
        ctx.activation, ctx.negative_slope = activation, negative_slope
        ctx.dtypes = (None if bias is None else bias.dtype, None if bn_bias is None else bn_bias.dtype)
        ctx.mark_non_differentiable(count, mean, m2)
        return y, count, mean, m2

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
        if need[2] or need[3]:
            # The sum of dz over the whole batch is zero (the unsynced layer's bias gradient),
            # but not over one rank's rows: this rank's share, as the unfused model under
            # nn.SyncBatchNorm gives it.
            dz_sum, dzhc_sum = _local_grads(local, sums, row, count, mean_h, invstd, scale, bn_weight)
            if need[2]:
                out[2] = (scale.double() * dz_sum).to(ctx.dtypes[0])
            if need[3]:
                out[3] = (dzhc_sum + mean_h * dz_sum).to(scale.dtype)  # sum dz h, h = (h - mean_h) + mean_h
        if need[4]:
            out[4] = (invstd * scale.double() * local[1]).to(bn_weight.dtype)
        if need[5]:
            out[5] = local[0].to(ctx.dtypes[1])
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
    if x.dim() != 2:
        raise ValueError(f"cutlass_fused: expected 2-D input (batch, in_features), but got {x.dim()}-D")
    dev = x.device.type
    x, weight, bias = (_autocast(t, dev) for t in (x, weight, bias))
    with torch.autocast(dev, enabled=False):
        y, count, mean, m2 = SyncFunction.apply(x, weight, bias, scale, bn_weight, bn_bias, eps, process_group,
                                                _family.current(), activation, negative_slope)
        if running_mean is not None:
            if num_batches_tracked is not None:
                num_batches_tracked.add_(1)
            # The unbiased var is M2 / (count - 1); see _sums_for for the count 2.
            ops.update_running_stats(_sums_for(2, mean, m2 / (count - 1) / 2), scale, 2, running_mean, running_var,
                                     num_batches_tracked, None if momentum is None else float(momentum))
    return y if output_dtype is None else y.to(output_dtype)
