"""CPU SGLang server speed: the tiny MiniMax-M3.1 (MXFP4 index cache) against plain SGLang on a dense model.

    python tests/benchmarks/bench_cpu_server.py [--before-tree DIR] [--rounds 2] [--prefill 2048,4096,8192,16384]

Arms, each a fresh ``sglang.launch_server --device cpu --attention-backend torch_native`` with the
same flags and dummy weights:

- ``m3.1`` (this tree) and ``m3.1@before`` (``--before-tree``: another checkout, e.g. a ``git worktree``
  of an older commit; its ``sglang_m3`` and ``m3_kernels`` come first on ``PYTHONPATH``);
- ``dense``: plain SGLang 0.5.16 serving ``LlamaForCausalLM`` built from the tiny config (same hidden
  size, layers, heads, head dim and vocabulary, dense MLP of the tiny config's dense width); a
  ``sitecustomize`` flips SGLang's rotary CPU flag (without it Llama's rotary layer imports vllm on a
  CPU). sglang_m3 is installed, so its CPU OpenMP settings (``OMP_WAIT_POLICY=PASSIVE``, ``GOMP_SPINCOUNT=3000``)
  apply to this arm too.
- ``m3dense``: the tiny M3.1 itself with MSA turned off (``sparse_attention_freq`` all 0: every layer
  attends densely as layer 0 does; no index branch, no index-K cache), served by this tree. It has the
  MoE, per-head norms and partial RoPE that ``dense`` lacks, so ``m3.1`` against it isolates what
  sparse attention costs or saves, where ``dense`` also counts the rest of the architecture.

Per arm: server ready time; the demo's ``/generate`` (``examples/needle_demo.py``'s dummy-weight prompt, 2.4k tokens, 16 new
tokens); decode tokens/s at batch 1 with a 4k context and at batch 16 with 1k contexts (prompts
prefilled first, then the same prompts again with 33 new tokens: the radix cache holds the prompts,
so the time is one token of prefill plus 32 decode steps); prefill tokens/s of fresh random prompts
(1 new token). Rounds interleave the arms (ABC, then CBA, ...); the table prints each round and
``uptime``'s 1-minute load when the arm started. Timings are wall-clock and shared-box noise shows
up in them: compare within a round. A request past ``--timeout`` prints ``>T`` (for a rate: ``timeout``) and
ends that arm's round (the server is still busy with it); the cells left print ``-``.
"""

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from sglang_m3.server import Server, cpu_args

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "minimax-m3.1-tiny"
CONTEXT = 32768


def _model_folder(folder: Path, cfg: dict) -> Path:
    """``folder`` holding ``cfg`` as its ``config.json`` and every other file of TINY (weights, tokenizer)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in TINY.iterdir():
        if f.name != "config.json":
            shutil.copy(f, folder / f.name)
    return folder


def dense_config(folder: Path) -> Path:
    """A Llama config of the tiny M3.1's size (tokenizer copied), for plain SGLang."""
    tiny = json.loads((TINY / "config.json").read_text())
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "vocab_size": tiny["vocab_size"], "hidden_size": tiny["hidden_size"],
        "intermediate_size": tiny["dense_intermediate_size"], "num_hidden_layers": tiny["num_hidden_layers"],
        "num_attention_heads": tiny["num_attention_heads"], "num_key_value_heads": tiny["num_key_value_heads"],
        "head_dim": tiny["head_dim"], "rms_norm_eps": tiny["rms_norm_eps"], "rope_theta": tiny["rope_theta"],
        "max_position_embeddings": CONTEXT, "bos_token_id": tiny["bos_token_id"], "eos_token_id": tiny["eos_token_id"],
        "tie_word_embeddings": False, "hidden_act": "silu",
    }
    return _model_folder(folder, cfg)


def m3_dense_config(folder: Path) -> Path:
    """The tiny M3.1 with every layer dense (``sparse_attention_freq`` all 0), weights and tokenizer as TINY."""
    cfg = json.loads((TINY / "config.json").read_text())
    sparse = dict(cfg["sparse_attention_config"])
    n = cfg["num_hidden_layers"]
    sparse["sparse_attention_freq"] = [0] * n
    sparse["sparse_disable_index_value"] = [0] * n
    cfg["sparse_attention_config"] = sparse
    return _model_folder(folder, cfg)


ROTARY_SHIM = """# bench_cpu_server.py: SGLang 0.5.16's rotary layer imports vllm off CUDA unless its module flag says CPU;
# the flag is flipped here (what sglang_m3 does while building M3.1) so plain SGLang can serve Llama on a CPU.
try:
    from sglang.srt.layers.rotary_embedding import base as _rotary_base
    _rotary_base._is_cpu = True
except ImportError:
    pass
"""


def rotary_shim(folder: Path) -> Path:
    """A folder with a ``sitecustomize.py`` that flips SGLang's rotary CPU flag in every process."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(ROTARY_SHIM)
    return folder


def load1() -> float:
    return os.getloadavg()[0]


class Busy(Exception):
    """A request ran past the timeout: the server is still working on it."""


class Arm:
    def __init__(self, name: str, model: Path, tree: Path, extra: list[str], env: dict, path: tuple = ()):
        self.name, self.model, self.tree, self.extra, self.env, self.path = name, model, tree, extra, env, path


def server(arm: Arm, max_total_tokens: int, log_path: Path, ready_timeout: float) -> Server:
    """The arm's CPU server (``sglang_m3.server``), not started yet."""
    env = dict(os.environ, **arm.env)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, arm.path), str(arm.tree), str(arm.tree / "kernels"),
                                         env.get("PYTHONPATH", "")])
    args = ["--load-format", "dummy", *cpu_args(max_total_tokens), "--context-length", str(CONTEXT),
            "--log-level", "warning", *arm.extra]
    return Server(arm.model, args, log_path, env=env, cwd=arm.tree, timeout_s=ready_timeout)


