"""Tensor parallelism check: SGLang 0.5.16 + sglang-m3 with ``--tp 2`` against ``--tp 1`` on the
same random checkpoint, for the fp8 and MXFP4 index-K caches. Started by
``lab/gpu/run_tp2_h200.sh`` on a machine with two GPUs; writes ``results.json``,
``server_logs.txt`` and ``table.md`` (last) into ``--out``.

Config: MiniMax-M3's per-layer attention geometry (``sglang_h200.make_config``: 4 KV heads x 128,
4 index heads x 128, fp8 main KV cache, MoE layers) with ``--dense`` + ``--sparse`` layers, 16
query heads, hidden 512. Under TP2 each rank holds 8 query heads, 2 KV heads and the matching 2
index-query heads; the index key (one head) is computed and cached on both ranks.

Weights: one random checkpoint (``tp_check.write_random_checkpoint``) loaded by every server:
SGLang's ``--load-format dummy`` gives a TP2 rank other values than TP1's slice of the same
tensor, so dummy weights cannot be compared across TP sizes. ``m3_load_check`` reports any model
parameter the checkpoint did not fill (must be none).

Per format, a TP1 server (one GPU) and a TP2 server (both GPUs) run side by side, CUDA graphs on
for decode (``--eager``: off), overlap scheduling off (so each request's forwards end before its
response), selection recording on. Prompts of ``--lengths`` random tokens (past 16 blocks, so
top-16 selection drops blocks) go one at a time to each server: greedy ``--new-tokens`` with
logprobs of every prompt token and the top-5 of every output step.

What is compared (bf16 all-reduce sums partial products in another order than TP1's GEMMs, so
bitwise-equal outputs are not expected; the checks say what agreement means):

- tokens: greedy outputs equal, or the first differing step is a near tie: both servers rank the
  two tokens within ``--tie-margin`` nats. Also the prompt-token logprob difference (max, mean).
- selected blocks, per layer, over prefill rows (and decode rows up to the first token
  divergence with ``--eager``; graph replays record nothing): the TP2 ranks' records are merged
  in index-head order and compared with TP1's. In the first sparse layer, where both record
  scores, a differing (row, head) must be a swap between blocks whose TP1 scores lie within twice
  that row's largest TP1-vs-TP2 score difference (else: unexplained); and each TP2 head's scores
  must be closest to the same TP1 head's (head mapping). Deeper layers (no scores recorded)
  report agreement only: their inputs already differ by the earlier layers' differences.
"""

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sglang_h200 as h200  # noqa: E402
import tp_check  # noqa: E402

from m3_kernels.formats import PAGE_SIZE, TOPK_BLOCKS  # noqa: E402


def generate(server, ids, new_tokens: int, timeout: float = 900) -> dict:
    """One greedy ``/generate`` with prompt logprobs and the top-5 of every output step."""
    payload = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5,
               "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(server.url + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = json.loads(r.read())
    return body[0] if isinstance(body, list) else body


def record_files(path: Path) -> list:
    return tp_check.rank_files(path) or ([path] if path.exists() else [])


def settle(path: Path, timeout_s: float = 60) -> list:
    """Wait until every rank file has the same, unchanging number of lines; returns the counts."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        counts = tp_check.line_counts(path)
        if counts == last and len(set(counts)) == 1:
            return counts
        last = counts
        time.sleep(0.3)
    raise TimeoutError(f"record files of {path} did not settle: {tp_check.line_counts(path)}")


def move_records(path: Path, dest: Path) -> None:
    """Move a server's record file(s) to ``dest`` (rank suffixes kept); the recorder opens the file
    anew for every line, so later lines start a fresh file."""
    for f in record_files(path):
        f.rename(dest.parent / (dest.name + f.name[len(path.name):]))


def run_server_prompts(server, rec: Path, prompt_ids: list, new_tokens: int, work: Path, left) -> list:
    """Prompts one at a time, each within ``left()`` seconds; returns the response bodies. Prompt
    i's records end up in ``<work>/<server>.p<i>.jsonl[.rank<r>]``."""
    settle(rec)
    move_records(rec, work / f"{server.name}.startup.jsonl")
    bodies = []
    for i, ids in enumerate(prompt_ids):
        if left() < 5:
            raise TimeoutError(f"no time left for prompt {i} (see --end-by)")
        bodies.append(generate(server, ids, new_tokens, timeout=left()))
        settle(rec)
        move_records(rec, work / f"{server.name}.p{i}.jsonl")
    return bodies


