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
import time

import pytest
import torch

from m3_kernels.testing import worker_threads

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
    import prewarm
    from sglang_m3.server import cpu_env

    # Importing lm_eval sets HF_XET_HIGH_PERFORMANCE=1 (a download setting that huggingface_hub reads when imported,
    # so the launcher refuses a request whose value differs): set lm_eval's value first, or every server a worker
    # starts after one of its tests imported lm_eval would import SGLang afresh.
    os.environ.setdefault("HF_XET_HIGH_PERFORMANCE", "1")
    root = tmp_path_factory.mktemp("prewarm")
    sock = str(root / "launcher.sock")
    with open(root / "launcher.log", "w") as log:
        proc = prewarm.launch(sock, log, env=cpu_env())
    os.environ[prewarm.PREWARM_ENV] = sock
    from sglang_m3.server import Server

    spawn = Server.__dict__["spawn"]
    Server.spawn = staticmethod(prewarm.start)  # every test's sglang_m3.server launch (m3-accuracy's too) forks here
    yield sock
    Server.spawn = spawn
    os.environ.pop(prewarm.PREWARM_ENV, None)
    proc.terminate()
    proc.wait(timeout=60)


_timeline: dict = {"path": None, "started": {}}


def pytest_configure(config):
    """``M3_TEST_TIMELINE=<file>``: one line per test, ``worker start end nodeid`` (wall-clock seconds, from its
    setup's start to its teardown's end), appended by each process that runs tests (the workers, not their
    controller): where the suite's wall time goes. In an xdist worker, torch runs on the worker's share of the
    cores (``worker_threads``): 5 min 09 s against 6 min 05 s for the suite on a 2-core box
    (lab/logs/perf-cpu-log.md, twelfth round)."""
    runs_tests = hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)
    _timeline["path"] = os.environ.get("M3_TEST_TIMELINE") if runs_tests else None
    if hasattr(config, "workerinput") and "OMP_NUM_THREADS" not in os.environ:
        # the workers share the cores (m3_kernels.testing.worker_threads)
        torch.set_num_threads(worker_threads(os.cpu_count() or 1, int(config.workerinput["workercount"])))


def pytest_runtest_logstart(nodeid, location):
    if _timeline["path"]:
        _timeline["started"][nodeid] = time.time()


def pytest_runtest_logfinish(nodeid, location):
    if _timeline["path"]:
        start = _timeline["started"].pop(nodeid)
        with open(_timeline["path"], "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {start:.3f} {time.time():.3f} {nodeid}\n")


@pytest.fixture
def gen():
    seed = int(os.environ.get("M3_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"M3_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


# Files whose tests take minutes on a 2-core box (the CI and README runs of 2026-12-02), longest first. In the
# suite, xdist's default reordering of files by test count (--loadscope-reorder, a stable sort) takes precedence:
# this order only breaks ties among files with equal test counts there, and holds fully with -n 0. Turning the
# reordering off to hand these out first was measured on 2026-12-02: 6 min 47 s quiet but 8 min 00 s in a
# fresh-clone CI run (the long server tests then run side by side, each slower), against 7 min 22-28 s with
# xdist's order; not kept (lab/logs/perf-cpu-log.md, ninth round).
LONG_FILES = ("scripts/test_accuracy_h200.py", "training/test_trained_checkpoint.py", "sglang_m3/test_tp.py",
              "training/test_model.py", "sglang_m3/test_server.py", "accuracy/test_run_e2e.py",
              "accuracy/test_agreement_e2e.py")


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
