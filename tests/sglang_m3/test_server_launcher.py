"""sglang_m3.server, the one launcher, on stand-in server processes (a tiny HTTP server that answers
``/v1/models``, with a child of its own): ready when it answers, a clear error when it exits, fresh ports
after a lost port race, and a stop that ends the whole process group. The SGLang servers it starts are
tested in test_server.py and tests/accuracy."""

import os
import re
import socket
import sys
import time

import pytest

from sglang_m3 import server
from sglang_m3.server import Server, cpu_args, free_port, server_env

STAND_IN = r"""
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child", child.pid, flush=True)
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
        self.wfile.write(b'{"data": []}')
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


class StandIn(Server):
    def _command(self, port):
        return [sys.executable, "-c", STAND_IN, str(port)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def test_cpu_args_bound_the_kv_cache():
    args = cpu_args(8192)
    assert args[args.index("--device") + 1] == "cpu" and args[args.index("--max-total-tokens") + 1] == "8192"
    with pytest.raises(ValueError, match="max_total_tokens must be >= 1, got 0"):
        cpu_args(0)


@pytest.mark.parametrize("args, cpu", [(["--device", "cpu"], True), (["--device=cpu"], True), (["--tp", "8"], False)])
def test_server_env(args, cpu):
    env = server_env(args, {"PATH": "/bin"})
    assert {k: env[k] for k in server.CRASH_DIAGNOSTICS_OFF} == server.CRASH_DIAGNOSTICS_OFF
    assert ({k: env.get(k) for k in server.CPU_OPENMP_WAITS} == server.CPU_OPENMP_WAITS) == cpu
    # a wait the user set is theirs: neither is added then; so is a crash-diagnostics setting
    assert "GOMP_SPINCOUNT" not in server_env(args, {"OMP_WAIT_POLICY": "ACTIVE"})
    assert server_env(args, {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1"})["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_never_hands_out_a_recent_port_again(monkeypatch):
    # The OS may hand back the port it just freed (seen once in 1,000-5,000 triples of binds): free_port skips a
    # port it handed out lately, so a retry after a lost port race cannot get its old port back.
    offered = iter([40001, 40001, 40002, 40001, 40002, 40003, 40004, 40001])

    class OSHandsBack(socket.socket):
        def getsockname(self):
            return ("127.0.0.1", next(offered))

    monkeypatch.setattr(server, "_handed_out", server.collections.OrderedDict())
    monkeypatch.setattr(server, "HANDED_OUT_MEMORY", 3)
    monkeypatch.setattr(server.socket, "socket", OSHandsBack)
    assert [free_port(), free_port(), free_port()] == [40001, 40002, 40003]
    assert free_port() == 40004  # 40001 is forgotten now, the oldest of four
    assert free_port() == 40001


def test_free_port_gives_up_when_every_port_was_handed_out(monkeypatch):
    class Always(socket.socket):
        def getsockname(self):
            return ("127.0.0.1", 40001)

    monkeypatch.setattr(server, "_handed_out", server.collections.OrderedDict({("127.0.0.1", 40001): None}))
    monkeypatch.setattr(server.socket, "socket", Always)
    with pytest.raises(RuntimeError, match="no port on 127.0.0.1 other than the 1 this process handed out last"):
        free_port()


def test_free_port_in_a_tight_loop_never_repeats_within_its_memory():
    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)


def test_ready_then_the_stop_ends_the_process_group(tmp_path):
    s = StandIn("m", [], tmp_path / "s.log", timeout_s=60)
    with s:
        assert s.url == f"http://127.0.0.1:{s.port}"
        deadline = time.monotonic() + 30
        while not re.search(r"(?m)^child \d+$", s.log_tail()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(re.search(r"(?m)^child (\d+)$", s.log_tail()).group(1))
        assert _alive(s.proc.pid) and _alive(child)
    assert s.proc.poll() is not None
    deadline = time.monotonic() + 10  # SIGKILL is delivered, not instant: on a loaded box the child takes a moment
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    assert s.log_path.read_text().startswith(sys.executable)  # the command line heads the log


def test_a_server_that_exits_names_its_code_and_log(tmp_path):
    class Exits(Server):
        def _command(self, port):
            return [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]

    with pytest.raises(RuntimeError, match=r"server exited with 3 \(log .*s\.log\):\n.*no model here"):
        with Exits("m", [], tmp_path / "s.log", timeout_s=60):
            pass


def test_a_lost_port_race_starts_again_on_fresh_ports(tmp_path):
    ports = []

    class Races(Server):
        def _command(self, port):
            ports.append(port)
            return [sys.executable, "-c", "print('OSError: [Errno 98] address already in use'); raise SystemExit(1)"]

    with pytest.raises(RuntimeError, match="server exited with 1"):
        with Races("m", [], tmp_path / "s.log", timeout_s=60):
            pass
    assert len(ports) == 1 + Races.PORT_RETRIES
    assert len(set(ports)) == len(ports)  # every retry on a port of its own


def test_not_ready_in_time_is_a_timeout(tmp_path):
    class Silent(Server):
        def _command(self, port):
            return [sys.executable, "-c", "import time; time.sleep(60)"]

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="server not ready after 2 s"):
        with Silent("m", [], tmp_path / "s.log", timeout_s=2):
            pass
    assert time.monotonic() - t0 < 30
