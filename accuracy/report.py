"""Tables and plots of a format comparison: per task and context length, accuracy of each format
and paired statistics of each format against the baseline (``build``'s ``baseline``, by default
the first format).

``python -m accuracy.report results.json [--restate-binary]`` prints the tables of a saved
``results.json``; ``--restate-binary`` first recomputes every paired entry from its counts with the
score interval (for results of 0/1 scores written when the report still used the bootstrap).
"""

import argparse
import copy
import dataclasses
import json
from pathlib import Path

from .stats import compare_counts, compare_paired, is_binary

ALL = "all"
INTERVAL_LABELS = {"tango": "Tango score", "tango_rao_scott": "Tango score, Rao-Scott clustered",
                   "bootstrap": "paired bootstrap", "bootstrap_clustered": "bootstrap over contexts"}


def _matched(base: list[dict], other: list[dict], task: str, fmt: str) -> list[tuple[dict, dict]]:
    """Rows of ``base`` and ``other`` matched by ``doc_id``, in ``base``'s order; ValueError unless both hold
    the same samples with the same targets (a paired statistic over a subset would not match the accuracies)."""
    by_id = {s["doc_id"]: s for s in other}
    only_base = sorted({s["doc_id"] for s in base} - set(by_id))
    only_other = sorted(set(by_id) - {s["doc_id"] for s in base})
    if only_base or only_other:
        raise ValueError(f"{task}: {fmt} lacks docs {only_base[:5]} and has extra docs {only_other[:5]} against "
                         "the baseline; the runs did not see the same data")
    matched = []
    for s in base:
        t = by_id[s["doc_id"]]
        if t["target"] != s["target"]:
            raise ValueError(f"{task} doc {s['doc_id']}: target differs between formats ({s['target']!r} vs "
                             f"{t['target']!r} in {fmt}); the runs did not see the same data")
        matched.append((s, t))
    return matched


def _pair(base: list[dict], other: list[dict], task: str, fmt: str):
    """Scores of ``base`` and ``other`` matched by ``doc_id`` (``_matched``)."""
    matched = _matched(base, other, task, fmt)
    return [s["score"] for s, _ in matched], [t["score"] for _, t in matched]


def discordant_pairs(base_rows: list[dict], cand_rows: list[dict], task: str, fmt: str) -> list[dict]:
    """The pairs scored 0/1 one way and 1/0 the other (partial scores: any pair whose scores differ), in the
    baseline's order: ``{task, length, depth, doc_id, right ("base" or "cand"), target, base_response,
    cand_response}``. Where the two formats disagree, with the needle's depth: where a format loses answers.
    The rows are matched as ``_matched`` does (``fmt``, the candidate, names it in its errors)."""
    return [{"task": task, "length": b["length"], "depth": b.get("depth"), "doc_id": b["doc_id"],
             "right": "base" if b["score"] > c["score"] else "cand", "target": b["target"],
             "base_response": b.get("response"), "cand_response": c.get("response")}
            for b, c in _matched(base_rows, cand_rows, task, fmt) if c["score"] != b["score"]]


NOT_RECORDED = "not recorded"


def served_on_pairs(base_rows: list[dict], cand_rows: list[dict], task: str, fmt: str) -> dict:
    """Pairs counted by where their two answers were served (the rows' ``served_on``, ``NOT_RECORDED`` where a row
    lacks it): ``{"<base's> / <cand's>": [pairs, right in base only, right in cand only]}``. Discordance that
    gathers in the pairs mixing two machines is the machines', not the formats'. Matched as ``_matched`` does."""
    counts = {}
    for b, c in _matched(base_rows, cand_rows, task, fmt):
        key = f"{b.get('served_on', NOT_RECORDED)} / {c.get('served_on', NOT_RECORDED)}"
        n = counts.setdefault(key, [0, 0, 0])
        n[0] += 1
        if b["score"] != c["score"]:
            n[1 if b["score"] > c["score"] else 2] += 1
    return counts


def cluster(row: dict) -> str:
    """The cluster of a sample row: its context (``<length>/c<context>``) when it is one of several
    questions on one context, else the row alone (its ``doc_id``)."""
    if row.get("context") is not None:
        return f"{row['length']}/c{row['context']}"
    return f"doc {row['doc_id']}"


