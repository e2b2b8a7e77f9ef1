"""SGLang 0.5.16 + the sglang-m3 plugin on an H200: CUDA-graph decode with bf16, fp8 and MXFP4
index-K caches. Started by ``lab/gpu/run_sglang_h200.sh``; writes ``table.md`` (last) and
``results.json`` into ``--out``.

For each index-K format, three real servers (``python -m sglang.launch_server``, dummy weights):

1. ``capacity``: MiniMax-M3's full attention geometry (60 layers: 3 dense + 57 sparse, 64 query
   heads, 4 KV heads x 128, 4 index heads x 128, fp8 main KV cache) with a tiny hidden size and
   few experts so the dummy weights are small; eager; reports ``max_total_num_tokens``.
2. ``eager``: the throughput config (fewer layers, same per-layer geometry, same 1:19
   dense:sparse ratio as M3's 3:57), ``--disable-cuda-graph``; greedy outputs of fixed prompts,
   and the decode inputs of the first sparse layer recorded by ``m3_gpu_probe`` (selected blocks
   are recomputed here with the float64 torch references).
3. ``graph``: the same config with decode CUDA graphs; the same prompts (outputs must equal the
   eager ones token for token), then decode timing at each context length and batch size.

Decode timing: ``bs`` prompts of ``ctx`` tokens (distinct random ids, prefilled once and kept in
the radix cache; the 64k prompts are prefixes of the 128k ones) are generated with
``max_new_tokens = 1`` and ``1 + D`` (``ignore_eos``), alternately, ``--repeats`` times each; time
per output token = (median t(1+D) - median t(1)) / D, which removes the prefix-hit prefill.
tokens/s = bs / TPOT. Every throughput row checks that the pool holds all ``bs`` contexts. Beside it,
the scheduler's own decode rate over the same requests (the median of its ``Decode batch`` log
lines), which leaves out the HTTP round trips and is the steadier of the two (2026-12-02, batch 32:
the pair estimates spread by ±1.75 ms, the log lines by under 1%).
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from sglang_m3.server import CPU_OPENMP_WAITS, free_port
from sglang_m3.server import cpu_env as server_cpu_env

REPO = Path(__file__).resolve().parents[2]
FULL_CONFIG = REPO / "configs" / "minimax-m3.1" / "config.json"
FORMATS = ("bf16", "fp8", "mxfp4")
M3_DENSE_LAYERS, M3_SPARSE_LAYERS = 3, 57
KV_HEADS, HEAD_DIM, INDEX_TOKEN_BYTES = 4, 128, {"bf16": 256, "fp8": 128, "mxfp4": 68}
PAGE = 128


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


# ---- configs ---------------------------------------------------------------------------------

def make_config(path: Path, n_dense: int, n_sparse: int, fmt: str, vocab: int, hidden: int, q_heads: int,
                max_pos: int) -> Path:
    """A config dir with M3's per-layer attention geometry, ``n_dense`` dense then ``n_sparse``
    sparse layers, a tiny MLP/MoE (dummy weights stay small) and index format ``fmt``."""
    cfg = json.loads(FULL_CONFIG.read_text())
    n = n_dense + n_sparse
    pattern = [0] * n_dense + [1] * n_sparse
    sac = dict(cfg["sparse_attention_config"])
    sac["sparse_attention_freq"] = pattern
    sac["sparse_disable_index_value"] = pattern
    cfg.update({
        "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "hidden_size": hidden, "num_hidden_layers": n, "num_attention_heads": q_heads,
        "intermediate_size": 128, "dense_intermediate_size": 512, "num_local_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_layer_freq": pattern,
        "max_position_embeddings": max_pos, "sparse_attention_config": sac, "index_k_format": fmt,
    })
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def cpu_env(tp: int) -> dict:
    """SGLang on a CPU: the OpenMP waits at launch (``sglang_m3.server.cpu_env``); with --tp > 1 also no NCCL (a CUDA
    build of torch finds libnccl and would use it), and one core per rank, ranks sharing cores when there
    are fewer cores than ranks ("0|1|0|1": TP4 on 2)."""
    env = {k: v for k, v in server_cpu_env().items() if k in CPU_OPENMP_WAITS}
    if tp == 1:
        return env
    cores = os.cpu_count() or 1
    return env | {"SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2",
                  "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(r % cores) for r in range(tp))}


def arm(name: str) -> tuple[str, dict]:
    """``fmt`` or ``fmt@backend`` (e.g. ``mxfp4@triton``: the MXFP4 cache with the Triton decode
    scorer forced through ``M3_SCORE_BACKEND``, the "before" arm of the CUDA kernel) -> (index-K
    format, extra server environment)."""
    fmt, _, backend = name.partition("@")
    return fmt, ({"M3_SCORE_BACKEND": backend} if backend else {})


def bytes_per_token(n_dense: int, n_sparse: int, fmt: str, kv_bytes: int = 1) -> int:
    """Pool bytes one token slot costs: main K+V in every layer, index K in sparse layers."""
    return (n_dense + n_sparse) * 2 * KV_HEADS * HEAD_DIM * kv_bytes + n_sparse * INDEX_TOKEN_BYTES[fmt]


# ---- servers ---------------------------------------------------------------------------------

class Server:
    """``python -m sglang.launch_server`` in its own process group, logging to a file; token ids in and
    out (``--skip-tokenizer-init``); SGLang's random dummy weights unless ``dummy_weights=False``."""

    def __init__(self, name: str, model: Path, args: list, log_dir: Path, env_extra: dict | None = None,
                 dummy_weights: bool = True):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        env = dict(os.environ, **(env_extra or {}))
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
               *(["--load-format", "dummy"] if dummy_weights else []),
               "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.cmd = cmd
        self._log = open(self.log_path, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/model_info", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.t0
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name}: not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def wait_log(self, pattern: str, timeout_s: float) -> float:
        """Seconds until ``pattern`` appears in the log (the server need not be ready)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if re.search(pattern, self.tail(10**7)):
                return time.monotonic() - self.t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: server exited with {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.5)
        raise TimeoutError(f"{self.name}: no {pattern!r} in the log after {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            return json.loads(r.read())

    def generate(self, input_ids, max_new_tokens: int, timeout: float = 1800):
        payload = {"input_ids": input_ids,
                   "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = json.loads(r.read())
        return body if isinstance(body, list) else [body]

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=60)
        self._log.close()
        time.sleep(2)  # let the driver release the GPU memory of the killed processes


def capacity_from(server: Server) -> int:
    """``max_total_num_tokens`` from the scheduler's log line (or /server_info)."""
    m = re.findall(r"max_total_num_tokens=(\d+)", server.tail(10**7))
    if m:
        return int(m[-1])
    info = server.get("/server_info")
    if "max_total_num_tokens" in info:
        return int(info["max_total_num_tokens"])
    m = re.findall(r"max_total_num_tokens=(\d+)", server.tail(10**7))
    if not m:
        raise RuntimeError(f"{server.name}: no max_total_num_tokens in /server_info or the log")
    return int(m[-1])


