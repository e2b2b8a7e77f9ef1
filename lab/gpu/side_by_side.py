"""SGLang's own MiniMax-M3 path against sglang-m3 on one GPU, at M3's per-layer geometry (dummy weights).

Arms (``--arms``, in order; every arm is one server, started alone on the GPU, stopped before the next):

- ``up-bf16``: SGLang's own M3 path. Its config is ours with ``model_type: minimax_m2`` (transformers 5.12 has no
  text ``minimax_m3`` type; ``MiniMaxM2Config`` keeps ``sparse_attention_config`` and every key M3's model class
  reads) and no ``index_k_*`` keys, served with ``SGLANG_PLUGINS=none`` so no sglang-m3 code is loaded. SGLang
  0.5.16 stores the index K in the model dtype: bf16.
- ``up-fp8kv``: the same with ``--kv-cache-dtype fp8_e4m3``. On 0.5.16 that makes only the main K/V fp8 (the index
  stays bf16); on 0.5.23 on Hopper the index K is stored in fp8 too (``get_minimax_sparse_index_dtype``). 0.5.16
  has no fp8 index cache of its own.
- ``m3-<fmt>`` (``bf16``, ``fp8``, ``mxfp4``, ``mxfp4_rot``): sglang-m3 with ``--index-k-format <fmt>``;
  ``m3-<fmt>-fp8kv`` adds ``--kv-cache-dtype fp8_e4m3``.

All arms: ``--attention-backend triton`` (the bundle has no FA3 library), ``--page-size 128``, the same chunked
prefill, CUDA-graph batch sizes, context length and memory fraction, no prefill CUDA graph (sglang-m3 turns it off;
the upstream arm gets ``--cuda-graph-backend-prefill disabled`` so TTFT compares eager prefill with eager
prefill; ``--upstream-prefill-graph default`` keeps SGLang's). SGLang 0.5.16's own M3 failed decode CUDA-graph
capture once in its fused K/index store (non-contiguous K, ``fused_store_kv_index``): the upstream arm starts with
that store off (``SGLANG_OPT_USE_MINIMAX_FUSED_KV_INDEX_STORE=0``, SGLang's own switch; ``--upstream-fused-store
on`` tries it), and if it still fails to start, once more with ``--disable-cuda-graph``; the table says which.

Per arm: KV-pool capacity (``max_total_num_tokens``), greedy tokens of fixed prompts (agreement against
``--reference``, an upstream arm by default), TTFT of one fresh prompt per ``--ttft`` length (median of
``--ttft-reps``), short-prompt TTFT (``--short``: LENxBATCH, one batched request), decode tokens/s per
``--decode`` cell (CTXxBATCH; ``sglang_h200.measure_decode``: pairs of 1 and 1 + D new tokens on radix-cached
contexts, the scheduler's own log rate beside it), and for one decode cell (``--profile``, the widest by default)
the kernel time of a decode step by kind from SGLang's profiler (``/start_profile`` by stage): index scoring +
top-k, sparse attention, stores, dense attention, MoE, GEMMs, other, and the index share. Cells that would end
past ``--budget-s`` are skipped and listed. Writes ``results.json`` and ``table.md`` (printed last) into ``--out``.

Time on an H100 (estimates, before the first run): a start 60-90 s (the first sglang-m3 MXFP4 start also builds
the CUDA decode scorer, about 45 s, once per machine), the 128k x 8 decode contexts about 30-45 s of prefill, the
rest about 30 s: about 150 s an arm, 450 s for the default three. ``--dry-run`` prints the plan and commands.

    source lab/gpu/bundle_env.sh && python3 lab/gpu/side_by_side.py --out "$OUT/sbs"
    python3 lab/gpu/side_by_side.py --out out/sbs --dry-run           # the plan, no server
    PYTHONPATH=.:kernels python3 lab/gpu/side_by_side.py --out out/sbs_cpu --cpu --arms up-bf16,m3-mxfp4,m3-fp8 \
        --hidden 256 --q-heads 16 --vocab 2048 --experts 4 --dense 1 --sparse 2 --decode 1024x2 --ttft 512 \
        --short 128x2 --agree-lengths 200,300 --agree-tokens 8 --decode-tokens 8 --repeats 1 --ttft-reps 1

The last is the plumbing on a CPU (about 3.5 minutes on 2 cores): SGLang's own M3 path does not start there (its
rotary layer imports vllm), so its row shows the failed start; the sglang-m3 rows are measured.
"""

