"""Report tables and the plot from constructed per-sample results."""

import copy
import dataclasses
import json
import random

import pytest

from accuracy import report
from accuracy.stats import compare_clustered, tango_interval


def _rows(scores_by_length, targets="t"):
    rows, i = [], 0
    for length, scores in scores_by_length.items():
        for s in scores:
            rows.append({"doc_id": i, "length": length, "depth": 0.0, "target": f"{targets}{i}", "response": "",
                         "score": s})
            i += 1
    return rows


def test_build_pairs_by_length_and_overall(tmp_path):
    per_format = {
        "fp8": {"m3_niah_single": _rows({1024: [1, 1, 1, 0], 2048: [1, 0, 0, 0]})},
        "mxfp4": {"m3_niah_single": _rows({1024: [1, 1, 0, 0], 2048: [1, 0, 0, 1]})},
    }
    summary = report.build(per_format, ["fp8", "mxfp4"], n_boot=200)
    groups = summary["tasks"]["m3_niah_single"]
    assert [g["length"] for g in groups] == [1024, 2048, report.ALL]
    assert groups[0]["acc"] == {"fp8": 0.75, "mxfp4": 0.5}
    p = groups[2]["paired"]["mxfp4"]
    assert (p["n"], p["n10"], p["n01"], p["diff"]) == (8, 1, 1, 0.0)
    assert p["ci_method"] == "tango" and (p["ci_lo"], p["ci_hi"]) == tango_interval(1, 1, 8)
    text = report.markdown(summary)
    assert "### m3_niah_single" in text and "| 1024 | 4 | 75.0 | 50.0 |" in text
    assert "mxfp4 - fp8 pts [Tango score 95% CI] | ± pts |" in text and "Tango score: Tango's (1998)" in text
    assert "paired bootstrap:" not in text
    assert report.plot(summary, tmp_path / "a.png").stat().st_size > 1000


def test_lengths_are_listed_shortest_first():
    """Groups (and table rows) run by length whatever order the rows came in, then the pooled row."""
    rows = _rows({4096: [1, 0], 1024: [1, 1], 2048: [0, 1]})
    summary = report.build({"fp8": {"t": rows}, "mxfp4": {"t": copy.deepcopy(rows)}}, ["fp8", "mxfp4"])
    assert [g["length"] for g in summary["tasks"]["t"]] == [1024, 2048, 4096, report.ALL]
    text = report.markdown(summary)
    rows = ["| 1024 | 2 |", "| 2048 | 2 |", "| 4096 | 2 |", "| all | 6 |"]
    assert [text.index(r) for r in rows] == sorted(text.index(r) for r in rows)


def test_table_row_carries_each_paired_column():
    """One row in full: accuracies, agreement, discordant pairs as only base / only cand, McNemar p to three
    digits, the signed difference with its interval and half its width, in points."""
    base = _rows({1024: [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]})
    cand = _rows({1024: [0, 0, 0, 0, 0, 0, 1, 1, 0, 0]})  # 6 right in fp8 only, 1 in mxfp4 only
    text = report.markdown(report.build({"fp8": {"t": base}, "mxfp4": {"t": cand}}, ["fp8", "mxfp4"]))
    lo, hi = tango_interval(6, 1, 10)
    p = 2 * (1 + 7) / 2**7  # 0.125
    assert (f"| 1024 | 10 | 70.0 | 20.0 | 30.0 | 6/1 | {p} | -50.0 [{100 * lo:+.1f}, {100 * hi:+.1f}] | "
            f"{50 * (hi - lo):.1f} |") in text
    assert f"{100 * lo:+.1f}" == "-79.3" and f"{100 * hi:+.1f}" == "+2.0"