# ---- correctness -----------------------------------------------------------------------------

def prompts(lengths, vocab: int, seed: int):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run_prompt_sets(server: Server, sets, new_tokens: int):
    """Output token ids of each prompt set (each set one batched request)."""
    return [[o["output_ids"] for o in server.generate(s, new_tokens)] for s in sets]


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_probe(probe_dir: Path) -> dict:
    """Recompute block scores (float64) and selection (torch reference) on recorded decode inputs."""
    import torch

    from m3_kernels.ops.score.naive import score_decode_ref
    from m3_kernels.ops.select.naive import select_blocks_ref

    files = sorted(probe_dir.glob("decode_*.pt"))
    res = {"calls": len(files), "rows": 0, "head_rows": 0, "exact": 0, "near_tie": 0, "mismatch": 0,
           "score_max_rel_err": 0.0}
    for f in files:
        r = torch.load(f, weights_only=False)
        bs = r["seq_lens"].shape[0]
        nb = r["scores"].shape[2]
        ref = score_decode_ref(r["q"], r["k_cache"], r["k_scale"], r["block_table"], r["seq_lens"], 1, r["sm_scale"],
                               max_block=nb)
        n_vis = r["n_visible"].long()
        sel_ref = select_blocks_ref(ref, n_vis, r["topk"], r["local_blocks"], r["init_blocks"])
        got = r["scores"].double()
        for b in range(bs):
            n = int(n_vis[b])
            a, e = got[:, b, :n], ref[:, b, :n]
            scale = e.abs().max().clamp(min=1e-30)
            res["score_max_rel_err"] = max(res["score_max_rel_err"], float((a - e).abs().max() / scale))
        res["rows"] += bs
        for h in range(sel_ref.shape[0]):
            for b in range(bs):
                res["head_rows"] += 1
                s_got = set(r["selected"][h, b].tolist()) - {-1}
                s_ref = set(sel_ref[h, b].tolist()) - {-1}
                if s_got == s_ref:
                    res["exact"] += 1
                    continue
                # A swap between blocks whose exact scores lie within fp32 rounding of each other.
                diff = sorted(s_got ^ s_ref)
                vals = ref[h, b, diff]
                kth = min(float(ref[h, b, i]) for i in s_ref if i < ref.shape[2]) if s_ref else 0.0
                tol = 1e-5 * max(1.0, abs(kth))
                if all(abs(float(v) - kth) <= tol for v in vals):
                    res["near_tie"] += 1
                else:
                    res["mismatch"] += 1
    return res