def build(per_format: dict, formats: list[str], n_boot: int = 10000, seed: int = 0,
          baseline: str | None = None, confidence: float = 0.95) -> dict:
    """``per_format[fmt][task] -> sample rows`` to ``{"baseline", "formats", "tasks": {task: [group]}}``.

    ``baseline`` (default ``formats[0]``) must be one of ``formats``.

    A group is one context length (or ``"all"``): ``{"length", "n", "acc": {fmt: acc},
    "paired": {fmt: PairedResult fields}}`` with ``paired`` for every format but the baseline;
    ``"discordant": {fmt: discordant_pairs(...)}`` lists every pair the two formats score differently. The
    interval of a (task, format) is Tango's score interval when both formats scored every sample of
    the task 0 or 1, else the paired bootstrap (``n_boot`` resamples, ``seed``), the same for all of
    the task's groups; ``ci_method`` says which. ``"served_on": {fmt: counts}`` (``served_on_pairs`` over every
    task) is there when any row says where it was served.
    """
    base = formats[0] if baseline is None else baseline
    if base not in formats:
        raise ValueError(f"baseline {base!r} must be one of formats {formats}")
    tasks, discordant = {}, {fmt: [] for fmt in formats if fmt != base}
    served_on = {fmt: {} for fmt in discordant}
    for task in per_format[base]:
        rows = per_format[base][task]
        for fmt in discordant:
            discordant[fmt] += discordant_pairs(rows, per_format[fmt].get(task, []), task, fmt)
            for key, n in served_on_pairs(rows, per_format[fmt].get(task, []), task, fmt).items():
                total = served_on[fmt].setdefault(key, [0, 0, 0])
                total[:] = [a + b for a, b in zip(total, n)]
        lengths = sorted({r["length"] for r in rows if r["length"] is not None})
        groups = []
        interval = {fmt: "tango" if is_binary([r["score"] for r in rows],
                                              [r["score"] for r in per_format[fmt].get(task, [])]) else "bootstrap"
                    for fmt in formats if fmt != base}
        for length in [*lengths, ALL] if lengths else [ALL]:
            pick = (lambda r: True) if length == ALL else (lambda r, n=length: r["length"] == n)
            base_rows = [r for r in rows if pick(r)]
            group = {"length": length, "n": len(base_rows), "acc": {}, "paired": {}}
            for fmt in formats:
                fmt_rows = [r for r in per_format[fmt].get(task, []) if pick(r)]
                group["acc"][fmt] = sum(r["score"] for r in fmt_rows) / len(fmt_rows) if fmt_rows else None
                if fmt != base:
                    a, b = _pair(base_rows, fmt_rows, task, fmt)
                    result = compare_paired(a, b, n_boot, seed, confidence, interval=interval[fmt],
                                            clusters=[cluster(r) for r in base_rows])
                    group["paired"][fmt] = dataclasses.asdict(result)
            groups.append(group)
        tasks[task] = groups
    summary = {"baseline": base, "formats": formats, "tasks": tasks, "discordant": discordant}
    recorded = any("served_on" in r for f in formats for task_rows in per_format[f].values() for r in task_rows)
    return {**summary, "served_on": served_on} if recorded else summary


def _shared(per_format: dict, base: str, fmt: str, **kw) -> dict:
    """``build`` of ``fmt`` against ``base`` on the doc ids both have, per task of ``base`` (``_pair`` then
    checks their targets)."""
    both = {task: {r["doc_id"] for r in rows} & {r["doc_id"] for r in per_format[fmt].get(task, [])}
            for task, rows in per_format[base].items()}
    pair = {f: {task: [r for r in per_format[f].get(task, []) if r["doc_id"] in both[task]] for task in both}
            for f in (base, fmt)}
    return build(pair, [base, fmt], baseline=base, **kw)


