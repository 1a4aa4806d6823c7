"""cutlass_fused: y = BatchNorm1d((x @ W^T + b) [* scale]) as one CUTLASS GEMM with a fused epilogue."""
__version__ = "0.2.0"

from ._family import use_kernel_family
from .fp8 import Float8Recipe
from .frozen import frozen_weights
from .functional import linear_scale_batch_norm
from .fuse import fuse
from .graphs import graphed_step
from .module import LinearBatchNorm1d, LinearScaleBatchNorm1d, convert_sync_batchnorm
from .ops import ops
from ._overrides import overrides, plan


def built_kernels() -> list[str]:
    """Names of the CUTLASS kernels in this build (empty for a CPU-only build)."""
    return list(ops.kernel_names())


__all__ = ["linear_scale_batch_norm", "LinearBatchNorm1d", "LinearScaleBatchNorm1d", "convert_sync_batchnorm", "use_kernel_family",
           "built_kernels", "fuse", "frozen_weights", "overrides", "plan", "Float8Recipe",
           "graphed_step"]