# ---- decode timing ---------------------------------------------------------------------------

def timed_generate(server: Server, ids, new_tokens: int) -> float:
    t = time.perf_counter()
    out = server.generate(ids, new_tokens)
    dt = time.perf_counter() - t
    got = [len(o["output_ids"]) for o in out]
    if got != [new_tokens] * len(ids):
        raise RuntimeError(f"asked {new_tokens} new tokens per request, got {got}")
    return dt


_DECODE_LOG = re.compile(r"Decode batch, #running-req: (\d+),.*cuda graph: (?:True|False), "
                         r"gen throughput \(token/s\): ([0-9.]+)")


def server_decode_rate(log_text: str, bs: int) -> dict | None:
    """The scheduler's own decode rate for batch ``bs`` from its ``Decode batch`` log lines (one per
    ``--decode-log-interval`` steps, 40 by default): each line's tokens/s covers the steps since the
    previous line, so a line whose interval spans a gap between requests reads low. The median of the
    lines at ``#running-req: bs`` ignores those; ``None`` if there are fewer than 3 such lines.
    Returns tok/s, TPOT in ms (one decode step of the batch), the line count and the quartiles'
    spread in ms (half the interquartile range of per-line TPOTs)."""
    rates = [float(m[2]) for m in _DECODE_LOG.finditer(log_text) if int(m[1]) == bs and float(m[2]) > 0]
    if len(rates) < 3:
        return None
    q1, _, q3 = statistics.quantiles([bs / r for r in rates], n=4)
    rate = statistics.median(rates)
    return {"tok_s": rate, "tpot_ms": bs / rate * 1e3, "lines": len(rates), "tpot_iqr_half_ms": (q3 - q1) / 2 * 1e3}


def measure_decode(server: Server, ids, decode_tokens: int, repeats: int) -> dict:
    """Time per output token from ``repeats`` pairs of requests generating 1 and 1 + ``decode_tokens``
    tokens (the prompt is radix-cached, so the difference is decode only). One warm-up pair first
    (the first request of a row pays one-off costs: 0.5-4 s were seen). ``tpot_spread_ms``: the
    spread of the per-pair estimates (max - min), the noise to compare format differences with.
    ``server``: the scheduler's decode rate over the same requests (``server_decode_rate``), which
    leaves out the HTTP round trips and the gaps between requests that make the pair estimates noisy.
    When the longer requests are not slower (decode below the timing noise: too few ``decode_tokens``
    for the step time), ``tpot_ms`` and ``tok_s`` are None and ``below_noise`` is True."""
    timed_generate(server, ids, 1)
    timed_generate(server, ids, 1 + decode_tokens)
    log_from = server.log_path.stat().st_size
    short, long_ = [], []
    for _ in range(repeats):
        short.append(timed_generate(server, ids, 1))
        long_.append(timed_generate(server, ids, 1 + decode_tokens))
    tpot = (statistics.median(long_) - statistics.median(short)) / decode_tokens
    pairs = [(b - a) / decode_tokens for a, b in zip(short, long_)]
    with open(server.log_path, "rb") as f:
        f.seek(log_from)
        rate = server_decode_rate(f.read().decode(errors="replace"), len(ids))
    resolved = tpot > 0
    return {"tpot_ms": tpot * 1e3 if resolved else None, "tok_s": len(ids) / tpot if resolved else None,
            "below_noise": not resolved, "tpot_spread_ms": (max(pairs) - min(pairs)) * 1e3,
            "t_short_s": short, "t_long_s": long_, "server": rate}