def build_pairs(per_format: dict, formats: list[str], n_boot: int = 10000, seed: int = 0,
                baseline: str | None = None, confidence: float = 0.95, replicas: dict | None = None) -> dict:
    """Every candidate against the baseline on the samples both scored (a resumable run's formats can
    hold different samples): ``{"baseline", "formats", "pairs": {candidate: build(...) of the two}}``.

    ``replicas`` maps a replica (``mxfp4@2``) to the variant it serves again (``mxfp4``), both in ``formats``:
    each is also built against that variant, in ``"replicas": {replica: build(...)}``, so that what serving
    again alone changes is counted for a format other than the baseline too."""
    base = formats[0] if baseline is None else baseline
    if base not in formats:
        raise ValueError(f"baseline {base!r} must be one of formats {formats}")
    kw = {"n_boot": n_boot, "seed": seed, "confidence": confidence}
    pairs = {fmt: _shared(per_format, base, fmt, **kw) for fmt in formats if fmt != base}
    summary = {"baseline": base, "formats": formats, "pairs": pairs}
    if replicas:
        summary["replicas"] = build_replicas({f: per_format[f] for f in formats}, replicas, **kw)
    return summary


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def _interval_kinds(groups, fmt) -> set[str]:
    """The interval kinds of a task's column (results written before ``ci_method`` hold bootstrap ones)."""
    return {g["paired"][fmt].get("ci_method", "bootstrap") for g in groups}


_INTERVAL_NOTES = {
    "tango": "Tango score: Tango's (1998) asymptotic score interval for paired 0/1 scores; near its nominal coverage "
             "down to n = 5 and of non-zero width with no discordant pair (then ±z²/(n + z²)). Newcombe's "
             "method 10 interval is in results.json beside it.",
    "tango_rao_scott": "Tango score, Rao-Scott clustered: several questions share a context, so their pairs are "
                       "correlated; Tango's interval on the counts divided by the design effect (between-context "
                       "over independent-pairs variance, 1 to the questions per context; the latter when fewer "
                       "than 10 pairs are discordant). Its McNemar p is the exact sign-flip test on the contexts' "
                       "totals of candidate minus baseline (McNemar's exact test when no context holds two "
                       "discordant pairs). results.json holds the contexts and the design effect of each cell.",
    "bootstrap": "paired bootstrap: percentile interval over resampled pairs, for scores other than 0/1; it has zero "
                 "width when every pair has the same difference.",
    "bootstrap_clustered": "bootstrap over contexts: the paired bootstrap resampling whole contexts (several "
                           "questions share one), for scores other than 0/1; zero width when every pair has the "
                           "same difference.",
}


def markdown(summary: dict) -> str:
    """``markdown_pairs`` for a ``build_pairs`` summary, else ``markdown_table`` and the tables of its
    ``"replicas"`` (``build_replicas``), if any."""
    if "pairs" in summary:
        return markdown_pairs(summary) + markdown_servers(summary)
    return "\n".join([markdown_table(summary)] + _markdown_replicas(summary)) + markdown_servers(summary)


def markdown_servers(summary: dict) -> str:
    """The table of what each format's server said it serves (``summary["servers"]``, from
    ``accuracy.run.server_identity``); empty when the summary has none (a report rebuilt from older state)."""
    servers = {f: s for f, s in (summary.get("servers") or {}).items() if s}
    if not servers:
        return ""
    lines = ["", "## Servers (what each said it serves, checked against its label before any prompt)", "",
             "| format | URL | model | index-K format | scale rule | sign seed | sparse layers | top-k blocks | "
             "SGLang | sglang-m3 |", "|" + "---|" * 10]
    for fmt, s in servers.items():
        k = s.get("m3_index_k") or {}
        cells = [fmt, s.get("url"), s.get("model_path"), k.get("format"), k.get("scale_rule"), k.get("sign_seed"),
                 k.get("sparse_layers"), k.get("sparse_topk_blocks"), s.get("sglang_version"),
                 k.get("sglang_m3_version")]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def build_replicas(per_format: dict, replicas: dict, **kw) -> dict:
    """``{replica: build(...)}`` of each replica (``mxfp4@2``) against the variant it serves again
    (``mxfp4``), on the doc ids both have; ``replicas`` maps one to the other, both in ``per_format``.
    ``kw`` as ``build``'s (``n_boot``, ``seed``, ``confidence``)."""
    for rep, of in replicas.items():
        if rep not in per_format or of not in per_format or rep == of:
            raise ValueError(f"replicas: {rep!r} -> {of!r} must name two different variants of the formats "
                             f"{list(per_format)}")
    return {rep: _shared(per_format, of, rep, **kw) for rep, of in replicas.items()}


