"""Where a served prefill's time goes on an H200: SGLang 0.5.16 + sglang-m3, one server per arm (index-K
format, chunked-prefill size, attention backend of the dense layers), otherwise the accuracy runs' launch
arguments (``lab/gpu/accuracy_h200.sh``).

Per server:
0. greedy tokens of a few fixed prompts (``--check-tokens`` each), compared with the first arm's: a
   backend or chunk size that changes answers shows here (near-ties aside);
1. one prompt alone at each of ``--lengths`` (fresh random token ids, one new token): seconds and
   prompt tokens per second;
2. a round like the accuracy runs': ``--concurrency`` prompts at once, the lengths mixed;
3. the torch profiler (SGLang's ``/start_profile``, GPU activity only) around one prompt of
   ``--profile-length``: GPU kernel time summed by kernel name, against the wall time of the request.

Writes ``results.json`` and ``table.md`` (last) into ``--out``; the trace files stay on the machine.

    source lab/gpu/bundle_env.sh && python3 lab/gpu/profile_prefill.py --out $OUT
"""

import argparse
import concurrent.futures
import gzip
import json
import random
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_h200 import Server, first_divergence, log, timed_generate  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def launch_args(context: int, chunk: int, fmt: str, concurrency: int, device: str, attention: str = "") -> list[str]:
    """The accuracy runs' launch arguments (accuracy_h200.sh) plus the format override; ``chunk`` 0 and
    ``attention`` "" keep SGLang's chunk size and the runs' backend (triton; torch_native on a CPU)."""
    if device == "cpu":  # the smoke test's
        args = ["--device", "cpu", "--attention-backend", attention or "torch_native", "--max-total-tokens",
                str(4 * context), "--context-length", str(context), "--skip-server-warmup"]
    else:
        args = ["--attention-backend", attention or "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
                "--disable-piecewise-cuda-graph", "--cuda-graph-max-bs", str(concurrency),
                "--context-length", str(context), "--mem-fraction-static", "0.85"]
    args += ["--random-seed", "0", "--json-model-override-args", json.dumps({"index_k_format": fmt})]
    if chunk:
        args += ["--chunked-prefill-size", str(chunk), "--max-prefill-tokens", str(max(chunk, 16384))]
    return args


def post(server: Server, path: str, payload: dict, timeout: float = 600):
    req = urllib.request.Request(server.url + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def kernel_table(trace_dir: Path, top: int, cats=("kernel", "gpu_memcpy", "gpu_memset")) -> dict:
    """Time by event name from the newest torch-profiler trace in ``trace_dir``: GPU kernels and copies by
    default (``cats``: the trace's event categories; CPU ops nest, so their sums overlap)."""
    traces = sorted(trace_dir.rglob("*.trace.json*"), key=lambda p: p.stat().st_mtime)
    if not traces:
        return {"error": f"no trace in {trace_dir}: {sorted(p.name for p in trace_dir.rglob('*'))}"}
    path = traces[-1]
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    by_name, count = defaultdict(float), defaultdict(int)
    t_min, t_max = float("inf"), 0.0
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in cats:
            continue
        name = re.sub(r"\s+", " ", e.get("name", "?"))[:90]
        by_name[name] += e["dur"]
        count[name] += 1
        t_min, t_max = min(t_min, e["ts"]), max(t_max, e["ts"] + e["dur"])
    total = sum(by_name.values())
    rows = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"trace": path.name, "trace_mib": round(path.stat().st_size / 2**20, 1), "gpu_busy_ms": total / 1e3,
            "gpu_span_ms": (t_max - t_min) / 1e3 if total else 0.0,
            "kernels": [{"name": n, "ms": d / 1e3, "calls": count[n], "share": d / total} for n, d in rows]}


def arm_name(fmt: str, chunk: int, attention: str) -> str:
    return f"{fmt} chunk={chunk or 'default'} attn={attention or 'default'}"


