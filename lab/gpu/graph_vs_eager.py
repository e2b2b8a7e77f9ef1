"""CUDA-graph replay against eager decode on a trained checkpoint (real weights, varied outputs).

For each index-K format, a decode-CUDA-graph server and an eager server (``--disable-cuda-graph``)
of the same model run side by side on one GPU and get the same needle prompts of the accuracy
runner (``accuracy.needle``, ``m3_niah_single``, the model's tokenizer) as one batched request,
``--gen-tokens`` greedy tokens each. Reported per format: whether every prompt's tokens are equal,
the first divergent token where not, and how many answers hold the needle's number in each server.
With dummy weights (``sglang_h200.py``) every greedy continuation is one token repeated, so equal
outputs say little; a trained model's answers change token by token.

    # on the GPU machine, with the SGLang bundle in .whl1/ (see run_sglang_h200.sh)
    source lab/gpu/bundle_env.sh && python3 lab/gpu/graph_vs_eager.py --out "$OUT/gve"
    python3 lab/gpu/graph_vs_eager.py --cpu --lengths 640 --samples 2 --out out/gve   # plumbing, CPU
    python3 lab/gpu/graph_vs_eager.py --prefill-graph breakable --out "$OUT/gve"      # prefill graph too

The bundle (51 MiB) and this checkpoint (31 MB) together exceed one 64 MiB transfer to the GPU
machine: send the bundle first with the checkpoint left out (``bundle_env.sh`` unpacks it into
``build/m3-site`` and keeps it), then run this on the same machine with the checkpoint.

Writes ``results.json`` and ``table.md`` into ``--out`` (server logs as ``<name>.log``).
``--cpu`` runs the same plumbing on a CPU (both servers eager there: no CUDA graphs on a CPU).
"""

import argparse
import json
import re
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sglang_h200 import FORMATS, PAGE, REPO, Server, first_divergence  # noqa: E402

from accuracy import needle  # noqa: E402


def build_prompts(model: Path, lengths, samples: int, seed: int):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    docs = needle.generate(tok, lengths, samples, samples, 1, seed)
    return tok, docs, [tok(d["input"], add_special_tokens=False)["input_ids"] for d in docs]


def _exit_on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the servers' stop short
    sys.exit(128 + signum)