def test_tables_name_the_confidence_they_were_built_at():
    """A 90% build says 90% in each candidate's column and in the pairs overview."""
    base, cand = {"t": _rows({1024: [1, 1, 0, 0]})}, {"t": _rows({1024: [1, 0, 1, 0]})}
    summary = report.build({"fp8": base, "mxfp4": cand}, ["fp8", "mxfp4"], confidence=0.9)
    assert summary["tasks"]["t"][0]["paired"]["mxfp4"]["ci_hi"] == tango_interval(1, 1, 4, 0.9)[1]
    text = report.markdown(summary)
    assert "mxfp4 - fp8 pts [Tango score 90% CI]" in text and "95%" not in text
    pairs = report.markdown(report.build_pairs({"fp8": base, "mxfp4": cand}, ["fp8", "mxfp4"], confidence=0.9))
    assert "| t: pts [90% CI] (n) |" in pairs and "[Tango score 90% CI]" in pairs and "95%" not in pairs


def test_plot_names_the_confidence_it_was_built_at(tmp_path, monkeypatch):
    import matplotlib.axes

    labels = []
    set_ylabel = matplotlib.axes.Axes.set_ylabel
    monkeypatch.setattr(matplotlib.axes.Axes, "set_ylabel",
                        lambda self, text, **kw: labels.append(text) or set_ylabel(self, text, **kw))
    base, cand = {"t": _rows({1024: [1, 1, 0, 0]})}, {"t": _rows({1024: [1, 0, 1, 0]})}
    report.plot(report.build_pairs({"fp8": base, "mxfp4": cand}, ["fp8", "mxfp4"], confidence=0.9), tmp_path / "a.png")
    assert labels == ["accuracy %", "format - fp8, points (90% CI)"]


def test_no_discordant_pair_is_not_a_zero_width_interval():
    # What scripts/main.sh's short comparison prints for 4 prompts both formats answer: not +0.0 [+0.0, +0.0].
    rows = _rows({4096: [1, 1, 1, 1]})
    text = report.markdown(report.build({"fp8": {"t": rows}, "mxfp4": {"t": rows}}, ["fp8", "mxfp4"]))
    half = 100 * tango_interval(0, 0, 4)[1]  # 100 z^2 / (4 + z^2) = 49.0
    assert f"| 100.0 | 0/0 | 1 | +0.0 [-{half:.1f}, +{half:.1f}] | {half:.1f} |" in text and f"{half:.1f}" == "49.0"


def test_partial_scores_use_the_labelled_bootstrap():
    base = {"short": _rows({None: [1, 0, 1, 1]}), "needle": _rows({1024: [1, 1, 0, 0]})}
    cand = {"short": _rows({None: [1, 0.5, 1, 0]}), "needle": _rows({1024: [1, 0, 1, 0]})}
    summary = report.build({"fp8": base, "mxfp4": cand}, ["fp8", "mxfp4"], n_boot=300)
    assert summary["tasks"]["short"][0]["paired"]["mxfp4"]["ci_method"] == "bootstrap"
    assert summary["tasks"]["needle"][0]["paired"]["mxfp4"]["ci_method"] == "tango"
    text = report.markdown(summary)
    assert "[paired bootstrap 95% CI]" in text and "[Tango score 95% CI]" in text
    assert "paired bootstrap: percentile interval" in text and "Tango score: " in text


def test_partial_scores_anywhere_in_a_task_give_every_length_the_bootstrap():
    """The interval is chosen per task: a length whose scores happen to be all 0/1 keeps the task's bootstrap."""
    base = {"t": _rows({1024: [1, 0, 1, 1], 2048: [1, 0.5, 0, 1]})}
    cand = {"t": _rows({1024: [1, 1, 0, 1], 2048: [1, 1, 0, 0.5]})}
    summary = report.build({"fp8": base, "mxfp4": cand}, ["fp8", "mxfp4"], n_boot=200)
    assert [g["paired"]["mxfp4"]["ci_method"] for g in summary["tasks"]["t"]] == ["bootstrap"] * 3
    text = report.markdown(summary)
    assert "[paired bootstrap 95% CI]" in text and "Tango score" not in text


