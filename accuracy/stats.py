"""Paired statistics between two index-K formats scored on the same samples.

Inputs are per-sample scores in the same sample order: ``a`` (baseline, e.g. fp8) and ``b``
(candidate, e.g. mxfp4). Scores lie in [0, 1]; McNemar, agreement and the score intervals use
``score == 1`` as "correct", the bootstrap uses the scores themselves.

The interval of ``diff = mean(b) - mean(a)``:

- 0/1 scores: Tango's asymptotic score interval for the difference of paired proportions
  (Tango 1998, Statistics in Medicine 17:891-908), the set of differences its score test does not
  reject. It depends on the discordant counts and ``n`` only, stays inside [-1, 1], and keeps its
  width with no discordant pair (``+-z^2 / (n + z^2)``: +-43 points at n = 5, +-3.7 at n = 100).
  Newcombe's hybrid score interval (method 10 of Newcombe 1998, Statistics in Medicine
  17:2635-2650) is computed beside it.
- 0/1 scores in clusters (several questions on one context, whose answers are correlated): Tango's
  interval on the Rao-Scott effective counts (Rao and Scott 1992, Biometrics 48:577-585): every
  count divided by the design effect of the difference (``design_effect``: between-cluster over
  independent-pairs variance, at least 1, at most the largest cluster, and the largest cluster when
  there are too few discordant pairs to estimate it), with the exact sign-flip test on the clusters'
  totals as the McNemar p (``mcnemar_clustered``).
- Other scores: the paired percentile bootstrap (which has zero width whenever every pair has the
  same difference, e.g. no discordant pair), over whole clusters when the pairs come in clusters.

statsmodels provides the exact McNemar test (``mcnemar(exact=True)``) and the Wilson interval
(``proportion_confint(method="wilson")``), scipy the normal quantile and root finding. Neither scipy 1.17 nor
statsmodels 0.15 has a paired-difference interval (Tango, Newcombe), the Rao-Scott adjustment or the clustered
sign-flip test, so those are written out here. The paired bootstrap stays ours too: ``scipy.stats.bootstrap``
draws its resamples in another order, so its ends differ from the published ones at the same seed.
"""

import dataclasses
import math

import numpy as np
from scipy.optimize import brentq
from scipy.stats import norm
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.proportion import proportion_confint

_BOOT_CHUNK_ELEMENTS = 1 << 22  # resampled indices held at once
INTERVALS = ("auto", "tango", "bootstrap")
DEFF_MIN_DISCORDANT = 10  # fewer discordant pairs: design_effect takes the largest cluster's size


def _check_pair(a, b):
    a, b = [float(x) for x in a], [float(x) for x in b]
    if len(a) != len(b):
        raise ValueError(f"a and b must score the same samples, got {len(a)} and {len(b)} scores")
    for name, xs in (("a", a), ("b", b)):
        bad = [(i, x) for i, x in enumerate(xs) if not (0.0 <= x <= 1.0)]
        if bad:
            raise ValueError(f"{name} scores must lie in [0, 1], got (index, score) {bad[:5]}")
    return a, b


def _check_confidence(confidence):
    if not (0.0 < confidence < 1.0):
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}")


def _check_counts(**counts):
    bad = {k: v for k, v in counts.items() if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0}
    if bad:
        raise ValueError(f"counts must be integers >= 0, got {bad}")


def is_binary(*score_lists) -> bool:
    """True when every score is exactly 0 or 1 (the score intervals apply)."""
    return all(float(x) in (0.0, 1.0) for xs in score_lists for x in xs)


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
    """Two-sided exact McNemar p-value: ``min(1, 2 * P[X <= min(n10, n01)])``, ``X ~ Bin(n10 + n01, 1/2)``
    (statsmodels' ``mcnemar(exact=True)``). No discordant pairs gives 1.0.
    """
    if n10 < 0 or n01 < 0:
        raise ValueError(f"discordant counts must be >= 0, got n10={n10}, n01={n01}")
    if n10 + n01 == 0:
        return 1.0
    return float(mcnemar([[0, n10], [n01, 0]], exact=True).pvalue)


