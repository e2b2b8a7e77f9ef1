"""The prewarmed launcher (sglang_m3.prewarm) on a probe module: what a forked run gets (arguments,
environment, working directory, log, its own session, exit status) and when the client falls back."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import prewarm

# A module the probe imports, keeping a variable as a constant (as SGLang's HTTP server keeps
# SGLANG_HEALTH_CHECK_TIMEOUT): a forked run would see the launcher's value, so a request changing it is refused
PROBE_DEP = 'import os\nAT_IMPORT = os.environ.get("M3_PROBE_AT_IMPORT", "unset")\n'
PROBE = textwrap.dedent("""
    import json, os, sys, time
    import m3_prewarm_probe_dep
    os.environ["KMP_M3_PROBE"] = "imported"  # as SGLang's import sets KMP_INIT_AT_FORK
    if __name__ == "__main__":  # as sglang.launch_server: importing it runs nothing else
        if sys.argv[1:2] == ["sleep"]:
            time.sleep(600)
        print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "probe": os.environ.get("M3_PROBE"),
                          "kmp": os.environ.get("KMP_M3_PROBE"), "own_session": os.getsid(0) == os.getpid(),
                          "at_import": m3_prewarm_probe_dep.AT_IMPORT}))
        sys.exit(int(sys.argv[1]))