def _context_rows(scores_by_length):
    """``_rows`` with a context a row: contexts 0 and 1 at each length, three questions each."""
    rows = _rows(scores_by_length)
    for i, r in enumerate(rows):
        r["context"] = (i % 6) // 3
    return rows


def test_questions_on_one_context_are_clustered_in_every_group():
    """Rows with a context take the Rao-Scott path in every group; context 0 is a context, and the pooled row
    keeps a context id at two lengths as two contexts (``<length>/c<context>``)."""
    base = _context_rows({1024: [1, 1, 1, 1, 0, 1], 2048: [1, 1, 0, 0, 1, 1]})
    cand = _context_rows({1024: [0, 0, 1, 1, 1, 1], 2048: [1, 0, 0, 1, 1, 1]})
    summary = report.build({"fp8": {"t": base}, "mxfp4": {"t": cand}}, ["fp8", "mxfp4"])
    paired = [g["paired"]["mxfp4"] for g in summary["tasks"]["t"]]
    assert [p["ci_method"] for p in paired] == ["tango_rao_scott"] * 3
    assert [p["clusters"] for p in paired] == [2, 2, 4]
    labels = [f"{r['length']}/c{r['context']}" for r in base]
    want = compare_clustered([r["score"] for r in base], [r["score"] for r in cand], labels)
    assert paired[-1] == dataclasses.asdict(want)
    assert "[Tango score, Rao-Scott clustered 95% CI]" in report.markdown(summary)
    # restate_binary cannot restate a clustered entry from its counts: it keeps it as it is.
    assert report.restate_binary(summary)["tasks"] == summary["tasks"]


def _old_summary():
    """A results.json as written before the score interval: bootstrap ends, no ci_method."""
    rows_a, rows_b = _rows({4096: [1, 1, 1, 0, 0]}), _rows({4096: [1, 1, 0, 1, 0]})
    summary = report.build({"fp8": {"t": rows_a}, "mxfp4": {"t": rows_b}}, ["fp8", "mxfp4"], n_boot=50)
    for g in summary["tasks"]["t"]:
        p = g["paired"]["mxfp4"]
        for key in ("ci_method", "confidence", "newcombe_lo", "newcombe_hi"):
            del p[key]
        p["ci_lo"], p["ci_hi"] = -0.4, 0.4
    return summary


def test_old_results_are_labelled_bootstrap_and_restated_from_counts(tmp_path):
    old = _old_summary()
    assert "[paired bootstrap 95% CI]" in report.markdown(old)
    new = report.restate_binary(old)
    p = new["tasks"]["t"][0]["paired"]["mxfp4"]
    assert p["ci_method"] == "tango" and (p["ci_lo"], p["ci_hi"]) == tango_interval(1, 1, 5)
    assert (p["n"], p["n10"], p["n01"], p["acc_a"], p["acc_b"]) == (5, 1, 1, 0.6, 0.6)
    assert old["tasks"]["t"][0]["paired"]["mxfp4"]["ci_lo"] == -0.4  # a copy: the input is untouched
    path = tmp_path / "results.json"
    path.write_text(json.dumps(old))
    report.main([str(path), "--restate-binary", "--out", str(tmp_path / "report.md")])
    assert "[Tango score 95% CI]" in (tmp_path / "report.md").read_text()


def test_restate_refuses_counts_of_partial_scores():
    old = _old_summary()
    bad = copy.deepcopy(old)
    bad["tasks"]["t"][0]["paired"]["mxfp4"]["acc_b"] = 0.5  # 2.5 of 5 right: not 0/1 scores
    with pytest.raises(ValueError, match="t length 4096 mxfp4: counts .* do not come from 0/1 scores"):
        report.restate_binary(bad)
    bad["tasks"]["t"][0]["paired"]["mxfp4"]["acc_b"] = 0.8  # 4 of 5 right: whole, but not 3 - 1 + 1
    with pytest.raises(ValueError, match="t length 4096 mxfp4: counts .* do not come from 0/1 scores"):
        report.restate_binary(bad)


