"""scripts/interval_coverage.py: exact coverage sums over every table, the printed table."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import interval_coverage  # noqa: E402


def test_tables_are_every_table_once():
    t = interval_coverage.tables(4)
    assert len(t) == 35 and len({tuple(r) for r in t}) == 35  # C(4 + 3, 3)
    assert (t.sum(1) == 4).all() and (t >= 0).all()


def test_coverage_of_known_intervals():
    n = 6
    t = interval_coverage.tables(n)
    points = interval_coverage.draw_points(np.random.default_rng(), 20, "agreeing", 0.3)
    assert interval_coverage.coverage(n, points, np.tile([-1.0, 1.0], (len(t), 1)), t) == pytest.approx(1.0)
    # the plug-in point "interval" [d_hat, d_hat] covers only tables whose estimate equals the truth
    d_hat = (t[:, 2] - t[:, 1]) / n
    point = np.array([[0.5, 0.0, 0.0, 0.5]])  # true difference 0: covered exactly when n10 == n01
    got = interval_coverage.coverage(n, point, np.stack([d_hat, d_hat], 1), t)
    assert got == pytest.approx([1.0])  # no discordant pair can occur at this point
    point = np.array([[0.4, 0.1, 0.1, 0.4]])
    want = sum(interval_coverage.multinomial.pmf(r, n, point[0]) for r in t if r[1] == r[2])
    assert interval_coverage.coverage(n, point, np.stack([d_hat, d_hat], 1), t) == pytest.approx([want])


def test_prints_a_table(capsys):
    interval_coverage.main(["--n", "4", "--points", "30", "--region", "simplex"])
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("| n | interval |") and len(out) == 5
    assert out[3].startswith("| 4 | Tango |") and out[4].startswith("| 4 | Newcombe |")
