"""A pre-imported launcher for many ``--device cpu`` server starts in a row (tests, format comparisons).

Starting ``python -m sglang.launch_server`` costs about 13 s of one core before the server does
anything: the launcher imports SGLang (torch, transformers, ...). A process that starts many short-lived
CPU servers can pay that once. ``python tests/prewarm.py --socket PATH`` imports
``sglang.launch_server`` (and the HTTP server module it imports when it runs) and then waits on a Unix
socket; for each request it forks, and the child runs the launcher module as ``python -m`` would, with
the requested arguments, environment, working directory and log file, in its own session. It is the same
launcher code on the same interpreter, started from a process that has imported it and run no torch op,
as the plugin's own fork of the scheduler already is (``plugin.cpu_children_start``).

``start(argv, ...)`` is the client: with ``PREWARM_ENV`` naming a live socket it asks that process, else
(or when the request does not fit it) it runs ``subprocess.Popen`` as usual. Either way the caller gets a
handle with ``pid`` (also the process group), ``poll()``, ``wait(timeout)`` and ``returncode``.

A request fits when it is ``[the same python, "-m", <the module>, ...]`` and its environment agrees with
the one the prewarmed process started with on everything read while the launcher was imported or when a
library loads: every variable a module's top level looked up during the import (kept as a module constant,
as SGLang keeps ``SGLANG_HEALTH_CHECK_TIMEOUT``: a forked child would have the launcher's value), every
``OMP_*``, ``GOMP_*``, ``KMP_*``, ``MALLOC_*`` variable, ``PYTHONHOME``, ``LD_*``; ``PYTHONPATH`` may add
directories, which the child puts on ``sys.path``, unless one holds another copy of a module already
imported. Other variables (``SGLANG_*`` settings read at run time, for example) are set in the child.
"""

import argparse
import atexit
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

PREWARM_ENV = "SGLANG_M3_PREWARMED"  # the socket of a running prewarmed launcher
LAUNCHER = "sglang.launch_server"
# Imported by the launcher only once it runs (``run_server``): 5 of its 14 s of imports on a 2-core box.
PRELOAD = {LAUNCHER: ("sglang.srt.entrypoints.http_server",)}
_FIXED_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MALLOC_")
_FIXED_NAMES = ("PYTHONPATH", "PYTHONHOME", "LD_PRELOAD", "LD_LIBRARY_PATH")


def fixed_env(env: dict) -> dict:
    """The part of ``env`` a forked child cannot change: read at interpreter start or when a library loads."""
    return {k: v for k, v in env.items() if k in _FIXED_NAMES or k.startswith(_FIXED_PREFIXES)}


class Forked:
    """A child of the prewarmed launcher: ``subprocess.Popen``'s ``pid``, ``poll``, ``wait``, ``returncode``.
    The launcher reaps it and writes its exit status to ``status_dir/<pid>`` (negative: killed by a signal)."""

    def __init__(self, pid: int, status_dir: Path):
        self.pid, self._status, self.returncode = pid, Path(status_dir) / str(pid), None

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            text = self._status.read_text().strip()
            if text:
                self.returncode = int(text)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def start(argv: list[str], *, env: dict | None = None, cwd=None, log=None):
    """``argv`` started with stdout and stderr to ``log`` (an open file) in a new session: through the
    prewarmed launcher named by ``PREWARM_ENV`` when the request fits it, else ``subprocess.Popen``."""
    env = dict(os.environ if env is None else env)
    path, name = os.environ.get(PREWARM_ENV), getattr(log, "name", None)
    if path and isinstance(name, str) and os.path.isfile(name):  # a log file the child can open by name
        log.flush()
        reply = _ask(path, {"argv": [str(a) for a in argv], "env": env, "cwd": str(cwd or os.getcwd()),
                            "log": str(Path(name).resolve())})
        if reply is not None and "pid" in reply:
            return Forked(reply["pid"], reply["status_dir"])
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT if log is not None else None, env=env,
                            cwd=cwd, start_new_session=True)