def run_server(model: Path, dummy: bool, fmt: str, chunk: int, attention: str, args, work: Path,
               rng: random.Random) -> dict:
    name = arm_name(fmt, chunk, attention)
    res = {"arm": name, "format": fmt, "chunked_prefill": chunk or "default", "attention": attention or "default"}
    context = max(args.lengths + [args.profile_length]) + 256
    slug = f"{fmt}-{chunk or 'default'}-{attention or 'default'}"  # the arm in file names
    trace_dir = work / f"trace-{slug}"
    trace_dir.mkdir(parents=True)
    env = {"SGLANG_TORCH_PROFILER_DIR": str(trace_dir)}
    s = Server(slug, model, launch_args(context, chunk, fmt, args.concurrency, args.device, attention), work, env,
               dummy_weights=dummy)
    try:
        res["ready_s"] = s.wait_ready(600)
        m = re.findall(r"chunked_prefill_size=(-?\d+)", s.tail(10**7))
        res["chunked_prefill_logged"] = int(m[-1]) if m else None
        vocab = args.vocab
        fixed = random.Random(7)  # the same check prompts for every arm
        check = [[fixed.randrange(3, vocab) for _ in range(n)] for n in args.check_lengths]
        res["check_outputs"] = [o["output_ids"] for o in s.generate(check, args.check_tokens)]
        draw = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
        res["warmup_s"] = timed_generate(s, [draw(min(8192, *args.lengths))], 1)
        res["alone_s"] = {}
        for n in args.lengths:
            dt = timed_generate(s, [draw(n)], 1)
            res["alone_s"][n] = dt
            log(f"{name}: {n} tokens alone {dt:.2f} s ({n / dt / 1e3:.0f}k tok/s)")
        mix = [args.lengths[i % len(args.lengths)] for i in range(args.concurrency)]
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as ex:
            list(ex.map(lambda n: s.generate([draw(n)], 1), mix))
        dt = time.perf_counter() - t
        res["round"] = {"lengths": mix, "s": dt, "tok_s": sum(mix) / dt}
        log(f"{name}: round of {len(mix)} ({sum(mix)} tokens) {dt:.2f} s")
        cpu = args.device == "cpu"
        post(s, "/start_profile", {"output_dir": str(trace_dir), "activities": ["CPU" if cpu else "GPU"],
                                   "with_stack": False, "record_shapes": False})
        dt = timed_generate(s, [draw(args.profile_length)], 1)
        post(s, "/stop_profile", {})
        time.sleep(3)  # the scheduler writes the trace after the stop request returns
        for _ in range(60):
            if list(trace_dir.rglob("*.trace.json*")):
                break
            time.sleep(1)
        res["profiled_s"] = dt
        res["profile"] = kernel_table(trace_dir, args.top, ("cpu_op",) if cpu else ("kernel", "gpu_memcpy", "gpu_memset"))
        log(f"{name}: profiled {args.profile_length} tokens in {dt:.2f} s, GPU busy "
            f"{res['profile'].get('gpu_busy_ms', 0):.0f} ms")
    except Exception as e:  # noqa: BLE001 - recorded; the next server runs
        res["error"] = repr(e)[-3000:]
        log(f"{name}: {e!r}"[-3000:])
    finally:
        res["log_tail"] = s.tail(4000)
        s.stop()
    return res


def same_outputs(results: list[dict]) -> None:
    """Mark each arm's check outputs against the first arm's of the same format: ``check_same`` (all equal)
    and ``check_first_divergence`` (per prompt, the first differing token or None)."""
    first = {}
    for r in results:
        if "check_outputs" not in r:
            continue
        base = first.setdefault(r["format"], r)
        r["check_against"] = base["arm"]
        r["check_first_divergence"] = [first_divergence(a, b) for a, b in zip(base["check_outputs"], r["check_outputs"])]
        r["check_same"] = all(d is None for d in r["check_first_divergence"])