def compare_format(work: Path, names: tuple, prompt_ids: list, bodies: dict, first_sparse: int, tie_margin: float):
    """Per-prompt token comparison and per-layer selection agreement of TP1 (``names[0]``) vs TPn."""
    ref_name, got_name = names
    res = {"prompts": [], "layers": {}, "head_mapping": []}
    for i, ids in enumerate(prompt_ids):
        cmp = tp_check.compare_tokens(bodies[ref_name][i], bodies[got_name][i])
        cmp["ok"] = tp_check.tokens_verdict(cmp, tie_margin)
        cmp["length"] = len(ids)
        j = cmp["first_divergence"]
        rows_ref = tp_check.selection_rows(tp_check.read_records(work / f"{ref_name}.p{i}.jsonl"))
        rows_got = tp_check.selection_rows(tp_check.read_records(work / f"{got_name}.p{i}.jsonl"))
        last_decode = None if j is None else len(ids) + j - 1
        sel = tp_check.compare_selections(rows_ref, rows_got, TOPK_BLOCKS, last_decode)
        cmp["record_keys_only_tp1"], cmp["record_keys_only_tpn"] = sel["keys_only_in_ref"], sel["keys_only_in_got"]
        hm = tp_check.head_mapping(rows_ref, rows_got, first_sparse, row_stride=8)
        res["head_mapping"].append({k: hm[k] for k in ("heads", "closest", "ok")} | {
            "diag_mean_abs_diff": max((hm["mean_abs_diff"][k][k] for k in range(len(hm["heads"]))), default=None),
            "offdiag_min_mean_abs_diff": min((hm["mean_abs_diff"][a][b] for a in range(len(hm["heads"]))
                                              for b in range(len(hm["heads"])) if a != b), default=None)})
        for layer, st in sel["layers"].items():
            counts = [k for k, v in st.items() if isinstance(v, int)]
            acc = res["layers"].setdefault(layer, dict.fromkeys(counts, 0))
            for k in counts:
                acc[k] += st[k]
            acc["max_score_diff"] = max(acc.get("max_score_diff", 0.0), st["max_score_diff"])
            acc["max_score_diff_rel"] = max(acc.get("max_score_diff_rel", 0.0), st["max_score_diff_rel"])
            if st["first_unexplained"] and "first_unexplained" not in acc:
                acc["first_unexplained"] = st["first_unexplained"] | {"prompt": i}
            modes = acc.setdefault("modes", {})
            for m, n in st["modes"].items():
                modes[m] = modes.get(m, 0) + n
        res["prompts"].append(cmp)
    unexplained = sum(st["unexplained"] for st in res["layers"].values())
    scored = sum(st["scored_head_rows"] for st in res["layers"].values())
    res["verdict"] = {
        "tokens_ok": all(p["ok"] for p in res["prompts"]),
        "tokens_equal": sum(p["equal"] for p in res["prompts"]),
        "selection_ok": unexplained == 0 and scored > 0,
        "heads_ok": all(m["ok"] for m in res["head_mapping"]),
        "same_rows_recorded": all(p["record_keys_only_tp1"] == p["record_keys_only_tpn"] == 0 for p in res["prompts"]),
    }
    return res


def cp_summary(path) -> dict | None:
    """The context-parallel test's outcome from its pytest log: summary line and printed cases."""
    if path is None or not Path(path).exists():
        return None
    text = Path(path).read_text(errors="replace")
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|error).*?)\s*=*$", text, re.M)
    cases = re.findall(r"^\{'case': .*\}$", text, re.M)
    return {"summary": summary[-1] if summary else "no pytest summary line", "cases": cases,
            "exit_code": (re.findall(r"context-parallel test exit code: (\d+)", text) or [None])[-1]}


