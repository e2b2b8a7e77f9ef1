"""Exact coverage of the paired-difference intervals of ``accuracy.stats`` at small n.

For each n, every paired table of n pairs is enumerated once; the coverage at a point (cell
probabilities both right, baseline only, candidate only, both wrong) is the multinomial probability
of the tables whose interval holds the true difference. Points are drawn at random:

- ``agreeing`` (default): formats that agree on most samples, discordance uniform in
  [0, --max-discordant], its split and the accuracy drawn from Beta(0.3, 0.3) (one-way losses and
  accuracies near 0 or 1 are frequent);
- ``simplex``: Dirichlet(0.3) over all four cells, corners with nearly every pair discordant included.

    python lab/scripts/interval_coverage.py [--n 5 10 20 40] [--points 3000] [--region agreeing] [--seed 12]

Prints a table: per n and interval, mean and lowest coverage and the point of the lowest.
"""

import argparse

import numpy as np
from scipy.stats import multinomial

from accuracy.stats import newcombe_interval, tango_interval


def tables(n: int) -> np.ndarray:
    """``[count, 4]`` int: every (n11, n10, n01, n00) with sum n."""
    return np.array([(a, b, c, n - a - b - c) for a in range(n + 1) for b in range(n + 1 - a)
                     for c in range(n + 1 - a - b)])


def draw_points(rng, count: int, region: str, max_discordant: float) -> np.ndarray:
    """``[count, 4]`` cell probabilities (n11, n10, n01, n00 order)."""
    if region == "simplex":
        return rng.dirichlet([0.3] * 4, count)
    disc = rng.uniform(0, max_discordant, count)
    split, acc = rng.beta(0.3, 0.3, count), rng.beta(0.3, 0.3, count)
    return np.stack([(1 - disc) * acc, disc * split, disc * (1 - split), (1 - disc) * (1 - acc)], 1)


def coverage(n: int, points: np.ndarray, ends: np.ndarray, table_list: np.ndarray) -> np.ndarray:
    """``[points]`` exact coverage of the intervals ``ends [tables, 2]`` of the true p01 - p10."""
    out = np.empty(len(points))
    for i in range(0, len(points), 200):  # [200, tables] weights at a time
        chunk = points[i : i + 200]
        weights = multinomial.pmf(table_list[None], n, chunk[:, None, :])
        delta = (chunk[:, 2] - chunk[:, 1])[:, None]
        out[i : i + 200] = (weights * ((ends[None, :, 0] <= delta) & (delta <= ends[None, :, 1]))).sum(1)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[5, 10, 20, 40])
    p.add_argument("--points", type=int, default=3000)
    p.add_argument("--region", choices=["agreeing", "simplex"], default="agreeing")
    p.add_argument("--max-discordant", type=float, default=0.3)
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=12)
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print(f"region {args.region}" + (f" (discordance <= {args.max_discordant})" if args.region == "agreeing" else "")
          + f", {args.points} points per n, seed {args.seed}, {100 * args.confidence:g}% intervals")
    print("| n | interval | mean coverage | lowest | at (n11, n10, n01, n00) |")
    print("|---:|---|---:|---:|---|")
    for n in args.n:
        table_list = tables(n)
        points = draw_points(rng, args.points, args.region, args.max_discordant)
        tango = {}
        kinds = {
            "Tango": np.array([tango.setdefault((b, c), tango_interval(b, c, n, args.confidence))
                               for _, b, c, _ in table_list]),
            "Newcombe": np.array([newcombe_interval(*map(int, t), args.confidence) for t in table_list]),
        }
        for name, ends in kinds.items():
            cov = coverage(n, points, ends, table_list)
            worst = np.round(points[cov.argmin()], 3).tolist()
            print(f"| {n} | {name} | {cov.mean():.4f} | {cov.min():.4f} | {worst} |")


if __name__ == "__main__":
    main()
