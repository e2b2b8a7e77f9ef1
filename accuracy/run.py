"""Does the MXFP4 index cache cost accuracy on my deployment? One command answers it.

For each index-K format the runner starts an SGLang server (model, launch arguments passed through
unchanged, the format switched by ``format_launch_args``) or uses a running deployment's URL, runs
the lm-eval tasks of ``accuracy/tasks`` against it through ``local-completions`` (or
``local-chat-completions``), and writes to ``--out``:

- ``samples/<format>/<task>.jsonl``: one line per sample (``doc_id, length, depth, target,
  response, score``);
- ``report.md``: per task and context length, accuracy of each format and paired statistics of
  each format against the first (agreement, exact McNemar p, paired-bootstrap 95% interval of the
  accuracy difference);
- ``results.json``: the same numbers; ``accuracy_vs_length.png``: accuracy against context length.

Examples::

    # start one server per format (8 GPUs, tensor parallel), 1k..context, 20 samples per length
    m3-accuracy --model MiniMaxAI/MiniMax-M3.1 --formats fp8 mxfp4 --out results/m3 -- --tp 8
    # running deployments, one URL per format
    m3-accuracy --model MiniMaxAI/MiniMax-M3.1 --base-url fp8=http://h1:30000 mxfp4=http://h2:30000

Everything after ``--`` goes to ``python -m sglang.launch_server`` as is.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from m3_kernels.formats import parse_format

from . import report

TASKS_DIR = Path(__file__).parent / "tasks"
LONG_TASKS = ("m3_niah_single", "m3_niah_multikey")
SHORT_TASKS = ("m3_short_arith",)
MIN_LENGTH = 1024
OVERRIDE_FLAG = "--json-model-override-args"
RUNNER_OWNED_FLAGS = ("--model-path", "--model", "--host", "--port")


# ---------------------------------------------------------------------------------------------
# The format switch (the one place that knows how a server is told its index-K format)


def format_launch_args(fmt: str, launch_args: list[str]) -> list[str]:
    """``launch_args`` with the index-K format set to ``fmt``.

    The sglang_m3 plugin reads ``index_k_format`` from the model config, and SGLang applies
    ``--json-model-override-args`` to it; an override dict already in ``launch_args`` is merged
    (our key wins), so other overrides pass through.
    """
    fmt = parse_format(fmt, "format").value
    args, overrides = [], {}
    i = 0
    while i < len(launch_args):
        arg = launch_args[i]
        if arg == OVERRIDE_FLAG:
            if i + 1 >= len(launch_args):
                raise ValueError(f"{OVERRIDE_FLAG} needs a JSON value")
            overrides.update(json.loads(launch_args[i + 1]))
            i += 2
            continue
        if arg.startswith(OVERRIDE_FLAG + "="):
            overrides.update(json.loads(arg.split("=", 1)[1]))
        else:
            args.append(arg)
        i += 1
    overrides["index_k_format"] = fmt
    return args + [OVERRIDE_FLAG, json.dumps(overrides)]


# ---------------------------------------------------------------------------------------------
# Servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


class SGLangServer:
    """``python -m sglang.launch_server`` in its own process group, log in ``log_path``."""

    def __init__(self, model: str, launch_args: list[str], log_path: Path, host: str = "127.0.0.1",
                 port: int | None = None, timeout_s: float = 1800.0):
        self.model, self.launch_args, self.log_path = model, launch_args, log_path
        self.host, self.port, self.timeout_s = host, port or _free_port(), timeout_s
        self.proc = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model, "--host", self.host,
                "--port", str(self.port), *self.launch_args]

    def __enter__(self):
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        self._log.write(" ".join(self.command()) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self._stop()
            raise
        return self

    def _wait_healthy(self):
        deadline = time.time() + self.timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with code {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.base_url + "/health_generate", timeout=60) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(2)
        raise TimeoutError(f"SGLang server not healthy after {self.timeout_s:.0f} s; see {self.log_path}")

    def _signal_group(self, sig):
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _stop(self):
        """SIGTERM the server's process group, SIGKILL after 60 s, then any leftover of the group."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self._signal_group(signal.SIGTERM)
                try:
                    self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    pass
            self._signal_group(signal.SIGKILL)
            self.proc.wait()
        self._log.close()

    def __exit__(self, *exc):
        self._stop()


