"""The suite's own set-up (tests/conftest.py): under pytest-xdist, as the README runs it, each worker
takes its share of the cores and Inductor compiles in the worker (decisions.md, "Tests")."""
import os

import pytest
import torch

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
under_xdist = pytest.mark.skipif(WORKERS <= 1, reason="runs under pytest-xdist (-n auto)")


@under_xdist
def test_each_worker_takes_its_share_of_the_cores():
    # conftest's share (cores // workers), unless OMP_NUM_THREADS came set
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])


@under_xdist
def test_inductor_compiles_in_the_worker():
    from torch._inductor import config
    assert config.compile_threads == int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])