def test_restate_goes_into_each_pair_of_a_pairs_summary(tmp_path):
    """A ``build_pairs`` results.json is restated pair by pair, on the command line too."""
    old = _old_summary()
    pairs = {"baseline": "fp8", "formats": ["fp8", "mxfp4"], "pairs": {"mxfp4": old}}
    new = report.restate_binary(pairs)
    p = new["pairs"]["mxfp4"]["tasks"]["t"][0]["paired"]["mxfp4"]
    assert p["ci_method"] == "tango" and (p["ci_lo"], p["ci_hi"]) == tango_interval(1, 1, 5)
    assert old["tasks"]["t"][0]["paired"]["mxfp4"]["ci_lo"] == -0.4
    path = tmp_path / "results.json"
    path.write_text(json.dumps(pairs))
    report.main([str(path), "--restate-binary", "--out", str(tmp_path / "report.md")])
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("## Every format against fp8") and "[Tango score 95% CI]" in text


def test_short_task_has_one_group():
    rows = [{"doc_id": i, "length": None, "depth": None, "target": str(i), "response": "", "score": 1.0}
            for i in range(3)]
    per_format = {"fp8": {"m3_short_arith": rows}, "mxfp4": {"m3_short_arith": rows}}
    summary = report.build(per_format, ["fp8", "mxfp4"], n_boot=10)
    assert [g["length"] for g in summary["tasks"]["m3_short_arith"]] == [report.ALL]
    assert summary["tasks"]["m3_short_arith"][0]["paired"]["mxfp4"]["agreement"] == 1.0


def test_mismatched_data_is_refused():
    a = _rows({1024: [1, 0]}, targets="x")
    b = _rows({1024: [1, 0]}, targets="y")
    with pytest.raises(ValueError, match="target differs"):
        report.build({"fp8": {"t": a}, "mxfp4": {"t": b}}, ["fp8", "mxfp4"])


def test_baseline_need_not_be_first():
    per_format = {
        "dense": {"m3_niah_single": _rows({1024: [1, 1, 1, 1]})},
        "fp8": {"m3_niah_single": _rows({1024: [1, 1, 0, 0]})},
        "mxfp4": {"m3_niah_single": _rows({1024: [1, 0, 0, 0]})},
    }
    summary = report.build(per_format, ["dense", "fp8", "mxfp4"], n_boot=200, baseline="fp8")
    group = summary["tasks"]["m3_niah_single"][0]
    assert summary["baseline"] == "fp8" and set(group["paired"]) == {"dense", "mxfp4"}
    assert group["paired"]["mxfp4"]["diff"] == -0.25 and group["paired"]["dense"]["diff"] == 0.5
    assert "mxfp4 vs fp8" in report.markdown(summary) and "dense vs fp8" in report.markdown(summary)
    with pytest.raises(ValueError, match="baseline"):
        report.build(per_format, ["dense", "fp8"], baseline="bf16")


@pytest.mark.parametrize("drop_from", ["base", "candidate"])
def test_unmatched_samples_are_refused(drop_from):
    # The accuracies would be over 4 and 3 samples but the paired statistics over 3: refuse instead.
    full, partial = _rows({1024: [1, 1, 0, 0]}), _rows({1024: [1, 1, 0, 0]})[:3]
    base, cand = (partial, full) if drop_from == "base" else (full, partial)
    with pytest.raises(ValueError, match="same data"):
        report.build({"fp8": {"t": base}, "mxfp4": {"t": cand}}, ["fp8", "mxfp4"], n_boot=10)
    with pytest.raises(ValueError, match="same data"):  # a task the candidate never ran
        report.build({"fp8": {"t": full}, "mxfp4": {}}, ["fp8", "mxfp4"], n_boot=10)


