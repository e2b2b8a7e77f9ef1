"""Shared fixtures: every test draws fresh random inputs from a seed it prints, so a failure
can be replayed with ``M3_TEST_SEED=<seed>``.

The whole suite (``pytest`` with no paths, i.e. the README's command) runs on ``SUITE_WORKERS`` pytest-xdist
workers when xdist is installed (the ``test`` extra brings it) and no ``-n`` was given: one test file per
worker at a time (module-scoped servers stay one per file), in collection order (handing the server files
out first made them run side by side, each slower: 10 min 16 s against 7 min 17 s). Most of the suite's time
is server start-ups, which are largely single-threaded imports, so two workers fit a 2-core box. ``-n 0``
runs it in one process; a run naming paths is not changed.
"""

import importlib.util
import os
import random

import pytest
import torch

SUITE_WORKERS = 2


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    if hasattr(config, "workerinput") or importlib.util.find_spec("xdist") is None:
        return
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS or config.getoption("numprocesses", None) is not None:
        return
    if config.getoption("collectonly") or config.getoption("dist", "no") != "no":
        return
    config.option.numprocesses = SUITE_WORKERS
    config.option.dist = "loadfile"


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
