"""lab/gpu/gate.py and the GPU gate's record: HEAD's kernels/ and sglang_m3/ have a row in lab/logs/gpu-gate.md
whose newest result is passed (or says no GPU could be had); the row parser, the pytest summary reader and the
verdict refuse what they should."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "lab" / "gpu"))
import gate  # noqa: E402

TABLE = gate.HEADER + "| 2026-12-07 | abc1234 | k1 | s1 | one H100 | 10 | 0 | 2 | passed |\n"


def test_head_trees_have_a_gate_row_that_did_not_fail():
    """The gate itself: a change to kernels/ or sglang_m3/ lands with its GPU-suite row (or a no-GPU row)."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    ok, why = gate.verdict(gate.LOG.read_text(), gate.trees("HEAD"))
    assert ok, why


def test_the_log_keeps_its_header():
    assert gate.HEADER in gate.LOG.read_text()


@pytest.mark.parametrize("summary,expected", [
    ("=== 417 passed, 3 failed, 12 skipped in 301.2s ===", dict(passed=417, failed=3, skipped=12, errors=0)),
    ("5 passed in 1.0s", dict(passed=5, failed=0, skipped=0, errors=0)),
    ("1 failed, 2 passed, 1 error in 3s", dict(passed=2, failed=1, skipped=0, errors=1)),
])
def test_counts_read_the_last_summary(summary, expected):
    assert gate.counts("collecting ...\n4 passed in 1s\n" + summary) == expected


def test_counts_refuse_a_log_without_a_summary():
    with pytest.raises(ValueError, match="no pytest summary"):
        gate.counts("collecting ...\nKilled\n")


def test_verdict_wants_the_newest_row_of_these_trees():
    assert gate.verdict(TABLE, ("k1", "s1")) == (True, "passed")
    ok, why = gate.verdict(TABLE, ("k2", "s1"))
    assert not ok and "have no row" in why
    failed_later = TABLE + "| 2026-12-08 | def5678 | k1 | s1 | one H200 | 9 | 1 | 2 | failed |\n"
    ok, why = gate.verdict(failed_later, ("k1", "s1"))
    assert not ok and "'failed'" in why
    no_gpu = failed_later + "| 2026-12-09 | 0123abc | k1 | s1 | none | - | - | - | no GPU |\n"
    assert gate.verdict(no_gpu, ("k1", "s1")) == (True, "no GPU")


def test_rows_skip_the_header_and_prose():
    text = "# title\n\nsome | prose\n\n" + TABLE
    assert [r["commit"] for r in gate.rows(text)] == ["abc1234"]


def test_record_sums_the_shards_of_one_suite(tmp_path, monkeypatch):
    """Two calls' logs (kernels, then serving) make one row; a failure in either fails the row."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    log = tmp_path / "gpu-gate.md"
    log.write_text("# title\n\n" + gate.HEADER)
    monkeypatch.setattr(gate, "LOG", log)
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("10 passed, 2 skipped in 5s\n")
    b.write_text("3 passed, 1 failed in 9s\n")
    assert gate.main(["record", "HEAD", "one H100", str(a), str(b)]) == 0
    (row,) = gate.rows(log.read_text())
    assert (row["passed"], row["failed"], row["skipped"], row["result"]) == ("13", "1", "2", "failed")
    assert (row["kernels"], row["sglang_m3"]) == gate.trees("HEAD")