def test_discordant_pairs_say_where_the_formats_disagree(monkeypatch):
    base = _rows({1024: [1, 1, 0, 0], 2048: [1, 0]})
    cand = _rows({1024: [1, 0, 1, 0], 2048: [1, 1]})
    for i, r in enumerate(base):
        r["depth"] = cand[i]["depth"] = 10.0 * i
        r["response"], cand[i]["response"] = f" {r['target']}.", " 9999999."
    summary = report.build({"fp8": {"m3_kv_64": base}, "mxfp4": {"m3_kv_64": cand}}, ["fp8", "mxfp4"])
    pairs = summary["discordant"]["mxfp4"]
    assert [(d["doc_id"], d["length"], d["depth"], d["right"]) for d in pairs] == [
        (1, 1024, 10.0, "base"), (2, 1024, 20.0, "cand"), (5, 2048, 50.0, "cand")]
    p = summary["tasks"]["m3_kv_64"][-1]["paired"]["mxfp4"]
    assert (p["n10"], p["n01"]) == (1, 2)  # the list holds exactly McNemar's discordant pairs
    text = report.markdown(summary)
    assert "### Discordant pairs, mxfp4 vs fp8: 3" in text
    assert "| m3_kv_64 | 1024 | 10 | fp8 | t1 | t1. | 9999999. |" in text
    assert "| m3_kv_64 | 2048 | 50 | mxfp4 | t5 | t5. | 9999999. |" in text
    # Past MAX_LISTED: counts per task and length, and per depth decile (right in fp8 / right in mxfp4).
    monkeypatch.setattr(report, "MAX_LISTED", 2)
    text = report.markdown(summary)
    assert "| m3_kv_64 | 1024 | 1/1 |" in text and "| m3_kv_64 | 2048 | 0/1 |" in text
    assert "| 10-20 | 1/0 |" in text and "| 20-30 | 0/1 |" in text and "| 50-60 | 0/1 |" in text
    # Formats that agree everywhere say so; results written before the list have no such section.
    same = report.build({"fp8": {"m3_kv_64": base}, "mxfp4": {"m3_kv_64": copy.deepcopy(base)}}, ["fp8", "mxfp4"])
    assert "### Discordant pairs, mxfp4 vs fp8: 0 (no prompt answered differently)" in report.markdown(same)
    del same["discordant"]
    assert "### Discordant pairs" not in report.markdown(same)


def test_pairs_report_opens_with_an_overview_and_explains_its_columns_once():
    rng = random.Random()
    base = {t: _rows({1024: [rng.randint(0, 1) for _ in range(12)], 2048: [rng.randint(0, 1) for _ in range(12)]})
            for t in ("m3_niah_single", "m3_kv_64")}
    flip = {t: copy.deepcopy(rows) for t, rows in base.items()}
    for r in flip["m3_kv_64"][:5]:  # five flips, either way: 1 -> 0 and 0 -> 1
        r["score"] = 1 - r["score"]
    summary = report.build_pairs({"fp8": base, "mxfp4": flip, "bf16": copy.deepcopy(base)}, ["fp8", "mxfp4", "bf16"],
                                 baseline="fp8")
    summary["coverage"] = {f: {t: {"1024": [12, 100], "2048": [12, 100]} for t in base}
                           for f in ("fp8", "mxfp4", "bf16")}
    summary["coverage"]["bf16"]["m3_kv_64"]["2048"] = [7, 100]
    text = report.markdown(summary)
    assert text.startswith("## Every format against fp8, pooled over lengths")
    ones = sum(r["score"] for r in base["m3_kv_64"][:5])
    kv = summary["pairs"]["mxfp4"]["tasks"]["m3_kv_64"][-1]["paired"]["mxfp4"]
    assert (kv["n10"], kv["n01"]) == (ones, 5 - ones)
    cell = f"{100 * kv['diff']:+.1f} [{100 * kv['ci_lo']:+.1f}, {100 * kv['ci_hi']:+.1f}] (24)"
    half = 100 * tango_interval(0, 0, 24)[1]
    assert f"| mxfp4 | 48 | {ones} / {5 - ones} | +0.0 [-{half:.1f}, +{half:.1f}] (24) | {cell} |" in text
    zero = f"+0.0 [-{half:.1f}, +{half:.1f}] (24)"
    assert f"| bf16 | 48 | 0 / 0 | {zero} | {zero} |" in text
    assert text.index("## mxfp4 vs fp8") < text.index("## bf16 vs fp8") < text.index("## Samples scored")
    assert text.count("Baseline: fp8. agree:") == 1 and text.count("Tango score: Tango's (1998)") == 1
    assert text.rindex("Baseline: fp8. agree:") > text.index("## Samples scored")  # the notes close the report
    assert "| task | length | fp8 | mxfp4 | bf16 |" in text and "| m3_kv_64 | 2048 | 12/100 | 12/100 | 7/100 |" in text


