"""The GPU gate's record: which trees of ``kernels/`` and ``sglang_m3/`` passed the GPU suite, on what machine.

A change to ``kernels/`` or ``sglang_m3/`` is done when the GPU suite (``lab/gpu/before_after.sh tests``,
i.e. every ``gpu``-marked test under ``tests/``) has passed at that commit. Each run, or each landing that
could get no GPU, adds one row to ``lab/logs/gpu-gate.md``. The rows key on the git tree ids of the two
folders, so committing the log itself does not move them, and ``lab/tests/scripts/test_gate.py`` fails
when the folders at HEAD have no row, or when their newest row failed.

    python lab/gpu/gate.py archive REV DIR [--with PATH ...]   # DIR/src: the files the suite needs at REV
                                                       # (carried), plus PATHs such as a model's weights
    python lab/gpu/gate.py record REV MACHINE LOG ...  # append the row of a returned run (each LOG: a
                                                       # pytest_gpu.log; shards of one suite are summed)
    python lab/gpu/gate.py no-gpu REV WHY           # append a row saying that no GPU could be had
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOG = ROOT / "lab" / "logs" / "gpu-gate.md"
GATED = ("kernels", "sglang_m3")
SUITE_FILES = ("kernels", "sglang_m3", "accuracy", "tests", "examples", "scripts", "conftest.py", "pyproject.toml",
               "lab/gpu", "configs/minimax-m3.1", "configs/minimax-m3.1-tiny")
HEADER = ("| date | commit | kernels tree | sglang_m3 tree | machine | passed | failed | skipped | result |\n"
          "|---|---|---|---|---|---|---|---|---|\n")


def _git(*args: str, repo: Path = ROOT) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def trees(rev: str = "HEAD", repo: Path = ROOT) -> tuple[str, ...]:
    """The git tree ids of the gated folders at ``rev``."""
    return tuple(_git("rev-parse", f"{rev}:{name}", repo=repo) for name in GATED)


def counts(pytest_log: str) -> dict[str, int]:
    """passed / failed / skipped / errors from pytest's last summary line (0 where absent)."""
    lines = [ln for ln in pytest_log.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    if not lines:
        raise ValueError("LOG has no pytest summary line (the run was cut short?)")
    found = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1])}
    return {k: found.get(k, 0) for k in ("passed", "failed", "skipped")} | {
        "errors": found.get("error", 0) + found.get("errors", 0)}


def rows(text: str) -> list[dict[str, str]]:
    """The table rows of a gate log, oldest first."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[0] not in ("date", "") and not set(cells[0]) <= set("-"):
            out.append(dict(zip(("date", "commit", "kernels", "sglang_m3", "machine", "passed", "failed",
                                 "skipped", "result"), cells)))
    return out


def verdict(text: str, current: tuple[str, ...]) -> tuple[bool, str]:
    """Whether the gated trees ``current`` are covered: their newest row passed, or says no GPU was had."""
    mine = [r for r in rows(text) if (r["kernels"], r["sglang_m3"]) == current]
    if not mine:
        return False, (f"kernels/ and sglang_m3/ at HEAD (trees {current[0][:10]}, {current[1][:10]}) have no row in "
                       "lab/logs/gpu-gate.md: run `lab/gpu/before_after.sh tests` on a GPU machine and "
                       "`python lab/gpu/gate.py record ...`, or `python lab/gpu/gate.py no-gpu REV WHY`")
    last = mine[-1]
    if last["result"] not in ("passed", "no GPU"):
        return False, f"the newest GPU-suite row for these trees ({last['commit']}, {last['date']}) is {last['result']!r}"
    return True, last["result"]


def _append(row: list[str]) -> None:
    text = LOG.read_text() if LOG.exists() else ""
    if HEADER not in text:
        raise SystemExit(f"gate: {LOG} lacks the table header; restore it before appending")
    LOG.write_text(text.rstrip("\n") + "\n| " + " | ".join(row) + " |\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("archive")
    a.add_argument("rev")
    a.add_argument("dir", type=Path)
    a.add_argument("--with", dest="extra", nargs="+", default=[], metavar="PATH")
    r = sub.add_parser("record")
    r.add_argument("rev")
    r.add_argument("machine", help='the card, e.g. "one H100"')
    r.add_argument("log", type=Path, nargs="+")
    n = sub.add_parser("no-gpu")
    n.add_argument("rev")
    n.add_argument("why")
    args = ap.parse_args(argv)
    rev = _git("rev-parse", "--short", args.rev)
    today = datetime.date.today().isoformat()
    if args.cmd == "archive":
        src = args.dir / "src"
        if src.exists():
            raise SystemExit(f"gate: {src} exists; remove it first")
        src.mkdir(parents=True)
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *SUITE_FILES, *args.extra], capture_output=True,
                             check=True)
        subprocess.run(["tar", "-x", "-C", str(src)], input=tar.stdout, check=True)
        (args.dir / "COMMIT").write_text(rev + "\n")
        print(f"{src}: {rev}, {len(tar.stdout) // 1024} KiB")
        return 0
    k, s = trees(rev)
    if args.cmd == "no-gpu":
        _append([today, rev, k, s, f"none: {args.why.replace('|', '/')}", "-", "-", "-", "no GPU"])
        print(f"{LOG.name}: {rev} no GPU ({args.why})")
        return 0
    c = dict(passed=0, failed=0, skipped=0, errors=0)
    for log in args.log:
        if not log.is_file():
            raise SystemExit(f"gate: LOG {log} is not a file")
        for key, n in counts(log.read_text(errors="replace")).items():
            c[key] += n
    result = "passed" if c["failed"] == 0 and c["errors"] == 0 and c["passed"] > 0 else "failed"
    failed = str(c["failed"] + c["errors"])
    _append([today, rev, k, s, args.machine, str(c["passed"]), failed, str(c["skipped"]), result])
    print(f"{LOG.name}: {rev} on {args.machine}: {c} -> {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