def _tango_statistic(delta: float, n10: int, n01: int, n: int) -> float:
    """Tango's score statistic for ``H0: p01 - p10 = delta`` (``p01``: right in b only).

    ``(n01 - n10 - n delta) / sqrt(n (2 q + delta (1 - delta)))`` with ``q`` the restricted maximum
    likelihood estimate of ``p10`` under H0, the root of ``2n q^2 + B q + C = 0`` given in closed form
    by Tango (1998). A zero variance (only at delta = +-1, or delta = 0 with no discordant pair) gives
    0 for a zero numerator and +-1e300 otherwise, so root finding brackets stay finite.
    """
    a2 = 2 * n
    b1 = -n01 - n10 + (2 * n - n01 + n10) * delta
    c0 = -n10 * delta * (1 - delta)
    q = (math.sqrt(max(0.0, b1 * b1 - 4 * a2 * c0)) - b1) / (2 * a2)
    variance = n * (2 * q + delta * (1 - delta))
    numerator = n01 - n10 - n * delta
    if variance <= 0.0:
        return 0.0 if numerator == 0 else math.copysign(1e300, numerator)
    return numerator / math.sqrt(variance)


def tango_interval(n10: int, n01: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """``(lo, hi)``: Tango's score interval for ``diff = (n01 - n10) / n``, the paired difference
    ``mean(b) - mean(a)`` of 0/1 scores.

    ``n10`` / ``n01``: pairs right in ``a`` only / in ``b`` only; ``n``: all pairs. The interval is
    every ``delta`` in [-1, 1] with ``|T(delta)| <= z``, ``z`` the normal ``(1 + confidence) / 2``
    quantile, each end found by Brent's method to 1e-12. ``n = 0`` gives (-1, 1).

    Example: ``tango_interval(0, 0, 5)`` is about ``(-0.434, 0.434)`` (no discordant pair in 5).
    """
    _check_counts(n10=n10, n01=n01, n=n)
    return _tango(n10, n01, n, confidence)


def _tango(n10: float, n01: float, n: float, confidence: float) -> tuple[float, float]:
    """``tango_interval`` on counts that may be fractional (``tango_rao_scott``'s effective counts)."""
    _check_confidence(confidence)
    if n10 + n01 > n:
        raise ValueError(f"discordant pairs n10 + n01 = {n10 + n01} exceed the n = {n} pairs")
    if n == 0:
        return -1.0, 1.0
    z = float(norm.ppf((1 + confidence) / 2))
    diff = (n01 - n10) / n

    def stat(delta):
        return _tango_statistic(delta, n10, n01, n)

    lo = -1.0 if n10 == n else brentq(lambda d: stat(d) - z, -1.0, diff, xtol=1e-12)
    hi = 1.0 if n01 == n else brentq(lambda d: stat(d) + z, diff, 1.0, xtol=1e-12)
    return float(lo), float(hi)


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``k / n``, ``n >= 1`` (statsmodels' ``proportion_confint``)."""
    _check_counts(k=k, n=n)
    _check_confidence(confidence)
    if n < 1 or k > n:
        raise ValueError(f"wilson_interval needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    lo, hi = proportion_confint(k, n, alpha=1 - confidence, method="wilson")
    return float(lo), float(hi)


def newcombe_interval(n11: int, n10: int, n01: int, n00: int, confidence: float = 0.95) -> tuple[float, float]:
    """``(lo, hi)``: Newcombe's hybrid score interval (1998, method 10) for ``diff = (n01 - n10) / n``.

    Cells: ``n11`` both right, ``n10`` right in ``a`` only, ``n01`` right in ``b`` only, ``n00`` both
    wrong. Square-and-add of the Wilson intervals of the two accuracies ``p_b = (n11 + n01) / n`` and
    ``p_a = (n11 + n10) / n``, with Newcombe's correlation estimate ``phi``: ``(A - n/2) / sqrt(M)`` for
    ``A = n11 n00 - n10 n01 > n/2``, 0 for ``0 <= A <= n/2``, ``A / sqrt(M)`` for ``A < 0``, and 0 when
    the product ``M`` of the four margins is 0. ``n = 0`` gives (-1, 1).
    """
    _check_counts(n11=n11, n10=n10, n01=n01, n00=n00)
    _check_confidence(confidence)
    n = n11 + n10 + n01 + n00
    if n == 0:
        return -1.0, 1.0
    p_b, p_a = (n11 + n01) / n, (n11 + n10) / n
    lo_b, hi_b = wilson_interval(n11 + n01, n, confidence)
    lo_a, hi_a = wilson_interval(n11 + n10, n, confidence)
    margins = (n11 + n01) * (n10 + n00) * (n11 + n10) * (n01 + n00)
    cross = n11 * n00 - n10 * n01
    if margins == 0 or 0 <= cross <= n / 2:
        phi = 0.0
    else:
        phi = (cross - n / 2 if cross > 0 else cross) / math.sqrt(margins)
    diff = p_b - p_a
    down_b, up_a = p_b - lo_b, hi_a - p_a
    up_b, down_a = hi_b - p_b, p_a - lo_a
    lo = diff - math.sqrt(max(0.0, down_b**2 - 2 * phi * down_b * up_a + up_a**2))
    hi = diff + math.sqrt(max(0.0, down_a**2 - 2 * phi * down_a * up_b + up_b**2))
    return lo, hi


def paired_bootstrap(a, b, n_boot: int = 10000, confidence: float = 0.95, seed: int = 0,
                     clusters=None) -> tuple[float, float, float]:
    """``(diff, lo, hi)``: ``diff = mean(b) - mean(a)`` and the percentile interval of that
    difference over ``n_boot`` resamples of sample indices (with replacement, pairs kept together), or,
    with ``clusters`` (one label per pair), of whole clusters: a resample's difference is its clusters'
    summed ``b - a`` over their summed pairs, so a context's correlated questions move together.

    The interval ends are the order statistics ``floor(lo_q * (n_boot - 1))`` and
    ``ceil(hi_q * (n_boot - 1))`` of the sorted resampled differences, ``lo_q, hi_q =
    (1 -/+ confidence) / 2`` (numpy ``default_rng(seed)``). Empty input gives ``(0, 0, 0)``.
    It has zero width when every pair has the same difference: use it for scores that are not 0/1.
    """
    a, b = _check_pair(a, b)
    if n_boot < 1 or not (0.0 < confidence < 1.0):
        raise ValueError(f"need n_boot >= 1 and 0 < confidence < 1, got n_boot={n_boot}, confidence={confidence}")
    if len(a) == 0:
        return 0.0, 0.0, 0.0
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    if clusters is None:
        totals, sizes = d, np.ones_like(d)
    else:
        _, totals, sizes = _cluster_totals(a, b, clusters)
    n = len(totals)
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    step = max(1, _BOOT_CHUNK_ELEMENTS // n)
    for i in range(0, n_boot, step):
        m = min(step, n_boot - i)
        pick = rng.integers(0, n, size=(m, n))
        means[i : i + m] = totals[pick].sum(1) / sizes[pick].sum(1)
    means.sort()
    lo_q, hi_q = (1 - confidence) / 2, (1 + confidence) / 2
    return float(d.mean()), float(means[math.floor(lo_q * (n_boot - 1))]), float(means[math.ceil(hi_q * (n_boot - 1))])


def design_effect(a, b, clusters, min_discordant: int = DEFF_MIN_DISCORDANT) -> float:
    """Rao-Scott design effect of the paired difference ``mean(b) - mean(a)`` over clustered pairs:
    the variance of the difference's total estimated between clusters (``C / (C - 1) sum_c (D_c - n_c
    dbar)^2``, ``D_c`` the cluster's sum of ``b - a``, ``n_c`` its pairs) over the same variance if the
    pairs were independent (``N / (N - 1) sum (d - dbar)^2``), clamped to ``[1, max n_c]``; ``max n_c``
    (every pair of a cluster alike: the clusters count as the samples) when fewer than
    ``min_discordant`` pairs are discordant, where the ratio cannot be estimated."""
    d, totals, sizes = _cluster_totals(a, b, clusters)
    largest = float(sizes.max()) if len(sizes) else 1.0
    if len(sizes) < 2 or int(np.count_nonzero(d)) < min_discordant:
        return max(1.0, largest)
    n, dbar = len(d), float(d.mean())
    iid = n / (n - 1) * float(((d - dbar) ** 2).sum())
    between = len(sizes) / (len(sizes) - 1) * float(((totals - sizes * dbar) ** 2).sum())
    if iid <= 0.0:
        return max(1.0, largest)
    return float(min(max(between / iid, 1.0), largest))


def _cluster_totals(a, b, clusters) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(d, totals, sizes)``: the pairs' ``b - a``, and per cluster (labels compared as strings) its sum
    of ``d`` and its pair count."""
    a, b = _check_pair(a, b)
    labels = [str(c) for c in clusters]
    if len(labels) != len(a):
        raise ValueError(f"clusters must name one cluster per pair, got {len(labels)} for {len(a)} pairs")
    d = np.asarray(b) - np.asarray(a)
    keys, index = np.unique(np.asarray(labels), return_inverse=True)
    return d, np.bincount(index, weights=d, minlength=len(keys)), np.bincount(index, minlength=len(keys))


def mcnemar_clustered(a, b, clusters) -> float:
    """Exact two-sided p of the sign-flip (randomization) test on the clusters' totals ``D_c = sum_c (b - a)``
    (integers for 0/1 scores): under no format effect each cluster's pairs are exchangeable between the
    formats, so every ``D_c`` is as likely as ``-D_c``; p is the share of the ``2^k`` sign patterns of the
    ``k`` non-zero totals whose sum is at least ``|sum_c D_c|`` in size. With at most one discordant pair a
    cluster it is McNemar's exact test (``mcnemar_exact``); 1 when no cluster's total is non-zero. Exact at
    any count, unlike Durkalski's chi-square version of the clustered McNemar test, which is optimistic at a
    few discordant pairs."""
    _, totals, _ = _cluster_totals(a, b, clusters)
    rounded = np.round(totals)
    if not np.allclose(totals, rounded):
        raise ValueError("mcnemar_clustered needs 0/1 scores: the clusters' totals of b - a must be integers")
    steps = [abs(int(t)) for t in rounded if t != 0]
    observed = abs(int(rounded.sum()))
    if not steps:
        return 1.0
    # Distribution of sum_c s_c |D_c| over independent fair signs s_c, on the integers -span..span.
    span = sum(steps)
    dist = np.zeros(2 * span + 1)
    dist[span] = 1.0
    for step in steps:
        dist = 0.5 * (np.roll(dist, step) + np.roll(dist, -step))  # no wrap: |partial sums| <= span
    sums = np.arange(-span, span + 1)
    return float(min(1.0, dist[np.abs(sums) >= observed].sum()))


def compare_clustered(a, b, clusters, confidence: float = 0.95) -> "PairedResult":
    """Paired statistics of 0/1 scores whose pairs come in clusters (several questions on one context):
    Tango's interval on the Rao-Scott effective counts (each count divided by ``design_effect``), the
    clustered exact McNemar p (``mcnemar_clustered``); ``ci_method`` "tango_rao_scott"."""
    a, b = _check_pair(a, b)
    if not is_binary(a, b):
        raise ValueError("compare_clustered needs 0/1 scores")
    n10, n01 = discordant(a, b)
    n11 = sum(1 for x, y in zip(a, b) if x == 1.0 and y == 1.0)
    n = len(a)
    plain = compare_counts(n11, n10, n01, n - n11 - n10 - n01, confidence)  # the counts' fields; its intervals go
    deff = design_effect(a, b, clusters)
    n10_eff, n01_eff = n10 / deff, n01 / deff
    # n from the effective parts, not n / deff: with every pair discordant the two quotients' sum may round
    # one ulp above n / deff, which _tango refuses.
    n_eff = n10_eff + n01_eff + (n - n10 - n01) / deff
    lo, hi = _tango(n10_eff, n01_eff, n_eff, confidence)
    return dataclasses.replace(plain, p_mcnemar=mcnemar_clustered(a, b, clusters), ci_lo=lo, ci_hi=hi,
                               ci_method="tango_rao_scott", newcombe_lo=None, newcombe_hi=None,
                               clusters=len({str(c) for c in clusters}), design_effect=deff)


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
    ci_lo: float  # interval of diff, of the kind ci_method names
    ci_hi: float
    ci_method: str = "tango"  # "tango", "tango_rao_scott" (0/1 scores); "bootstrap", "bootstrap_clustered"
    confidence: float = 0.95
    newcombe_lo: float | None = None  # Newcombe's method 10 beside Tango's (0/1 scores only)
    newcombe_hi: float | None = None
    clusters: int | None = None  # *_clustered, tango_rao_scott: the clusters (contexts) the pairs come in
    design_effect: float | None = None  # tango_rao_scott: the counts' divisor (design_effect)


def compare_counts(n11: int, n10: int, n01: int, n00: int, confidence: float = 0.95) -> PairedResult:
    """Paired statistics of 0/1 scores from the four cells of the paired table (see
    ``newcombe_interval``): Tango's interval as ``ci_lo, ci_hi``, Newcombe's beside it."""
    _check_counts(n11=n11, n10=n10, n01=n01, n00=n00)
    n = n11 + n10 + n01 + n00
    lo, hi = tango_interval(n10, n01, n, confidence)
    nlo, nhi = newcombe_interval(n11, n10, n01, n00, confidence)
    return PairedResult(n=n, acc_a=(n11 + n10) / n if n else 0.0, acc_b=(n11 + n01) / n if n else 0.0,
                        agreement=(n11 + n00) / n if n else 1.0, n10=n10, n01=n01,
                        p_mcnemar=mcnemar_exact(n10, n01), diff=(n01 - n10) / n if n else 0.0, ci_lo=lo, ci_hi=hi,
                        ci_method="tango", confidence=confidence, newcombe_lo=nlo, newcombe_hi=nhi)


def compare_paired(a, b, n_boot: int = 10000, seed: int = 0, confidence: float = 0.95,
                   interval: str = "auto", clusters=None) -> PairedResult:
    """All paired statistics of candidate ``b`` against baseline ``a``.

    ``interval``: "tango" (scores must be 0/1; ``compare_counts``), "bootstrap" (``paired_bootstrap``
    with ``n_boot`` and ``seed``), or "auto": tango when every score is 0 or 1, else bootstrap.
    ``clusters`` (one label per pair, or None), when some cluster holds two or more pairs: with 0/1 scores
    "tango" becomes ``compare_clustered``; the bootstrap resamples whole clusters (``ci_method``
    "bootstrap_clustered").
    """
    if interval not in INTERVALS:
        raise ValueError(f"interval must be one of {INTERVALS}, got {interval!r}")
    a, b = _check_pair(a, b)
    _check_confidence(confidence)
    binary = is_binary(a, b)
    if interval == "tango" and not binary:
        raise ValueError("interval='tango' needs 0/1 scores; use 'bootstrap' (or 'auto') for partial scores")
    n10, n01 = discordant(a, b)
    labels = None
    if clusters is not None:
        labels = [str(c) for c in clusters]
        if len(labels) != len(a):
            raise ValueError(f"clusters must name one cluster per pair, got {len(labels)} for {len(a)} pairs")
        if len(set(labels)) == len(labels):
            labels = None  # every cluster one pair: the plain statistics
    if binary and interval != "bootstrap":
        if labels is not None:
            return compare_clustered(a, b, labels, confidence)
        n11 = sum(1 for x, y in zip(a, b) if x == 1.0 and y == 1.0)
        return compare_counts(n11, n10, n01, len(a) - n11 - n10 - n01, confidence)
    diff, lo, hi = paired_bootstrap(a, b, n_boot, confidence, seed=seed, clusters=labels)
    n = len(a)
    kind, n_clusters = ("bootstrap", None) if labels is None else ("bootstrap_clustered", len(set(labels)))
    return PairedResult(n=n, acc_a=sum(a) / n if n else 0.0, acc_b=sum(b) / n if n else 0.0,
                        agreement=agreement(a, b), n10=n10, n01=n01, p_mcnemar=mcnemar_exact(n10, n01),
                        diff=diff, ci_lo=lo, ci_hi=hi, ci_method=kind, confidence=confidence, clusters=n_clusters)
