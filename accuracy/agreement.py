"""Per-layer block-selection agreement between index-K formats, and needle-block recall, on served needles.

For the needle prompts of the accuracy runner (``accuracy.needle.generate`` with the model's
tokenizer), one SGLang server per format (``accuracy.run.format_launch_args``, ``dense`` included)
runs each prompt with a few greedy tokens while the plugin's selection recorder
(``sglang_m3.debug``, last ``--prompt-rows`` prompt rows and every decode row) is on. From the
recorded selections, per sparse layer and context length:

- **agreement** of each pair of formats: over (index head, row) selections, the fraction with the
  same block set (``identical``) and the mean ``|A & B| / max(|A|, |B|)`` (``overlap``; ``|A|`` =
  topk for rows that see more than topk blocks). Rows: ``prompt`` (the last ``--prompt-rows``
  prompt rows: same inputs in every format) and ``answer`` (the rows that produce the generated
  tokens: the last prompt row, then decode rows as long as both formats generated the same tokens,
  so the inputs still match).
- **needle recall** of each format: the fraction of (head, row) selections that contain every
  block holding the queried needle sentence (``recall``; ``recall_any``: at least one of them).
  Rows: ``question`` (the question at the end of the prompt) and ``answer`` (as above, every
  generated token of the format's own answer). ``chance``: the same fraction for a uniformly
  random choice of the ranked blocks (the local block is always kept).
- for ``dense`` (the control), ``all_visible``: the fraction of selections holding every visible
  block (1 when the server really attends densely); its recall is 1 by construction.

Writes ``agreement.json``, ``agreement.md``, ``server-<fmt>.log`` and each format's selections under
``formats/`` (``--reuse`` loads them instead of serving that format again, so the formats can be
served in separate calls); the raw records are deleted as they are read. Example::

    python -m accuracy.agreement --model ckpt --formats dense bf16 fp8 mxfp4 \\
        --lengths 4096 8192 16384 32768 --samples 10 --out out/agreement

Everything after ``--`` goes to ``python -m sglang.launch_server``; the tool adds
``--disable-cuda-graph`` (decode rows are recorded in eager forwards only) and
``--disable-overlap-schedule`` (every record of a request is written before its response).
"""

import argparse
import hashlib
import itertools
import json
import math
import urllib.request
from collections import defaultdict
from pathlib import Path

import numpy as np

from m3_kernels.formats import LOCAL_BLOCKS, PAGE_SIZE

from . import needle
from .run import (OVERRIDE_FLAG, RUNNER_OWNED_FLAGS, SGLangServer, dense_max_tokens, dense_sparse_config,
                  format_launch_args, is_dense, model_sparse_config, parse_command_line)

EAGER_FLAGS = ("--disable-cuda-graph", "--disable-overlap-schedule")
ALL_LAYERS = "all"
ROW_KINDS = ("prompt", "question", "answer")  # see row_kinds
AGREEMENT_ROWS = ("prompt", "answer")
RECALL_ROWS = ("question", "answer")


# ---------------------------------------------------------------------------------------------
# Prompts


