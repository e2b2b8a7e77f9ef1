"""Paired statistics between two index-K formats scored on the same samples.

Inputs are per-sample scores in the same sample order: ``a`` (baseline, e.g. fp8) and ``b``
(candidate, e.g. mxfp4). Scores lie in [0, 1]; McNemar and agreement use ``score == 1`` as
"correct", the bootstrap uses the scores themselves.
"""

import dataclasses
import math

import numpy as np

_BOOT_CHUNK_ELEMENTS = 1 << 22  # resampled indices held at once


def _check_pair(a, b):
    a, b = [float(x) for x in a], [float(x) for x in b]
    if len(a) != len(b):
        raise ValueError(f"a and b must score the same samples, got {len(a)} and {len(b)} scores")
    for name, xs in (("a", a), ("b", b)):
        bad = [(i, x) for i, x in enumerate(xs) if not (0.0 <= x <= 1.0)]
        if bad:
            raise ValueError(f"{name} scores must lie in [0, 1], got (index, score) {bad[:5]}")
    return a, b


def discordant(a, b) -> tuple[int, int]:
    """``(n10, n01)``: samples right in ``a`` only, right in ``b`` only (right = score 1)."""
    a, b = _check_pair(a, b)
    n10 = sum(1 for x, y in zip(a, b) if x == 1.0 and y != 1.0)
    n01 = sum(1 for x, y in zip(a, b) if x != 1.0 and y == 1.0)
    return n10, n01


def agreement(a, b) -> float:
    """Fraction of samples where both formats are right or both wrong (1.0 for no samples)."""
    a, b = _check_pair(a, b)
    if not a:
        return 1.0
    return sum((x == 1.0) == (y == 1.0) for x, y in zip(a, b)) / len(a)


def mcnemar_exact(n10: int, n01: int) -> float:
    """Two-sided exact McNemar p-value: ``min(1, 2 * P[X <= min(n10, n01)])``, ``X ~ Bin(n10 + n01, 1/2)``.

    Computed with exact integers. No discordant pairs gives 1.0.
    """
    if n10 < 0 or n01 < 0:
        raise ValueError(f"discordant counts must be >= 0, got n10={n10}, n01={n01}")
    n = n10 + n01
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(n10, n01) + 1))
    return min(1.0, 2 * tail / 2**n)


def paired_bootstrap(a, b, n_boot: int = 10000, confidence: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """``(diff, lo, hi)``: ``diff = mean(b) - mean(a)`` and the percentile interval of that
    difference over ``n_boot`` resamples of sample indices (with replacement, pairs kept together).

    The interval ends are the order statistics ``floor(lo_q * (n_boot - 1))`` and
    ``ceil(hi_q * (n_boot - 1))`` of the sorted resampled differences, ``lo_q, hi_q =
    (1 -/+ confidence) / 2`` (numpy ``default_rng(seed)``). Empty input gives ``(0, 0, 0)``.
    """
    a, b = _check_pair(a, b)
    if n_boot < 1 or not (0.0 < confidence < 1.0):
        raise ValueError(f"need n_boot >= 1 and 0 < confidence < 1, got n_boot={n_boot}, confidence={confidence}")
    n = len(a)
    if n == 0:
        return 0.0, 0.0, 0.0
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    step = max(1, _BOOT_CHUNK_ELEMENTS // n)
    for i in range(0, n_boot, step):
        m = min(step, n_boot - i)
        means[i : i + m] = d[rng.integers(0, n, size=(m, n))].mean(1)
    means.sort()
    lo_q, hi_q = (1 - confidence) / 2, (1 + confidence) / 2
    return float(d.mean()), float(means[math.floor(lo_q * (n_boot - 1))]), float(means[math.ceil(hi_q * (n_boot - 1))])


@dataclasses.dataclass
class PairedResult:
    n: int
    acc_a: float
    acc_b: float
    agreement: float
    n10: int  # right in a only
    n01: int  # right in b only
    p_mcnemar: float
    diff: float  # mean(b) - mean(a)
    ci_lo: float
    ci_hi: float


def compare_paired(a, b, n_boot: int = 10000, seed: int = 0) -> PairedResult:
    """All paired statistics of candidate ``b`` against baseline ``a``."""
    a, b = _check_pair(a, b)
    n10, n01 = discordant(a, b)
    diff, lo, hi = paired_bootstrap(a, b, n_boot, seed=seed)
    n = len(a)
    return PairedResult(
        n=n,
        acc_a=sum(a) / n if n else 0.0,
        acc_b=sum(b) / n if n else 0.0,
        agreement=agreement(a, b),
        n10=n10,
        n01=n01,
        p_mcnemar=mcnemar_exact(n10, n01),
        diff=diff,
        ci_lo=lo,
        ci_hi=hi,
    )