import argparse
import gzip
import json
import random
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

from sglang_h200 import FULL_CONFIG, PAGE, Server, capacity_from, first_divergence, measure_decode  # noqa: E402

from sglang_m3.server import CPU_OPENMP_WAITS, cpu_args  # noqa: E402

M3_FORMATS = ("bf16", "fp8", "mxfp4", "mxfp4_rot")
UPSTREAM_MODEL_TYPE = "minimax_m2"  # a transformers config class that keeps M3's keys (module docstring)
INDEX_KEYS = ("index_k_format", "index_k_scale_rule", "index_k_sign_seed")
FUSED_STORE_ENV = "SGLANG_OPT_USE_MINIMAX_FUSED_KV_INDEX_STORE"
START_S, PREFILL_TOK_S, STEP_S = 90.0, 30000.0, 0.03  # the budget's guesses: a start, prefill rate, a decode step


# ---- arguments -------------------------------------------------------------------------------

def parse_arm(name: str) -> dict:
    """``up-bf16`` | ``up-fp8kv`` | ``m3-<fmt>`` | ``m3-<fmt>-fp8kv`` -> ``{name, upstream, fmt, fp8kv}``
    (ValueError naming the arm and the choices)."""
    base, fp8kv = (name[: -len("-fp8kv")], True) if name.endswith("-fp8kv") else (name, False)
    if base == "up" and fp8kv or base == "up-bf16" and not fp8kv:
        return {"name": name, "upstream": True, "fmt": "bf16", "fp8kv": fp8kv}
    kind, _, fmt = base.partition("-")
    if kind == "m3" and fmt in M3_FORMATS:
        return {"name": name, "upstream": False, "fmt": fmt, "fp8kv": fp8kv}
    raise ValueError(f"--arms: {name!r} is not an arm; choices: up-bf16, up-fp8kv, m3-<fmt>, m3-<fmt>-fp8kv "
                     f"with <fmt> in {', '.join(M3_FORMATS)}")


