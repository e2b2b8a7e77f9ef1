"""Dense against MSA-sparse, and the index-K formats against each other, on the retrofitted SmolLM2.

For each (length, task, sample) one prompt (``retrofit.tasks``) is scored teacher-forced (greedy exact
match on the answer) by the dense model and by the sparse model with each index-K format's
selection (``--formats``; bf16 first). The bf16 run also measures, per sparse layer, at ``--probe``
rows spread over the positions where selection binds (past 16 blocks) plus the answer rows:

- ``recall``: the fraction of bf16's selected (row, head, block) triples each other format selects
  from the same index q and k (the bf16 run's states), i.e. top-16 recall against bf16;
- ``kept``: the dense attention mass (this layer's, averaged over query heads) inside bf16's selection.

Rows go to ``rows.jsonl`` in ``--out`` (appended; a rerun skips samples already there), the summary
(``summary.json``, ``summary.md``) uses ``accuracy.stats.compare_paired`` (Tango's interval on the
paired 0/1 scores; the m3-accuracy statistics) for sparse-bf16 against dense and every format against
fp8 and bf16, per (task, length) and pooled per length.

    python -m retrofit.evaluate --index out/retrofit/index.pt --lengths 4096 8192 --n 50 --out lab/data/retrofit/run
"""

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

import torch

from m3_kernels.formats import PAGE_SIZE, TOPK_BLOCKS

from .base import load_base
from .model import FORMATS, RetrofitLM
from .tasks import TASKS, Prompts, sample_rng

BASELINES = ("dense", "fp8", "bf16")


@dataclasses.dataclass
class _Counts:
    """The fields ``markdown`` reads when ``accuracy.stats`` cannot be imported."""

    n: int
    n10: int
    n01: int
    diff: float
    ci_lo: float
    ci_hi: float


