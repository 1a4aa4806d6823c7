"""KernelBench level 2, problem 33: Gemm_Scale_BatchNorm, y = bn(gemm(x) * scale) with a
batch of 1024 and 8192 -> 8192 features, in fp32 and training mode.

A KernelBench drop-in, self-contained but for the package: `Model` is KernelBench's reference,
`ModelNew` this package's fused layer (cutlass_fused.kernelbench), which loads Model's
state_dict unchanged.

    python examples/kernelbench_33_gemm_scale_batchnorm.py   # the largest difference, KernelBench-style
"""
import torch
from torch import nn

from cutlass_fused.kernelbench import ModelNew, check

batch_size = 1024
in_features = 8192
out_features = 8192
scale_shape = (out_features,)


class Model(nn.Module):
    """KernelBench's reference: bn(gemm(x) * scale)."""

    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(scale_shape))
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum)

    def forward(self, x):
        x = self.gemm(x)
        x = x * self.scale
        x = self.bn(x)
        return x


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, scale_shape]


__all__ = ["Model", "ModelNew", "get_inputs", "get_init_inputs"]

if __name__ == "__main__":
    import sys
    print(f"max |Model - ModelNew|: {check(sys.modules[__name__]):.2e} (KernelBench allows 1e-4 + 1e-4 * |Model|)")
