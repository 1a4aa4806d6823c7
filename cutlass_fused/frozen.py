"""frozen_weights: the one scope in which the CUDA ops keep what they derive from a layer's tensors.

Outside it nothing is kept between calls: every call folds the batch norm for eval (one small
kernel before the GEMM) and, for fp32 without TF32, splits the weight for 3xTF32 (sm90) or flags
its infinite rows (sm80), so a write of any kind, `.data` included, takes effect at the next call,
as in PyTorch. Inside, those values are kept while their tensors are unchanged as far as PyTorch's
version counters see (identity, storage, layout and version; csrc/derived_cache.h): a write
through `.data` is not seen there, which is the promise the scope asks of its user.
"""
import contextlib
import threading

import torch

from .ops import ops

class _Scopes(threading.local):
    """Each thread's stack of frozen_weights() scopes, each a dict id(tensor) -> tensor."""

    def __init__(self):
        self.stack = []


_scopes = _Scopes()


def _tensors(objs):
    out = {}
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            found = [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, torch.Tensor):
            found = [obj]
        else:
            raise TypeError(f"cutlass_fused: frozen_weights expects modules or tensors, but got {type(obj).__name__}")
        out.update((id(t), t) for t in found)
    return out


@contextlib.contextmanager
def frozen_weights(*modules_or_tensors):
    """Keep what the layers derive from these modules' parameters and buffers (or these tensors)
    between calls, for forward-only loops over unchanged weights: inference, a frozen teacher,
    KernelBench-style timing. `with cutlass_fused.frozen_weights(model): ...`

    The promise: no write through `.data` to these tensors inside the scope. Other writes
    (optimizer steps, `copy_` under no_grad, `load_state_dict`, assigning a new tensor) are seen
    and the values made anew; leaving the scope drops them all. A call whose weight, bias, scale,
    batch-norm parameters or running stats are not all frozen keeps nothing (so
    `torch.func.functional_call` with other tensors is always exact). What torch.compile
    traces keeps nothing either (cudagraph trees' private pool must hold no kept tensor)."""
    if not modules_or_tensors:
        raise TypeError("cutlass_fused: frozen_weights expects the modules or tensors it freezes")
    _scopes.stack.append(_tensors(modules_or_tensors))
    try:
        yield
    finally:
        _scopes.stack.pop()
        ops.clear_cache()


def may_cache(*tensors) -> bool:
    """The GEMM ops' `cache` argument (csrc/ops.cpp): whether every given tensor (None aside) is
    frozen by an enclosing frozen_weights() of this thread, outside what torch.compile traces."""
    if torch.compiler.is_compiling():
        return False
    stack = _scopes.stack
    if not stack:
        return False
    return all(t is None or any(s.get(id(t)) is t for s in stack) for t in tensors)