def probe_rows(T: int, answers: list[int], n: int) -> torch.Tensor:
    """``n`` rows evenly spread over ``[16 blocks, T)`` plus ``answers`` (sorted, distinct)."""
    lo = TOPK_BLOCKS * PAGE_SIZE
    spread = [] if T <= lo else [lo + (T - lo) * j // n for j in range(n)]
    return torch.tensor(sorted(set(spread) | set(answers)))


@torch.no_grad()
def score_batch(model: RetrofitLM, prompts: Prompts, samples: list, formats, n_probe: int, device):
    """Rows (one dict per sample) of one batch of samples of one length (right-padded)."""
    T = max(len(s.input_ids) for s in samples)
    ids = torch.zeros(len(samples), T, dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, : len(s.input_ids)] = torch.tensor(s.input_ids)
    answer = [prompts.answer_rows(s) for s in samples]
    width = max(len(a) for a in answer)
    rows = torch.tensor([a + [a[-1]] * (width - len(a)) for a in answer])
    targets = [[s.input_ids[r + 1] for r in a] for s, a in zip(samples, answer)]
    ids, rows = ids.to(device), rows.to(device)

    def right(logits):
        pred = logits.argmax(-1).tolist()
        return [float(p[: len(t)] == t) for p, t in zip(pred, targets)]

    out = [{"scores": {}, "seconds": {}} for _ in samples]
    t = time.time()
    logits, _ = model(ids, "dense", logit_rows=rows)
    for o, r in zip(out, right(logits)):
        o["scores"]["dense"] = r
    for o in out:
        o["seconds"]["dense"] = round(time.time() - t, 2)
    # Probe rows shared by the batch: spread rows below the shortest sample, plus every answer row.
    shortest = min(len(s.input_ids) for s in samples)
    probe = probe_rows(shortest, sorted({r for a in answer for r in a}), n_probe).to(device)
    for fmt in formats:
        t = time.time()
        others = [f for f in formats if f != "bf16"] if fmt == "bf16" else ()
        logits, aux = model(ids, "sparse", index_k_format=fmt, logit_rows=rows,
                            probe_rows=probe if fmt == "bf16" else None, probe_formats=others)
        for o, r in zip(out, right(logits)):
            o["scores"][fmt] = r
            o["seconds"][fmt] = round(time.time() - t, 2)
        if fmt == "bf16":
            for o in out:
                o["probe"] = {str(layer): {f: list(v) for f, v in d.items()} for layer, d in aux["probe"].items()}
                o["kept"] = {str(layer): round(v, 5) for layer, v in aux["kept"].items()}
    return out


def summarize(rows: list[dict], formats) -> dict:
    """Paired statistics per (task, length) and pooled per length (``accuracy.stats.compare_paired``;
    without scipy/statsmodels, as on a bare GPU machine, the discordant counts only, no interval)."""
    try:
        from accuracy.stats import compare_paired
    except ImportError:
        def compare_paired(a, b):
            n10 = sum(1 for x, y in zip(a, b) if x == 1 and y != 1)
            n01 = sum(1 for x, y in zip(a, b) if x != 1 and y == 1)
            return _Counts(len(a), n10, n01, (n01 - n10) / len(a), float("nan"), float("nan"))

    cells = {}
    for r in rows:
        cells.setdefault((r["task"], r["length"]), []).append(r)
        cells.setdefault(("all", r["length"]), []).append(r)
    out = []
    arms = ["dense", *formats]
    for (task, length), rs in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0] == "all", kv[0][0])):
        cell = {"task": task, "length": length, "n": len(rs),
                "acc": {a: sum(r["scores"][a] for r in rs) / len(rs) for a in arms if all(a in r["scores"] for r in rs)}}
        comps = {}
        for base in BASELINES:
            for arm in arms:
                if arm == base or base not in cell["acc"] or arm not in cell["acc"]:
                    continue
                if base == "dense" and arm != "bf16":
                    continue
                res = compare_paired([r["scores"][base] for r in rs], [r["scores"][arm] for r in rs])
                comps[f"{arm}-{base}"] = dataclasses.asdict(res)
        cell["paired"] = comps
        out.append(cell)
    recall = {}
    for r in rows:
        for layer, d in r.get("probe", {}).items():
            for f, (hit, tot) in d.items():
                acc = recall.setdefault(f, {}).setdefault(layer, [0, 0])
                acc[0] += hit
                acc[1] += tot
    kept = {}
    for r in rows:
        for layer, v in r.get("kept", {}).items():
            kept.setdefault(layer, []).append(v)
    return {"cells": out,
            "recall": {f: {l: h / t for l, (h, t) in sorted(d.items(), key=lambda x: int(x[0]))} for f, d in recall.items()},
            "kept": {l: sum(v) / len(v) for l, v in sorted(kept.items(), key=lambda x: int(x[0]))}}


def _pct(x):
    return f"{100 * x:.1f}"