def test_pairs_plot_adds_a_row_of_paired_differences_and_one_of_every_candidate(tmp_path):
    def png_size(path):
        head = path.read_bytes()[:24]
        return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")

    base = {"m3_kv_64": _rows({1024: [1, 0, 1, 1], 2048: [1, 1, 0, 0]})}
    cand = {"m3_kv_64": _rows({1024: [1, 1, 1, 0], 2048: [1, 1, 0, 0]})}
    single = report.plot(report.build({"fp8": base, "mxfp4": cand}, ["fp8", "mxfp4"]), tmp_path / "one.png")
    one = report.plot(report.build_pairs({"fp8": base, "mxfp4": cand}, ["fp8", "mxfp4"]), tmp_path / "two.png")
    pairs = report.build_pairs({"fp8": base, "mxfp4": cand, "bf16": copy.deepcopy(base)}, ["fp8", "mxfp4", "bf16"])
    several = report.plot(pairs, tmp_path / "three.png")
    (w1, h1), (w2, h2), (w3, h3) = png_size(single), png_size(one), png_size(several)
    assert w3 == w2 == w1 and h2 == 2 * h1 and h3 == 3 * h1
    assert report.plot(report.build_pairs({"fp8": base}, ["fp8"]), tmp_path / "none.png") is None


def test_pairs_plot_second_row_holds_each_tasks_most_paired_candidate_in_one_colour(tmp_path, monkeypatch):
    # mxfp4 has the most pairs in m3_kv_64 and bf16 in m3_vt: the second row draws that one alone (its axis
    # fitted to its intervals, not a small arm's), the third every candidate; a format's colour is one on every row.
    import matplotlib.axes

    drawn = []  # (row, column, format, colour)
    errorbar, line = matplotlib.axes.Axes.errorbar, matplotlib.axes.Axes.plot

    def where(ax):
        spec = ax.get_subplotspec()
        return spec.rowspan.start, spec.colspan.start

    def spy_errorbar(self, *args, **kwargs):
        drawn.append((*where(self), kwargs["label"].split()[0], kwargs["color"]))
        return errorbar(self, *args, **kwargs)

    def spy_plot(self, *args, **kwargs):
        if "label" in kwargs:  # the top row's accuracy lines
            drawn.append((*where(self), kwargs["label"], kwargs["color"]))
        return line(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", spy_errorbar)
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy_plot)
    every = {"m3_kv_64": _rows({1024: [1, 0] * 4, 2048: [0, 1] * 4}), "m3_vt": _rows({1024: [1, 1, 0] * 3})}
    few = {task: [r for r in rows if r["doc_id"] % 4 == 0] for task, rows in every.items()}
    per_format = {"fp8": every, "mxfp4": {"m3_kv_64": every["m3_kv_64"], "m3_vt": few["m3_vt"]},
                  "bf16": {"m3_kv_64": few["m3_kv_64"], "m3_vt": every["m3_vt"]}}
    report.plot(report.build_pairs(per_format, ["fp8", "mxfp4", "bf16"]), tmp_path / "acc.png")
    kv, vt = 0, 1
    assert sorted(drawn) == sorted([
        (0, kv, "fp8", "C0"), (0, kv, "mxfp4", "C1"), (0, vt, "fp8", "C0"), (0, vt, "mxfp4", "C1"),
        (1, kv, "mxfp4", "C1"), (1, vt, "bf16", "C2"),
        (2, kv, "mxfp4", "C1"), (2, kv, "bf16", "C2"), (2, vt, "mxfp4", "C1"), (2, vt, "bf16", "C2")])


