"""Land the H200 comparison's calls in the repo: what each `lab/gpu/accuracy_h200.sh` call returns
(`call.log`, `state.tgz` or its parts, ...) becomes the committed resume state, new rows of the per-sample dump, the
call's log and, last, the rebuilt report and plot (`lab/scripts/accuracy_h200_report.sh`).

    python lab/scripts/accuracy_h200_land.py [--date YYYY-MM-DD] [--no-report] CALL_DIR [CALL_DIR ...]

CALL_DIRs are the calls' returned folders in the order they ran. A call's state holds every row of the
state it resumed from, so the last one is the new state. Each state must hold every row of the one before
it and the last every committed row, unchanged, or nothing is written (a call resumed from the wrong state,
or not at all, would lose rows). Landing calls again adds nothing. Writes, under
lab/data/:
- accuracy_h200_resume/state.tgz: the last call's state, its sample rows (``acc/``) only, repacked with sorted
  names and no owners (a call's agreement selections, ``agreement/``, are not landed: the committed ones are
  accuracy_h200_resume/agreement_formats.tgz, packed by hand; so a call resumed from this state with
  ``AGREE_FORMATS`` left at its default serves the agreement study again);
- accuracy_h200_2026-12-02_q4_samples.jsonl: the rows not yet in it appended (``format`` and ``task``
  first), the rows already there left in place;
- accuracy_h200_<date>_q4_call<N>.log for each call, N counting on from the highest already there, the
  machine's absolute paths into the repo cut to repo-relative ones and the root of its other home, scratch and
  temporary paths written <machine> (a log already landed is skipped);
- accuracy_h200_<date>_q4_report.md and accuracy_h200_<date>_q4_accuracy_vs_length.png.
Then prints the report's first table and, per call, where its time went (lab/gpu/call_timings.py).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "lab" / "gpu")]
import call_timings  # noqa: E402
from accuracy.run import write_atomic  # noqa: E402
STATE = Path("accuracy_h200_resume") / "state.tgz"
SAMPLES = "accuracy_h200_2026-12-02_q4_samples.jsonl"
# A kept log with a suffix (``call30_repeat.log``: served, not landed) still takes its number.
_CALL_LOG = re.compile(r"accuracy_h200_\d{4}-\d{2}-\d{2}_q4_call(\d+)(?:_[\w-]+)?\.log$")
# An absolute path up to one of the repo's top-level folders: /any/where/main/build/x -> build/x. Not a URL's path
# (the first slash follows a space, a quote or a bracket), nor one through a hidden folder or an installed package
# (/home/u/.cache/torch/kernels/x, .../site-packages/kernels/x are not the repo's).
_REPO_PATH = re.compile(r"(?<![\w./:~-])/(?:(?!(?:site|dist)-packages/)[\w+@-][\w.+@-]*/)+?"
                        r"(?=(?:build|scripts|configs|accuracy|sglang_m3|kernels|lab|training|tests|docs|out)/)")
# What is left of a machine's own folders after that: their root becomes <machine>.
_MACHINE_PATH = re.compile(r"(?<![\w./:~-])/(?:root|tmp|work|home|farm|scratch|mnt)(?=/)")


def read_state(tgz: Path) -> dict:
    """{(format, task, doc_id): row} from a state archive's ``acc/samples/<format>/<task>.jsonl`` files."""
    rows = {}
    with tarfile.open(tgz) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) != 4 or parts[:2] != ("acc", "samples") or not parts[3].endswith(".jsonl"):
                continue
            fmt, task = parts[2], parts[3][:-len(".jsonl")]
            for line in tar.extractfile(member).read().decode().splitlines():
                row = json.loads(line)
                rows[(fmt, task, row["doc_id"])] = row
    return rows


def strip_paths(text: str) -> str:
    """The log with absolute paths into the repo made repo-relative, and the root of any other path under a
    machine's home, scratch or temporary folders written ``<machine>``; URLs are left as they are."""
    return _MACHINE_PATH.sub("<machine>", _REPO_PATH.sub("", text))


def check_superset(old: dict, new: dict, new_name: str, old_name: str) -> None:
    """Every row of ``old`` is in ``new``, unchanged; raises naming both otherwise."""
    missing = [k for k in old if k not in new]
    if missing:
        raise SystemExit(f"{new_name}: lacks {len(missing)} rows of {old_name} (first: {missing[0]}); "
                         "was the call resumed from the committed state, and are the calls in the order they ran?")
    changed = [k for k in old if new[k] != old[k]]
    if changed:
        raise SystemExit(f"{new_name}: {len(changed)} rows differ from {old_name} (first: {changed[0]})")


def repack(src_tgz: Path, dst_tgz: Path) -> None:
    """``src_tgz``'s ``acc/`` tree rewritten to ``dst_tgz`` with sorted names, numeric owner 0, every time
    1970-01-01 and no time in the gzip header: the same rows give the same bytes, so landing again changes
    nothing in git."""
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(src_tgz) as tar:
            tar.extractall(tmp, filter="data")
        plain = subprocess.run(["tar", "-C", tmp, "--sort=name", "--owner=0", "--group=0", "--numeric-owner",
                                "--mtime=@0", "-cf", "-", "acc"], check=True, capture_output=True).stdout
    write_atomic(dst_tgz, gzip.compress(plain, compresslevel=6, mtime=0))