def _markdown_replicas(summary: dict) -> list[str]:
    return [f"## {fmt} vs {pair['baseline']}, served again (the samples both have)\n\n"
            + markdown_table(pair, notes=False) for fmt, pair in (summary.get("replicas") or {}).items()]


def _markdown_overview(summary: dict) -> str:
    """One row per candidate of a ``build_pairs`` summary: its pairs with the baseline, discordant
    pairs each way and, per task, the difference pooled over lengths with its interval and n; then
    one row per replica against the variant it serves again, if any."""
    base = summary["baseline"]
    head = [f"## Every format against {base}, pooled over lengths", "",
            f"Format minus {base} in points, with the interval of each format's tables below.", ""]
    text = _overview_rows(summary["pairs"], head, f"{base} right / format right")
    if summary.get("replicas"):
        head = ["## Each replica against the variant it serves again, pooled over lengths", "",
                "Replica minus that variant in points: what serving again alone changes.", ""]
        text += "\n" + _overview_rows(summary["replicas"], head, "variant right / replica right", first="replica")
    return text


def _overview_rows(pairs: dict, head: list[str], discordant: str, first: str = "format") -> str:
    tasks = list(dict.fromkeys(t for pair in pairs.values() for t in pair["tasks"]))
    fmt0, pair0 = next(iter(pairs.items()))
    level = 100 * next(iter(pair0["tasks"].values()))[0]["paired"][fmt0].get("confidence", 0.95)
    lines = head + [f"| {first} | pairs | discordant ({discordant}) | "
                    + " | ".join(f"{t}: pts [{level:g}% CI] (n)" for t in tasks) + " |",
                    "|---|---|---|" + "---|" * len(tasks)]
    for fmt, pair in pairs.items():
        pooled = {t: next(g for g in groups if g["length"] == ALL)["paired"][fmt]
                  for t, groups in pair["tasks"].items()}
        cells = [fmt, str(sum(p["n"] for p in pooled.values())),
                 f"{sum(p['n10'] for p in pooled.values())} / {sum(p['n01'] for p in pooled.values())}"]
        for t in tasks:
            p = pooled.get(t)
            cells.append("-" if p is None else f"{100 * p['diff']:+.1f} [{100 * p['ci_lo']:+.1f}, "
                                               f"{100 * p['ci_hi']:+.1f}] ({p['n']})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_pairs(summary: dict) -> str:
    """An overview (``_markdown_overview``), then per candidate the tables of ``markdown_table`` on the
    samples it shares with the baseline, the samples each format has per task and length against its
    target (``coverage``) if given, and the notes on the columns once."""
    base = summary["baseline"]
    parts = [_markdown_overview(summary)] if summary["pairs"] else []
    used = set()
    for fmt, pair in summary["pairs"].items():
        parts.append(f"## {fmt} vs {base} (the samples both have)\n\n" + markdown_table(pair, notes=False))
        used |= _used_kinds(pair)
    parts += _markdown_replicas(summary)
    used |= {kind for pair in (summary.get("replicas") or {}).values() for kind in _used_kinds(pair)}
    cov = summary.get("coverage")
    if cov:
        cells = [(t, L) for t, by_len in next(iter(cov.values())).items() for L in by_len]
        lines = ["## Samples scored per task and length (done / target)", "",
                 "| task | length | " + " | ".join(cov) + " |", "|---|---|" + "---|" * len(cov)]
        for t, L in cells:
            lines.append(f"| {t} | {L} | " + " | ".join(f"{cov[f][t][L][0]}/{cov[f][t][L][1]}" for f in cov) + " |")
        parts.append("\n".join(lines) + "\n")
    for fmt, error in (summary.get("errors") or {}).items():
        parts.append(f"**{fmt} failed in this run**: {error}\n")
    if summary["pairs"]:
        parts.append(_notes(base, used))
    return "\n".join(parts)


def _used_kinds(summary: dict) -> set[str]:
    """The interval kinds a ``build`` summary's tables use."""
    others = [f for f in summary["formats"] if f != summary["baseline"]]
    return {k for groups in summary["tasks"].values() for f in others for k in _interval_kinds(groups, f)}


def _notes(base: str, used: set[str]) -> str:
    """What the tables' columns mean, and each interval kind in ``used``."""
    notes = [f"Baseline: {base}. agree: both right or both wrong. only base/only cand: samples right in one format "
             "only (McNemar's discordant pairs; exact two-sided p). Difference: candidate minus baseline accuracy "
             "in points with its interval; ±: half the interval's width, the resolution of this run: differences "
             "much smaller than it are not told apart from none, whatever the point estimate."]
    return "\n\n".join(notes + [_INTERVAL_NOTES[k] for k in sorted(used)]) + "\n"


def markdown_table(summary: dict, notes: bool = True) -> str:
    """One table per task: a row per length, accuracy per format, then paired columns per candidate;
    then the discordant pairs and (``notes``) what the columns mean.

    Each candidate's difference column names its interval (Tango score or paired bootstrap); the
    "±" column is half that interval's width in points.
    """
    base, formats = summary["baseline"], summary["formats"]
    others = [f for f in formats if f != base]
    lines = []
    for task, groups in summary["tasks"].items():
        head = ["length", "n"] + [f"{f} acc %" for f in formats]
        for f in others:
            kinds = _interval_kinds(groups, f)
            level = 100 * groups[0]["paired"][f].get("confidence", 0.95)
            label = " / ".join(INTERVAL_LABELS[k] for k in sorted(kinds))
            head += [f"{f} vs {base}: agree %", "only base/only cand", "McNemar p",
                     f"{f} - {base} pts [{label} {level:g}% CI]", "± pts"]
        lines += [f"### {task}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for g in groups:
            cells = [str(g["length"]), str(g["n"])] + [_pct(g["acc"][f]) for f in formats]
            for f in others:
                p = g["paired"][f]
                cells += [_pct(p["agreement"]), f"{p['n10']}/{p['n01']}", f"{p['p_mcnemar']:.3g}",
                          f"{100 * p['diff']:+.1f} [{100 * p['ci_lo']:+.1f}, {100 * p['ci_hi']:+.1f}]",
                          f"{50 * (p['ci_hi'] - p['ci_lo']):.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    for f in others:
        lines += _markdown_discordant(summary.get("discordant", {}).get(f), base, f)
        lines += _markdown_served_on(summary.get("served_on", {}).get(f), base, f)
    text = "\n".join(lines) + "\n"
    return text + _notes(base, _used_kinds(summary)) if notes and others else text


MAX_LISTED = 40  # discordant pairs listed one by one; past that, the counts per task, length and depth


def _markdown_discordant(pairs: list[dict] | None, base: str, cand: str) -> list[str]:
    """Where ``cand`` and ``base`` disagree: each discordant pair (task, length, needle depth, who was right,
    the two answers), or past ``MAX_LISTED`` their counts per task and length and per depth decile."""
    if pairs is None:  # results written before the list existed
        return []
    head = f"### Discordant pairs, {cand} vs {base}: {len(pairs)}"
    if not pairs:
        return [head + " (no prompt answered differently)", ""]

    def short(text):
        text = (text or "").strip().replace("\n", " ").replace("|", "/")
        return text if len(text) <= 32 else text[:31] + "…"

    if len(pairs) <= MAX_LISTED:
        lines = [head, "", "| task | length | depth % | right | target | " + f"{base} answer | {cand} answer |",
                 "|---|---|---|---|---|---|---|"]
        for d in pairs:
            depth = "-" if d["depth"] is None else f"{d['depth']:.0f}"
            right = base if d["right"] == "base" else cand
            lines.append(f"| {d['task']} | {d['length']} | {depth} | {right} | {d['target']} | "
                         f"{short(d['base_response'])} | {short(d['cand_response'])} |")
        return lines + [""]
    cells, deciles = {}, {}
    for d in pairs:
        k = 0 if d["right"] == "base" else 1
        cells.setdefault((d["task"], d["length"]), [0, 0])[k] += 1
        if d["depth"] is not None:
            deciles.setdefault(min(9, int(d["depth"] // 10)), [0, 0])[k] += 1
    lines = [head + f" (right in {base} / right in {cand})", "", "| task | length | pairs |", "|---|---|---|"]
    lines += [f"| {t} | {L} | {a}/{b} |" for (t, L), (a, b) in sorted(cells.items())]
    lines += ["", "| needle depth % | pairs |", "|---|---|"]
    lines += [f"| {10 * i}-{10 * i + 10} | {a}/{b} |" for i, (a, b) in sorted(deciles.items())]
    return lines + [""]


def _markdown_served_on(counts: dict | None, base: str, cand: str) -> list[str]:
    """``served_on_pairs``'s counts as a table, most pairs first (nothing for results without them)."""
    if not counts:
        return []
    lines = [f"### Pairs by where they were served, {cand} vs {base}", "",
             f"| served on ({base} / {cand}) | pairs | discordant (right in {base} / right in {cand}) | discordant % |",
             "|---|---|---|---|"]
    for key, (n, a, b) in sorted(counts.items(), key=lambda kv: (-kv[1][0], kv[0])):
        lines.append(f"| {key} | {n} | {a}/{b} | {100 * (a + b) / n:.2f} |")
    return lines + [""]


def restate_binary(summary: dict, confidence: float = 0.95) -> dict:
    """A copy of a ``build`` or ``build_pairs`` summary (a results.json) with every paired entry, its
    replicas' too, recomputed by ``compare_counts`` from its stored counts (``n``, ``acc_a``, ``acc_b``,
    ``n10``, ``n01``).

    For results of 0/1 scores; ValueError when the counts cannot come from 0/1 scores (``n * acc``
    not a whole number, or inconsistent with the discordant counts).
    """
    out = copy.deepcopy(summary)
    for key in ("pairs", "replicas"):  # a build_pairs summary, or a build summary's replicas
        if summary.get(key):
            out[key] = {f: restate_binary(p, confidence) for f, p in summary[key].items()}
    for task, groups in out.get("tasks", {}).items():
        for g in groups:
            for fmt, p in g["paired"].items():
                if p.get("ci_method") == "tango_rao_scott":  # clustered: its counts alone do not restate it
                    continue
                n, n10, n01 = p["n"], p["n10"], p["n01"]
                right_a, right_b = n * p["acc_a"], n * p["acc_b"]
                n11 = round(right_a) - n10
                if (abs(right_a - round(right_a)) > 1e-6 or abs(right_b - round(right_b)) > 1e-6
                        or round(right_b) != n11 + n01 or n11 < 0 or n11 + n10 + n01 > n):
                    raise ValueError(f"{task} length {g['length']} {fmt}: counts n={n}, acc_a={p['acc_a']}, "
                                     f"acc_b={p['acc_b']}, n10={n10}, n01={n01} do not come from 0/1 scores; "
                                     "restate only results of 0/1 scores")
                p.update(dataclasses.asdict(compare_counts(n11, n10, n01, n - n11 - n10 - n01, confidence)))
    return out


def plot(summary: dict, path: Path):
    """Accuracy against context length, one panel per task with lengths, one line per format. For a
    ``build_pairs`` summary: in each task's panel the baseline and the first candidate with samples of that
    task, on the samples they share; below it, each candidate's paired difference from the baseline per length,
    in points with its interval as error bars: a second row with the task's most-paired candidate alone (its axis
    fitted to its intervals) and, when there are several candidates, a third with all of them (the small control
    arms' wide intervals would flatten the second row's). A format keeps one colour on every row. Returns
    ``path``, or None (and removes a stale ``path``) when no task has a length to plot."""
    if "pairs" in summary:
        top = {}  # task -> the first candidate pair's summary that has lengths for it
        for pair in summary["pairs"].values():
            for task, groups in pair["tasks"].items():
                if task not in top and any(g["length"] != ALL for g in groups):
                    top[task] = pair
        out = _plot(top, path, summary)
    else:
        out = _plot({t: summary for t in summary["tasks"]}, path, None)
    if out is None:
        Path(path).unlink(missing_ok=True)
    return out


def _plot(top: dict, path: Path, pairs: dict | None):
    """``top``: task -> the summary whose formats' accuracy its upper panel draws."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = {t: [g for g in summary["tasks"][t] if g["length"] != ALL] for t, summary in top.items()}
    tasks = {t: gs for t, gs in tasks.items() if gs}
    if not tasks:
        return None
    if pairs is None:
        rows, cands, color = 1, [], {}
    else:  # the candidates with samples of some plotted task, each in one colour on every row
        per_length = {f: {t: [g for g in pair["tasks"].get(t, []) if g["length"] != ALL] for t in tasks}
                      for f, pair in pairs["pairs"].items()}  # candidate -> task -> its groups with a length
        cands = [f for f, by_task in per_length.items() if any(by_task.values())]
        rows = 2 if len(cands) == 1 else 3
        color = {pairs["baseline"]: "C0"} | {f: f"C{i + 1}" for i, f in enumerate(cands)}
    fig, axes = plt.subplots(rows, len(tasks), figsize=(5 * len(tasks), 3.8 * rows), squeeze=False)

    def length_axis(ax, x):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{n // 1024}k" if n >= 1024 else str(n) for n in x])
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3)

    for ax, (task, groups) in zip(axes[0], tasks.items()):
        x = [g["length"] for g in groups]
        for fmt in top[task]["formats"]:
            y = [None if g["acc"][fmt] is None else 100 * g["acc"][fmt] for g in groups]
            ax.plot(x, y, marker="o", label=fmt, color=color.get(fmt))
        length_axis(ax, x)
        ax.set_ylim(-2, 102)
        ax.set_ylabel("accuracy %")
        ax.set_title(task)
        ax.legend()
    if pairs is not None:
        base = pairs["baseline"]
        label = {}  # one label a candidate over every panel, naming the range of its pairs a point
        for fmt in cands:
            ns = [g["n"] for gs in per_length[fmt].values() for g in gs]
            span = f"{min(ns)}" if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}"
            label[fmt] = f"{fmt} ({span} pairs a point)"

        def differences(ax, task, fmts):
            levels = set()
            for i, fmt in enumerate(fmts):
                groups = per_length[fmt][task]
                if not groups:
                    continue
                shift = 2 ** (0.06 * (i - (len(fmts) - 1) / 2))  # side by side on the log axis
                x = [g["length"] * shift for g in groups]
                d = [100 * g["paired"][fmt]["diff"] for g in groups]
                err = [[100 * (g["paired"][fmt]["diff"] - g["paired"][fmt]["ci_lo"]) for g in groups],
                       [100 * (g["paired"][fmt]["ci_hi"] - g["paired"][fmt]["diff"]) for g in groups]]
                ax.errorbar(x, d, yerr=err, marker="o", capsize=3, linestyle="none", label=label[fmt],
                            color=color[fmt])
                levels |= {round(100 * g["paired"][fmt].get("confidence", 0.95), 6) for g in groups}
            ax.axhline(0, color="black", linewidth=0.8)
            length_axis(ax, [g["length"] for g in tasks[task]])
            ax.set_ylabel(f"format - {base}, points ({'/'.join(f'{v:g}%' for v in sorted(levels))} CI)")

        for col, task in enumerate(tasks):
            task_pairs = {f: sum(g["n"] for g in per_length[f][task]) for f in cands}
            differences(axes[1][col], task, [max(cands, key=task_pairs.get)])  # the first of the largest on a tie
            if rows == 3:
                differences(axes[2][col], task, cands)
        legend = {}  # label -> handle, over every panel (a task a candidate lacks has none)
        for ax in axes[1:].flat:
            legend.update({name: h for h, name in zip(*ax.get_legend_handles_labels())})
        fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=max(1, len(legend)), frameon=False)
        fig.tight_layout(rect=(0, 0.05, 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    """``python -m accuracy.report results.json [--restate-binary] [--out report.md]``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a results.json written by m3-accuracy")
    p.add_argument("--restate-binary", action="store_true",
                   help="recompute the paired statistics from the stored counts with the score interval "
                        "(the task scores must be 0/1)")
    p.add_argument("--out", type=Path, default=None, help="write the markdown here instead of printing it")
    args = p.parse_args(argv)
    summary = json.loads(args.results.read_text())
    text = markdown(restate_binary(summary) if args.restate_binary else summary)
    if args.out is None:
        print(text, end="")
    else:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
