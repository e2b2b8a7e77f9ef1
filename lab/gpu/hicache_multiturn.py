"""HiCache with each index-K format on one GPU: a multi-turn run whose prefixes exceed the device pool.

Per format, one server (``configs/msa-small``, trained weights, ``--attention-backend triton``,
``--enable-hierarchical-cache``, decode CUDA graphs on) with a small device pool (``--device-slots``,
default 8,192) and a host pool ``--hicache-ratio`` times larger (default 4). ``--convs`` conversations
(default 8) of ``--prefix`` tokens (default 3,072, random ids) take ``--turns`` turns (default 3) in
round-robin order; each turn appends the last answer (``--answer`` greedy tokens, default 16) and
``--user`` new tokens (default 128). The conversations together hold about 3x the device pool, so by a
conversation's next turn its prefix has been pushed to the host: turns >= 2 should hit the host.

Each request streams; TTFT is the time to its first streamed chunk. The last chunk's
``cached_tokens_details`` says how many prompt tokens came from the device pool and how many were loaded
back from the host. After the run, ``/flush_cache`` empties both tiers and the turn >= 2 prompts are sent
again, cold: the same greedy tokens are expected, and their TTFT is the cold baseline.

    # on the GPU machine, with the SGLang bundle (lab/gpu/bundle_env.sh)
    source lab/gpu/bundle_env.sh && python3 lab/gpu/hicache_multiturn.py --out "$OUT/hicache"
    python3 lab/gpu/hicache_multiturn.py --cpu --formats mxfp4 --convs 3 --turns 2 --prefix 2200 \
        --device-slots 4096 --out out/hicache   # plumbing on a CPU (SGLang's K/V host copies by the tests' hooks)

Writes ``results.json`` and ``table.md`` into ``--out`` (server logs as ``<format>.log``) and prints the
table last.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from sglang_m3.server import Server  # noqa: E402

FORMATS = ("bf16", "fp8", "mxfp4", "mxfp4_rot")
VOCAB = 2048  # configs/msa-small


def stream_generate(url: str, input_ids, max_new_tokens: int):
    """``(ttft_s, output_ids, cached_tokens_details, prompt_tokens)`` of one greedy streamed request."""
    payload = {"input_ids": input_ids, "stream": True,
               "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, chunks = None, []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            chunks.append(json.loads(line[len("data:"):]))
    if not chunks:
        raise RuntimeError(f"no streamed chunk for a {len(input_ids)}-token prompt (see the server's log)")
    last = chunks[-1]
    meta = last["meta_info"]
    details = meta.get("cached_tokens_details") or {"device": meta.get("cached_tokens", 0), "host": 0}
    output = last["output_ids"]  # cumulative, unless the server streams increments
    if len(output) != max_new_tokens:
        output = [t for c in chunks for t in c["output_ids"]]
    return ttft, output, details, meta["prompt_tokens"]


def post(url: str, path: str):
    req = urllib.request.Request(url + path, data=b"{}", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status


def run_format(fmt: str, a, out: Path) -> dict:
    args = ["--index-k-format", fmt, "--skip-tokenizer-init", "--max-total-tokens", str(a.device_slots),
            "--chunked-prefill-size", "2048", "--max-running-requests", "8"]
    args += ["--enable-hierarchical-cache", "--hicache-ratio", str(a.hicache_ratio)]
    env = None
    if a.cpu:  # plumbing: SGLang's K/V host copies are CUDA-only; the tests' hooks replace them with torch
        args += ["--device", "cpu", "--attention-backend", "torch_native", "--hicache-io-backend", "direct",
                 "--hicache-mem-layout", "layer_first"]
        hooks = REPO / "tests" / "sglang_m3" / "hicache_cpu"
        env = dict(os.environ, M3_TEST_HICACHE_ON_CPU="1", SGLANG_M3_CPU_START="spawn",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")])))
    else:
        args += ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
                 "--mem-fraction-static", "0.3"]
    rng = random.Random(a.seed)
    convs = [[rng.randrange(3, VOCAB) for _ in range(a.prefix)] for _ in range(a.convs)]
    turns = []  # (turn, conv, prompt, ttft, output, details)
    t_start = time.monotonic()
    server = Server(REPO / "configs" / "msa-small", args, out / f"{fmt}.log", cwd=REPO, env=env, timeout_s=900).start()
    try:
        server.wait_ready()
        ready_s = time.monotonic() - t_start
        for turn in range(1, a.turns + 1):
            for c in range(a.convs):
                prompt = list(convs[c])
                ttft, output, details, _ = stream_generate(server.url, prompt, a.answer)
                turns.append(dict(turn=turn, conv=c, prompt=prompt, ttft=ttft, output=output, details=details))
                convs[c] = prompt + output + [rng.randrange(3, VOCAB) for _ in range(a.user)]
        assert post(server.url, "/flush_cache") == 200
        time.sleep(1)
        cold = []
        for row in (r for r in turns if r["turn"] >= 2):
            ttft, output, details, _ = stream_generate(server.url, row["prompt"], a.answer)
            cold.append(dict(ttft=ttft, output=output, details=details))
            post(server.url, "/flush_cache")  # each cold request starts from empty tiers
    finally:
        server.stop()
    later = [r for r in turns if r["turn"] >= 2]
    prompt_tokens = sum(len(r["prompt"]) for r in later)
    host = sum(r["details"].get("host", 0) for r in later)
    device = sum(r["details"].get("device", 0) for r in later)
    agree = sum(r["output"] == c["output"] for r, c in zip(later, cold))
    return {
        "format": fmt, "ready_s": ready_s, "device_slots": a.device_slots,
        "turn1_ttft_ms": 1e3 * statistics.median(r["ttft"] for r in turns if r["turn"] == 1),
        "later_ttft_ms": 1e3 * statistics.median(r["ttft"] for r in later),
        "cold_ttft_ms": 1e3 * statistics.median(c["ttft"] for c in cold),
        "host_hit_rate": host / prompt_tokens, "device_hit_rate": device / prompt_tokens,
        "later_requests": len(later), "host_hit_requests": sum(r["details"].get("host", 0) > 0 for r in later),
        "cold_cached_tokens": sum(c["details"].get("device", 0) + c["details"].get("host", 0) for c in cold),
        "greedy_equal_to_cold": f"{agree}/{len(later)}",
        "rows": [{k: v for k, v in r.items() if k != "prompt"} | {"prompt_len": len(r["prompt"])} for r in turns],
    }


def table(results, a) -> str:
    lines = [
        f"HiCache multi-turn, configs/msa-small, device pool {a.device_slots} slots, host ratio {a.hicache_ratio}, "
        f"{a.convs} conversations x {a.turns} turns, prefix {a.prefix}, "
        f"+{a.answer} answer +{a.user} user tokens a turn",
        "",
        "| format | turn-1 TTFT ms (cold) | turn>=2 TTFT ms (HiCache) | same prompts cold TTFT ms | host hit rate | "
        "device hit rate | requests with host hits | greedy == cold | cached tokens in the cold pass |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['format']} | error: {r['error'][:200]} | | | | | | | |")
            continue
        lines.append(
            f"| {r['format']} | {r['turn1_ttft_ms']:.1f} | {r['later_ttft_ms']:.1f} | {r['cold_ttft_ms']:.1f} | "
            f"{r['host_hit_rate']:.3f} | {r['device_hit_rate']:.3f} | {r['host_hit_requests']}/{r['later_requests']} | "
            f"{r['greedy_equal_to_cold']} | {r['cold_cached_tokens']} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("out/hicache"))
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--device-slots", type=int, default=8192)
    p.add_argument("--hicache-ratio", type=float, default=4.0)
    p.add_argument("--convs", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prefix", type=int, default=3072)
    p.add_argument("--answer", type=int, default=16)
    p.add_argument("--user", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true",
                   help="plumbing on a CPU: SGLang's CUDA-only K/V host copies replaced by tests/sglang_m3/hicache_cpu")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    for fmt in a.formats:
        try:
            results.append(run_format(fmt, a, a.out))
        except Exception as e:  # one format's failure is reported, the others still run
            results.append({"format": fmt, "error": f"{type(e).__name__}: {e}"})
        (a.out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results, a)
    (a.out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
