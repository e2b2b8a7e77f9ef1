"""The GPU's clocks, power, temperature, utilization and clock-event reasons, and the host's load, sampled
through a call, so that a slow call can be told apart: a GPU held at a lower clock (power, thermal), a busy
host (load average over the core count), or neither (a slower machine, or the work itself).

    python lab/gpu/gpu_clocks.py sample OUT.csv [--every 5]    # until killed (SIGTERM); GPU 0
    python lab/gpu/gpu_clocks.py summarize OUT.csv [--busy 50]  # one line, over the busy samples

``OUT.csv`` columns: time (UTC), sm_mhz, mem_mhz, power_w, temp_c, util_pct, reasons (the hex bitmask of
``clocks_event_reasons.active``, or ``-`` where the driver does not report it), load1 (the host's
one-minute load average), cores.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

FIELDS = ["clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "utilization.gpu"]
REASONS = "clocks_event_reasons.active"
COLUMNS = ["time", "sm_mhz", "mem_mhz", "power_w", "temp_c", "util_pct", "reasons", "load1", "cores"]
# clocks_event_reasons bits (nvidia-smi --help-query-gpu); the idle bit alone is the normal state between work
REASON_BITS = {
    0x1: "idle",
    0x2: "app-clocks",
    0x4: "sw-power-cap",
    0x8: "hw-slowdown",
    0x10: "sync-boost",
    0x20: "sw-thermal",
    0x40: "hw-thermal",
    0x80: "hw-power-brake",
    0x100: "display-clocks",
}


def query(fields: list[str]) -> list[str] | None:
    """One ``nvidia-smi`` reading of GPU 0 as strings, or None if the query fails."""
    try:
        out = subprocess.run(["nvidia-smi", "-i", "0", f"--query-gpu={','.join(fields)}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]


def sample(path: Path, every: float) -> int:
    """Append a row to ``path`` every ``every`` seconds until SIGTERM/SIGINT, which end it at once (mid-sleep):
    the call that started it waits for it before packing its logs."""

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    fields = FIELDS + [REASONS]
    if query(fields) is None:  # an older driver without the reasons field, or none at all
        fields = FIELDS
        if query(fields) is None:
            print(f"gpu_clocks: nvidia-smi --query-gpu={','.join(fields)} fails: not sampling", file=sys.stderr)
            return 1
    cores = os.cpu_count() or 0
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if f.tell() == 0:
            w.writerow(COLUMNS)
        while True:
            row = query(fields)
            if row is not None:
                reasons = row[5] if len(row) > 5 else "-"
                load1 = os.getloadavg()[0]
                w.writerow([time.strftime("%H:%M:%S", time.gmtime()), *row[:5], reasons, f"{load1:.2f}", cores])
                f.flush()
            time.sleep(every)


def reason_names(mask: int) -> list[str]:
    """The names of the bits set in a ``clocks_event_reasons`` mask; bits not named here as one hex value."""
    names = [name for bit, name in REASON_BITS.items() if mask & bit]
    rest = mask & ~sum(REASON_BITS)
    return names + ([f"0x{rest:x}"] if rest else [])


def number(value: str) -> float:
    """A reading as a float; NaN for what the driver could not report (``[N/A]``)."""
    try:
        return float(value)
    except ValueError:
        return math.nan


def summarize(path: Path, busy: float) -> str:
    """One line over the rows with utilization >= ``busy`` percent: their count of all, the median SM and
    memory clocks, median power, the largest temperature, the clock-event reasons seen, the median load."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    hot = [r for r in rows if number(r["util_pct"]) >= busy]
    if not hot:
        return f"GPU samples: {len(rows)}, none at >= {busy:g}% utilization"

    def med(key: str) -> float:
        values = [v for v in (number(r[key]) for r in hot) if not math.isnan(v)]
        return statistics.median(values) if values else math.nan

    reported = [r["reasons"] for r in hot if r["reasons"] != "-"]
    seen = Counter(name for mask in reported for name in reason_names(int(mask, 16)))
    if not reported:
        reasons = "not reported"
    else:
        reasons = ", ".join(f"{k} {v}" for k, v in seen.most_common()) or "none"
    cores = hot[0]["cores"]
    top_temp = max(number(r["temp_c"]) for r in hot)
    return (f"GPU samples: {len(hot)} of {len(rows)} at >= {busy:g}% utilization: SM {med('sm_mhz'):.0f} MHz, "
            f"memory {med('mem_mhz'):.0f} MHz, {med('power_w'):.0f} W (medians), up to {top_temp:.0f} C; "
            f"clock-event reasons (samples): {reasons}; host load {med('load1'):.1f} on {cores} cores")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample", help="append rows until killed")
    s.add_argument("csv", type=Path)
    s.add_argument("--every", type=float, default=5.0, help="seconds between rows (default 5)")
    m = sub.add_parser("summarize", help="one line over the busy rows")
    m.add_argument("csv", type=Path)
    m.add_argument("--busy", type=float, default=50.0, help="utilization percent a row needs (default 50)")
    args = ap.parse_args(argv)
    if args.cmd == "sample":
        if args.every <= 0:
            ap.error(f"--every must be > 0 seconds, got {args.every}")
        try:
            return sample(args.csv, args.every)
        except KeyboardInterrupt:  # SIGTERM or SIGINT: the rows written so far are the result
            return 0
    if not args.csv.is_file():
        ap.error(f"csv: no such file {args.csv}")
    print(summarize(args.csv, args.busy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