def post(url: str, payload: dict, timeout: float) -> dict:
    req = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def timed(fn, row: dict, key: str, scale: float = 1.0):
    """Seconds of fn() into ``row[key]`` (``scale / seconds`` when ``scale`` is not 1, for a rate); past the
    timeout ``row[key] = None`` and Busy."""
    t0 = time.monotonic()
    try:
        fn()
    except (TimeoutError, urllib.error.URLError) as e:
        if "timed out" in str(e) or isinstance(e, TimeoutError):
            row[key] = None
            raise Busy(key) from None
        raise
    dt = time.monotonic() - t0
    row[key] = dt if scale == 1.0 else scale / dt
    return dt


def gen_ids(url, ids_list, new_tokens, timeout):
    payload = {"input_ids": ids_list if len(ids_list) > 1 else ids_list[0],
               "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    return post(url, payload, timeout)


# The demo's dummy-weight prompt (``examples/needle_demo.py``): about 2,450 tokens at 34 repeats with the tiny
# model's tokenizer. Fixed text, so every arm and every run prefills the same tokens.
DEMO_PROMPT = ("MiniMax-M3 scores every 128-token block of the context with a small indexer and attends to the best "
               "sixteen; the indexer keys live in a paged cache, here stored as MXFP4. ")


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def measure(arm: Arm, args, vocab: int, rng: random.Random) -> dict:
    row = {"arm": arm.name, "load": load1()}
    with tempfile.NamedTemporaryFile("w+", prefix=f"bench-{arm.name.replace('@', '-')}-", suffix=".log",
                                     delete=False) as log:
        srv = server(arm, args.max_total_tokens, Path(log.name), args.ready_timeout)
        try:
            timed(lambda: srv.start().wait_ready(), row, "ready_s")
            url = srv.url
            demo = {"text": DEMO_PROMPT * 34, "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                             "ignore_eos": True}}
            timed(lambda: post(url, demo, args.timeout), row, "demo_s")
            for bs, ctx, key in ((1, 4096, "dec1_tps"), (16, 1024, "dec16_tps")):
                prompts = [random_ids(rng, ctx - 40, vocab) for _ in range(bs)]
                timed(lambda: gen_ids(url, prompts, 1, args.timeout), row, key)  # prefill; the radix cache keeps it
                timed(lambda: gen_ids(url, prompts, 33, args.timeout), row, key, scale=bs * 32)
            for n in args.prefill:
                ids = random_ids(rng, n, vocab)
                timed(lambda: gen_ids(url, [ids], 1, args.timeout), row, f"pre{n}_tps", scale=n)
        except Busy:
            pass
        except Exception:
            print(srv.log_tail(3000), file=sys.stderr)
            raise
        finally:
            srv.stop()
    return row


def fmt(row: dict, key: str, timeout: float) -> str:
    if key not in row:
        return "-"
    v = row[key]
    if v is None:
        return f">{timeout:.0f}s" if key.endswith("_s") else f"timeout ({timeout:.0f} s)"
    return f"{v:.1f}" if key.endswith("_s") or v < 100 else f"{v:.0f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before-tree", type=Path, help="a checkout to compare with (its sglang_m3 and m3_kernels)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prefill", default="2048,4096,8192,16384", help="prompt lengths of the prefill column(s)")
    p.add_argument("--arms", default="before,after,dense", help="subset and order of arms in the first round "
                   "(before, after, dense, m3dense)")
    p.add_argument("--max-total-tokens", type=int, default=70000)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for a server to start")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for every server (repeatable)")
    args = p.parse_args(argv)
    args.prefill = [int(x) for x in args.prefill.split(",") if x]
    env = dict(kv.split("=", 1) for kv in args.env)
    vocab = json.loads((TINY / "config.json").read_text())["vocab_size"]
    ctx_override = ["--json-model-override-args", json.dumps({"max_position_embeddings": CONTEXT})]
    tmp = Path(tempfile.mkdtemp(prefix="bench-cpu-dense-"))
    arms = {
        "after": Arm("m3.1", TINY, REPO, ["--index-k-format", "mxfp4", *ctx_override], env),
        "dense": Arm("dense", dense_config(tmp / "dense"), REPO, [], env, (rotary_shim(tmp / "shim"),)),
        "m3dense": Arm("m3.1-msa-off", m3_dense_config(tmp / "m3dense"), REPO, ctx_override, env),
    }
    if args.before_tree is not None:
        arms["before"] = Arm("m3.1@before", TINY, args.before_tree.resolve(),
                             ["--index-k-format", "mxfp4", *ctx_override], env)
    order = [a for a in args.arms.split(",") if a in arms]
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    before = ""
    if args.before_tree is not None:
        before = subprocess.run(["git", "-C", str(args.before_tree), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
    import torch

    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; python {platform.python_version()}, torch {torch.__version__}; tree {commit}"
          + (f", before {before}" if before else "") + (f"; env {env}" if env else ""))
    cols = ["ready_s", "demo_s", "dec1_tps", "dec16_tps", *[f"pre{n}_tps" for n in args.prefill]]
    head = ["round", "arm", "load", "ready s", "demo /generate s", "decode tok/s b1 4k", "decode tok/s b16 1k",
            *[f"prefill tok/s {n // 1024}k" for n in args.prefill]]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head), flush=True)
    rng = random.Random(0)
    for r in range(args.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            row = measure(arms[name], args, vocab, rng)
            cells = [str(r + 1), row["arm"], f"{row['load']:.1f}"] + [fmt(row, c, args.timeout) for c in cols]
            print("| " + " | ".join(cells) + " |", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
