import os

# Under pytest-xdist (the README's `-n auto`) each worker gets its share of the cores, and Inductor
# compiles in the worker: torch's default of a thread a core in every worker, and a compile pool
# forked by each, oversubscribe the CPU many times over (decisions.md, "Tests").
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest
import torch

if _WORKERS > 1:  # the variable alone misses a torch that a plugin imported before this file
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Every output of our CUDA ops starts as NaN, so an element a kernel never
# wrote fails the comparison instead of passing as stale memory.
os.environ.setdefault("CUTLASS_FUSED_POISON", "1")

# CUTLASS_FUSED_TEST_GPU=1 runs the whole suite on cuda:1 (on a 2-GPU machine):
# every "cuda" tensor of the tests lands there, and each test fails if cuda:0
# gains an allocation meanwhile, so nothing of ours may lean on device 0.
# Tests that use both GPUs on purpose are marked `uses_gpu0`.
TEST_GPU = int(os.environ.get("CUTLASS_FUSED_TEST_GPU", "0"))
if TEST_GPU:
    if torch.cuda.device_count() <= TEST_GPU:
        raise RuntimeError(f"CUTLASS_FUSED_TEST_GPU={TEST_GPU}, but this machine has "
                           f"{torch.cuda.device_count()} GPU(s)")
    torch.cuda.set_device(TEST_GPU)


@pytest.fixture
def override():
    """override(**choices): cutlass_fused.overrides(**choices) for the rest of the test (nested
    calls stack), restored at its end."""
    import contextlib

    import cutlass_fused
    with contextlib.ExitStack() as stack:
        yield lambda **choices: stack.enter_context(cutlass_fused.overrides(**choices))


@pytest.fixture
def fresh_dynamo():
    """Dynamo reset, and its counters zeroed, before and after the test: each test counts its own
    compilations and graph breaks from zero (the torch.compile tests' pytestmark)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def pytest_configure(config):
    config.addinivalue_line("markers", "uses_gpu0: allocates on cuda:0 on purpose (exempt from the cuda:1 check)")


@pytest.fixture(autouse=True)
def nothing_on_gpu0(request):
    if not TEST_GPU or request.node.get_closest_marker("uses_gpu0"):
        yield
        return
    before = torch.cuda.memory_allocated(0)
    yield
    # Only growth counts: what a uses_gpu0 test left may be freed during a later test.
    grown = torch.cuda.memory_allocated(0) - before
    assert grown <= 0, f"the test ran on cuda:{TEST_GPU}, yet cuda:0 gained {grown} bytes"
