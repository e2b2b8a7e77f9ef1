"""lab/scripts/interval_coverage.py: exact coverage sums over every table, the printed table."""

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


def test_coverage_is_of_p01_minus_p10():
    """At (0.25, 0.125, 0.375, 0.25) the difference is +0.25 (exact in binary): an interval [0, 1] of every table
    covers it, [-1, 0) none; the plug-in point covers it exactly when n01 - n10 = 0.25 n."""
    n = 4
    t = interval_coverage.tables(n)
    point = np.array([[0.25, 0.125, 0.375, 0.25]])
    assert interval_coverage.coverage(n, point, np.tile([0.0, 1.0], (len(t), 1)), t) == pytest.approx([1.0])
    assert interval_coverage.coverage(n, point, np.tile([-1.0, -1e-9], (len(t), 1)), t) == pytest.approx([0.0])
    d_hat = (t[:, 2] - t[:, 1]) / n
    want = sum(interval_coverage.multinomial.pmf(r, n, point[0]) for r in t if r[2] - r[1] == 1)
    assert interval_coverage.coverage(n, point, np.stack([d_hat, d_hat], 1), t) == pytest.approx([want])


def test_coverage_of_many_points_matches_one_point_at_a_time():
    """450 points: more than one chunk of 200; each the same as computed alone."""
    rng = np.random.default_rng()
    n = 6
    t = interval_coverage.tables(n)
    lo = rng.uniform(-1, 0.2, len(t))
    ends = np.stack([lo, lo + rng.uniform(0, 0.8, len(t))], 1)
    points = interval_coverage.draw_points(rng, 450, "simplex", 0.3)
    got = interval_coverage.coverage(n, points, ends, t)
    alone = [interval_coverage.coverage(n, p[None], ends, t)[0] for p in points[::37]]
    assert got.shape == (450,) and got[::37] == pytest.approx(alone)
    assert len(set(np.round(got, 6))) > 100  # the points differ, so do their coverages


@pytest.mark.parametrize("region", ["agreeing", "simplex"])
def test_points_are_cell_probabilities(region):
    points = interval_coverage.draw_points(np.random.default_rng(), 2000, region, 0.25)
    assert points.shape == (2000, 4) and (points >= 0).all() and points.sum(1) == pytest.approx(np.ones(2000))
    if region == "agreeing":
        disc = points[:, 1] + points[:, 2]
        assert disc.max() <= 0.25 + 1e-12 and disc.max() > 0.2


def test_printed_coverage_is_that_of_each_tables_own_interval(capsys):
    """The printed row against coverage() of intervals computed table by table (no cache), same seed."""
    interval_coverage.main(["--n", "5", "--points", "40", "--seed", "7"])
    rows = capsys.readouterr().out.splitlines()[3:]
    rng = np.random.default_rng(7)
    t = interval_coverage.tables(5)
    points = interval_coverage.draw_points(rng, 40, "agreeing", 0.3)
    for row, interval in zip(rows, (lambda r: interval_coverage.tango_interval(int(r[1]), int(r[2]), 5),
                                    lambda r: interval_coverage.newcombe_interval(*map(int, r)))):
        cov = interval_coverage.coverage(5, points, np.array([interval(r) for r in t]), t)
        assert row.startswith(f"| 5 | {row.split(' | ')[1]} | {cov.mean():.4f} | {cov.min():.4f} |"), row