def test_pairs_plot_draws_candidates_after_one_without_samples(tmp_path, monkeypatch):
    # mxfp4 not served yet: bf16 still gets both rows, and its one legend entry names the range of its pairs a
    # point (20 at 1024, 4 at 2048) for every panel, not the first length's n.
    import matplotlib.figure

    labels = []
    legend = matplotlib.figure.Figure.legend

    def spy(self, handles, names, **kwargs):
        labels.append(list(names))
        return legend(self, handles, names, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "legend", spy)
    base = {"m3_kv_64": _rows({1024: [1] * 10 + [0] * 10, 2048: [1, 0, 1, 1]}), "m3_vt": _rows({1024: [1, 0] * 4})}
    cand = {"m3_kv_64": _rows({1024: [0] * 10 + [1] * 10, 2048: [1, 1, 0, 1]}), "m3_vt": _rows({1024: [0, 1] * 4})}
    pairs = report.build_pairs({"fp8": base, "mxfp4": {"m3_kv_64": []}, "bf16": cand}, ["fp8", "mxfp4", "bf16"])
    path = tmp_path / "acc.png"
    assert report.plot(pairs, path) == path and path.stat().st_size > 1000
    assert labels == [["bf16 (4-20 pairs a point)"]]
    # Nothing to plot: the file an earlier report left is removed, not left beside the new report.
    assert report.plot(report.build_pairs({"fp8": base}, ["fp8"]), path) is None and not path.exists()


def test_pairs_are_counted_by_where_each_answer_was_served():
    base = _rows({1024: [1, 1, 0, 0, 1, 1]})
    cand = _rows({1024: [1, 0, 1, 0, 1, 0]})
    for i, (b, c) in enumerate(zip(base, cand)):
        b["served_on"] = "H200"
        if i < 4:
            c["served_on"] = "H200" if i < 2 else "H100"
    counts = report.served_on_pairs(base, cand, "m3_kv_64", "mxfp4")
    # pairs 0-1: H200 both (1 right in base only); 2-3: mixed (1 right in cand only); 4-5: cand unrecorded (1/0)
    assert counts == {"H200 / H200": [2, 1, 0], "H200 / H100": [2, 0, 1], f"H200 / {report.NOT_RECORDED}": [2, 1, 0]}
    summary = report.build({"fp8": {"m3_kv_64": base, "m3_vt": base}, "mxfp4": {"m3_kv_64": cand, "m3_vt": cand}},
                           ["fp8", "mxfp4"])
    assert summary["served_on"]["mxfp4"]["H200 / H100"] == [4, 0, 2]  # summed over tasks
    text = report.markdown(summary)
    assert "### Pairs by where they were served, mxfp4 vs fp8" in text
    assert "| H200 / H100 | 4 | 0/2 | 50.00 |" in text
    # Rows that never say where they were served add no such table.
    for r in base + cand:
        r.pop("served_on", None)
    plain = report.build({"fp8": {"m3_kv_64": base}, "mxfp4": {"m3_kv_64": cand}}, ["fp8", "mxfp4"])
    assert "served_on" not in plain and "Pairs by where" not in report.markdown(plain)


def test_served_on_table_lists_most_pairs_first_and_counts_one_sided_records():
    """Only the candidate says where it was served: the table is still there, the baseline's side "not recorded",
    its rows by pairs (most first), not by name."""
    base = _rows({1024: [1] * 6})
    cand = _rows({1024: [1, 0, 1, 1, 1, 1]})
    for c, where in zip(cand, ["H200", "H200", "H100", "H200", "H100", "H200"]):
        c["served_on"] = where
    summary = report.build({"fp8": {"t": base}, "mxfp4": {"t": cand}}, ["fp8", "mxfp4"])
    nr = report.NOT_RECORDED
    assert summary["served_on"]["mxfp4"] == {f"{nr} / H200": [4, 1, 0], f"{nr} / H100": [2, 0, 0]}
    text = report.markdown(summary)
    assert text.index(f"| {nr} / H200 | 4 | 1/0 | 25.00 |") < text.index(f"| {nr} / H100 | 2 | 0/0 | 0.00 |")


