"""The unfused layer this package replaces (KernelBench level 2, problems 33 and 39):
`bn(gemm(x) * scale)`. The reference for tests, benchmarks and checkpoints."""
import torch
from torch import nn


class SeedModel(nn.Module):
    def __init__(self, in_features, out_features, **bn_kwargs):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(out_features))
        self.bn = nn.BatchNorm1d(out_features, **bn_kwargs)

    def forward(self, x):
        return self.bn(self.gemm(x) * self.scale)
