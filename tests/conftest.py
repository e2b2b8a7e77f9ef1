"""Shared fixtures: every test draws fresh random inputs from a seed it prints, so a failure
can be replayed with ``M3_TEST_SEED=<seed>``."""

import os
import random

import pytest
import torch


@pytest.fixture
def gen():
    seed = int(os.environ.get("M3_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"M3_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/run_gpu_tests.sh on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