def parse_cells(text: str, flag: str) -> list[tuple[int, int]]:
    """``"32768x8,131072x8"`` -> ``[(32768, 8), (131072, 8)]`` (tokens x batch); a bare length means batch 1."""
    cells = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        length, _, batch = item.partition("x")
        try:
            cell = (int(length), int(batch or 1))
        except ValueError:
            raise ValueError(f"{flag}: {item!r} must be LENGTH or LENGTHxBATCH (integers)") from None
        if min(cell) < 1:
            raise ValueError(f"{flag}: {item!r} needs a length and a batch >= 1")
        cells.append(cell)
    return cells


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--arms", default="up-bf16,m3-fp8,m3-mxfp4")
    ap.add_argument("--reference", default=None, help="arm the greedy tokens are compared with (default: the "
                                                       "first upstream arm, else the first arm)")
    ap.add_argument("--decode", default="32768x8,131072x8", help="decode cells CTXxBATCH ('' for none)")
    ap.add_argument("--ttft", default="8192,32768", help="TTFT prompt lengths, one prompt a request")
    ap.add_argument("--short", default="512x1,2048x8", help="short-prompt TTFT cells LENxBATCH")
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64, help="D: timed decode steps per request")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--agree-lengths", default="1000,3000,9000", help="greedy-agreement prompt lengths")
    ap.add_argument("--agree-tokens", type=int, default=32)
    ap.add_argument("--dense", type=int, default=1, help="dense layers (first), M3: 3 of 60")
    ap.add_argument("--sparse", type=int, default=5, help="sparse layers after them, M3: 57 of 60")
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--q-heads", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8, help="routed experts (M3: 128); top-k stays M3's 4")
    ap.add_argument("--vocab", type=int, default=200064)
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--chunked-prefill", type=int, default=16384)
    ap.add_argument("--upstream-fused-store", choices=("off", "on"), default="off")
    ap.add_argument("--upstream-prefill-graph", choices=("disabled", "default"), default="disabled")
    ap.add_argument("--m3-prefill-graph", action="store_true",
                    help="sglang-m3 arms keep SGLang's breakable prefill graph (SGLANG_M3_PREFILL_GRAPH=1)")
    ap.add_argument("--profile", default="widest",
                    help="decode cell CTXxBATCH whose step is profiled (kernel time by kind); 'widest': the decode "
                         "cell of the most tokens; '' for none")
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=500, help="skip cells that would end past this")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the server commands; start nothing")
    ap.add_argument("--cpu", action="store_true",
                    help="plumbing run on a CPU: torch_native, no graphs, a small pool; pair it with a small "
                         "geometry (--hidden 256 --q-heads 16 --vocab 2048) and short cells")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.arm_specs = [parse_arm(a) for a in filter(None, args.arms.split(","))]
        args.decode_cells = parse_cells(args.decode, "--decode")
        args.ttft_lengths = [n for n, _ in parse_cells(args.ttft, "--ttft")]
        args.short_cells = parse_cells(args.short, "--short")
        args.agree = [n for n, _ in parse_cells(args.agree_lengths, "--agree-lengths")]
    except ValueError as e:
        ap.error(str(e))
    if args.profile == "widest":
        args.profile_cell = max(args.decode_cells, key=lambda c: c[0] * c[1], default=None)
    else:
        try:
            cells = parse_cells(args.profile, "--profile")
        except ValueError as e:
            ap.error(str(e))
        if cells and cells[0] not in args.decode_cells:
            ap.error(f"--profile {args.profile!r} must be one of the --decode cells {args.decode}")
        args.profile_cell = cells[0] if cells else None
    names = [a["name"] for a in args.arm_specs]
    if not names or len(set(names)) != len(names):
        ap.error(f"--arms: give at least one arm, each once; got {names}")
    if args.reference is None:
        args.reference = next((a["name"] for a in args.arm_specs if a["upstream"]), names[0])
    elif args.reference not in names:
        ap.error(f"--reference {args.reference!r} must be one of --arms {names}")
    if args.dense < 1 or args.sparse < 1:
        ap.error("--dense and --sparse must be >= 1 (SGLang's M3 path needs both kinds of layer)")
    return args


# ---- configs and commands --------------------------------------------------------------------

def context_length(args) -> int:
    longest = max([c for c, _ in args.decode_cells] + args.ttft_lengths + [n for n, _ in args.short_cells]
                  + args.agree)
    return longest + args.decode_tokens + 4 * PAGE


