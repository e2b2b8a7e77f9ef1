"""lab/scripts/accuracy_h200_report.sh rebuilds the H200 comparison's report from the committed resume state, byte for
byte the committed report (the newest lab/data/accuracy_h200_<date>_q4_report.md, which the land script writes),
and that state agrees with the committed per-sample dump (lab/data/accuracy_h200_2026-12-02_q4_samples.jsonl):
the same pairs and the same discordant pairs for every format against fp8."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SAMPLES = ROOT / "lab" / "data" / "accuracy_h200_2026-12-02_q4_samples.jsonl"


def _pairs_from_dump() -> dict:
    """{format: (pairs with fp8, fp8 right only, format right only)} counted straight from the dump."""
    rows = {}
    for line in SAMPLES.read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(r["format"], {})[(r["task"], r["doc_id"])] = r["score"]
    out = {}
    for fmt, scores in rows.items():
        if fmt == "fp8":
            continue
        both = scores.keys() & rows["fp8"].keys()
        base = rows["fp8"]
        out[fmt] = (len(both), sum(base[k] > scores[k] for k in both), sum(base[k] < scores[k] for k in both))
    return out


def test_report_rebuilds_from_the_committed_state_and_matches_the_dump(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(["bash", str(ROOT / "lab" / "scripts" / "accuracy_h200_report.sh"), str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "results.json").read_text())
    want = _pairs_from_dump()
    assert set(summary["pairs"]) == set(want) and {"mxfp4", "mxfp4_rot", "bf16", "dense"} <= set(want)
    for fmt, (n, base_only, cand_only) in want.items():
        pair = summary["pairs"][fmt]
        overall = [g[-1]["paired"][fmt] for g in pair["tasks"].values()]  # each task's "all" row
        assert sum(p["n"] for p in overall) == n, fmt
        assert sum(p["n10"] for p in overall) == base_only and sum(p["n01"] for p in overall) == cand_only, fmt
        listed = pair["discordant"][fmt]
        assert len(listed) == base_only + cand_only and sum(d["right"] == "base" for d in listed) == base_only
    text = (out / "report.md").read_text()
    assert f"### Discordant pairs, mxfp4 vs fp8: {sum(want['mxfp4'][1:])}" in text
    for fmt, (n, base_only, cand_only) in want.items():  # the overview's row of each format
        assert f"\n| {fmt} | {n} | {base_only} / {cand_only} | " in text, fmt
    assert (out / "accuracy_vs_length.png").stat().st_size > 1000
    # The committed report is what this code makes of the committed state: a change to the statistics or the
    # report's text shows here until the report is rebuilt and committed with it.
    committed = max((ROOT / "lab" / "data").glob("accuracy_h200_????-??-??_q4_report.md"))
    assert text == committed.read_text(), f"{committed.name} differs from the report rebuilt from the state"
