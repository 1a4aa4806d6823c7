"""LinearScaleBatchNorm1d: a drop-in for `bn(linear(x) * scale)` with the same state_dict."""
import torch
from torch import nn

from .functional import linear_scale_batch_norm


class LinearScaleBatchNorm1d(nn.Module):
    """`BatchNorm1d(Linear(x) * scale)`; parameters live in `gemm`, `scale` and `bn`, as in the
    unfused model, so checkpoints load either way."""

    def __init__(self, in_features, out_features, bias=True, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.gemm = nn.Linear(in_features, out_features, bias=bias, **kw)
        self.scale = nn.Parameter(torch.randn(out_features, **kw))
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum, affine=affine,
                                 track_running_stats=track_running_stats, **kw)

    @classmethod
    def from_modules(cls, linear: nn.Linear, scale: nn.Parameter, bn: nn.BatchNorm1d) -> "LinearScaleBatchNorm1d":
        """A layer that shares `linear`'s, `scale`'s and `bn`'s parameters and buffers."""
        if not isinstance(linear, nn.Linear) or not isinstance(bn, nn.BatchNorm1d):
            raise TypeError("cutlass_fused: from_modules expects (nn.Linear, nn.Parameter, nn.BatchNorm1d)")
        if scale.shape != (linear.out_features,) or bn.num_features != linear.out_features:
            raise ValueError(f"cutlass_fused: expected scale and bn of size {linear.out_features}, but got "
                             f"{tuple(scale.shape)} and {bn.num_features}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.gemm, self.scale, self.bn = linear, scale, bn
        return self

    def forward(self, x):
        bn = self.bn
        # nn.BatchNorm1d's own rules for which statistics to use and update.
        track = bn.training and bn.track_running_stats
        use_batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
        keep_running = not bn.training or bn.track_running_stats
        return linear_scale_batch_norm(
            x, self.gemm.weight, self.gemm.bias, self.scale, bn.weight, bn.bias,
            bn.running_mean if keep_running else None, bn.running_var if keep_running else None,
            use_batch_stats, bn.momentum, bn.eps, bn.num_batches_tracked if track else None)

    def extra_repr(self):
        return f"in_features={self.gemm.in_features}, out_features={self.gemm.out_features}"