def render(results: list[dict], args) -> str:
    lines = [f"# Served prefill ({args.device}): {args.model.name}, {'dummy' if args.dummy else 'trained'} weights, "
             f"SGLang's launch arguments of the accuracy runs", ""]
    head = "| arm | chunk logged | ready s | same tokens as | " + " | ".join(f"{n} alone s (k tok/s)" for n in args.lengths)
    lines += [head + " | round s (k tok/s) | profiled s | GPU busy ms |",
              "|" + "---|" * (7 + len(args.lengths))]
    for r in results:
        alone = " | ".join(f"{r['alone_s'][n]:.2f} ({n / r['alone_s'][n] / 1e3:.0f})" if n in r.get("alone_s", {})
                           else "-" for n in args.lengths)
        rnd = r.get("round")
        rnd = f"{rnd['s']:.2f} ({rnd['tok_s'] / 1e3:.0f})" if rnd else "-"
        prof = r.get("profile", {})
        same = ("-" if "check_same" not in r else
                f"{r['check_against']}: {'yes' if r['check_same'] else r['check_first_divergence']}")
        err = f" error: {r['error'][:120]}" if "error" in r else ""
        lines.append(f"| {r['arm']}{err} | {r.get('chunked_prefill_logged')} | {r.get('ready_s', 0):.0f} | {same} | "
                     f"{alone} | {rnd} | {r.get('profiled_s', 0):.2f} | {prof.get('gpu_busy_ms', 0):.0f} |")
    for r in results:
        prof = r.get("profile", {})
        if not prof.get("kernels"):
            continue
        lines += ["", f"## {r['arm']}: GPU kernels over one {args.profile_length}-token prompt "
                      f"({r['profiled_s']:.2f} s wall, GPU busy {prof['gpu_busy_ms']:.0f} ms, span "
                      f"{prof['gpu_span_ms']:.0f} ms)", "",
                  "| kernel | ms | calls | share |", "|---|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['ms']:.1f} | {k['calls']} | {100 * k['share']:.1f}% |" for k in prof["kernels"]]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=REPO / "configs" / "msa-medium")
    ap.add_argument("--formats", default="fp8,mxfp4")
    ap.add_argument("--chunked", default="0", help="chunked-prefill sizes to compare (0: SGLang's default)")
    ap.add_argument("--attention", default="",
                    help="attention backends to compare, e.g. triton,fa3 (empty: the accuracy runs' triton)")
    ap.add_argument("--lengths", default="8192,32768,65536,131072")
    ap.add_argument("--profile-length", type=int, default=131072)
    ap.add_argument("--check-lengths", default="3000,9000,20000,40000", help="prompts of the output check")
    ap.add_argument("--check-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the smoke test (torch ops, not kernels)")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.check_lengths = [int(x) for x in args.check_lengths.split(",")]
    args.dummy = not list(args.model.glob("*.safetensors"))
    args.vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="m3-prefill-"))
    rng = random.Random(0)
    t0, results = time.monotonic(), []
    plan = [(f, int(c), a) for a in args.attention.split(",") for c in args.chunked.split(",")
            for f in args.formats.split(",")]
    for fmt, chunk, attention in plan:
        ran = sum("skipped" not in r for r in results)
        per_server = (time.monotonic() - t0) / ran if ran else 150.0
        if time.monotonic() - t0 + per_server > args.budget_s:
            log(f"{arm_name(fmt, chunk, attention)}: skipped (time budget)")
            results.append({"arm": arm_name(fmt, chunk, attention), "format": fmt, "skipped": "time budget"})
            continue
        results.append(run_server(args.model, args.dummy, fmt, chunk, attention, args, work, rng))
        same_outputs(results)
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    table = render([r for r in results if "skipped" not in r], args)
    (args.out / "table.md").write_text(table)
    print(table, flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