""")


@pytest.fixture
def launcher(tmp_path, monkeypatch):
    (tmp_path / "m3_prewarm_probe.py").write_text(PROBE)
    (tmp_path / "m3_prewarm_probe_dep.py").write_text(PROBE_DEP)
    monkeypatch.delenv("M3_PROBE_AT_IMPORT", raising=False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    sock = str(tmp_path / "launcher.sock")
    with open(tmp_path / "launcher.log", "w") as log:
        proc = prewarm.launch(sock, log, env=env, module="m3_prewarm_probe")
    monkeypatch.setenv(prewarm.PREWARM_ENV, sock)
    yield proc
    proc.terminate()
    proc.wait(timeout=30)


def _run(tmp_path, *args, env=None, name="run"):
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "w") as log:
        handle = prewarm.start([sys.executable, "-m", "m3_prewarm_probe", *args], env=env, cwd=tmp_path, log=log)
    return handle, log_path


def test_a_forked_run_gets_its_arguments_environment_cwd_log_and_session(launcher, tmp_path):
    import json

    env = dict(os.environ, M3_PROBE="seen")
    handle, log_path = _run(tmp_path, "3", "x", env=env)
    assert isinstance(handle, prewarm.Forked)
    assert handle.wait(timeout=60) == 3 and handle.poll() == 3
    out = json.loads(log_path.read_text().strip().splitlines()[-1])
    assert out == {"argv": ["3", "x"], "cwd": str(tmp_path), "probe": "seen", "kmp": "imported", "own_session": True,
                   "at_import": "unset"}
    # a client that imported the module itself carries what the import set: still the same start-up
    handle, _ = _run(tmp_path, "0", env=dict(env, KMP_M3_PROBE="imported"), name="imported")
    assert isinstance(handle, prewarm.Forked) and handle.wait(timeout=60) == 0


def test_a_killed_run_reports_the_signal_and_its_group_can_be_signalled(launcher, tmp_path):
    handle, _ = _run(tmp_path, "sleep")
    assert isinstance(handle, prewarm.Forked)
    time.sleep(0.5)
    assert handle.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        handle.wait(timeout=0.2)
    os.killpg(handle.pid, signal.SIGTERM)
    assert handle.wait(timeout=30) == -signal.SIGTERM


def test_requests_that_do_not_fit_fall_back_to_a_subprocess(launcher, tmp_path):
    env = dict(os.environ, OMP_WAIT_POLICY="ACTIVE" if os.environ.get("OMP_WAIT_POLICY") != "ACTIVE" else "PASSIVE")
    handle, _ = _run(tmp_path, "5", env=env, name="omp")  # OpenMP read its settings when the launcher started
    assert isinstance(handle, subprocess.Popen) and handle.wait(timeout=60) == 5
    with open(tmp_path / "other.log", "w") as log:  # another module
        handle = prewarm.start([sys.executable, "-c", "raise SystemExit(4)"], log=log)
    assert isinstance(handle, subprocess.Popen) and handle.wait(timeout=60) == 4


def test_a_variable_read_while_importing_is_not_changed_under_a_forked_run(launcher, tmp_path):
    import json

    handle, log_path = _run(tmp_path, "0", env=dict(os.environ, M3_PROBE_AT_IMPORT="120"), name="at_import")
    assert isinstance(handle, subprocess.Popen) and handle.wait(timeout=60) == 0  # a fresh interpreter
    assert json.loads(log_path.read_text().strip().splitlines()[-1])["at_import"] == "120"
    handle, _ = _run(tmp_path, "0", env=dict(os.environ, M3_PROBE="run time only"), name="run_time")
    assert isinstance(handle, prewarm.Forked) and handle.wait(timeout=60) == 0
    log = (tmp_path / "launcher.log").read_text()
    assert "M3_PROBE_AT_IMPORT, read while m3_prewarm_probe was imported" in log and "M3_PROBE," not in log


def test_without_a_launcher_start_is_popen(tmp_path, monkeypatch):
    monkeypatch.delenv(prewarm.PREWARM_ENV, raising=False)
    with open(tmp_path / "a.log", "w") as log:
        handle = prewarm.start([sys.executable, "-c", "raise SystemExit(2)"], log=log)
    assert isinstance(handle, subprocess.Popen) and handle.wait(timeout=60) == 2
    monkeypatch.setenv(prewarm.PREWARM_ENV, str(tmp_path / "nobody.sock"))  # named but not running
    with open(tmp_path / "b.log", "w") as log:
        handle = prewarm.start([sys.executable, "-c", "raise SystemExit(6)"], log=log)
    assert isinstance(handle, subprocess.Popen) and handle.wait(timeout=60) == 6


def _wait_until_a_zombie(pid: int, timeout_s: float = 60.0) -> None:
    """Until ``pid`` has exited and is not reaped (a fixed sleep is too short on a loaded box)."""
    deadline = time.monotonic() + timeout_s
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, f"{pid} still running after {timeout_s} s"
        time.sleep(0.05)


def test_a_launcher_that_failed_to_import_is_not_waited_for(tmp_path, monkeypatch):
    sock = str(tmp_path / "broken.sock")
    with open(tmp_path / "launcher.log", "w") as log:
        proc = prewarm.launch(sock, log, module="m3_no_such_module")
    monkeypatch.setenv(prewarm.PREWARM_ENV, sock)
    _wait_until_a_zombie(proc.pid)  # died, unreaped: its pid still answers kill(pid, 0)
    t0 = time.monotonic()
    with open(tmp_path / "a.log", "w") as log:
        handle = prewarm.start([sys.executable, "-c", "raise SystemExit(7)"], log=log)
    assert isinstance(handle, subprocess.Popen) and handle.wait(timeout=60) == 7
    assert time.monotonic() - t0 < 10
    assert proc.wait(timeout=30) != 0


def test_pythonpath_may_add_directories_that_hide_nothing_already_imported(launcher, tmp_path):
    import json

    base = os.environ["PYTHONPATH"]
    extra = tmp_path / "elsewhere"
    extra.mkdir()
    (extra / "m3_probe_helper.py").write_text("VALUE = 1\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(extra), base]))
    handle, log_path = _run(tmp_path, "0", env=env, name="new")  # a launcher script's "$PWD/kernels:..."
    assert isinstance(handle, prewarm.Forked) and handle.wait(timeout=60) == 0
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "json.py").write_text("")  # another json than the one the launcher imported
    handle, _ = _run(tmp_path, "0", env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow), base])),
                     name="shadow")
    assert isinstance(handle, subprocess.Popen)
    handle.wait(timeout=60)
    handle, _ = _run(tmp_path, "0", env=dict(os.environ, PYTHONPATH=str(extra)), name="dropped")
    assert isinstance(handle, subprocess.Popen)  # the launcher's own PYTHONPATH entry is dropped
    handle.wait(timeout=60)
    startup = tmp_path / "startup"
    startup.mkdir()
    (startup / "sitecustomize.py").write_text("")  # Python runs it at start-up only: a fork would skip it
    handle, _ = _run(tmp_path, "0", env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(startup), base])),
                     name="startup")
    assert isinstance(handle, subprocess.Popen)
    handle.wait(timeout=60)
    json.loads(log_path.read_text().strip().splitlines()[-1])


@pytest.mark.parametrize("request_", [[], "argv", 5, None, {"argv": 5}, {"argv": [], "env": []},
                                      {"argv": [sys.executable, "-m", "m3_prewarm_probe"], "env": {}}])
def test_a_request_that_is_not_an_object_of_the_right_fields_is_refused_and_serving_goes_on(launcher, tmp_path,
                                                                                             request_):
    reply = prewarm._ask(os.environ[prewarm.PREWARM_ENV], request_)
    assert reply is not None and reply["refused"].startswith("bad request: ")
    handle, _ = _run(tmp_path, "0")  # the launcher is still there
    assert isinstance(handle, prewarm.Forked) and handle.wait(timeout=60) == 0


def _next_pids(count: int) -> list[int]:
    """Pids the kernel is about to hand out (it counts up from the last one given)."""
    try:
        last = int(open("/proc/sys/kernel/ns_last_pid").read())
    except OSError:
        last = subprocess.Popen(["true"]).pid
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    return [p for p in range(last + 1, last + 1 + count) if p <= pid_max]


def test_a_reused_pid_does_not_report_an_earlier_childs_exit_status(launcher, tmp_path):
    from pathlib import Path

    handle, _ = _run(tmp_path, "0", name="first")  # the launcher is up: its status folder exists
    assert isinstance(handle, prewarm.Forked) and handle.wait(timeout=60) == 0
    status_dir = Path(os.environ[prewarm.PREWARM_ENV] + ".status")
    stale = _next_pids(3000)
    for pid in stale:  # as earlier children with those pids left them
        (status_dir / str(pid)).write_text("99")
    handle, _ = _run(tmp_path, "sleep", name="reused")
    try:
        assert isinstance(handle, prewarm.Forked) and handle.pid in stale
        time.sleep(0.5)
        assert handle.poll() is None
    finally:
        os.killpg(handle.pid, signal.SIGTERM)  # a failure must not leave it sleeping
    assert handle.wait(timeout=30) == -signal.SIGTERM