# ---- main ------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--contexts", default="65536,131072", help="decode context lengths (tokens)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--decode-tokens", type=int, default=256, help="D: timed decode steps per measurement")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small-dense", type=int, default=1, help="dense layers of the throughput config")
    ap.add_argument("--small-sparse", type=int, default=19, help="sparse layers of the throughput config")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--q-heads", type=int, default=16,
                    help="query heads of the throughput config (decode reads KV per KV head; 16 keeps prefill short)")
    ap.add_argument("--cap-q-heads", type=int, default=64, help="query heads of the capacity config (M3: 64)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--mem-fraction", type=float, default=0.88)
    ap.add_argument("--chunked-prefill", type=int, default=32768)
    ap.add_argument("--check-lengths", default="2300,3100,4200,5000",
                    help="prompt lengths of the batched eager-vs-graph check (one more prompt runs alone)")
    ap.add_argument("--check-tokens", type=int, default=24)
    ap.add_argument("--check-pool-tokens", type=int, default=65536, help="--max-total-tokens of the eager servers")
    ap.add_argument("--budget-s", type=float, default=500, help="skip steps that would end past this")
    ap.add_argument("--cpu", action="store_true", help="smoke test of this driver on a CPU (tiny sizes, no graphs)")
    ap.add_argument("--skip-capacity", action="store_true")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel size of every server (--tp-size; TP4 gives each rank one of the 4 index "
                         "heads). The eager probe records one process only: with --tp > 1 use --eager skip")
    ap.add_argument("--graph-bs", default=None,
                    help="decode CUDA-graph batch sizes (default: the --batches values); each one costs capture time")
    ap.add_argument("--eager", choices=("alongside", "separate", "skip"), default="alongside",
                    help="alongside: each format's eager server runs next to its graph server (started once the "
                         "graph server's pool is allocated, stopped before any timing); separate: all eager "
                         "servers first, side by side; skip: no eager servers (decode timing only)")
    args = ap.parse_args()
    if args.tp < 1 or (args.tp > 1 and args.eager != "skip"):
        ap.error(f"--tp {args.tp}: must be >= 1, and > 1 needs --eager skip (the eager check's probe records one "
                 "process; lab/gpu/sglang_tp2.py compares TP against TP1 outputs and selections)")
    for name, heads in (("--q-heads", args.q_heads), ("--cap-q-heads", args.cap_q_heads)):
        if heads % args.tp:
            ap.error(f"{name} {heads} must be a multiple of --tp {args.tp}")

    t_start = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - t_start)  # noqa: E731
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="m3-h200-"))
    log_dir = work / "logs"
    log_dir.mkdir()
    formats = args.formats.split(",")
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    max_ctx, max_bs = max(contexts), max(batches)
    context_len = max_ctx + 8 * PAGE
    nd, ns = args.small_dense, args.small_sparse

    base = ["--page-size", str(PAGE), "--log-level", "info", "--skip-server-warmup", "--random-seed", "0",
            "--context-length", str(context_len), "--max-running-requests", str(max(64, 2 * max_bs)),
            "--chunked-prefill-size", str(args.chunked_prefill)]
    if args.tp > 1:
        base += ["--tp-size", str(args.tp)]
    if args.cpu:
        os.environ.update(cpu_env(args.tp))  # every server's environment (read when SGLang starts)
        base += ["--device", "cpu", "--attention-backend", "torch_native"]
    else:
        base += ["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "triton", "--sampling-backend", "pytorch",
                 "--grammar-backend", "none"]
    eager_flags = ["--disable-cuda-graph"]
    graph_bs = sorted({int(x) for x in (args.graph_bs or args.batches).split(",")})
    graph_flags = [] if args.cpu else ["--disable-piecewise-cuda-graph", "--cuda-graph-bs", *map(str, graph_bs)]
    full_pool = ["--mem-fraction-static", str(args.mem_fraction)]
    if args.cpu:
        full_pool = ["--mem-fraction-static", "0.3", "--max-total-tokens", str(max_bs * (max_ctx + 4 * PAGE) + 4096)]
    # Eager servers have a small pool of their own (--max-total-tokens caps it). Separate: side by side
    # on an empty GPU; alongside: on what the graph server leaves, so their static fraction is high.
    check_pool = ["--mem-fraction-static", "0.3" if args.cpu else ("0.2" if args.eager == "separate" else "0.96"),
                  "--max-total-tokens", str(args.check_pool_tokens)]

    check_lengths = [int(x) for x in args.check_lengths.split(",")]
    check_sets = [prompts(check_lengths, args.vocab, 1), prompts([max(check_lengths) + 700], args.vocab, 2)]
    import numpy as np

    long_prompts = np.random.default_rng(3).integers(3, args.vocab, size=(max_bs, max_ctx)).tolist()

    results = {"formats": {f: {} for f in formats}, "args": vars(args) | {"out": str(out)}, "notes": [],
               "env": env_report()}

    def save():
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))

    def fail(r, key, e):
        r[key] = repr(e)[-3000:]
        log(f"{key}: {e!r}"[-3000:])

    save()
    abort = False
    # Phase A: pool capacity at M3's full attention geometry, one server at a time (alone on the GPU).
    startup_timeout = 900 if args.cpu else 420
    for fmt in ([] if args.skip_capacity or args.cpu else formats):
        r = results["formats"][fmt]
        if left() < 40:
            results["notes"].append(f"{fmt}: capacity not measured (time budget)")
            continue
        cfg = make_config(work / f"cap60-{fmt}", M3_DENSE_LAYERS, M3_SPARSE_LAYERS, arm(fmt)[0], args.vocab, args.hidden,
                          args.cap_q_heads, context_len)
        s = Server(f"capacity-{fmt}", cfg, base + eager_flags + full_pool, log_dir, arm(fmt)[1])
        try:
            r["capacity_ready_s"] = s.wait_log(r"max_total_num_tokens=(\d+)", startup_timeout)
            r["capacity_tokens"] = capacity_from(s)
            r["capacity_bytes_per_token"] = bytes_per_token(M3_DENSE_LAYERS, M3_SPARSE_LAYERS, arm(fmt)[0])
            log(f"{fmt}: 60-layer capacity {r['capacity_tokens']} tokens (ready in {r['capacity_ready_s']:.0f} s)")
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            fail(r, "capacity_error", e)
        finally:
            s.stop()
        startup_timeout = 300
        save()
        if "capacity_error" in r and "exited" in r["capacity_error"] and fmt == formats[0]:
            results["notes"].append("stopped after the first server failed to start (see capacity_error)")
            abort = True
            break

    # Phase B: eager servers (all formats side by side): reference outputs + recorded decode inputs.
    eager_out = {}
    if abort or args.eager in ("alongside", "skip"):
        pass
    elif left() < 60:
        results["notes"].append("eager runs skipped (time budget)")
    else:
        servers = {}
        for fmt in formats:
            cfg = make_config(work / f"small-{fmt}", nd, ns, arm(fmt)[0], args.vocab, args.hidden, args.q_heads,
                              context_len)
            servers[fmt] = Server(f"eager-{fmt}", cfg, base + eager_flags + check_pool, log_dir,
                                  {"M3_PROBE_DIR": str(work / f"probe-{fmt}"), "M3_PROBE_CALLS": "3", **arm(fmt)[1]})
        for fmt, s in servers.items():
            r = results["formats"][fmt]
            try:
                r["eager_ready_s"] = s.wait_ready(startup_timeout)
                t = time.perf_counter()
                eager_out[fmt] = r["eager_outputs"] = run_prompt_sets(s, check_sets, args.check_tokens)
                r["eager_check_s"] = time.perf_counter() - t
                log(f"{fmt}: eager outputs done ({r['eager_check_s']:.1f} s)")
            except Exception as e:  # noqa: BLE001
                fail(r, "eager_error", e)
        for s in servers.values():
            s.stop()
        for fmt in formats:
            r = results["formats"][fmt]
            try:
                r["selection"] = check_probe(work / f"probe-{fmt}")
                log(f"{fmt}: selection vs torch reference: {r['selection']}")
            except Exception as e:  # noqa: BLE001
                fail(r, "selection_error", e)
        startup_timeout = 300
        save()
        if not eager_out:
            results["notes"].append("no eager server produced outputs: graph runs skipped")
            abort = True

    # Phase C: one CUDA-graph server per format (alone): same outputs, then decode timing. Each format
    # gets an equal share of the time left; rows run by batch size (largest last), so a short budget
    # drops the same rows for every format.
    phase_c_start, phase_c_time = time.monotonic(), max(0.0, left())
    plan = sorted(((ctx, bs) for ctx in contexts for bs in batches), key=lambda cb: (cb[1], -cb[0]))
    for i_fmt, fmt in enumerate([] if abort else formats):
        r = results["formats"][fmt]
        fmt_deadline = phase_c_start + (i_fmt + 1) * phase_c_time / len(formats)
        fmt_left = lambda: fmt_deadline - time.monotonic()  # noqa: E731
        if fmt_left() < 45:
            results["notes"].append(f"{fmt}: graph run skipped (time budget)")
            continue
        cfg = make_config(work / f"small-{fmt}", nd, ns, arm(fmt)[0], args.vocab, args.hidden, args.q_heads, context_len)
        s = Server(f"graph-{fmt}", cfg, base + graph_flags + full_pool, log_dir, arm(fmt)[1])
        eager = None
        try:
            if args.eager == "alongside":
                s.wait_log(r"max_total_num_tokens=(\d+)", startup_timeout)
                eager = Server(f"eager-{fmt}", cfg, base + eager_flags + check_pool, log_dir,
                               {"M3_PROBE_DIR": str(work / f"probe-{fmt}"), "M3_PROBE_CALLS": "3", **arm(fmt)[1]})
            r["graph_ready_s"] = s.wait_ready(startup_timeout)
            scorer = re.findall(r"decode scorer (\w+)", s.tail(10**7))
            r["decode_scorer"] = sorted(set(scorer)) or None  # what the model runner's backend logged
            cap = r["small_capacity_tokens"] = capacity_from(s)
            graph_out = r["graph_outputs"] = run_prompt_sets(s, check_sets, args.check_tokens)
            if eager is not None:
                try:
                    r["eager_ready_s"] = eager.wait_ready(startup_timeout)
                    eager_out[fmt] = r["eager_outputs"] = run_prompt_sets(eager, check_sets, args.check_tokens)
                    log(f"{fmt}: eager outputs done")
                except Exception as e:  # noqa: BLE001
                    fail(r, "eager_error", e)
                finally:
                    eager.stop()  # before any timing
                try:
                    r["selection"] = check_probe(work / f"probe-{fmt}")
                    log(f"{fmt}: selection vs torch reference: {r['selection']}")
                except Exception as e:  # noqa: BLE001
                    fail(r, "selection_error", e)
            startup_timeout = 300
            if fmt in eager_out:
                r["graph_equals_eager"] = graph_out == eager_out[fmt]
                r["divergence"] = [[first_divergence(a, b) for a, b in zip(es, gs)]
                                   for es, gs in zip(eager_out[fmt], graph_out)]
                log(f"{fmt}: graph == eager: {r['graph_equals_eager']} (first divergence {r['divergence']})")
            r["decode"] = {}
            prefilled = 0
            for ctx, bs in plan:
                key = f"{ctx}x{bs}"
                need = bs * (max_ctx + 4 * PAGE)
                if need > cap:
                    r["decode"][key] = {"skipped": f"pool holds {cap} tokens, {need} needed"}
                    continue
                if bs > prefilled:
                    # New contexts are prefilled once at full length; estimate from the last rate.
                    est = (bs - prefilled) * r.get("prefill_s_per_ctx", 2.0)
                    if est + 8 > fmt_left():
                        r["decode"][key] = {"skipped": f"time budget (prefill est. {est:.0f} s)"}
                        continue
                    t = time.perf_counter()
                    for i in range(prefilled, bs, 4):
                        s.generate(long_prompts[i:min(bs, i + 4)], 1)
                    r["prefill_s_per_ctx"] = (time.perf_counter() - t) / (bs - prefilled)
                    log(f"{fmt}: prefilled contexts {prefilled}..{bs - 1} of {max_ctx} tokens "
                        f"({r['prefill_s_per_ctx']:.2f} s each)")
                    prefilled = bs
                if fmt_left() < 5:
                    r["decode"][key] = {"skipped": "time budget"}
                    continue
                m = measure_decode(s, [p[:ctx] for p in long_prompts[:bs]], args.decode_tokens, args.repeats)
                r["decode"][key] = m
                srv = m["server"]
                http = "below the timing noise" if m["below_noise"] else \
                    f"{m['tok_s']:.0f} tok/s, TPOT {m['tpot_ms']:.3f} ms"
                log(f"{fmt}: ctx {ctx} bs {bs}: {http}; scheduler: "
                    + (f"{srv['tok_s']:.0f} tok/s, TPOT {srv['tpot_ms']:.3f} ms ({srv['lines']} lines)" if srv else "-"))
                save()
            logtext = s.tail(10**8)
            r["decode_graph_batches"] = len(re.findall(r"Decode batch.*cuda graph: True", logtext))
            r["decode_eager_batches"] = len(re.findall(r"Decode batch.*cuda graph: False", logtext))
        except Exception as e:  # noqa: BLE001
            fail(r, "graph_error", e)
        finally:
            s.stop()
            if eager is not None and eager.proc.poll() is None:
                eager.stop()
        save()

    results["elapsed_s"] = time.monotonic() - t_start
    save()
    write_logs(log_dir, out / "server_logs.txt")
    table = render_table(results, contexts, batches, nd, ns)
    (out / "table.md").write_text(table)
    print(table, flush=True)
    shutil.rmtree(work, ignore_errors=True)


