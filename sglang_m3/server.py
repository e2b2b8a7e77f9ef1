"""One launcher for the SGLang servers this project starts: the format comparison (``m3-accuracy``), the
tests and the CPU benchmark.

A ``Server`` is ``python -m sglang.launch_server --model-path MODEL ... --host H --port P`` in a session
(process group) of its own, its output in a log file, on a port the OS hands out and this process has not
handed out lately (``free_port``). Readiness is polled with SGLang's ``sglang.utils.wait_for_http_ready`` on
``/v1/models`` and the server is stopped with SIGTERM to its group, then SGLang's ``kill_process_tree`` and
SIGKILL to the group for what is left. A start that loses a port race (``address already in use`` in its log:
another program took the port between ``free_port`` and the server's bind) is retried on fresh ports.

``--device cpu`` servers take ``CPU_ARGS`` (``cpu_args``) and ``cpu_env``: the torch_native attention backend,
a bounded ``--max-total-tokens`` (without it SGLang sizes the KV cache from the free RAM: 21 of 23 GB for
configs/msa-small), no warm-up request, idle sleep, and short OpenMP waits.

Example::

    from sglang_m3.server import Server, cpu_args
    with Server("configs/msa-small", [*cpu_args(8192), "--index-k-format", "mxfp4"], "server.log") as s:
        print(s.url)  # http://127.0.0.1:<port>
"""

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

LAUNCHER = "sglang.launch_server"
DEFAULT_CPU_MAX_TOTAL_TOKENS = 16384  # KV slots of a CPU server: ~0.3 GB for configs/msa-small
READY_PATH = "/v1/models"
PORT_IN_USE = "address already in use"

# OpenMP's default spin-wait costs a CPU server an order of magnitude when another process holds a core;
# set before the server process starts, they also let the plugin fork its children (sglang_m3.plugin).
CPU_OPENMP_WAITS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}
# SGLang's crash diagnostics wait 5 s for a scheduler that a process-group stop ended first.
CRASH_DIAGNOSTICS_OFF = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


def cpu_args(max_total_tokens: int = DEFAULT_CPU_MAX_TOTAL_TOKENS) -> list[str]:
    """Launch arguments of a ``--device cpu`` server holding at most ``max_total_tokens`` KV slots."""
    if max_total_tokens < 1:
        raise ValueError(f"max_total_tokens must be >= 1, got {max_total_tokens}")
    return ["--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", str(max_total_tokens),
            "--skip-server-warmup", "--sleep-on-idle"]


def on_cpu(args) -> bool:
    """Whether launch arguments ``args`` ask for ``--device cpu``."""
    args = [str(a) for a in args]
    return "--device=cpu" in args or any(a == "--device" and b == "cpu" for a, b in zip(args, args[1:]))


def server_env(args, env: dict | None = None) -> dict:
    """``env`` (default ``os.environ``) for a server launched with ``args``: crash diagnostics off (it is stopped
    through its process group) and, on ``--device cpu``, the OpenMP waits unless either is set."""
    env = dict(os.environ if env is None else env)
    for name, value in CRASH_DIAGNOSTICS_OFF.items():
        env.setdefault(name, value)
    if on_cpu(args) and not set(CPU_OPENMP_WAITS) & set(env):
        env.update(CPU_OPENMP_WAITS)
    return env


def cpu_env(env: dict | None = None) -> dict:
    """``server_env`` of a ``--device cpu`` server."""
    return server_env(["--device", "cpu"], env)


