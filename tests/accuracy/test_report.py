"""Report tables and the plot from constructed per-sample results."""

import pytest

from accuracy import report


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
    text = report.markdown(summary)
    assert "### m3_niah_single" in text and "| 1024 | 4 | 75.0 | 50.0 |" in text
    assert report.plot(summary, tmp_path / "a.png").stat().st_size > 1000


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