def _ask(path: str, request: dict, timeout_s: float = 180.0) -> dict | None:
    """The launcher's reply (``{"pid", "status_dir"}`` or ``{"refused": why}``); None if it is not there.
    Waits for a launcher that is still importing, up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout_s)
                s.connect(path)
                s.sendall(json.dumps(request).encode() + b"\n")
                data = b""
                while not data.endswith(b"\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        return None
                    data += chunk
            return json.loads(data)
        except (FileNotFoundError, ConnectionRefusedError):
            if not _starting(path) or time.monotonic() > deadline:
                return None
            time.sleep(0.2)
        except OSError:
            return None


def _starting(path: str) -> bool:
    """Whether a launcher for ``path`` is alive and still importing (its marker holds its pid)."""
    try:
        pid = int(Path(path + ".starting").read_text())
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return False
    return state != "Z"  # exited, not yet reaped by its parent


def launch(path: str, log, env: dict | None = None, module: str = LAUNCHER) -> subprocess.Popen:
    """Start a prewarmed launcher listening on ``path`` (its own output to ``log``); clients that ask
    before it is ready wait for it."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--socket", path, "--module", module],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    Path(path + ".starting").write_text(str(proc.pid))
    return proc


# ---- the prewarmed launcher --------------------------------------------------------------------

class _EnvReads:
    """Within ``with``: the environment variables that a module's top-level code looks up
    (``os.environ[...]``, ``.get``, ``in``, ``os.getenv``), collected in ``names``: what modules keep as
    constants (SGLang's ``HEALTH_CHECK_TIMEOUT``, torch's compile config). Lookups inside functions are left
    out: SGLang's ``envs`` settings, for one, are looked up again each time they are used."""

    _LOOKUP_MODULES = ("os", "_collections_abc", "collections.abc")  # os.getenv -> Mapping.get -> __getitem__

    def __init__(self):
        self.names: set[str] = set()
        self._getitem = None

    def __enter__(self) -> "_EnvReads":
        self._getitem = getitem = os._Environ.__getitem__
        names, lookup_modules = self.names, self._LOOKUP_MODULES

        def recording_getitem(environ, key):
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__") in lookup_modules:
                frame = frame.f_back
            if frame is not None and frame.f_code.co_name == "<module>":
                names.add(key)
            return getitem(environ, key)

        os._Environ.__getitem__ = recording_getitem
        return self

    def __exit__(self, *exc) -> None:
        os._Environ.__getitem__ = self._getitem


def _dirs(path_list: str | None) -> set[str]:
    return {os.path.realpath(p) for p in (path_list or "").split(os.pathsep) if p}


def _refusal(request, module: str, initial_env: dict, imported_env: dict,
             read_at_import: set[str]) -> str | None:
    """Why ``request`` (the decoded JSON) cannot be served by a fork of this process, or None."""
    if not isinstance(request, dict):
        return f"bad request: must be a JSON object, got {type(request).__name__}"
    for key, kind, name in (("argv", list, "array"), ("env", dict, "object"), ("cwd", str, "string"),
                            ("log", str, "string")):
        if not isinstance(request.get(key), kind):
            return f"bad request: {key!r} must be a JSON {name}, got {type(request.get(key)).__name__}"
    argv = request["argv"]
    if argv[:3] != [sys.executable, "-m", module]:
        return f"serves only [{sys.executable}, -m, {module}, ...]"
    env = request["env"]
    # Variables the import sets (KMP_*) are set in every child; a client that imported SGLang has them too.
    skip = {"PYTHONPATH", *imported_env}
    ours, theirs = fixed_env(initial_env), fixed_env(env)
    if {k: v for k, v in theirs.items() if k not in skip} != {k: v for k, v in ours.items() if k not in skip}:
        return "its environment differs in variables read at start-up"
    changed = sorted(k for k in read_at_import - skip if env.get(k) != initial_env.get(k))
    if changed:
        return f"its environment changes {', '.join(changed)}, read while {module} was imported here"
    # PYTHONPATH only sets sys.path at start. The child adds the directories it names (a launcher script's
    # "$PWD:$PWD/kernels") unless one would hide a module already imported here behind another file.
    if not _dirs(initial_env.get("PYTHONPATH")) <= _dirs(env.get("PYTHONPATH")):
        return "its PYTHONPATH drops directories this launcher started with"
    for d in _new_dirs(env):
        startup = [f for f in ("sitecustomize.py", "usercustomize.py") if os.path.exists(os.path.join(d, f))]
        if startup:  # Python runs these when an interpreter starts; a forked child never would
            return f"its PYTHONPATH entry {d} holds {startup[0]}, which Python runs only at start-up"
        for name, mod in list(sys.modules.items()):
            origin = getattr(mod, "__file__", None)
            if "." in name or not origin:
                continue
            for candidate in (os.path.join(d, name, "__init__.py"), os.path.join(d, name + ".py")):
                if os.path.exists(candidate) and os.path.realpath(candidate) != os.path.realpath(origin):
                    return f"its PYTHONPATH entry {d} holds another {name} than the one imported here"
    return None


