"""Paired statistics against hand-computed cases."""

import math

import pytest

from accuracy.stats import agreement, compare_paired, discordant, mcnemar_exact, paired_bootstrap


@pytest.mark.parametrize(
    "n10, n01, p",
    [
        (5, 1, 2 * (1 + 6) / 2**6),  # 0.21875
        (0, 10, 2 / 2**10),
        (2, 8, 2 * (1 + 10 + 45) / 2**10),  # 0.109375
        (11, 1, 2 * (1 + 12) / 2**12),
        (3, 3, 1.0),  # 2 * 42/64 > 1 is capped
        (0, 0, 1.0),  # no discordant pairs
        (1, 0, 1.0),  # 2 * 1/2
    ],
)
def test_mcnemar_exact_hand_computed(n10, n01, p):
    assert mcnemar_exact(n10, n01) == pytest.approx(p, rel=1e-12)
    assert mcnemar_exact(n01, n10) == pytest.approx(p, rel=1e-12)  # two-sided: symmetric


def test_mcnemar_rejects_negative_counts():
    with pytest.raises(ValueError, match="discordant"):
        mcnemar_exact(-1, 3)


def test_discordant_and_agreement():
    a = [1, 1, 1, 0, 0, 1, 0.5]
    b = [1, 0, 0, 1, 0, 1, 1]
    assert discordant(a, b) == (2, 2)  # 0.5 counts as wrong
    assert agreement(a, b) == pytest.approx(3 / 7)


def test_pairs_must_match():
    with pytest.raises(ValueError, match="same samples"):
        compare_paired([1, 0], [1])
    with pytest.raises(ValueError, match=r"a scores must lie in \[0, 1\], got \(index, score\) \[\(1, 2.0\)\]"):
        compare_paired([1, 2], [1, 0])
    with pytest.raises(ValueError, match=r"b scores .* \[\(0, nan\)\]"):  # NaN is not a score either
        compare_paired([1], [float("nan")])


def test_bootstrap_constant_difference_is_a_point():
    diff, lo, hi = paired_bootstrap([1] * 30, [0] * 30, n_boot=200)
    assert (diff, lo, hi) == (-1.0, -1.0, -1.0)
    assert paired_bootstrap([1, 0, 1], [1, 0, 1], n_boot=200) == (0.0, 0.0, 0.0)


def test_bootstrap_two_samples_exact_interval():
    # d = [0, 1]: resampled means are 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4, so the 95%
    # percentile interval is [0, 1] once n_boot is large.
    diff, lo, hi = paired_bootstrap([0, 0], [0, 1], n_boot=4000, seed=3)
    assert (diff, lo, hi) == (0.5, 0.0, 1.0)


def test_bootstrap_matches_normal_approximation():
    # 400 pairs, 100 where only b is right: diff 0.25, se sqrt(.25 * .75 / 400).
    a, b = [0] * 400, [1] * 100 + [0] * 300
    diff, lo, hi = paired_bootstrap(a, b, n_boot=20000, seed=1)
    se = math.sqrt(0.25 * 0.75 / 400)
    assert diff == 0.25
    assert lo == pytest.approx(0.25 - 1.96 * se, abs=0.006)
    assert hi == pytest.approx(0.25 + 1.96 * se, abs=0.006)


def test_bootstrap_is_seeded_and_contains_the_difference():
    a = [1, 0, 1, 1, 0, 1, 0, 1, 1, 1, 0, 0]
    b = [1, 1, 0, 1, 0, 1, 1, 1, 0, 1, 1, 0]
    first = paired_bootstrap(a, b, n_boot=500, seed=7)
    assert first == paired_bootstrap(a, b, n_boot=500, seed=7)
    assert first[1] <= first[0] <= first[2]


def test_compare_paired_fields():
    r = compare_paired([1, 1, 0, 0], [1, 0, 1, 1], n_boot=100)
    assert (r.n, r.n10, r.n01) == (4, 1, 2)
    assert (r.acc_a, r.acc_b, r.diff) == (0.5, 0.75, 0.25)
    assert r.p_mcnemar == 1.0
    assert r.agreement == 0.25
