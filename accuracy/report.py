"""Tables and plots of a format comparison: per task and context length, accuracy of each format
and paired statistics of each format against the baseline (``build``'s ``baseline``, by default
the first format)."""

import dataclasses
from pathlib import Path

from .stats import compare_paired

ALL = "all"


def _pair(base: list[dict], other: list[dict], task: str, fmt: str):
    """Scores of ``base`` and ``other`` matched by ``doc_id``; ValueError unless both hold the same
    samples with the same targets (a paired statistic over a subset would not match the accuracies)."""
    by_id = {s["doc_id"]: s for s in other}
    only_base = sorted({s["doc_id"] for s in base} - set(by_id))
    only_other = sorted(set(by_id) - {s["doc_id"] for s in base})
    if only_base or only_other:
        raise ValueError(f"{task}: {fmt} lacks docs {only_base[:5]} and has extra docs {only_other[:5]} against "
                         "the baseline; the runs did not see the same data")
    a, b = [], []
    for s in base:
        t = by_id[s["doc_id"]]
        if t["target"] != s["target"]:
            raise ValueError(f"{task} doc {s['doc_id']}: target differs between formats ({s['target']!r} vs "
                             f"{t['target']!r} in {fmt}); the runs did not see the same data")
        a.append(s["score"])
        b.append(t["score"])
    return a, b


def build(per_format: dict, formats: list[str], n_boot: int = 10000, seed: int = 0,
          baseline: str | None = None) -> dict:
    """``per_format[fmt][task] -> sample rows`` to ``{"baseline", "formats", "tasks": {task: [group]}}``.

    ``baseline`` (default ``formats[0]``) must be one of ``formats``.

    A group is one context length (or ``"all"``): ``{"length", "n", "acc": {fmt: acc},
    "paired": {fmt: PairedResult fields}}`` with ``paired`` for every format but the baseline.
    """
    base = formats[0] if baseline is None else baseline
    if base not in formats:
        raise ValueError(f"baseline {base!r} must be one of formats {formats}")
    tasks = {}
    for task in per_format[base]:
        rows = per_format[base][task]
        lengths = sorted({r["length"] for r in rows if r["length"] is not None})
        groups = []
        for length in [*lengths, ALL] if lengths else [ALL]:
            pick = (lambda r: True) if length == ALL else (lambda r, n=length: r["length"] == n)
            base_rows = [r for r in rows if pick(r)]
            group = {"length": length, "n": len(base_rows), "acc": {}, "paired": {}}
            for fmt in formats:
                fmt_rows = [r for r in per_format[fmt].get(task, []) if pick(r)]
                group["acc"][fmt] = sum(r["score"] for r in fmt_rows) / len(fmt_rows) if fmt_rows else None
                if fmt != base:
                    a, b = _pair(base_rows, fmt_rows, task, fmt)
                    group["paired"][fmt] = dataclasses.asdict(compare_paired(a, b, n_boot, seed))
            groups.append(group)
        tasks[task] = groups
    return {"baseline": base, "formats": formats, "tasks": tasks}


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def markdown(summary: dict) -> str:
    """One table per task: a row per length, accuracy per format, then paired columns per candidate."""
    base, formats = summary["baseline"], summary["formats"]
    others = [f for f in formats if f != base]
    lines = []
    for task, groups in summary["tasks"].items():
        head = ["length", "n"] + [f"{f} acc %" for f in formats]
        for f in others:
            head += [f"{f} vs {base}: agree %", "only base/only cand", "McNemar p", "diff pts [95% CI]"]
        lines += [f"### {task}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for g in groups:
            cells = [str(g["length"]), str(g["n"])] + [_pct(g["acc"][f]) for f in formats]
            for f in others:
                p = g["paired"][f]
                cells += [_pct(p["agreement"]), f"{p['n10']}/{p['n01']}", f"{p['p_mcnemar']:.3g}",
                          f"{100 * p['diff']:+.1f} [{100 * p['ci_lo']:+.1f}, {100 * p['ci_hi']:+.1f}]"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(f"Baseline: {base}. agree: both right or both wrong. only base/only cand: samples right in one "
                 "format only (McNemar's discordant pairs; exact two-sided p). diff: candidate minus baseline "
                 "accuracy in points, paired-bootstrap 95% interval.")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path):
    """Accuracy against context length, one panel per task with lengths, one line per format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = {t: [g for g in gs if g["length"] != ALL] for t, gs in summary["tasks"].items()}
    tasks = {t: gs for t, gs in tasks.items() if gs}
    if not tasks:
        return None
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), squeeze=False)
    for ax, (task, groups) in zip(axes[0], tasks.items()):
        x = [g["length"] for g in groups]
        for fmt in summary["formats"]:
            y = [None if g["acc"][fmt] is None else 100 * g["acc"][fmt] for g in groups]
            ax.plot(x, y, marker="o", label=fmt)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{n // 1024}k" if n >= 1024 else str(n) for n in x])
        ax.set_ylim(-2, 102)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("accuracy %")
        ax.set_title(task)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
