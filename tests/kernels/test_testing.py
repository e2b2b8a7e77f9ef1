"""Test support (``m3_kernels.testing``): the suite's share of the cores per xdist worker."""

import os

import pytest
import torch

from m3_kernels.testing import worker_threads


@pytest.mark.parametrize("cpus,workers,threads", [(2, 2, 1), (1, 2, 1), (8, 2, 4), (16, 3, 5), (4, 1, 4)])
def test_worker_threads_share_the_cores(cpus, workers, threads):
    assert worker_threads(cpus, workers) == threads


def test_this_worker_runs_torch_on_its_share():
    """In an xdist worker, torch's intra-op threads are this worker's share of the cores."""
    if "PYTEST_XDIST_WORKER_COUNT" not in os.environ or "OMP_NUM_THREADS" in os.environ:
        pytest.skip("only in an xdist worker without OMP_NUM_THREADS (the README's command)")
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    assert torch.get_num_threads() == worker_threads(os.cpu_count() or 1, workers)
