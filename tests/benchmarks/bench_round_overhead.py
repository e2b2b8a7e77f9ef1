"""How much of a resumable round is the runner's own work: rounds of ``m3-accuracy --resume`` against a
stand-in completions server that answers every request after ``--delay-s`` (no model: a fixed answer), with
the rounds' prompts built ahead (the default) and in turn (``--no-prefetch``). Prints a table of round times;
a round's requests alone take ``delay * prompts / concurrency`` seconds.

    .venv/bin/python scripts/bench_round_overhead.py [--model configs/msa-medium] [--delay-s 2.5] [--samples 16]
"""

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accuracy import retrieval, run  # noqa: E402


def stand_in(delay_s: float, model: str, context: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._reply({"data": [{"id": model, "max_model_len": context}]})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            time.sleep(delay_s)
            self._reply({"id": "0", "object": "text_completion", "model": model,
                         "choices": [{"index": 0, "text": " 1234567.", "finish_reason": "stop", "logprobs": None}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "configs" / "msa-medium"))
    p.add_argument("--delay-s", type=float, default=2.5)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--chunk", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    args = p.parse_args()
    server = stand_in(args.delay_s, args.model, max(args.lengths) + 256)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    times = {}
    for mode, flag in (("built ahead", []), ("built in turn", ["--no-prefetch"])):
        retrieval.clear_cache()  # each mode builds every prompt itself
        with tempfile.TemporaryDirectory() as out:
            argv = ["--model", args.model, "--formats", "fp8", "--base-url", f"fp8={url}",
                    "--tasks", "m3_niah_single", "m3_niah_multikey", "m3_kv_64", "m3_vt_value",
                    "--lengths", *map(str, args.lengths), "--samples", str(args.samples), "--questions", "4",
                    "--chunk", str(args.chunk), "--concurrency", str(args.concurrency), "--resume",
                    "--bootstrap", "100", "--out", out, *flag]
            log = io.StringIO()
            t0 = time.time()
            with contextlib.redirect_stdout(log):
                run.compare_formats(argv)
            total = time.time() - t0
        rounds = [(int(n), float(s)) for n, s in re.findall(r"round of (\d+) prompts in ([\d.]+) s", log.getvalue())]
        times[mode] = (rounds, total)
    server.shutdown()
    print(f"| prompts built | rounds (s each; requests alone {args.delay_s * rounds[0][0] / args.concurrency:.1f} s)"
          " | later rounds' mean | whole run |")
    print("|---|---|---|---|")
    for mode, (rounds, total) in times.items():
        later = [s for _, s in rounds[1:]]
        mean = f"{sum(later) / len(later):.1f} s" if later else "-"
        print(f"| {mode} | {', '.join(f'{s:.1f}' for _, s in rounds)} | {mean} | {total:.0f} s |")


if __name__ == "__main__":
    main()