def env_report() -> dict:
    rep = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "python": sys.version.split()[0]}
    try:
        import torch

        rep["torch"] = torch.__version__
        rep["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception as e:  # noqa: BLE001
        rep["torch"] = repr(e)
    for mod in ("sglang", "triton", "transformers"):
        try:
            rep[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            rep[mod] = repr(e)[:200]
    rep["commit"] = os.environ.get("M3_COMMIT", "unknown")
    return rep


def write_logs(log_dir: Path, dest: Path, lines: int = 150):
    with open(dest, "w") as f:
        for p in sorted(log_dir.glob("*.log")):
            text = p.read_text(errors="replace").splitlines()
            f.write(f"===== {p.name}: last {lines} of {len(text)} lines =====\n")
            f.write("\n".join(text[-lines:]) + "\n")


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def render_table(results, contexts, batches, nd, ns) -> str:
    env, fr = results["env"], results["formats"]
    lines = [f"# SGLang + sglang-m3 on {env.get('gpu')} ({env['date_utc']} UTC; sglang {env.get('sglang')}, "
             f"torch {env.get('torch')}, triton {env.get('triton')}, commit {env.get('commit')})", ""]
    lines += ["## Pool capacity: M3 attention geometry (60 layers, 3 dense + 57 sparse, fp8 main KV)", "",
              "| index K | bytes/token | max_total_num_tokens | capacity / fp8 | bytes fp8 / bytes | within 1% |",
              "|---|---|---|---|---|---|"]
    fp8 = fr.get("fp8", {})
    for fmt, r in fr.items():
        cap, bpt = r.get("capacity_tokens"), r.get("capacity_bytes_per_token")
        ratio = cap / fp8["capacity_tokens"] if cap and fp8.get("capacity_tokens") else None
        bratio = fp8.get("capacity_bytes_per_token") / bpt if bpt and fp8.get("capacity_bytes_per_token") else None
        ok = None if ratio is None or bratio is None else abs(ratio / bratio - 1) <= 0.01
        lines.append(f"| {fmt} | {bpt or '-'} | {cap or r.get('capacity_error', '-')[:80]} | {_fmt(ratio, '.4f')} | "
                     f"{_fmt(bratio, '.4f')} | {'-' if ok is None else ('yes' if ok else 'NO')} |")
    lines += ["", f"## Correctness: throughput config ({nd} dense + {ns} sparse layers), greedy, dummy weights", "",
              "| index K | graph == eager | decode batches in graph / eager | selection rows (head x row) exact / "
              "near-tie / mismatch | scorer max rel. err vs float64 |", "|---|---|---|---|---|"]
    for fmt, r in fr.items():
        sel = r.get("selection")
        sel_s = (f"{sel['exact']} / {sel['near_tie']} / {sel['mismatch']} of {sel['head_rows']} ({sel['calls']} calls)"
                 if sel else r.get("selection_error", "-")[:80])
        eq = r.get("graph_equals_eager")
        eq_s = "-" if eq is None else ("yes" if eq else f"NO {r.get('divergence')}")
        if eq is None and (r.get("graph_error") or r.get("eager_error")):
            eq_s = "error: " + (r.get("graph_error") or r.get("eager_error"))[:100].replace("|", "/")
        lines.append(f"| {fmt} | {eq_s} | {r.get('decode_graph_batches', '-')} / {r.get('decode_eager_batches', '-')} "
                     f"| {sel_s} | {_fmt(sel and sel['score_max_rel_err'], '.2e')} |")
    lines += ["", f"## Decode with CUDA graphs: throughput config ({nd} dense + {ns} sparse layers, fp8 main KV)", "",
              "Two measures per cell. tok/s and TPOT: from request pairs timed over HTTP (± half the spread of "
              "the per-pair estimates). sched TPOT: the scheduler's own decode rate over the same requests, the "
              "median of its `Decode batch` log lines (± half the interquartile range); /fp8 uses it where "
              "both formats have it.", "",
              "| context | batch | " + " | ".join(f"{f} tok/s | {f} TPOT ms | {f} sched TPOT ms" for f in fr) + " | "
              + " | ".join(f"{f}/fp8" for f in fr if f != "fp8") + " |",
              "|---|---|" + "---|---|---|" * len(fr) + "---|" * len([f for f in fr if f != "fp8"])]
    for ctx in contexts:
        for bs in batches:
            key = f"{ctx}x{bs}"
            cells = []
            for fmt, r in fr.items():
                d = r.get("decode", {}).get(key, {})
                if "tok_s" in d:
                    srv = d.get("server")
                    srv_s = f"{srv['tpot_ms']:.3f} ±{srv['tpot_iqr_half_ms']:.3f}" if srv else "-"
                    if d["tok_s"] is None:
                        cells.append(f"below noise | - | {srv_s}")
                        continue
                    spread = f" ±{d['tpot_spread_ms'] / 2:.3f}" if "tpot_spread_ms" in d else ""
                    cells.append(f"{d['tok_s']:.0f} | {d['tpot_ms']:.3f}{spread} | {srv_s}")
                else:
                    cells.append(f"{d.get('skipped', 'not run')[:40]} | - | -")
            base_d = fr.get("fp8", {}).get("decode", {}).get(key, {})
            ratios = []
            for fmt, r in fr.items():
                if fmt == "fp8":
                    continue
                d = r.get("decode", {}).get(key, {})
                if d.get("server") and base_d.get("server"):
                    v, base = d["server"]["tok_s"], base_d["server"]["tok_s"]
                else:
                    v, base = d.get("tok_s"), base_d.get("tok_s")
                ratios.append(_fmt(v / base if v and base else None, ".3f"))
            ctx_s = f"{ctx // 1024}k" if ctx >= 1024 and ctx % 1024 == 0 else str(ctx)
            lines.append(f"| {ctx_s} | {bs} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    small = {f: r.get("small_capacity_tokens") for f, r in fr.items()}
    lines += ["", f"Throughput-config pool capacity (tokens): {small}."]
    lines += ["Decode scorer each graph server logged: "
              f"{ {f: r.get('decode_scorer') for f, r in fr.items()} }."]
    lines += [f"Note: {n}" for n in results["notes"]]
    lines += [f"Elapsed: {results.get('elapsed_s', 0):.0f} s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
