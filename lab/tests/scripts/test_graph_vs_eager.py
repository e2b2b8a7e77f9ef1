"""lab/gpu/graph_vs_eager.py: a SIGTERM while a server starts is deferred until the server is recorded,
and the server's process is started with SIGTERM neither blocked nor ignored (no server is started here)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "lab" / "gpu"))

import graph_vs_eager  # noqa: E402


def _sigterm_bit(pid: int, field: str) -> bool:
    """Whether SIGTERM is set in ``field`` (SigBlk, SigIgn) of ``/proc/<pid>/status``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.fixture
def exit_on_sigterm():
    before = signal.signal(signal.SIGTERM, graph_vs_eager._exit_on_sigterm)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/<pid>/status")
def test_a_started_server_can_be_stopped_by_sigterm(exit_on_sigterm):
    servers = {}
    graph_vs_eager._start(servers, "graph", lambda: subprocess.Popen(["sleep", "60"], start_new_session=True))
    proc = servers["graph"]
    try:
        assert not _sigterm_bit(proc.pid, "SigBlk") and not _sigterm_bit(proc.pid, "SigIgn")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert signal.getsignal(signal.SIGTERM) is graph_vs_eager._exit_on_sigterm


def test_a_sigterm_during_the_start_exits_only_once_the_server_is_recorded(exit_on_sigterm):
    servers, started = {}, object()

    def make():
        os.kill(os.getpid(), signal.SIGTERM)
        return started

    with pytest.raises(SystemExit) as stop:
        graph_vs_eager._start(servers, "eager", make)
    assert stop.value.code == 128 + signal.SIGTERM
    assert servers == {"eager": started}


def test_a_failed_start_restores_the_handler_and_records_nothing(exit_on_sigterm):
    servers = {}

    def make():
        raise RuntimeError("the server did not start")

    with pytest.raises(RuntimeError, match="did not start"):
        graph_vs_eager._start(servers, "graph", make)
    assert servers == {}
    assert signal.getsignal(signal.SIGTERM) is graph_vs_eager._exit_on_sigterm
