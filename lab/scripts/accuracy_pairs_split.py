"""Where the discordant pairs of a served comparison fall: by prompt index, by the cards that served the two
answers, and over ranges of prompt index. The checks behind docs/accuracy.md's "later pairs" paragraph.

    python lab/scripts/accuracy_pairs_split.py [SAMPLES] [--base fp8] [--cand mxfp4] [--split 512] [--width 128]

SAMPLES is a per-sample dump (default lab/data/accuracy_h200_2026-12-02_q4_samples.jsonl: one JSON row a
sample with ``format``, ``task``, ``doc_id`` = ``"<length>/<index>"``, ``score`` and ``served_on``). Pairs are the
rows of ``--base`` and ``--cand`` with one (task, doc_id), 0/1 scores; a prompt's index is the number after the
slash (per task and length; with 4 questions a context, questions count one each). Prints, for every pair and
then per task: pairs below ``--split`` against the rest (discordant pairs, base right / cand right, Fisher's exact
two-sided p on discordant against concordant); pairs by the cards on both sides, in all and below the split;
discordance per range of ``--width`` indices with the chi-square test of one rate (scipy's ``chi2_contingency``).
The split and the ranges are the reader's choice: a split chosen after seeing the data has no nominal p-value.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from scipy.stats import chi2_contingency, fisher_exact

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from accuracy.report import NOT_RECORDED  # noqa: E402
from accuracy.stats import discordant  # noqa: E402

DEFAULT = REPO / "lab" / "data" / "accuracy_h200_2026-12-02_q4_samples.jsonl"


def load_pairs(path: Path, base: str, cand: str) -> list[dict]:
    """``{task, length, index, base, cand, base_on, cand_on}`` per (task, doc_id) both formats answered, in
    (task, length, index) order, a card ``NOT_RECORDED`` where a row lacks ``served_on``; ValueError on a row
    whose score is not 0 or 1 or whose doc_id is not ``<length>/<index>``, a format that answered one doc
    twice, or a pair whose two rows name different targets (the formats did not see the same data)."""
    rows: dict[str, dict] = {base: {}, cand: {}}
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if row["format"] not in rows:
                continue
            if row["score"] not in (0, 1):
                raise ValueError(f"{path}:{line_no}: score {row['score']!r} is not 0 or 1")
            key = (row["task"], row["doc_id"])
            if key in rows[row["format"]]:
                raise ValueError(f"{path}:{line_no}: {row['format']} answered {key} twice")
            rows[row["format"]][key] = row
    pairs = []
    for key in rows[base].keys() & rows[cand].keys():
        b, c = rows[base][key], rows[cand][key]
        length, sep, index = key[1].partition("/")
        if not (sep and length.isdigit() and index.isdigit()):
            raise ValueError(f"doc_id {key[1]!r} of {key[0]} is not <length>/<index>")
        if b.get("target") != c.get("target"):
            raise ValueError(f"{key[0]} doc {key[1]}: target {b.get('target')!r} in {base} but "
                             f"{c.get('target')!r} in {cand}; the formats did not see the same data")
        pairs.append({"task": key[0], "length": int(length), "index": int(index), "base": int(b["score"]),
                      "cand": int(c["score"]), "base_on": b.get("served_on", NOT_RECORDED),
                      "cand_on": c.get("served_on", NOT_RECORDED)})
    return sorted(pairs, key=lambda p: (p["task"], p["length"], p["index"]))


def counts(pairs: list[dict]) -> tuple[int, int, int]:
    """(pairs, base right only, cand right only), the latter two by ``accuracy.stats.discordant``."""
    return (len(pairs), *discordant([p["base"] for p in pairs], [p["cand"] for p in pairs]))


def split_test(pairs: list[dict], split: int) -> dict:
    """Pairs below index ``split`` against the rest: each side's counts and Fisher's exact two-sided p of
    discordant against concordant (nan when a side is empty)."""
    low = counts([p for p in pairs if p["index"] < split])
    high = counts([p for p in pairs if p["index"] >= split])
    table = [[low[1] + low[2], low[0] - low[1] - low[2]], [high[1] + high[2], high[0] - high[1] - high[2]]]
    p = fisher_exact(table)[1] if low[0] and high[0] else float("nan")
    return {"low": low, "high": high, "p": float(p)}


def by_cards(pairs: list[dict]) -> dict[str, tuple[int, int, int]]:
    """Counts per ``"<base's card> / <cand's card>"``."""
    groups = defaultdict(list)
    for p in pairs:
        groups[f"{p['base_on']} / {p['cand_on']}"].append(p)
    return {k: counts(v) for k, v in sorted(groups.items())}


def by_range(pairs: list[dict], width: int) -> tuple[list[tuple[int, int, tuple[int, int, int]]], float]:
    """Counts per range of ``width`` indices, ``[(first, last, counts)]``, and the chi-square p of one
    discordance rate across them (nan with fewer than two ranges or no discordant or no concordant pair)."""
    groups = defaultdict(list)
    for p in pairs:
        groups[p["index"] // width].append(p)
    ranges = []
    for k in sorted(groups):
        indices = [p["index"] for p in groups[k]]
        ranges.append((k * width, max(indices), counts(groups[k])))
    table = [[c[1] + c[2], c[0] - c[1] - c[2]] for _, _, c in ranges]
    if len(table) < 2 or not all(sum(col) for col in zip(*table)):
        return ranges, float("nan")
    return ranges, float(chi2_contingency(table, correction=False)[1])


def _rate(c: tuple[int, int, int]) -> str:
    d = c[1] + c[2]
    return f"{d} of {c[0]} ({100 * d / c[0]:.2f}%; {c[1]} / {c[2]})" if c[0] else "no pairs"


def report(pairs: list[dict], base: str, cand: str, split: int, width: int) -> str:
    """The printed text: every pair, then each task."""
    lines = [f"discordant pairs of {cand} against {base} ({base} right / {cand} right)"]
    groups = [("all tasks", pairs)] + [(t, [p for p in pairs if p["task"] == t])
                                       for t in sorted({p["task"] for p in pairs})]
    for name, group in groups:
        s = split_test(group, split)
        lines += [f"\n## {name}: {_rate(counts(group))}",
                  f"index < {split}: {_rate(s['low'])}",
                  f"index >= {split}: {_rate(s['high'])}",
                  f"Fisher exact, two-sided: p = {s['p']:.3g}"]
        lines += [f"cards {k}: {_rate(c)}" for k, c in by_cards(group).items()]
        lines += [f"index < {split}, cards {k}: {_rate(c)}"
                  for k, c in by_cards([p for p in group if p["index"] < split]).items()]
        ranges, p = by_range(group, width)
        lines += [f"indices {a}-{b}: {_rate(c)}" for a, b, c in ranges]
        lines.append(f"chi-square, one rate over {len(ranges)} ranges: p = {p:.3g}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("samples", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--base", default="fp8")
    ap.add_argument("--cand", default="mxfp4")
    ap.add_argument("--split", type=int, default=512, help="first index of the later pairs")
    ap.add_argument("--width", type=int, default=128, help="indices a range")
    args = ap.parse_args(argv)
    if args.split < 1 or args.width < 1:
        ap.error(f"--split ({args.split}) and --width ({args.width}) must be at least 1")
    pairs = load_pairs(args.samples, args.base, args.cand)
    if not pairs:
        sys.exit(f"{args.samples}: no (task, doc_id) answered by both {args.base} and {args.cand}")
    print(report(pairs, args.base, args.cand, args.split, args.width))


if __name__ == "__main__":
    main()