def _state_archive(d: Path, tmp: Path) -> Path:
    """A call's ``state.tgz``, or its parts (``state.tgz.part-*``, a state over 15 MiB) joined under ``tmp``."""
    parts = sorted(d.glob("state.tgz.part-*"))
    if (d / "state.tgz").is_file() or not parts:
        return d / "state.tgz"
    joined = tmp / f"{len(list(tmp.iterdir()))}-state.tgz"
    joined.write_bytes(b"".join(part.read_bytes() for part in parts))
    return joined


def land(call_dirs: list[Path], perf_data: Path, date: str, report: bool) -> dict:
    """Land ``call_dirs`` (in call order) into ``perf_data``; returns what was written."""
    with tempfile.TemporaryDirectory() as tmp:
        archives = [_state_archive(d, Path(tmp)) for d in call_dirs]
        return _land(call_dirs, archives, perf_data, date, report)


def _land(call_dirs: list[Path], archives: list[Path], perf_data: Path, date: str, report: bool) -> dict:
    for d, a in zip(call_dirs, archives):
        if not a.is_file() or not (d / "call.log").is_file():
            raise SystemExit(f"CALL_DIR {d}: needs call.log and state.tgz or its parts (what accuracy_h200.sh returns)")
    states = [read_state(a) for a in archives]
    for i in range(1, len(call_dirs)):
        check_superset(states[i - 1], states[i], f"{call_dirs[i]}/state.tgz", f"{call_dirs[i - 1]}/state.tgz")
    new, new_name = states[-1], f"{call_dirs[-1]}/state.tgz"
    check_superset(read_state(perf_data / STATE), new, new_name, "the committed state")

    dump_path = perf_data / SAMPLES
    dump_text = dump_path.read_text() if dump_path.exists() else ""
    dump_lines = dump_text.splitlines()
    dumped = {}
    for line in dump_lines:
        r = json.loads(line)
        dumped[(r["format"], r["task"], r["doc_id"])] = {k: v for k, v in r.items() if k not in ("format", "task")}
    check_superset(dumped, new, new_name, SAMPLES)
    added = [k for k in new if k not in dumped]

    saved = {p: int(m[1]) for p in perf_data.iterdir() if (m := _CALL_LOG.search(p.name))}  # log -> call number
    n = max(saved.values(), default=0)
    landed = {strip_paths(p.read_text(errors="replace")): k for p, k in saved.items()}
    logs, call_numbers = {}, []  # every log read before anything is written
    for d in call_dirs:
        text = strip_paths((d / "call.log").read_text(errors="replace"))
        if text not in landed:
            n += 1
            logs[perf_data / f"accuracy_h200_{date}_q4_call{n}.log"] = text
            landed[text] = n
        call_numbers.append(landed[text])

    # Each file is replaced whole; cut short between two of them, a landing run again finishes the job.
    repack(archives[-1], perf_data / STATE)
    if dump_text and not dump_text.endswith("\n"):
        dump_text += "\n"
    write_atomic(dump_path, (dump_text + "".join(
        json.dumps({"format": fmt, "task": task, **new[(fmt, task, doc_id)]}) + "\n"
        for fmt, task, doc_id in added)).encode())
    for path, text in logs.items():
        write_atomic(path, text.encode())
    log_paths = list(logs)

    out = {"rows_added": len(added), "rows": len(new), "logs": [p.name for p in log_paths], "calls": call_numbers}
    if report:
        with tempfile.TemporaryDirectory() as tmp:
            if subprocess.run(["bash", str(REPO / "lab" / "scripts" / "accuracy_h200_report.sh"), tmp], cwd=REPO).returncode:
                raise SystemExit("accuracy_h200_report.sh failed (its log's tail above); the state, rows and logs are "
                                 "landed: fix the report and rerun this command, which appends nothing twice")
            shutil.copy(Path(tmp) / "report.md", perf_data / f"accuracy_h200_{date}_q4_report.md")
            plot = perf_data / f"accuracy_h200_{date}_q4_accuracy_vs_length.png"
            shutil.copy(Path(tmp) / "accuracy_vs_length.png", plot)
        out["report"] = f"accuracy_h200_{date}_q4_report.md"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("call_dirs", nargs="+", type=Path, help="the calls' returned folders, in call order")
    ap.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                    help="date in the new files' names (default: today, UTC)")
    ap.add_argument("--perf-data", type=Path, default=REPO / "lab" / "data", help=argparse.SUPPRESS)
    ap.add_argument("--no-report", action="store_true", help="leave the report and plot as they are")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", args.date):
        ap.error(f"--date must be YYYY-MM-DD, got {args.date!r}")
    if not args.no_report and args.perf_data.resolve() != (REPO / "lab" / "data").resolve():
        ap.error("--perf-data other than lab/data needs --no-report (the report reads lab/data)")
    out = land(args.call_dirs, args.perf_data, args.date, not args.no_report)
    print(f"state: {out['rows']} rows, {out['rows_added']} new appended to {SAMPLES}")
    print("call logs: " + (", ".join(out["logs"]) or "none new"))
    if "report" in out:
        report = (args.perf_data / out["report"]).read_text()
        overview = report.split("\n\n## ", 1)[0]  # the report's first section: every format against fp8
        print(f"report: {out['report']} and its plot\n\n{overview}")
    print("\n## Where each call's time went (lab/gpu/call_timings.py)\n")
    try:
        print(call_timings.table(args.call_dirs, [f"call {n}" for n in out["calls"]]))
    except SystemExit as e:  # the calls are landed by now; a log the timings cannot read changes nothing
        print(f"(not read: {e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
