"""Shared fixtures: every test draws fresh random inputs from a seed it prints, so a failure
can be replayed with ``M3_TEST_SEED=<seed>``.

The whole suite (``pytest`` with no paths, i.e. the README's command) runs on ``SUITE_WORKERS`` pytest-xdist
workers when xdist is installed (the ``test`` extra brings it) and no ``-n`` was given: one test file per
worker at a time (module-scoped servers stay one per file), the longest files first (``LONG_FILES``), then in
collection order. xdist's own reordering by test count is turned off: it had handed out the one-test files last,
so a 37-s file ended the run alone (7 min 22-28 s against 6 min 47 s, 2026-12-02). Three workers were no faster.
``-n 0`` runs it in one process; a run naming paths is not changed.
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
    config.option.loadscopereorder = False  # xdist would hand out files by test count, not in LONG_FILES order


@pytest.fixture(scope="session", autouse=True)
def prewarmed_launcher(request, tmp_path_factory):
    """One prewarmed SGLang launcher per test process (``sglang_m3.prewarm``) when the run holds server
    tests (marked ``slow``): their CPU servers are then forked from it instead of each importing SGLang
    (about 13 s of a core per start), the same launcher code on the same interpreter. ``M3_TEST_PREWARM=0``
    starts every server as its own process."""
    wanted = any("slow" in item.keywords for item in request.session.items)
    if not wanted or os.environ.get("M3_TEST_PREWARM") == "0" or importlib.util.find_spec("sglang") is None:
        yield None
        return
    from sglang_m3 import prewarm
    from sglang_m3.plugin import cpu_launch_env

    root = tmp_path_factory.mktemp("prewarm")
    sock = str(root / "launcher.sock")
    with open(root / "launcher.log", "w") as log:
        proc = prewarm.launch(sock, log, env=cpu_launch_env())
    os.environ[prewarm.PREWARM_ENV] = sock
    yield sock
    os.environ.pop(prewarm.PREWARM_ENV, None)
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture
def gen():
    seed = int(os.environ.get("M3_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"M3_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


# Files whose tests take the longest on a 2-core box, longest first (test seconds in a quiet run of the README
# suite, 2026-12-02): the suite's workers take whole files in this order (loadfile, xdist's reordering by test
# count off), so the run ends on short files instead of one worker on a long one while the other waits.
LONG_FILES = ("scripts/test_accuracy_h200.py",  # 136 s
              "training/test_model.py",  # 75
              "training/test_trained_checkpoint.py",  # 73
              "sglang_m3/test_server.py",  # 69
              "sglang_m3/test_tp.py",  # 50
              "accuracy/test_agreement_e2e.py",  # 39
              "kernels/ops/score/backends/test_cuda.py",  # 30
              "scripts/test_train_msa_medium_h200.py",  # 30
              "accuracy/test_run_resume.py",  # 29
              "accuracy/test_run_e2e.py",  # 25
              "training/test_train.py",  # 21
              "sglang_m3/test_plugin.py",  # 21
              "kernels/ops/score/backends/test_flydsl_isolated.py")  # 19


def _long_first(item) -> int:
    path = item.path.as_posix()
    return next((rank for rank, name in enumerate(LONG_FILES) if path.endswith("/tests/" + name)), len(LONG_FILES))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_long_first)  # stable: the files' own order and their tests' order are kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/run_gpu_tests.sh on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