def markdown(summary: dict, formats) -> str:
    """Accuracy per cell, paired differences with 95% intervals, recall per layer."""
    arms = ["dense", *formats]
    lines = ["Accuracy (%), teacher-forced greedy exact match", "",
             "| task | length | n | " + " | ".join(arms) + " |", "|---|---|---|" + "---|" * len(arms)]
    for c in summary["cells"]:
        lines.append(f"| {c['task']} | {c['length']} | {c['n']} | "
                     + " | ".join(_pct(c["acc"][a]) if a in c["acc"] else "-" for a in arms) + " |")
    lines += ["", "Paired differences, points: diff [95% interval] (discordant worse/better), "
                  "Tango's interval as m3-accuracy", ""]
    comps = ["bf16-dense"] + [f"{f}-fp8" for f in formats if f != "fp8"] + [f"{f}-bf16" for f in formats if f != "bf16"]
    lines += ["| task | length | n | " + " | ".join(comps) + " |", "|---|---|---|" + "---|" * len(comps)]
    for c in summary["cells"]:
        cells = []
        for name in comps:
            p = c["paired"].get(name)
            cells.append("-" if p is None else f"{100 * p['diff']:+.1f} [{100 * p['ci_lo']:+.1f}, "
                         f"{100 * p['ci_hi']:+.1f}] ({p['n10']}/{p['n01']})")
        lines.append(f"| {c['task']} | {c['length']} | {c['n']} | " + " | ".join(cells) + " |")
    if summary["recall"]:
        layers = sorted({l for d in summary["recall"].values() for l in d}, key=int)
        lines += ["", "Top-16 recall against bf16 (%), per sparse layer, rows past 16 blocks; "
                      "last row: dense attention mass inside bf16's selection (%)", "",
                  "| format | " + " | ".join(f"L{l}" for l in layers) + " | mean |",
                  "|---|" + "---|" * (len(layers) + 1)]
        for f, d in summary["recall"].items():
            vals = [d.get(l) for l in layers]
            mean = sum(v for v in vals if v is not None) / max(1, sum(v is not None for v in vals))
            lines.append(f"| {f} | " + " | ".join("-" if v is None else _pct(v) for v in vals) + f" | {_pct(mean)} |")
        kept = summary["kept"]
        lines.append("| kept mass (bf16) | " + " | ".join(_pct(kept[l]) if l in kept else "-" for l in layers)
                     + f" | {_pct(sum(kept.values()) / max(1, len(kept)))} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--index", type=Path, required=True, help="index-head weights from retrofit.train")
    p.add_argument("--out", type=Path, required=True, help="folder for rows.jsonl, summary.json, summary.md")
    p.add_argument("--gguf", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--n", type=int, default=10, help="samples per (task, length)")
    p.add_argument("--start", type=int, default=0, help="first sample index")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--probe", type=int, default=32, help="probe rows per sample for recall")
    p.add_argument("--batch", type=int, default=1, help="samples per forward (same length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--base-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the frozen model's weights (the index heads stay fp32)")
    p.add_argument("--time-limit", type=float, default=None, help="stop starting batches after this many seconds")
    p.add_argument("--summary-only", action="store_true", help="summarize rows.jsonl, run nothing")
    args = p.parse_args(argv)
    formats = ["bf16"] + [f for f in args.formats if f != "bf16"]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "rows.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
    if not args.summary_only:
        torch.set_num_threads(args.threads)
        t0 = time.time()
        hf, tok = load_base(args.gguf, getattr(torch, args.base_dtype))
        model = RetrofitLM(hf).to(args.device)
        model.index.load_state_dict(torch.load(args.index, map_location=args.device))
        if args.device != "cpu":
            model.sparse_backend = "masked"
        prompts = Prompts(tok.backend_tokenizer, evaluation=True)
        done = {(r["task"], r["length"], r["sample"]) for r in rows}
        todo = [(L, task, i) for i in range(args.start, args.start + args.n) for L in args.lengths for task in args.tasks
                if (task, L, i) not in done]
        # Chunks of --batch sample indices, every length and task in each: a run cut short by the time
        # limit still covers every (task, length) cell evenly.
        todo.sort(key=lambda x: (x[2] // args.batch, x[0], x[2], x[1]))
        with path.open("a") as f:
            for j in range(0, len(todo), args.batch):
                if args.time_limit and time.time() - t0 > args.time_limit:
                    print(f"time limit reached: {len(todo) - j} samples left", flush=True)
                    break
                group = [x for x in todo[j : j + args.batch] if x[0] == todo[j][0]]
                samples = [prompts.sample(task, sample_rng(task, L, i, args.seed), L) for L, task, i in group]
                for (L, task, i), s, res in zip(group, samples, score_batch(model, prompts, samples, formats,
                                                                             args.probe, args.device)):
                    row = {"task": task, "length": L, "sample": i, "tokens": len(s.input_ids), **res}
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    rows.append(row)
                    print(task, L, i, row["scores"], f"{time.time() - t0:.0f} s", flush=True)
    summary = summarize(rows, formats)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    table = markdown(summary, formats)
    (args.out / "summary.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