def needle_token_span(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """Token range ``[first, last + 1)`` of the tokens whose characters overlap ``[start, end)``.

    ``offsets`` are a fast tokenizer's ``(char_start, char_end)`` per token (special tokens ``(0, 0)``).
    """
    hit = [i for i, (s, e) in enumerate(offsets) if e > s and s < end and e > start]
    if not hit:
        raise ValueError(f"no token covers characters [{start}, {end})")
    return hit[0], hit[-1] + 1


def prepare(tokenizer, doc: dict, doc_id: int) -> dict:
    """Token ids of ``doc``'s prompt and where its queried needle and its question sit (token positions)."""
    if not getattr(tokenizer, "is_fast", False):
        raise NotImplementedError("needle token spans need a fast tokenizer (character offsets)")
    prompt = doc["input"]
    enc = tokenizer(prompt, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    sentence = needle.NEEDLE.format(key=doc["key"], value=doc["target"])
    at = prompt.index(sentence)
    n0, n1 = needle_token_span(offsets, at, at + len(sentence))
    q_at = prompt.rindex("\n\nQuestion:") + 2
    q0, _ = needle_token_span(offsets, q_at, len(prompt))
    return {"doc_id": doc_id, "length": doc["length"], "depth": doc["depth"], "target": doc["target"],
            "input_ids": ids, "prompt_len": len(ids), "needle_tokens": [n0, n1], "question_start": q0,
            "needle_blocks": sorted({t // PAGE_SIZE for t in range(n0, n1)})}


# ---------------------------------------------------------------------------------------------
# Records


class RecordReader:
    """Reads and then empties the recorder's file(s): ``path``, or ``path.rank<r>`` per attention-TP rank.

    The recorder opens its file in append mode for every line, so emptying it between requests
    loses nothing once a request's response has come back (no other request in flight).
    """

    def __init__(self, path: Path):
        self.path = path

    def _files(self) -> list[Path]:
        ranks = sorted(self.path.parent.glob(self.path.name + ".rank*"), key=lambda p: int(p.suffix[5:]))
        return ranks or ([self.path] if self.path.exists() else [])

    def take(self) -> list[dict]:
        """Records written since the last ``take``, rank files merged (see ``merge_ranks``)."""
        per_rank = []
        for f in self._files():
            text = f.read_text()
            f.write_text("")
            per_rank.append([json.loads(line) for line in text.splitlines() if line.strip()])
        return merge_ranks(per_rank)


def merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """One record per forward from per-rank records (same forwards in the same order): ``selected``
    of all ranks concatenated in global index-head order (``heads``; ranks sharing heads once)."""
    if len(per_rank) <= 1:
        return per_rank[0] if per_rank else []
    if len({len(r) for r in per_rank}) != 1:
        raise ValueError(f"rank files hold different numbers of records: {[len(r) for r in per_rank]}")
    merged = []
    for recs in zip(*per_rank):
        by_head = {}
        for rec in recs:
            if (rec["layer"], rec["positions"]) != (recs[0]["layer"], recs[0]["positions"]):
                raise ValueError("rank records out of step (different layer or positions)")
            for h, sel in zip(rec["heads"], rec["selected"]):
                by_head.setdefault(h, sel)
        heads = sorted(by_head)
        merged.append({**recs[0], "heads": heads, "selected": [by_head[h] for h in heads]})
    return merged


def request_rows(records: list[dict], first: int, end: int) -> dict:
    """Rows ``first <= position < end`` of one request's records, per layer.

    Returns ``{layer: {"positions": int64 [rows], "n_visible": int64 [rows], "selected": int32
    [H, rows, topk]}}`` with rows in position order; ValueError if a position is missing or
    recorded twice in a layer.
    """
    by_layer = defaultdict(dict)
    for rec in records:
        for r, pos in enumerate(rec["positions"]):
            if first <= pos < end:
                if pos in by_layer[rec["layer"]]:
                    raise ValueError(f"layer {rec['layer']}: position {pos} recorded twice")
                by_layer[rec["layer"]][pos] = (rec["n_visible"][r], [head[r] for head in rec["selected"]])
    out = {}
    for layer, rows in sorted(by_layer.items()):
        missing = sorted(set(range(first, end)) - set(rows))
        if missing:
            raise ValueError(f"layer {layer}: positions {missing[:5]}... of [{first}, {end}) not recorded "
                             "(recorder rows option too small, or CUDA-graph decode)")
        positions = sorted(rows)
        out[layer] = {
            "positions": np.array(positions, dtype=np.int64),
            "n_visible": np.array([rows[p][0] for p in positions], dtype=np.int64),
            "selected": np.array([rows[p][1] for p in positions], dtype=np.int32).transpose(1, 0, 2),
        }
    if not out:
        raise ValueError(f"no record holds positions [{first}, {end})")
    return out


# ---------------------------------------------------------------------------------------------
# Measures (pure functions of selections)


def _as_sets(sel: np.ndarray) -> list[frozenset]:
    """Block-id sets of ``sel [..., topk]`` (-1 padding dropped), flattened over leading dims."""
    flat = sel.reshape(-1, sel.shape[-1])
    return [frozenset(int(b) for b in row if b >= 0) for row in flat]


def set_agreement(a: np.ndarray, b: np.ndarray) -> tuple[int, int, float]:
    """``(n, identical, overlap_sum)`` over matching selections of ``a``, ``b [..., topk]`` (same leading
    shape): ``identical`` counts equal block sets, ``overlap_sum`` adds ``|A & B| / max(|A|, |B|)``
    (1 for two empty sets)."""
    if a.shape[:-1] != b.shape[:-1]:
        raise ValueError(f"a and b must hold the same selections, got shapes {a.shape} and {b.shape}")
    n = identical = 0
    overlap = 0.0
    for x, y in zip(_as_sets(a), _as_sets(b)):
        n += 1
        identical += x == y
        overlap += len(x & y) / max(len(x), len(y)) if (x or y) else 1.0
    return n, identical, overlap


def needle_hits(sel: np.ndarray, needle_blocks) -> tuple[int, int, int]:
    """``(n, all, any)`` over selections ``sel [..., topk]``: how many contain every / at least one
    of ``needle_blocks``."""
    want = frozenset(int(b) for b in needle_blocks)
    if not want:
        raise ValueError("needle_blocks must not be empty")
    sets = _as_sets(sel)
    return len(sets), sum(want <= s for s in sets), sum(bool(want & s) for s in sets)


def chance_recall(n_visible: int, needle_blocks, topk: int, local_blocks: int = LOCAL_BLOCKS,
                  init_blocks: int = 0) -> float:
    """Probability that a row seeing ``n_visible`` blocks holds every needle block when its ``topk -
    init - local`` ranked blocks are drawn uniformly from the non-init, non-local ones (init and
    local blocks are always kept; needle blocks past the row are never visible: 0)."""
    blocks = set(int(b) for b in needle_blocks)
    if max(blocks) >= n_visible:
        return 0.0
    if n_visible <= topk:
        return 1.0
    pool = n_visible - init_blocks - local_blocks
    ranked = topk - init_blocks - local_blocks
    m = sum(1 for b in blocks if init_blocks <= b < n_visible - local_blocks)
    return math.comb(pool - m, ranked - m) / math.comb(pool, ranked) if m <= ranked else 0.0


def row_kinds(doc: dict, n_answer: int, prompt_rows: int) -> dict:
    """Position ranges ``[first, end)`` of the row kinds of ``doc`` with ``n_answer`` answer rows."""
    p = doc["prompt_len"]
    return {"prompt": (max(0, p - prompt_rows), p), "question": (doc["question_start"], p),
            "answer": (p - 1, p - 1 + n_answer)}


def answer_rows_in_step(out_a: list[int], out_b: list[int]) -> int:
    """Answer rows whose inputs match in two runs: the last prompt row, then one decode row per
    generated token while the generated tokens agree (decode row ``i`` is fed token ``i``)."""
    n = 1
    for x, y in zip(out_a[:-1], out_b[:-1]):
        if x != y:
            break
        n += 1
    return min(n, max(len(out_a), 1), max(len(out_b), 1))


class Tally:
    """Sums keyed by (length, layer, rows, name), reduced to fractions by ``table``; every layer
    also adds to ``ALL_LAYERS``."""

    def __init__(self):
        self.sums = defaultdict(lambda: defaultdict(float))

    def add(self, length, layer, rows, name, **values):
        for lay in (layer, ALL_LAYERS):
            for k, v in values.items():
                self.sums[(length, lay, rows, name)][k] += v

    def table(self, ratios: dict) -> list[dict]:
        """One dict per key: ``n`` and each ``ratios[out] = (numerator, denominator)`` sum ratio."""
        out = []
        order = lambda k: (k[0], k[1] == ALL_LAYERS, k[1] if k[1] != ALL_LAYERS else 0, k[2], k[3])  # noqa: E731
        for key in sorted(self.sums, key=order):
            s = self.sums[key]
            row = {"length": key[0], "layer": key[1], "rows": key[2], "name": key[3], "n": int(s["n"])}
            for name, (num, den) in ratios.items():
                if den in s:
                    row[name] = s[num] / s[den] if s[den] else None
            out.append(row)
        return out


class Measures:
    """Running tallies of agreement, recall and the dense check (``add_format`` per format and
    prompt, ``add_pair`` per pair of sparse formats and prompt; ``summary`` at the end).

    A prompt's selections ``sel`` are ``{kind: {layer: int32 [H, rows, topk]}, "n_visible": {kind:
    {layer: int64 [rows]}}}`` with kinds as ``row_kinds``; ``out`` its generated token ids.
    """

    def __init__(self, local_blocks: int = LOCAL_BLOCKS, init_blocks: int = 0):
        self.local_blocks, self.init_blocks = local_blocks, init_blocks
        self.agree, self.recall, self.dense = Tally(), Tally(), Tally()

    def add_format(self, doc: dict, fmt: str, sel: dict, topk: int) -> None:
        length, blocks = doc["length"], doc["needle_blocks"]
        for kind in RECALL_ROWS:
            for layer, s in sel[kind].items():
                n, hit_all, hit_any = needle_hits(s, blocks)
                chance = s.shape[0] * sum(chance_recall(int(v), blocks, topk, self.local_blocks, self.init_blocks)
                                          for v in sel["n_visible"][kind][layer])
                self.recall.add(length, layer, kind, fmt, n=n, all=hit_all, any=hit_any, chance=chance)
        if is_dense(fmt):
            for kind in AGREEMENT_ROWS:
                for layer, s in sel[kind].items():
                    full = [frozenset(range(int(v))) for v in sel["n_visible"][kind][layer]] * s.shape[0]
                    got = _as_sets(s)
                    self.dense.add(length, layer, kind, fmt, n=len(got), full=sum(x == y for x, y in zip(got, full)))

    def add_pair(self, doc: dict, a: str, b: str, sel_a: dict, sel_b: dict, out_a: list[int], out_b: list[int]) -> None:
        in_step = answer_rows_in_step(out_a, out_b)
        for kind in AGREEMENT_ROWS:
            for layer, sa in sel_a[kind].items():
                sb = sel_b[kind][layer]
                if kind == "answer":
                    sa, sb = sa[:, :in_step], sb[:, :in_step]
                n, same, overlap = set_agreement(sa, sb)
                self.agree.add(doc["length"], layer, kind, f"{a}/{b}", n=n, identical=same, overlap=overlap)

    def summary(self) -> dict:
        return {
            "agreement": self.agree.table({"identical": ("identical", "n"), "overlap": ("overlap", "n")}),
            "recall": self.recall.table({"recall": ("all", "n"), "recall_any": ("any", "n"),
                                         "chance": ("chance", "n")}),
            "dense": self.dense.table({"all_visible": ("full", "n")}),
        }


def measure(docs: list[dict], selections: dict, outputs: dict, formats: list[str], topk: dict,
            local_blocks: int = LOCAL_BLOCKS, init_blocks: int = 0) -> dict:
    """``Measures`` over ``selections[fmt][doc_id]`` and ``outputs[fmt][doc_id]`` (every format, every
    pair of non-dense formats); ``topk[fmt]`` is each server's top-k."""
    m = Measures(local_blocks, init_blocks)
    sparse = [f for f in formats if not is_dense(f)]
    for doc in docs:
        d = doc["doc_id"]
        for fmt in formats:
            m.add_format(doc, fmt, selections[fmt][d], topk[fmt])
        for a, b in itertools.combinations(sparse, 2):
            m.add_pair(doc, a, b, selections[a][d], selections[b][d], outputs[a][d], outputs[b][d])
    return m.summary()


# ---------------------------------------------------------------------------------------------
# Serving


def _generate(base_url: str, input_ids: list[int], max_new_tokens: int, timeout: float) -> list[int]:
    body = json.dumps({"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                    "temperature": 0.0}}).encode()
    req = urllib.request.Request(base_url + "/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["output_ids"]


def run_format(fmt: str, model: str, docs: list[dict], launch_args: list[str], args, dense: dict, on_doc) -> int:
    """Serve ``docs`` one at a time on one ``fmt`` server; ``on_doc(doc, sel, out)`` gets each prompt's
    selections (as ``Measures``) and generated token ids. Returns the rows the prompts' records held
    (all layers)."""
    record = (args.out / f"records-{fmt}.jsonl").resolve()
    for stale in [record, *record.parent.glob(record.name + ".rank*")]:
        stale.unlink(missing_ok=True)
    extra = [a for a in EAGER_FLAGS if a not in launch_args]
    recorder = {"index_k_debug_record": str(record), "index_k_debug_rows": args.prompt_rows}
    launch = format_launch_args(fmt, [*launch_args, *extra, OVERRIDE_FLAG, json.dumps(recorder)],
                                **(dense if is_dense(fmt) else {}))
    reader = RecordReader(record)
    recorded = 0
    with SGLangServer(model, launch, args.out / f"server-{fmt}.log", timeout_s=args.launch_timeout) as server:
        reader.take()  # the health probe's forwards
        for doc in docs:
            out = _generate(server.base_url, doc["input_ids"], args.gen_tokens, args.request_timeout)
            records = reader.take()
            recorded += sum(len(rec["positions"]) for rec in records)
            kinds = row_kinds(doc, len(out), args.prompt_rows)
            lo, hi = min(r[0] for r in kinds.values()), max(r[1] for r in kinds.values())
            rows = request_rows(records, lo, hi)
            per_kind = {"n_visible": {}}
            for kind, (first, end) in kinds.items():
                per_kind[kind], per_kind["n_visible"][kind] = {}, {}
                for layer, r in rows.items():
                    pick = (r["positions"] >= first) & (r["positions"] < end)
                    per_kind[kind][layer] = r["selected"][:, pick]
                    per_kind["n_visible"][kind][layer] = r["n_visible"][pick]
            on_doc(doc, per_kind, out)
        reader.take()
    for f in [record, *record.parent.glob(record.name + ".rank*")]:
        f.unlink(missing_ok=True)
    return recorded


def _settings_digest(settings: dict, docs: list[dict]) -> str:
    """Digest of the run settings and the prompts' token ids (what a saved format must match)."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for d in docs:
        h.update(np.asarray(d["input_ids"], dtype=np.int64).tobytes())
    return h.hexdigest()


def save_format(folder: Path, fmt: str, digest: str, selections: dict, outputs: dict, recorded: int) -> None:
    """``<folder>/<fmt>.npz`` (selections and visible counts per prompt, kind and layer) and
    ``<fmt>.json`` (settings digest, generated token ids, rows recorded)."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for d, sel in selections.items():
        for kind in ROW_KINDS:
            for layer, a in sel[kind].items():
                arrays[f"{d}/{kind}/{layer}"] = a.astype(np.int32)
                arrays[f"{d}/n_visible/{kind}/{layer}"] = sel["n_visible"][kind][layer]
    np.savez_compressed(folder / f"{fmt}.npz", **arrays)
    meta = {"digest": digest, "outputs": {str(d): o for d, o in outputs.items()}, "recorded_rows": recorded}
    (folder / f"{fmt}.json").write_text(json.dumps(meta))


def load_format(folder: Path, fmt: str, digest: str) -> tuple[dict, dict, int] | None:
    """``(selections, outputs, recorded)`` saved by ``save_format``; None if absent; ValueError if it
    was made with other settings or prompts."""
    meta_path = folder / f"{fmt}.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    if meta["digest"] != digest:
        raise ValueError(f"{meta_path} was made with other settings or prompts; use another --out or drop --reuse")
    selections = defaultdict(lambda: {"n_visible": defaultdict(dict), **{k: {} for k in ROW_KINDS}})
    with np.load(folder / f"{fmt}.npz") as z:
        for key in z.files:
            parts = key.split("/")
            if parts[1] == "n_visible":
                selections[int(parts[0])]["n_visible"][parts[2]][int(parts[3])] = z[key]
            else:
                selections[int(parts[0])][parts[1]][int(parts[2])] = z[key]
    return dict(selections), {int(d): o for d, o in meta["outputs"].items()}, meta["recorded_rows"]


# ---------------------------------------------------------------------------------------------
# Report


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def markdown(summary: dict) -> str:
    """Tables: pairwise agreement, needle recall per format, and the dense check."""
    run = summary["run"]
    lines = [f"Model `{run['model']}`; formats {', '.join(run['formats'])}; {run['samples']} samples per length; "
             f"last {run['prompt_rows']} prompt rows and {run['gen_tokens']} generated tokens recorded.", ""]
    pairs = sorted({r["name"] for r in summary["agreement"]},
                   key=lambda pair: [run["formats"].index(f) for f in pair.split("/")])
    if pairs:
        lines += ["### Top-k block agreement between formats (identical sets % / mean overlap %)", ""]
        head = ["length", "layer"] + [f"{p} {k}" for p in pairs for k in AGREEMENT_ROWS]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        cells = defaultdict(dict)
        for r in summary["agreement"]:
            cells[(r["length"], r["layer"])][(r["name"], r["rows"])] = f"{_pct(r['identical'])} / {_pct(r['overlap'])}"
        for (length, layer), c in cells.items():
            lines.append("| " + " | ".join([str(length), str(layer)] + [c.get((p, k), "-") for p in pairs
                                                                          for k in AGREEMENT_ROWS]) + " |")
        lines.append("")
    fmts = run["formats"]
    lines += ["### Needle-block recall (% of head-row selections holding every needle block; chance in brackets)", ""]
    head = ["length", "layer"] + [f"{f} {k}" for f in fmts for k in RECALL_ROWS]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cells = defaultdict(dict)
    for r in summary["recall"]:
        cells[(r["length"], r["layer"])][(r["name"], r["rows"])] = f"{_pct(r['recall'])} ({_pct(r['chance'])})"
    for (length, layer), c in cells.items():
        lines.append("| " + " | ".join([str(length), str(layer)] + [c.get((f, k), "-") for f in fmts
                                                                      for k in RECALL_ROWS]) + " |")
    lines.append("")
    if summary["dense"]:
        lines += ["### Dense control: selections holding every visible block", "", "| length | layer | rows | n | % |",
                  "|---|---|---|---|---|"]
        for r in summary["dense"]:
            if r["layer"] == ALL_LAYERS:
                lines.append(f"| {r['length']} | {r['layer']} | {r['rows']} | {r['n']} | {_pct(r['all_visible'])} |")
        lines.append("")
    if summary.get("docs"):
        right = {f: sum(d["correct"][f] for d in summary["docs"]) for f in fmts}
        lines += ["Answers holding the target: " + ", ".join(f"{f} {right[f]:.0f}/{len(summary['docs'])}" for f in fmts)
                  + ".", ""]
    lines.append("Rows: prompt = the last recorded prompt rows; question = the question at the end of the prompt; "
                 "answer = the rows producing the generated tokens (for agreement, only while both formats "
                 "generated the same tokens). Counts are over (index head, row) selections.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m accuracy.agreement", description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- go to `python -m sglang.launch_server` unchanged.")
    p.add_argument("--model", required=True, help="model path or hub id given to --model-path")
    p.add_argument("--tokenizer", default=None, help="tokenizer path or id (default: --model)")
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8", "mxfp4"],
                   help="index-K formats and/or dense (the dense-attention control)")
    p.add_argument("--lengths", type=int, nargs="+", required=True, help="context lengths in tokens")
    p.add_argument("--samples", type=int, default=10, help="needle prompts per length")
    p.add_argument("--depths", type=int, default=10, help="needle depths spread evenly over 0..100%%")
    p.add_argument("--keys", type=int, default=1, help="needles per prompt (1: m3_niah_single, 4: m3_niah_multikey)")
    p.add_argument("--gen-tokens", type=int, default=8, help="greedy tokens generated per prompt")
    p.add_argument("--prompt-rows", type=int, default=128,
                   help="last prompt rows recorded per request (must cover the question)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--launch-timeout", type=float, default=1800.0)
    p.add_argument("--out", type=Path, default=Path("out/agreement"))
    p.add_argument("--reuse", action="store_true",
                   help="load formats already served into --out/formats (same settings and prompts) instead of "
                        "serving them again: run one format per call, then all of them to get the pairs")
    return p


def main(argv=None) -> dict:
    """Run the study for command-line ``argv``; returns the summary written to agreement.json."""
    args, formats, launch_args = parse_command_line(build_parser(), argv)
    if args.gen_tokens < 1 or args.prompt_rows < 1:
        raise ValueError(f"--gen-tokens and --prompt-rows must be >= 1, got {args.gen_tokens}, {args.prompt_rows}")
    owned = [a for a in launch_args if a.split("=")[0] in RUNNER_OWNED_FLAGS]
    if owned:
        raise ValueError(f"launch arguments {owned} are set by the tool; drop them")
    from transformers import AutoTokenizer

    from .retrieval import register_m3_config

    register_m3_config()  # the model folder's config type, before its tokenizer is loaded
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model, trust_remote_code=True)
    raw = needle.generate(tokenizer, args.lengths, args.samples, args.depths, args.keys, args.seed)
    docs = [prepare(tokenizer, doc, i) for i, doc in enumerate(raw)]
    too_long = [d["doc_id"] for d in docs if d["prompt_len"] - d["question_start"] > args.prompt_rows]
    if too_long:
        raise ValueError(f"--prompt-rows {args.prompt_rows} does not cover the question of docs {too_long[:5]}; "
                         "raise it")
    sparse_cfg = model_sparse_config(args.model)
    max_tokens = dense_max_tokens(args.lengths, args.gen_tokens)
    dense = {"sparse_config": sparse_cfg, "max_tokens": max_tokens, "via": "topk"}  # the recorder needs selections
    topk = {f: (dense_sparse_config(**dense) if is_dense(f) else sparse_cfg)["sparse_topk_blocks"]
            for f in formats}
    args.out.mkdir(parents=True, exist_ok=True)

    settings = {k: getattr(args, k) for k in ("model", "tokenizer", "lengths", "samples", "depths", "keys", "seed",
                                              "gen_tokens", "prompt_rows")}
    saved_dir = args.out / "formats"
    measures = Measures(sparse_cfg.get("sparse_local_block", LOCAL_BLOCKS), sparse_cfg.get("sparse_init_block", 0))
    selections, outputs, recorded = {}, {}, {}
    for fmt in formats:
        digest = _settings_digest({**settings, "topk": topk[fmt]}, docs)
        loaded = load_format(saved_dir, fmt, digest) if args.reuse else None
        if loaded is not None:
            print(f"[agreement] {fmt}: loaded from {saved_dir}", flush=True)
            sel, outputs[fmt], recorded[fmt] = loaded
        else:
            print(f"[agreement] {fmt}: {len(docs)} prompts", flush=True)
            sel, outputs[fmt] = {}, {}

            def on_doc(doc, s, out, fmt=fmt, sel=sel):
                sel[doc["doc_id"]], outputs[fmt][doc["doc_id"]] = s, out

            recorded[fmt] = run_format(fmt, args.model, docs, launch_args, args, dense, on_doc)
            save_format(saved_dir, fmt, digest, sel, outputs[fmt], recorded[fmt])
        for doc in docs:
            measures.add_format(doc, fmt, sel[doc["doc_id"]], topk[fmt])
        if not is_dense(fmt):  # the dense selections are not paired: let them go
            selections[fmt] = sel
    sparse = [f for f in formats if not is_dense(f)]
    for doc in docs:
        for a, b in itertools.combinations(sparse, 2):
            d = doc["doc_id"]
            measures.add_pair(doc, a, b, selections[a][d], selections[b][d], outputs[a][d], outputs[b][d])
    summary = measures.summary()
    summary["run"] = {"model": args.model, "formats": formats, "lengths": sorted(args.lengths), "samples": args.samples,
                      "depths": args.depths, "keys": args.keys, "gen_tokens": args.gen_tokens,
                      "prompt_rows": args.prompt_rows, "topk": topk, "recorded_rows": recorded,
                      "launch_args": launch_args}
    summary["docs"] = [
        {**{k: d[k] for k in ("doc_id", "length", "depth", "target", "prompt_len", "needle_blocks")},
         "answers": {f: tokenizer.decode(outputs[f][d["doc_id"]]) for f in formats},
         "correct": {f: needle.score(tokenizer.decode(outputs[f][d["doc_id"]]), d["target"]) for f in formats}}
        for d in docs
    ]
    (args.out / "agreement.json").write_text(json.dumps(summary, indent=1))
    (args.out / "agreement.md").write_text(markdown(summary))
    print(markdown(summary))
    print(f"wrote {args.out}/agreement.json and agreement.md")
    return summary


if __name__ == "__main__":
    from .run import exit_on_sigterm

    exit_on_sigterm()  # a timeout around the tool stops the server it started
    main()