HANDED_OUT_MEMORY = 4096  # ports free_port remembers; Linux hands out ~14,000 (even) ephemeral ports to bind(0)
_handed_out: collections.OrderedDict = collections.OrderedDict()  # (host, port) -> None, oldest first
_handed_out_lock = threading.Lock()
FREE_PORT_TRIES = 1000


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that the OS reports free now (bind to port 0) and that is none of the last
    ``HANDED_OUT_MEMORY`` ports this function returned in this process: a server started again after a lost port
    race, or one started beside another that has not bound its port yet, never gets a port just given to another
    (the OS may hand back the port it just freed: 1 triple of calls in 1,000-5,000 did on a 2-core box).
    RuntimeError if ``FREE_PORT_TRIES`` binds find none."""
    with _handed_out_lock:
        for _ in range(FREE_PORT_TRIES):
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if (host, port) not in _handed_out:
                _handed_out[(host, port)] = None
                while len(_handed_out) > HANDED_OUT_MEMORY:
                    _handed_out.popitem(last=False)
                return port
    raise RuntimeError(f"no port on {host} other than the {len(_handed_out)} this process handed out last, in "
                       f"{FREE_PORT_TRIES} tries")


class Server:
    """``python -m sglang.launch_server`` for ``model`` with ``args``, in its own process group, output to
    ``log_path``. ``start()`` launches, ``wait_ready()`` blocks until ``/v1/models`` answers (RuntimeError naming
    the exit code and the log when the process ends first, TimeoutError after ``timeout_s``), ``stop()`` ends
    the group; ``with Server(...) as s`` does all three."""

    PORT_RETRIES = 2  # fresh ports for a start that lost a port race

    def __init__(self, model, args=(), log_path=None, *, host: str = "127.0.0.1", port: int | None = None,
                 env: dict | None = None, cwd=None, timeout_s: float = 600.0):
        self.model, self.args, self.host = str(model), [str(a) for a in args], host
        self.log_path = Path(log_path) if log_path is not None else None
        self.env, self.cwd, self.timeout_s = env, cwd, timeout_s
        self._fixed_port, self.port, self.proc, self._log = port, port, None, None
        self._port_retries = self.PORT_RETRIES

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    base_url = url

    def _command(self, port: int) -> list[str]:
        return [sys.executable, "-m", LAUNCHER, "--model-path", self.model, *self.args, "--host", self.host,
                "--port", str(port)]

    def command(self) -> list[str]:
        return self._command(self.port)

    @staticmethod
    def spawn(argv: list[str], *, env: dict, cwd, log):
        """The launch itself: a ``subprocess.Popen`` in a new session (the tests put a prewarmed launcher here)."""
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)

    def start(self) -> "Server":
        """Launch on ``port`` (or a free one), the command line as the log's first line; returns at once."""
        if self._log is not None:  # a relaunch: the failed start's children go with its process group
            self._signal_group(signal.SIGKILL)
            self._log.close()
        self.port = self._fixed_port or free_port(self.host)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_path.open("w")
        else:
            import tempfile

            self._log = tempfile.NamedTemporaryFile("w", prefix="sglang-server-", suffix=".log", delete=False)
            self.log_path = Path(self._log.name)
        command = self.command()
        self._log.write(" ".join(command) + "\n")
        self._log.flush()
        self.proc = self.spawn(command, env=server_env(command, self.env), cwd=self.cwd, log=self._log)
        return self

    def wait_ready(self, timeout_s: float | None = None) -> "Server":
        from sglang.utils import wait_for_http_ready

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                wait_for_http_ready(self.url + READY_PATH, timeout=max(0.0, deadline - time.monotonic()),
                                    process=self.proc, headers={"Authorization": "Bearer None"})
                return self
            except RuntimeError:  # the process ended
                if PORT_IN_USE in self.log_tail() and self._port_retries > 0 and not self._fixed_port:
                    self._port_retries -= 1
                    self.start()
                    continue
                raise RuntimeError(f"server exited with {self.proc.poll()} (log {self.log_path}):\n"
                                   f"{self.log_tail()}") from None
            except TimeoutError:
                raise TimeoutError(f"server not ready after {timeout_s:.0f} s (log {self.log_path}):\n"
                                   f"{self.log_tail()}") from None

    def log_tail(self, chars: int = 4000) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def _signal_group(self, sig) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM the group; after ``grace_s`` (or at once if it ended) SGLang's ``kill_process_tree`` and
        SIGKILL for whatever of the group is left."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self._signal_group(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    from sglang.srt.utils import kill_process_tree

                    kill_process_tree(self.proc.pid)
            self._signal_group(signal.SIGKILL)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> "Server":
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