def _new_dirs(env: dict) -> list[str]:
    """``env``'s PYTHONPATH directories that are not on this process's ``sys.path``, in order."""
    have = {os.path.realpath(p or os.getcwd()) for p in sys.path}
    out = []
    for p in (env.get("PYTHONPATH") or "").split(os.pathsep):
        if p and os.path.realpath(p) not in have and os.path.realpath(p) not in out:
            out.append(os.path.realpath(p))
    return out


def _child(request: dict, module: str, imported_env: dict, inherited: list) -> None:
    """In the forked child: become the requested ``python -m module`` run; never returns."""
    code = 1
    try:
        for obj in inherited:  # the launcher's sockets and selector
            obj.close()
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(imported_env)
        sys.path[1:1] = _new_dirs(request["env"])  # where PYTHONPATH puts them: after the -m run's directory
        sys.argv = [sys.argv[0], *request["argv"][3:]]
        sys.modules.pop(module, None)  # run afresh as __main__; what it imports stays imported
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str, module: str = LAUNCHER) -> None:
    """Import ``module``, then fork a run of it for each request on the Unix socket ``path`` until SIGTERM."""
    marker = Path(path + ".starting")
    marker.write_text(str(os.getpid()))
    import importlib

    initial_env = dict(os.environ)
    with _EnvReads() as reads:
        importlib.import_module(module)  # the expensive part, paid once
        for name in PRELOAD.get(module, ()):
            try:
                importlib.import_module(name)
            except ImportError as e:  # another SGLang release: the child imports what it needs itself
                print(f"prewarm: not preloaded: {name}: {e}", file=sys.stderr, flush=True)
    # What the import set (SGLang: KMP_DUPLICATE_LIB_OK, KMP_INIT_AT_FORK, TORCHINDUCTOR_CACHE_DIR): a
    # launcher started as its own process sets it too, so each child gets it over its requested environment.
    imported_env = {k: v for k, v in os.environ.items() if initial_env.get(k) != v}
    status_dir = Path(path + ".status")
    status_dir.mkdir(exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    Path(path).unlink(missing_ok=True)
    listener.bind(path)
    listener.listen(16)
    marker.unlink(missing_ok=True)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    while not stopping:
        for _ in sel.select(timeout=0.2):
            conn, _ = listener.accept()
            with conn:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        break
                    data += chunk
                try:
                    request = json.loads(data)
                    why = _refusal(request, module, initial_env, imported_env, reads.names)
                except ValueError as e:
                    request, why = None, f"bad request: {e}"
                if why is not None:
                    argv = request.get("argv") if isinstance(request, dict) else None
                    shown = argv[:3] if isinstance(argv, list) else []
                    print(f"prewarm: refused {shown}: {why}", file=sys.stderr, flush=True)
                    conn.sendall(json.dumps({"refused": why}).encode() + b"\n")
                    continue
                pid = os.fork()
                if pid == 0:
                    _child(request, module, imported_env, [conn, listener, sel])
                # An earlier child with this pid left its status here; only _reap (this thread, later) writes it.
                (status_dir / str(pid)).unlink(missing_ok=True)
                conn.sendall(json.dumps({"pid": pid, "status_dir": str(status_dir)}).encode() + b"\n")
        _reap(status_dir)
    listener.close()
    Path(path).unlink(missing_ok=True)


def _reap(status_dir: Path) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        (status_dir / str(pid)).write_text(str(os.waitstatus_to_exitcode(status)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="Unix socket path to listen on")
    parser.add_argument("--module", default=LAUNCHER, help="the module each request runs (default: %(default)s)")
    args = parser.parse_args(argv)
    serve(args.socket, args.module)


if __name__ == "__main__":
    # Run as a script, sys.path[0] is tests/, where the test folder tests/sglang_m3 would stand in for the package
    # sglang_m3 (as a namespace) in every forked server; a launcher's children expect what ``python -m`` gives:
    # the working directory first.
    sys.path[0] = os.getcwd()
    main()