def _start(servers: dict, key: str, make) -> None:
    """``servers[key] = make()`` with a SIGTERM that arrives meanwhile deferred until the server is in
    ``servers``: one between its process starting and its name being stored would leave it running, unknown
    to the ``finally`` that stops the servers (on a GPU, holding the memory the next server needs). Deferred
    by a handler, not blocked with ``pthread_sigmask``: the server's processes inherit a blocked mask, and
    would then ignore every SIGTERM of their own life."""
    pending = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: pending.append(signum))
    try:
        servers[key] = make()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if pending:
        signal.raise_signal(signal.SIGTERM)  # now, to the handler it was meant for


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "configs" / "msa-small")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--lengths", default="4096,8192,16384,32768", help="needle prompt lengths (tokens)")
    ap.add_argument("--samples", type=int, default=4, help="prompts per length (depths spread over 0-100%%)")
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu", action="store_true", help="plumbing check on a CPU (no graphs there)")
    ap.add_argument("--prefill-graph", default="disabled", choices=["disabled", "breakable", "tc_piecewise"],
                    help="the graph server's prefill CUDA graph; other than disabled it runs with "
                         "SGLANG_M3_PREFILL_GRAPH=1 (the plugin's unverified opt-in: docs/design.md)")
    ap.add_argument("--dummy-weights", action="store_true",
                    help="SGLang's random weights (for configs without a checkpoint)")
    args = ap.parse_args(argv)
    # A SIGTERM (``timeout`` in accuracy_h200.sh) unwinds through the ``finally`` that stops the servers, so none
    # is left holding the GPU's memory for what runs next.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args.out.mkdir(parents=True, exist_ok=True)
    formats = [f for f in args.formats.split(",") if f]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise SystemExit(f"--formats: each must be one of {FORMATS}, got {bad}")
    lengths = [int(x) for x in args.lengths.split(",")]
    tok, docs, ids = build_prompts(args.model, lengths, args.samples, args.seed)
    context = max(len(x) for x in ids) + args.gen_tokens + PAGE
    # Both pools hold every prompt at once. The eager server starts once the graph server has taken its
    # pool, so its static fraction applies to what is left (as in sglang_h200.py's "alongside" mode).
    pool = ["--max-total-tokens", str(len(ids) * context)]
    base = ["--page-size", str(PAGE), "--random-seed", "0", "--context-length", str(context),
            "--skip-server-warmup", "--max-running-requests", str(len(ids)), *pool,
            "--log-level", "info", "--decode-log-interval", "1"]  # every decode batch logs "cuda graph: ..."
    if args.cpu:
        base += ["--device", "cpu", "--attention-backend", "torch_native", "--mem-fraction-static", "0.3"]
        graph_flags = eager_flags = ["--disable-cuda-graph"]
    else:
        base += ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none"]
        graph_bs = sorted({min(2 ** i, len(ids)) for i in range(len(ids).bit_length() + 1)})
        graph_flags = ["--mem-fraction-static", "0.5", "--cuda-graph-backend-prefill", args.prefill_graph,
                       "--cuda-graph-bs", *map(str, graph_bs)]
        eager_flags = ["--mem-fraction-static", "0.96", "--disable-cuda-graph"]

    results = {"model": str(args.model.resolve().relative_to(REPO)) if args.model.resolve().is_relative_to(REPO)
               else args.model.name, "lengths": lengths, "samples": args.samples, "gen_tokens": args.gen_tokens,
               "prompt_tokens": [len(x) for x in ids], "targets": [d["target"] for d in docs], "cpu": args.cpu,
               "prefill_graph": args.prefill_graph,
               "formats": {}}
    for fmt in formats:
        override = ["--json-model-override-args", json.dumps({"index_k_format": fmt})]
        r = results["formats"][fmt] = {}
        servers = {}
        try:
            graph_env = {} if args.prefill_graph == "disabled" else {"SGLANG_M3_PREFILL_GRAPH": "1"}
            _start(servers, "graph", lambda: Server(f"graph-{fmt}", args.model, base + graph_flags + override,
                                                    args.out, env_extra=graph_env,
                                                    dummy_weights=args.dummy_weights))
            servers["graph"].wait_log(r"max_total_num_tokens=(\d+)", args.startup_timeout)
            _start(servers, "eager", lambda: Server(f"eager-{fmt}", args.model, base + eager_flags + override,
                                                    args.out, dummy_weights=args.dummy_weights))
            outs = {}
            for kind, s in servers.items():
                r[f"{kind}_ready_s"] = s.wait_ready(args.startup_timeout)
                t = time.perf_counter()
                outs[kind] = [o["output_ids"] for o in s.generate(ids, args.gen_tokens)]
                r[f"{kind}_generate_s"] = time.perf_counter() - t
                r[f"{kind}_correct"] = sum(needle.score(tok.decode(o), d["target"]) for o, d in zip(outs[kind], docs))
            r["graph_batches"] = len(re.findall(r"Decode batch.*cuda graph: True", servers["graph"].tail(10**8)))
            r["equal"] = outs["graph"] == outs["eager"]
            r["divergence"] = [first_divergence(a, b) for a, b in zip(outs["eager"], outs["graph"])]
            r["distinct_outputs"] = len({tuple(o) for o in outs["eager"]})
            r["eager_text"] = [tok.decode(o) for o in outs["eager"]]
        except Exception as e:  # noqa: BLE001
            r["error"] = f"{type(e).__name__}: {e}"
        finally:
            for s in servers.values():
                s.stop()
        print(fmt, json.dumps(r), flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))

    n = len(ids)
    lines = [f"Graph vs eager, `{results['model']}`, {n} needle prompts ({min(results['prompt_tokens'])}-"
             f"{max(results['prompt_tokens'])} tokens), {args.gen_tokens} greedy tokens"
             + (" (CPU: both servers eager)" if args.cpu else ""), "",
             "| index K | graph == eager | first divergence (per prompt) | distinct outputs | answers right: graph / eager "
             "| decode batches in a graph |", "|---|---|---|---|---|---|"]
    for fmt, r in results["formats"].items():
        if "error" in r:
            lines.append(f"| {fmt} | error: {r['error'][:120]} | | | | |")
            continue
        div = "none" if r["equal"] else str(r["divergence"])
        lines.append(f"| {fmt} | {'yes' if r['equal'] else 'no'} | {div} | {r['distinct_outputs']} / {n} | "
                     f"{r['graph_correct']:.0f} / {r['eager_correct']:.0f} of {n} | {r['graph_batches']} |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