def load_report(path: Path) -> dict:
    if not path.exists():
        return {"lines": 0, "missing": None}
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {"lines": len(lines), "ranks": sorted(x["rank"] for x in lines),
            "checkpoint_tensors": [x["checkpoint_tensors"] for x in lines],
            "missing": sorted({m for x in lines for m in x["missing"]})}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--formats", default="fp8,mxfp4")
    ap.add_argument("--tp", type=int, default=2, help="TP size compared with TP1")
    ap.add_argument("--lengths", default="2300,3100,4200,5000", help="prompt lengths (tokens), one request each")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dense", type=int, default=1)
    ap.add_argument("--sparse", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0, help="checkpoint and prompt seed")
    ap.add_argument("--std", type=float, default=0.02, help="std of the checkpoint's projections")
    ap.add_argument("--tie-margin", type=float, default=0.1, help="nats: a token divergence within it is a near tie")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (decode selections are recorded too)")
    ap.add_argument("--budget-s", type=float, default=330, help="give up waiting for servers past this")
    ap.add_argument("--end-by", type=float, help="unix time by which the driver must have written its table: "
                    "requests are cut off 40 s before (default: no limit)")
    ap.add_argument("--cpu", action="store_true", help="smoke test on a CPU (tiny sizes, torch paths)")
    ap.add_argument("--cp-log", type=Path, help="pytest log of test_cp_multigpu.py to summarise in table.md")
    args = ap.parse_args()

    t_start = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - t_start)  # noqa: E731
    requests_left = lambda: (args.end_by - 40 - time.time()) if args.end_by else 1800.0  # noqa: E731
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="m3-tp2-"))
    log_dir = work / "logs"
    log_dir.mkdir()
    formats = args.formats.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    context_len = max(lengths) + args.new_tokens + 8 * PAGE_SIZE
    prompt_ids = h200.prompts(lengths, args.vocab, args.seed + 1)

    base = ["--page-size", str(PAGE_SIZE), "--log-level", "info", "--skip-server-warmup", "--random-seed", "0",
            "--context-length", str(context_len), "--max-running-requests", "8", "--chunked-prefill-size", "8192",
            "--disable-overlap-schedule", "--decode-log-interval", "1", "--load-format", "auto",
            "--max-total-tokens", str(4 * context_len)]
    if args.cpu:
        base += ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle",
                 "--mem-fraction-static", "0.3"]
        mode = []
    else:
        base += ["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "triton", "--sampling-backend", "pytorch",
                 "--grammar-backend", "none", "--mem-fraction-static", "0.15"]
        mode = ["--disable-cuda-graph"] if args.eager else ["--disable-piecewise-cuda-graph", "--cuda-graph-bs", "1",
                                                            "2", "4"]

    results = {"args": vars(args) | {"out": str(out)}, "env": h200.env_report(), "formats": {f: {} for f in formats},
               "notes": [], "cp_multigpu": cp_summary(args.cp_log)}

    def save():
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))

    save()
    # One checkpoint (same seed) per format dir: the formats differ only in index_k_format.
    servers = {}
    for i, fmt in enumerate(formats):
        cfg = h200.make_config(work / f"model-{fmt}", args.dense, args.sparse, fmt, args.vocab, args.hidden,
                               args.q_heads, context_len)
        t = time.perf_counter()
        tp_check.write_random_checkpoint(cfg, seed=args.seed, std=args.std)
        results["formats"][fmt]["checkpoint_s"] = time.perf_counter() - t
        for tp in (1, args.tp):
            name = f"{fmt}-tp{tp}"
            rec = work / f"{name}.jsonl"
            extra = ["--json-model-override-args", json.dumps({"index_k_debug_record": str(rec)})]
            extra += ["--tp", str(tp)] if tp > 1 else ["--base-gpu-id", str(i % 2)] if not args.cpu else []
            env = {"M3_LOAD_REPORT": str(work / f"{name}.load.jsonl")} | (h200.cpu_env(tp) if args.cpu else {})
            servers[name] = (h200.Server(name, cfg, base + mode + extra, log_dir, env), rec, fmt)
    h200.log(f"started {len(servers)} servers: {list(servers)}")

    bodies = {}

    def serve(name):
        server, rec, fmt = servers[name]
        r = results["formats"][fmt].setdefault("servers", {}).setdefault(name, {})
        r["ready_s"] = server.wait_ready(max(10.0, min(left(), requests_left())))
        h200.log(f"{name}: ready after {r['ready_s']:.0f} s")
        t = time.perf_counter()
        bodies[name] = run_server_prompts(server, rec, prompt_ids, args.new_tokens, work, requests_left)
        r["prompts_s"] = time.perf_counter() - t
        h200.log(f"{name}: {len(prompt_ids)} prompts in {r['prompts_s']:.1f} s")

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(servers)) as pool:
        futures = {pool.submit(serve, name): name for name in servers}
        for fut in concurrent.futures.as_completed(futures):
            name = futures[fut]
            if fut.exception() is not None:
                fmt = servers[name][2]
                results["formats"][fmt].setdefault("errors", {})[name] = repr(fut.exception())[-3000:]
                h200.log(f"{name}: {fut.exception()!r}"[-3000:])
    for name, (server, _, fmt) in servers.items():
        logtext = server.tail(10**8)
        r = results["formats"][fmt].setdefault("servers", {}).setdefault(name, {})
        r["decode_batches_graph_eager"] = [len(re.findall(r"Decode batch.*graph: True", logtext)),
                                           len(re.findall(r"Decode batch.*graph: False", logtext))]
        server.stop()
    save()

    first_sparse = args.dense
    for fmt in formats:
        r = results["formats"][fmt]
        names = (f"{fmt}-tp1", f"{fmt}-tp{args.tp}")
        for name in names:
            r.setdefault("servers", {}).setdefault(name, {})["load"] = load_report(work / f"{name}.load.jsonl")
        if not all(n in bodies for n in names):
            r["compare_error"] = "a server produced no outputs (see errors)"
            continue
        try:
            r["compare"] = compare_format(work, names, prompt_ids, bodies, first_sparse, args.tie_margin)
            loads = [r["servers"][n]["load"] for n in names]
            r["compare"]["verdict"]["checkpoint_complete"] = all(x["missing"] == [] and x["lines"] > 0 for x in loads)
            h200.log(f"{fmt}: verdict {r['compare']['verdict']}")
        except Exception as e:  # noqa: BLE001 - recorded
            r["compare_error"] = repr(e)[-3000:]
            h200.log(f"{fmt}: compare failed: {e!r}")
        save()

    results["elapsed_s"] = time.monotonic() - t_start
    save()
    h200.write_logs(log_dir, out / "server_logs.txt")
    table = render_table(results, args)
    (out / "table.md").write_text(table)
    print(table, flush=True)
    shutil.rmtree(work, ignore_errors=True)