def served_model(base_url: str) -> tuple[str, int | None]:
    """``(model id, max context or None)`` from the server's ``/v1/models``."""
    data = _get_json(base_url.rstrip("/") + "/v1/models")["data"][0]
    return data["id"], data.get("max_model_len")


def default_lengths(context: int) -> list[int]:
    """Powers of two from ``MIN_LENGTH`` up to ``context``, and ``context`` itself."""
    lengths, n = [], MIN_LENGTH
    while n < context:
        lengths.append(n)
        n *= 2
    return lengths + [context]


# ---------------------------------------------------------------------------------------------
# lm-eval


def run_lm_eval(base_url: str, model_id: str, tokenizer: str, tasks: list[str], lengths: list[int], args) -> dict:
    """Per-sample rows ``{task: [{doc_id, length, depth, target, response, score}]}`` of one server."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    chat = args.api == "chat"
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    model_args = {
        "model": model_id,
        "base_url": base_url.rstrip("/") + endpoint,
        "tokenizer": tokenizer,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": False,
        "num_concurrent": args.concurrency,
        "max_retries": 3,
        "max_length": max(lengths) + 64,
        "timeout": args.request_timeout,
    }
    metadata = {"max_seq_lengths": lengths, "num_samples": args.samples, "num_depths": args.depths,
                "seed": args.seed, "tokenizer": tokenizer}
    # Our tasks only: indexing lm-eval's own few thousand task files costs ~20 s.
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=metadata)
    out = lm_eval.simple_evaluate(
        model="local-chat-completions" if chat else "local-completions",
        model_args=model_args,
        tasks=tasks,
        task_manager=manager,
        log_samples=True,
        limit=args.limit,
        apply_chat_template=chat,
        gen_kwargs=None if args.max_gen_toks is None else f"max_gen_toks={args.max_gen_toks}",
    )
    rows = {}
    for task in tasks:
        rows[task] = sorted(
            (
                {
                    "doc_id": s["doc_id"],
                    "length": s["doc"].get("length"),
                    "depth": s["doc"].get("depth"),
                    "target": str(s["target"]),
                    "response": s["resps"][0][0] if s["resps"] and s["resps"][0] else "",
                    "score": float(s["acc"]),
                }
                for s in out["samples"][task]
            ),
            key=lambda r: r["doc_id"],
        )
    return rows


def write_samples(out: Path, fmt: str, rows: dict):
    folder = out / "samples" / fmt
    folder.mkdir(parents=True, exist_ok=True)
    for task, samples in rows.items():
        with (folder / f"{task}.jsonl").open("w") as f:
            for s in samples:
                f.write(json.dumps(s) + "\n")


# ---------------------------------------------------------------------------------------------
# CLI


def _parse_base_urls(values: list[str] | None, formats: list[str]) -> dict[str, str]:
    if not values:
        return {}
    if len(values) == 1 and "=" not in values[0]:
        if len(formats) != 1:
            raise ValueError(f"--base-url without fmt= names one deployment; give --formats one format, got {formats}")
        return {formats[0]: values[0]}
    urls = {}
    for value in values:
        fmt, sep, url = value.partition("=")
        if not sep:
            raise ValueError(f"--base-url entries must be fmt=URL when there are several, got {value!r}")
        urls[parse_format(fmt, "--base-url format").value] = url
    return urls


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="m3-accuracy", description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- go to `python -m sglang.launch_server` unchanged "
                                       "(e.g. -- --tp 8).")
    p.add_argument("--model", required=True, help="model path or hub id given to --model-path")
    p.add_argument("--tokenizer", default=None, help="tokenizer path or id (default: --model)")
    p.add_argument("--formats", nargs="+", default=["fp8", "mxfp4"],
                   help="index-K formats; the first is the baseline of the paired statistics")
    p.add_argument("--base-url", nargs="+", default=None,
                   help="running deployments instead of starting servers: fmt=URL per format "
                        "(or one URL for one format)")
    p.add_argument("--tasks", nargs="+", default=[*LONG_TASKS, *SHORT_TASKS])
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="context lengths in tokens (default: powers of two from 1024 to the served context)")
    p.add_argument("--samples", type=int, default=20, help="needle samples per length")
    p.add_argument("--depths", type=int, default=10, help="needle depths spread evenly over 0..100%%")
    p.add_argument("--limit", type=int, default=None, help="lm-eval --limit (samples per task, for smoke runs)")
    p.add_argument("--max-gen-toks", type=int, default=None,
                   help="cap on generated tokens for every task (default: each task's own: 24 needle, 16 arithmetic)")
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--concurrency", type=int, default=8, help="parallel requests")
    p.add_argument("--request-timeout", type=int, default=1800)
    p.add_argument("--launch-timeout", type=float, default=1800.0)
    p.add_argument("--bootstrap", type=int, default=10000, help="paired-bootstrap resamples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/accuracy"))
    return p


def main(argv=None) -> None:
    """Console entry point (``m3-accuracy``)."""
    compare_formats(argv)


def compare_formats(argv=None) -> dict:
    """Run the comparison for command-line ``argv``; returns the summary written to results.json."""
    argv = list(sys.argv[1:] if argv is None else argv)
    launch_args = []
    if "--" in argv:
        cut = argv.index("--")
        argv, launch_args = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    formats = [parse_format(f, "--formats").value for f in args.formats]
    if len(set(formats)) != len(formats):
        raise ValueError(f"--formats must not repeat, got {formats}")
    urls = _parse_base_urls(args.base_url, formats)
    if urls and set(urls) != set(formats):
        raise ValueError(f"--base-url names formats {sorted(urls)} but --formats is {formats}")
    unknown = [t for t in args.tasks if t not in (*LONG_TASKS, *SHORT_TASKS)]
    if unknown:
        raise ValueError(f"--tasks must be among {[*LONG_TASKS, *SHORT_TASKS]}, got {unknown}")
    owned = [a for a in launch_args if a.split("=")[0] in RUNNER_OWNED_FLAGS]
    if owned:
        raise ValueError(f"launch arguments {owned} are set by the runner (one free local port per server); "
                         "drop them, or start the servers yourself and pass --base-url")
    tokenizer = args.tokenizer or args.model
    args.out.mkdir(parents=True, exist_ok=True)

    from tqdm import tqdm

    per_format, lengths = {}, args.lengths
    for fmt in tqdm(formats, desc="formats", unit="fmt"):
        if fmt in urls:
            per_format[fmt], lengths = _evaluate(urls[fmt], tokenizer, lengths, args)
        else:
            server = SGLangServer(args.model, format_launch_args(fmt, launch_args), args.out / f"server-{fmt}.log",
                                  timeout_s=args.launch_timeout)
            with server:
                per_format[fmt], lengths = _evaluate(server.base_url, tokenizer, lengths, args)
        write_samples(args.out, fmt, per_format[fmt])
    summary = report.build(per_format, formats, n_boot=args.bootstrap, seed=args.seed)
    summary["run"] = {"model": args.model, "formats": formats, "tasks": args.tasks, "lengths": lengths,
                      "samples": args.samples, "depths": args.depths, "limit": args.limit, "api": args.api,
                      "launch_args": launch_args}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    (args.out / "report.md").write_text(report.markdown(summary))
    report.plot(summary, args.out / "accuracy_vs_length.png")
    print(report.markdown(summary))
    print(f"wrote {args.out}/report.md, results.json, accuracy_vs_length.png and samples/")
    return summary


def _evaluate(base_url, tokenizer, lengths, args):
    model_id, context = served_model(base_url)
    if lengths is None:
        if context is None:
            raise ValueError("the server does not report max_model_len; pass --lengths")
        lengths = default_lengths(int(context))
    return run_lm_eval(base_url, model_id, tokenizer, args.tasks, sorted(lengths), args), lengths


if __name__ == "__main__":
    main()