def write_config(path: Path, arm: dict, args) -> Path:
    """``path/config.json``: M3's attention geometry (``configs/minimax-m3.1``) with ``--dense`` dense then
    ``--sparse`` sparse layers and ``--experts`` routed experts; the upstream arm's model type and no index
    keys, or sglang-m3's with the arm's format."""
    cfg = json.loads(FULL_CONFIG.read_text())
    pattern = [0] * args.dense + [1] * args.sparse
    sac = dict(cfg["sparse_attention_config"], sparse_attention_freq=pattern, sparse_disable_index_value=pattern)
    cfg.update({"num_hidden_layers": len(pattern), "moe_layer_freq": pattern, "sparse_attention_config": sac,
                "hidden_size": args.hidden, "num_attention_heads": args.q_heads, "num_local_experts": args.experts,
                "vocab_size": args.vocab, "max_position_embeddings": max(context_length(args), 8192)})
    if args.vocab < 200064:
        cfg.update({"bos_token_id": 1, "eos_token_id": 2})
    if arm["upstream"]:
        cfg["model_type"] = UPSTREAM_MODEL_TYPE
        for key in INDEX_KEYS:
            cfg.pop(key, None)
    else:
        cfg["index_k_format"] = arm["fmt"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def common_flags(args) -> list[str]:
    max_bs = max([b for _, b in args.decode_cells + args.short_cells] + [len(args.agree), 1])
    graph_bs = sorted({b for _, b in args.decode_cells} | {1, len(args.agree)})
    if args.cpu:
        pool = max([b * c for c, b in args.decode_cells] + [4 * context_length(args)]) + 8 * PAGE
        device = [*cpu_args(pool), "--disable-cuda-graph", "--mem-fraction-static", "0.3"]
    else:
        device = ["--attention-backend", "triton", "--mem-fraction-static", str(args.mem_fraction),
                  "--cuda-graph-bs", *map(str, graph_bs), "--skip-server-warmup"]
    return [*device, "--page-size", str(PAGE), "--context-length", str(context_length(args)),
            "--chunked-prefill-size", str(args.chunked_prefill), "--max-running-requests", str(max(max_bs, 8)),
            "--sampling-backend", "pytorch", "--grammar-backend", "none", "--random-seed", "0",
            "--log-level", "info", "--decode-log-interval", "8"]


def attempts(arm: dict, args) -> list[tuple[str, list[str], dict]]:
    """The launches to try in turn: ``(note, extra flags, extra environment)``; the first that serves is kept."""
    flags = ["--kv-cache-dtype", "fp8_e4m3"] if arm["fp8kv"] else []
    if args.cpu:  # SGLang's own M3 path does not serve on a CPU: its attempts fail, which is the plumbing's test
        cpu = dict(CPU_OPENMP_WAITS)
        return [("cpu", flags, dict(cpu, SGLANG_PLUGINS="none") if arm["upstream"] else cpu)]
    if not arm["upstream"]:
        env = {"SGLANG_M3_PREFILL_GRAPH": "1"} if args.m3_prefill_graph else {}
        graph = ["--cuda-graph-backend-prefill", "breakable"] if args.m3_prefill_graph else []
        return [("prefill graph on" if args.m3_prefill_graph else "", flags + graph, env)]
    env = {"SGLANG_PLUGINS": "none"}
    if args.upstream_prefill_graph == "disabled":
        flags += ["--cuda-graph-backend-prefill", "disabled"]
    off = dict(env, **{FUSED_STORE_ENV: "0"})
    tries = [("fused K/index store off", flags, off)]
    if args.upstream_fused_store == "on":
        tries.insert(0, ("", flags, env))
    return tries + [("fused store off, no CUDA graphs (the graph start failed)", flags + ["--disable-cuda-graph"], off)]


def estimate_s(args) -> dict:
    """Seconds per arm the plan expects (START_S, PREFILL_TOK_S, STEP_S guesses; the budget skips what overruns)."""
    widest = {}
    for ctx, bs in args.decode_cells:
        widest[bs] = max(widest.get(bs, 0), ctx)
    prefill = sum(bs * ctx for bs, ctx in widest.items()) + args.ttft_reps * (sum(args.ttft_lengths) + sum(
        n * b for n, b in args.short_cells)) + sum(args.agree)
    steps = len(args.decode_cells) * (args.repeats + 1) * 2 * (1 + args.decode_tokens)
    profile = 10.0 + (args.profile_steps + 6) * STEP_S if args.profile_cell else 0.0  # the trace's export included
    parts = {"start": START_S, "prefill": prefill / PREFILL_TOK_S, "decode": steps * STEP_S, "profile": profile}
    parts["arm"] = sum(parts.values())
    parts["all"] = parts["arm"] * len(args.arm_specs)
    return parts


# ---- measurements ----------------------------------------------------------------------------

def fresh_prompts(rng: random.Random, vocab: int, length: int, batch: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def ttft_s(server, ids) -> float:
    """Seconds until one new token for each prompt of ``ids`` (one batched request)."""
    t = time.perf_counter()
    server.generate(ids, 1)
    return time.perf_counter() - t


# Kernel kinds of a decode step, first match wins (names: our Triton/CUDA kernels, SGLang 0.5.16's M3 kernels).
KERNEL_KINDS = (
    ("index scoring + top-k", r"_score_kernel|score_decode_mxfp4|_select_kernel|_decode_score_kernel|"
                              r"_decode_score_attn_kernel|_topk_index_partial|_topk_index_merge|topk_index_reduce"),
    ("sparse attention", r"gqa_share_sparse|_merge_topk_attn_out|_merge_attn_out"),
    ("K/V + index-K store", r"write_index_k|_write_mxfp4|store_kv_index|store_cache|set_kv_buffer|copy_kv"),
    ("dense attention", r"_fwd_kernel|_fwd_grouped_kernel|decode_att|extend_attention"),
    ("MoE", r"moe|expert|topk_softmax|grouped_topk"),
    ("GEMM", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_|ampere_"),
)


def kernel_kind(name: str) -> str:
    for kind, pattern in KERNEL_KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def kernel_breakdown(trace: dict, steps: int) -> dict:
    """Kernel time per decode step by kind (``KERNEL_KINDS``) from a torch profiler trace (``traceEvents`` with
    ``cat: kernel``), the total, the index scoring + top-k share of it, and the 12 costliest kernels."""
    per_name = {}
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "kernel" and "dur" in e:
            per_name[e["name"]] = per_name.get(e["name"], 0.0) + float(e["dur"])
    kinds = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for name, us in per_name.items():
        kinds[kernel_kind(name)] += us
    ms = {kind: us / 1e3 / steps for kind, us in kinds.items()}
    total = sum(ms.values())
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:12]
    return {"steps": steps, "ms_per_step": ms, "total_ms": total,
            "index_share": ms["index scoring + top-k"] / total if total else None,
            "top": [(name[:120], us / 1e3 / steps) for name, us in top]}


def profile_decode(server, ids, steps: int, out_dir: Path, gpu: bool, timeout_s: float = 120) -> dict:
    """Profile ``steps`` decode steps of ``ids`` (contexts already cached) with SGLang's profiler by stage and
    return ``kernel_breakdown`` of its DECODE trace (``out_dir`` keeps the trace)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    body = {"output_dir": str(out_dir), "num_steps": steps, "activities": ["GPU" if gpu else "CPU"],
            "profile_by_stage": True, "with_stack": False, "record_shapes": False, "profile_id": server.name}
    req = urllib.request.Request(server.url + "/start_profile", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()
    server.generate(ids, steps + 6)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = sorted(out_dir.glob("*DECODE*.trace.json.gz"))
        if found:
            time.sleep(1)  # the export may still be writing
            with gzip.open(found[-1], "rt") as f:
                return kernel_breakdown(json.load(f), steps) | {"trace": found[-1].name}
        time.sleep(1)
    raise TimeoutError(f"no DECODE trace in {out_dir} after {timeout_s:.0f} s")


def last_error_line(text: str) -> str:
    """The last line of a failed start's log tail that names an error (else its last line)."""
    lines = [x.strip() for x in text.replace("\\n", "\n").replace("\\'", "'").splitlines() if x.strip()]
    named = [x for x in lines if "Error" in x or "error" in x]
    return (named or lines or ["?"])[-1][:200]


def run_arm(arm: dict, args, work: Path, left, r: dict, agree_prompts) -> None:
    cfg = write_config(work / arm["name"], arm, args)
    server = None
    for i, (note, flags, env) in enumerate(attempts(arm, args)):
        server = Server(f"{arm['name']}-{i}", cfg, common_flags(args) + flags, work, env_extra=env)
        try:
            r["ready_s"] = server.wait_ready(args.startup_timeout)
            r["launch"] = {"note": note, "flags": flags, "env": env}
            break
        except Exception as e:  # noqa: BLE001 - the next attempt, or the arm's error
            r.setdefault("failed_starts", []).append({"note": note, "error": repr(e)[-2000:]})
            server.stop()
            server = None
    if server is None:
        r["error"] = "no launch served; last: " + last_error_line(r["failed_starts"][-1]["error"])
        return
    try:
        r["capacity_tokens"] = capacity_from(server)
        r["greedy"] = [o["output_ids"] for o in server.generate(agree_prompts, args.agree_tokens)]
        rng = random.Random(f"ttft-{arm['name']}")  # fresh prompts: no radix hit, the same lengths in every arm
        r["ttft_s"], r["short_ttft_s"], r["decode"], r["skipped"] = {}, {}, {}, []
        for length in args.ttft_lengths:
            if left() < args.ttft_reps * length / PREFILL_TOK_S + 5:
                r["skipped"].append(f"ttft {length}")
                continue
            r["ttft_s"][str(length)] = statistics.median(
                ttft_s(server, fresh_prompts(rng, args.vocab, length, 1)) for _ in range(args.ttft_reps))
        for length, batch in args.short_cells:
            r["short_ttft_s"][f"{length}x{batch}"] = statistics.median(
                ttft_s(server, fresh_prompts(rng, args.vocab, length, batch)) for _ in range(args.ttft_reps))
        # Decode contexts: one set of prompts per batch size at the widest length; shorter cells use prefixes.
        widest = {}
        for ctx, bs in args.decode_cells:
            widest[bs] = max(widest.get(bs, 0), ctx)
        contexts = {bs: fresh_prompts(random.Random(f"decode-{bs}"), args.vocab, ctx, bs) for bs, ctx in widest.items()}
        for ctx, bs in sorted(args.decode_cells, key=lambda c: (c[1], -c[0])):
            need = bs * ctx / PREFILL_TOK_S + (args.repeats + 1) * 2 * (1 + args.decode_tokens) * STEP_S
            key = f"{ctx}x{bs}"
            if left() < need:
                r["skipped"].append(f"decode {key}")
                continue
            if bs * (ctx + args.decode_tokens + PAGE) > r["capacity_tokens"]:
                r["skipped"].append(f"decode {key} (pool holds {r['capacity_tokens']} tokens)")
                continue
            r["decode"][key] = measure_decode(server, [p[:ctx] for p in contexts[bs]], args.decode_tokens,
                                              args.repeats)
            if (ctx, bs) == args.profile_cell:
                try:
                    r["profile"] = profile_decode(server, [p[:ctx] for p in contexts[bs]], args.profile_steps,
                                                  work / f"profile-{arm['name']}", gpu=not args.cpu)
                except Exception as e:  # noqa: BLE001 - the timings stand without it
                    r["profile"] = {"error": f"{type(e).__name__}: {e}"[-500:]}
    finally:
        server.stop()


def agreement(results: dict, reference: str) -> None:
    """Per arm: prompts whose greedy tokens equal the reference arm's, and the first divergence of each. A
    reference that served nothing gives way to the first arm that did (``results["agreement_reference"]``)."""
    served = [name for name, r in results["arms"].items() if "greedy" in r]
    if reference not in served and served:
        reference = served[0]
    results["agreement_reference"] = reference
    ref = results["arms"].get(reference, {}).get("greedy")
    for r in results["arms"].values():
        if ref is None or "greedy" not in r:
            continue
        div = [first_divergence(a, b) for a, b in zip(ref, r["greedy"])]
        r["agree"] = {"equal": sum(d is None for d in div), "of": len(div), "first_divergence": div}


# ---- table -----------------------------------------------------------------------------------

def _cell(x, spec="{:.0f}") -> str:
    return "-" if x is None else spec.format(x)


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def decode_rate(m: dict | None):
    """tokens/s of a decode cell: the scheduler's own rate where it has one, else the request pairs'."""
    if not m:
        return None
    return (m.get("server") or {}).get("tok_s") or m.get("tok_s")


def render_table(results: dict) -> str:
    """Markdown: one row per arm (capacity, launch note, agreement, TTFTs, decode tok/s), then each arm's decode
    and TTFT as a ratio of the reference arm's."""
    args, arms, ref = results["args"], results["arms"], results["reference"]
    decode_keys = [f"{c}x{b}" for c, b in args["decode_cells"]]
    ttft_keys = [str(n) for n in args["ttft_lengths"]]
    short_keys = [f"{n}x{b}" for n, b in args["short_cells"]]
    head = (["arm", "pool tokens", "launch", f"greedy = {results.get('agreement_reference', ref)}"]
            + [f"decode tok/s {k}" for k in decode_keys]
            + [f"TTFT ms {k}" for k in ttft_keys] + [f"short TTFT ms {k}" for k in short_keys])
    lines = [f"Side by side, {results['geometry']}; {results['machine']}; {results['date']}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in arms.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:100]} |" + " |" * (len(head) - 2))
            continue
        agree = r.get("agree")
        row = [name, _cell(r.get("capacity_tokens")), (r.get("launch") or {}).get("note") or "as is",
               f"{agree['equal']}/{agree['of']}" if agree else "-"]
        row += [_cell(decode_rate(r.get("decode", {}).get(k)), "{:.1f}") for k in decode_keys]
        row += [_ms((r.get("ttft_s") or {}).get(k)) for k in ttft_keys]
        row += [_ms((r.get("short_ttft_s") or {}).get(k)) for k in short_keys]
        lines.append("| " + " | ".join(row) + " |")
    base = arms.get(ref, {})
    if "error" not in base:
        lines += ["", f"Against {ref} (decode: tok/s ratio, > 1 is faster; TTFT: time ratio, < 1 is faster)", "",
                  "| arm | " + " | ".join([f"decode {k}" for k in decode_keys] + [f"TTFT {k}" for k in ttft_keys])
                  + " |", "|---|" + "---|" * (len(decode_keys) + len(ttft_keys))]
        for name, r in arms.items():
            if name == ref or "error" in r:
                continue
            ratios = []
            for k in decode_keys:
                a, b = decode_rate(r.get("decode", {}).get(k)), decode_rate(base.get("decode", {}).get(k))
                ratios.append("-" if a is None or not b else f"{a / b:.3f}")
            for k in ttft_keys:
                a, b = (r.get("ttft_s") or {}).get(k), (base.get("ttft_s") or {}).get(k)
                ratios.append("-" if a is None or not b else f"{a / b:.3f}")
            lines.append(f"| {name} | " + " | ".join(ratios) + " |")
    profiled = {n: r["profile"] for n, r in arms.items() if "ms_per_step" in (r.get("profile") or {})}
    if profiled:
        kinds = [kind for kind, _ in KERNEL_KINDS] + ["other"]
        cell = "x".join(map(str, args.get("profile_cell") or ()))
        lines += ["", f"Decode step at {cell}: kernel ms per step by kind (torch profiler, "
                      f"{next(iter(profiled.values()))['steps']} steps)", "",
                  "| arm | " + " | ".join(kinds) + " | total | index share | step ms, timed |",
                  "|---|" + "---|" * (len(kinds) + 3)]
        for name, p in profiled.items():
            share = "-" if p["index_share"] is None else f"{p['index_share']:.1%}"
            timed = arms[name].get("decode", {}).get(cell) or {}
            step = (timed.get("server") or {}).get("tpot_ms") or timed.get("tpot_ms")
            lines.append(f"| {name} | " + " | ".join(f"{p['ms_per_step'][k]:.3f}" for k in kinds)
                         + f" | {p['total_ms']:.3f} | {share} | {_cell(step, '{:.3f}')} |")
        lines += ["", "(kernel time below the timed step: gaps between kernels, or kernels the profiler did not see "
                      "inside CUDA graphs)"]
    failed_profiles = [f"{n}: {r['profile']['error']}" for n, r in arms.items()
                       if "error" in (r.get("profile") or {})]
    if failed_profiles:
        lines += ["", "Profile failed: " + "; ".join(failed_profiles)]
    skipped = [f"{n}: {', '.join(r['skipped'])}" for n, r in arms.items() if r.get("skipped")]
    if skipped:
        lines += ["", "Skipped (time budget or pool): " + "; ".join(skipped)]
    return "\n".join(lines) + "\n"


# ---- main ------------------------------------------------------------------------------------

def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    except ImportError:
        pass
    return "no CUDA device"


def main(argv=None) -> dict:
    args = parse_args(argv)
    # A SIGTERM (a wall-clock limit) unwinds through the ``finally`` that stops the running server.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args.out.mkdir(parents=True, exist_ok=True)
    est = estimate_s(args)
    geometry = (f"{args.dense} dense + {args.sparse} sparse layers, hidden {args.hidden}, {args.q_heads} query heads, "
                f"4 KV heads, 4 index heads, {args.experts} experts, vocab {args.vocab}, dummy weights")
    plan = {"arms": [a["name"] for a in args.arm_specs], "estimate_s": est,
            "commands": {a["name"]: [(note, common_flags(args) + flags, env) for note, flags, env in attempts(a, args)]
                         for a in args.arm_specs}}
    print(f"plan: {len(args.arm_specs)} arms, about {est['arm']:.0f} s an arm, {est['all']:.0f} s in all "
          f"(budget {args.budget_s:.0f} s)", flush=True)
    for name, tries in plan["commands"].items():
        for note, flags, env in tries:
            print(f"  {name} [{note or 'as is'}]: {' '.join(f'{k}={v}' for k, v in env.items())} "
                  f"python -m sglang.launch_server {' '.join(flags)}", flush=True)
    if args.dry_run:
        return plan
    try:
        import sglang

        version = sglang.__version__
    except ImportError:
        version = "not importable"
    results = {"args": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
               "geometry": geometry, "machine": f"{machine()}, SGLang {version}",
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "reference": args.reference,
               "estimate_s": est, "arms": {}}
    t0 = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - t0)  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="m3-sbs-"))
    agree_prompts = [fresh_prompts(random.Random(f"agree-{n}"), args.vocab, n, 1)[0] for n in args.agree]
    for arm in args.arm_specs:
        r = results["arms"][arm["name"]] = {}
        if left() < START_S:
            r["error"] = "not started (time budget)"
        else:
            try:
                run_arm(arm, args, work, left, r, agree_prompts)
            except Exception as e:  # noqa: BLE001 - recorded, the next arm runs
                r["error"] = f"{type(e).__name__}: {e}"[-2000:]
            r["elapsed_s"] = time.monotonic() - t0
            print(arm["name"], json.dumps({k: v for k, v in r.items() if k != "greedy"})[:2000], flush=True)
        table = save(results, args.out, work)  # after every arm: a run cut short keeps what it measured
    print(table, flush=True)
    return results


def save(results: dict, out: Path, work: Path) -> str:
    """Agreement, ``results.json``, the server logs' tails and ``table.md``; returns the table."""
    agreement(results, results["reference"])
    for log in work.glob("*.log"):
        (out / log.name).write_text(log.read_text(errors="replace")[-200000:])
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    table = render_table(results)
    (out / "table.md").write_text(table)
    return table


if __name__ == "__main__":
    main()