def _yn(x) -> str:
    return "-" if x is None else ("yes" if x else "NO")


def render_table(results: dict, args) -> str:
    env, tp = results["env"], args.tp
    lines = [f"# TP{tp} vs TP1: SGLang + sglang-m3 on {env.get('gpu')} ({env['date_utc']} UTC; "
             f"sglang {env.get('sglang')}, torch {env.get('torch')}, triton {env.get('triton')}, "
             f"commit {env.get('commit')})", "",
             f"Config: {args.dense} dense + {args.sparse} sparse layers, M3 per-layer geometry ({args.q_heads} query "
             f"heads, 4 KV heads, 4 index heads), hidden {args.hidden}, vocab {args.vocab}; random checkpoint seed "
             f"{args.seed}; decode {'on the CPU' if args.cpu else 'eager' if args.eager else 'in CUDA graphs'}; "
             f"prompts {args.lengths} tokens, "
             f"{args.new_tokens} greedy tokens each.", "",
             "## Verdict", "",
             "| index K | checkpoint complete (both) | tokens equal | tokens ok (equal or near tie) | "
             "selection ok (no unexplained swap) | head mapping ok | same rows recorded |",
             "|---|---|---|---|---|---|---|"]
    for fmt, r in results["formats"].items():
        v = r.get("compare", {}).get("verdict")
        if v is None:
            err = r.get("compare_error") or "; ".join(f"{k}: {e[:100]}" for k, e in r.get("errors", {}).items())
            lines.append(f"| {fmt} | error: {err[:200].replace('|', '/')} | | | | | |")
            continue
        n = len(r["compare"]["prompts"])
        lines.append(f"| {fmt} | {_yn(v.get('checkpoint_complete'))} | {v['tokens_equal']}/{n} | "
                     f"{_yn(v['tokens_ok'])} | {_yn(v['selection_ok'])} | {_yn(v['heads_ok'])} | "
                     f"{_yn(v['same_rows_recorded'])} |")
    lines += ["", "## Greedy tokens per prompt", "",
              "| index K | prompt tokens | equal | first divergence | margin TP1 / TPn (nats) | "
              "prompt logprob max / mean abs diff |", "|---|---|---|---|---|---|"]
    for fmt, r in results["formats"].items():
        for p in r.get("compare", {}).get("prompts", []):
            m = (f"{_fmt(p.get('margin_ref'))} / {_fmt(p.get('margin_got'))}" if not p["equal"] else "-")
            lines.append(f"| {fmt} | {p['length']} | {_yn(p['equal'])} | {p['first_divergence']} | {m} | "
                         f"{_fmt(p.get('prompt_logprob_max_abs_diff'))} / "
                         f"{_fmt(p.get('prompt_logprob_mean_abs_diff'))} |")
    lines += ["", "## Selected blocks per layer (all prompts; TPn ranks merged in head order)", "",
              "| index K | layer | rows (extend / decode) | head-rows equal, rows with > 16 blocks | "
              "head-rows equal, all | scored differing: explained / unexplained | max abs score diff | "
              "max diff / score spread |",
              "|---|---|---|---|---|---|---|---|"]
    for fmt, r in results["formats"].items():
        for layer, st in sorted(r.get("compare", {}).get("layers", {}).items(), key=lambda kv: int(kv[0])):
            modes = st.get("modes", {})
            scored = (f"{st['explained']} / {st['unexplained']}" if st["scored_head_rows"] else "not scored")
            lines.append(f"| {fmt} | {layer} | {modes.get('extend', 0)} / {modes.get('decode', 0)} | "
                         f"{tp_check.fraction(st['choice_equal'], st['choice_head_rows'])} | "
                         f"{tp_check.fraction(st['equal'], st['head_rows'])} | {scored} | "
                         f"{_fmt(st['max_score_diff']) if st['scored_head_rows'] else '-'} | "
                         f"{_fmt(st['max_score_diff_rel']) if st['scored_head_rows'] else '-'} |")
    lines += ["", "## Head mapping in the first sparse layer (mean abs score difference)", "",
              "| index K | prompt | TPn head -> closest TP1 head | same head (max) | other heads (min) |",
              "|---|---|---|---|---|"]
    for fmt, r in results["formats"].items():
        for i, m in enumerate(r.get("compare", {}).get("head_mapping", [])):
            pairs = ", ".join(f"{a}->{b}" for a, b in zip(m["heads"], m["closest"]))
            lines.append(f"| {fmt} | {i} | {pairs} | {_fmt(m['diag_mean_abs_diff'])} | "
                         f"{_fmt(m['offdiag_min_mean_abs_diff'])} |")
    lines += ["", "## Servers", "", "| server | ready s | prompts s | decode batches graph / eager | "
              "checkpoint tensors per rank | missing params |", "|---|---|---|---|---|---|"]
    for fmt, r in results["formats"].items():
        for name, s in r.get("servers", {}).items():
            load = s.get("load", {})
            lines.append(f"| {name} | {_fmt(s.get('ready_s'), '.0f')} | {_fmt(s.get('prompts_s'), '.1f')} | "
                         f"{' / '.join(map(str, s.get('decode_batches_graph_eager', ['-'])))} | "
                         f"{load.get('checkpoint_tensors', '-')} | "
                         f"{load.get('missing', '-')} |")
    cp = results.get("cp_multigpu")
    if cp is not None:
        lines += ["", "## Context-parallel scorer across the two GPUs (world 2, NCCL)", "",
                  f"tests/kernels/ops/score/test_cp_multigpu.py: {cp['summary']} (exit code {cp['exit_code']}).", ""]
        lines += [f"- {c}" for c in cp["cases"]]
    lines += [f"Note: {n}" for n in results["notes"]]
    lines += ["", f"Elapsed: {results.get('elapsed_s', 0):.0f} s.", ""]
    return "\n".join(lines)


def _fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
