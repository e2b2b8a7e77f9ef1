"""Real SGLang servers for the plugin tests: the tiny MiniMax-M3.1 config with dummy weights on
the CPU, on loopback ports, started as subprocesses and torn down with their process group."""

import json
import os  # noqa: F401 (tests/training stubs os.killpg through this module)
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import prewarm
from sglang_m3.server import Server as _Server
from sglang_m3.server import cpu_args

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "configs" / "minimax-m3.1-tiny"
STARTUP_TIMEOUT_S = 600


def server_command(port: int, *extra: str, max_total_tokens: int = 16384) -> list[str]:
    return [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(TINY_MODEL), "--load-format", "dummy",
        *cpu_args(max_total_tokens), "--log-level", "warning", *extra, "--host", "127.0.0.1", "--port", str(port),
    ]


class Server(_Server):
    """``sglang_m3.server.Server`` on the tiny config (dummy weights, CPU), started at once, through the
    prewarmed launcher when the run has one, with the tests' request helpers."""

    def __init__(self, log_path: Path, *extra: str, max_total_tokens: int = 16384, record: Path | None = None):
        self.record = record
        if record is not None:
            extra = (*extra, "--json-model-override-args", json.dumps({"index_k_debug_record": str(record)}))
        self._extra, self._max_total_tokens = extra, max_total_tokens
        super().__init__(TINY_MODEL, (), log_path, cwd=REPO, timeout_s=STARTUP_TIMEOUT_S)
        self.start()

    def _command(self, port: int) -> list[str]:
        return server_command(port, *self._extra, max_total_tokens=self._max_total_tokens)

    @staticmethod
    def spawn(argv, *, env, cwd, log):
        return prewarm.start(argv, env=env, cwd=cwd, log=log)

    def post(self, path: str, payload: dict, timeout: float = 600):
        """``(status, json body)`` of a POST; HTTP errors are returned, not raised."""
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def generate(self, input_ids, max_new_tokens: int = 4, **kw):
        """Greedy ``/generate`` of exactly ``max_new_tokens`` (EOS ignored: dummy weights may pick it)."""
        status, body = self.post("/generate", {"input_ids": input_ids,
                                               "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                                   "ignore_eos": True},
                                               **kw})
        assert status == 200, body
        return body

    def healthy(self, tries: int = 3) -> bool:
        """Whether ``/health`` answers 200 to one of ``tries`` calls. SGLang's scheduler puts off a health request
        that arrives while its last batch is still on record (``Scheduler.is_fully_idle``) until the next batch's
        result; one landing just after a burst's final batch (as a test's next call does) waits for a batch that
        never comes and gets a 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s). The next call finds it idle."""
        for _ in range(tries):
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=60) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
        return False

    def records(self) -> list[dict]:
        if self.record is None or not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]


@pytest.fixture(scope="session")
def launch_command():
    """``launch_command(port, *extra_args)``: the tiny-model server command line."""
    return server_command


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory):
    """Start servers (``factory(name, *args, record=True)``); all are stopped at module end."""
    started: list[Server] = []
    root = tmp_path_factory.mktemp("servers")

    def factory(name: str, *extra: str, record: bool = False, max_total_tokens: int = 16384) -> Server:
        server = Server(root / f"{name}.log", *extra, max_total_tokens=max_total_tokens,
                        record=root / f"{name}.jsonl" if record else None)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()