def test_a_replica_is_paired_with_the_variant_it_serves_again(tmp_path):
    """``mxfp4@2`` (served on a prefix of mxfp4's docs) is paired with mxfp4 on the docs both have, counted
    by a loop over them; its pair with fp8 and mxfp4's are what they are without it."""
    rng = random.Random()
    scores = {f: {L: [rng.random() < 0.6 for _ in range(12)] for L in (1024, 2048)} for f in ("fp8", "mxfp4")}
    served_again = {L: [s if rng.random() < 0.7 else not s for s in scores["mxfp4"][L][:7]] for L in (1024, 2048)}
    per_format = {f: {"t": _rows(scores[f])} for f in scores}
    replica = [r for r in _rows({L: served_again[L] + [0] * 5 for L in (1024, 2048)}) if r["doc_id"] % 12 < 7]
    per_format["mxfp4@2"] = {"t": replica}
    formats = ["fp8", "mxfp4", "mxfp4@2"]
    summary = report.build_pairs(per_format, formats, n_boot=10, replicas={"mxfp4@2": "mxfp4"})
    plain = report.build_pairs(per_format, formats, n_boot=10)
    assert summary["pairs"] == plain["pairs"] and "replicas" not in plain
    n10 = n01 = 0
    for L in (1024, 2048):
        for a, b in zip(scores["mxfp4"][L][:7], served_again[L]):
            n10 += a and not b
            n01 += b and not a
    pooled = summary["replicas"]["mxfp4@2"]["tasks"]["t"][-1]["paired"]["mxfp4@2"]
    assert summary["replicas"]["mxfp4@2"]["baseline"] == "mxfp4"
    assert (pooled["n"], pooled["n10"], pooled["n01"]) == (14, n10, n01)
    assert (pooled["ci_lo"], pooled["ci_hi"]) == tango_interval(n10, n01, 14)
    text = report.markdown(summary)
    assert "## Each replica against the variant it serves again, pooled over lengths" in text
    assert f"| mxfp4@2 | 14 | {n10} / {n01} |" in text and "## mxfp4@2 vs mxfp4, served again" in text
    assert text.index("## mxfp4@2 vs fp8 (the samples both have)") < text.index("## mxfp4@2 vs mxfp4, served again")
    # Restated from a results.json like the pairs (a wrong stored interval is recomputed from the counts).
    saved = json.loads(json.dumps(summary))
    saved["replicas"]["mxfp4@2"]["tasks"]["t"][-1]["paired"]["mxfp4@2"]["ci_lo"] = -1.0
    assert report.restate_binary(saved)["replicas"] == json.loads(json.dumps(summary))["replicas"]
    # A plain (build) summary carries its replicas' tables after its own.
    flat = report.build(per_format, ["fp8", "mxfp4"], n_boot=10)
    flat["replicas"] = report.build_replicas(per_format, {"mxfp4@2": "mxfp4"}, n_boot=10)
    assert flat["replicas"] == summary["replicas"]
    assert report.markdown(flat).index("### t") < report.markdown(flat).index("## mxfp4@2 vs mxfp4, served again")
    assert report.restate_binary(flat)["replicas"] == flat["replicas"]
    for bad in ({"mxfp4@2": "bf16"}, {"mxfp4@3": "mxfp4"}, {"mxfp4": "mxfp4"}):
        with pytest.raises(ValueError, match="replicas: .* must name two different variants"):
            report.build_pairs(per_format, formats, n_boot=10, replicas=bad)
