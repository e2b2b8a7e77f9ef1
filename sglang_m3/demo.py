"""Serve the tiny MiniMax-M3.1 on the CPU, show one answer, stop the server.

    python -m sglang_m3.demo [--index-k-format mxfp4] [--port 0]

The tiny model has random (dummy) weights, so the answer is gibberish by construction: the demo
shows the serving path (plugin, index-K pool in the chosen format, MSA selection over a prompt
longer than 16 blocks), not a language model.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from m3_kernels.formats import PAGE_SIZE, TOPK_BLOCKS, IndexKFormat

TINY_MODEL = Path(__file__).resolve().parent.parent / "configs" / "minimax-m3.1-tiny"
PROMPT = ("MiniMax-M3 scores every 128-token block of the context with a small indexer and attends to the best "
          "sixteen; the indexer keys live in a paged cache, here stored as MXFP4. ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(index_k_format: str, port: int, log_file, max_total_tokens: int = 16384) -> subprocess.Popen:
    """Start ``sglang.launch_server`` for the tiny model on the CPU in its own process group."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(TINY_MODEL), "--load-format", "dummy",
           "--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", str(max_total_tokens),
           "--index-k-format", index_k_format, "--host", "127.0.0.1", "--port", str(port), "--skip-server-warmup",
           "--sleep-on-idle"]
    print("$", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/model_info", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    raise TimeoutError(f"server not ready after {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index-k-format", default=IndexKFormat.MXFP4.value, choices=[f.value for f in IndexKFormat])
    parser.add_argument("--port", type=int, default=0, help="0 picks a free loopback port")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    port = args.port or _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+", prefix="sglang-m3-demo-", suffix=".log", delete=False) as log:
        proc = launch(args.index_k_format, port, log)
        try:
            t0 = time.monotonic()
            wait_ready(url, proc)
            print(f"server ready in {time.monotonic() - t0:.0f} s at {url} (index-K cache: {args.index_k_format})")
            try:
                with urllib.request.urlopen(url + "/get_server_info", timeout=30) as r:
                    info = json.loads(r.read())
                print(f"max_total_num_tokens={info.get('max_total_num_tokens')} page_size={info.get('page_size')}")
            except urllib.error.URLError:
                pass
            # About 2450 tokens: 20 blocks, so top-16 selection drops some.
            payload = {"text": PROMPT * 34,
                       "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 0}}
            req = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
            t0 = time.monotonic()
            with urllib.request.urlopen(req, timeout=900) as r:
                answer = json.loads(r.read())
            meta = answer["meta_info"]
            print(f"/generate: {meta['prompt_tokens']} prompt tokens "
                  f"({-(-meta['prompt_tokens'] // PAGE_SIZE)} blocks, top-{TOPK_BLOCKS} selected), "
                  f"{meta['completion_tokens']} new tokens in {time.monotonic() - t0:.1f} s")
            print(f"answer (dummy weights): {answer['text']!r}")
        except Exception:
            log.flush()
            print(Path(log.name).read_text(errors="replace")[-4000:], file=sys.stderr)
            raise
        finally:
            stop(proc)
    print("server stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
