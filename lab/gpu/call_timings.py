"""Where an accuracy call's time went, read from what it returned (``call.log`` and ``logs.tgz``): per server the
call started, the seconds from launch to ready, the CUDA-graph capture, the rounds, the prefill rate, and the
configurations Triton's autotuner picked (``TRITON_PRINT_AUTOTUNING=1``: SGLang's sparse prefill attention, 41-43%
of a prefill, picks among 9 at its first call in each server process; its decode attention, among 8 at each batch
bucket) or the one ``M3_SPARSE_PREFILL_CONFIG`` / ``M3_SPARSE_DECODE_CONFIG`` held.

    python lab/gpu/call_timings.py CALL_DIR [CALL_DIR ...]     # one markdown row per server

A held machine's server logs keep the servers of earlier calls; a call's own are those launched after its start
(``accuracy_h200: start ...`` in ``call.log``; the machine's clock is UTC). Prefill rate: the new tokens of every
``Prefill batch`` line over the seconds from the first such line to the last (1-s stamps).
"""

from __future__ import annotations

import argparse
import re
import sys
import tarfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")
ROUND = re.compile(r"\[resume\] (\S+): round of (\d+) prompts in ([\d.]+) s")
START = re.compile(r"accuracy_h200: start (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)Z")
CAPTURE = re.compile(r"Capture target decode CUDA graph end\. elapsed=([\d.]+) s")
NEW_TOKENS = re.compile(r"Prefill batch.*#new-token: (\d+)")
AUTOTUNED = re.compile(r"^Triton autotuning for function (\w+),")
PICKED = re.compile(r"^best config selected: (.*);")
HELD = re.compile(r"sparse (prefill|decode) attention held to (\d+) warps, (\d+) stages")  # M3_SPARSE_*_CONFIG
HELD_KERNEL = {"prefill": "_gqa_share_sparse_fwd_kernel", "decode": "_gqa_share_sparse_decode_kernel"}


@dataclass
class Server:
    fmt: str
    launched: datetime
    ready: datetime | None = None
    capture_s: float | None = None
    prefill_tokens: int = 0
    prefill_stamps: list[datetime] = field(default_factory=list)
    autotuned: list[tuple[str, str]] = field(default_factory=list)  # (kernel, "w<warps> s<stages>") in pick order

    @property
    def prefill_rate(self) -> float | None:
        if len(self.prefill_stamps) < 2:
            return None
        span = (self.prefill_stamps[-1] - self.prefill_stamps[0]).total_seconds()
        return self.prefill_tokens / span if span > 0 else None


def _stamp(line: str) -> datetime | None:
    m = STAMP.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S") if m else None


def _config(text: str) -> str:
    """``w<num_warps> s<num_stages>`` and any block sizes, from Triton's printed ``Config``."""
    fields = dict(kv.split(": ", 1) for kv in text.split(", ") if ": " in kv)
    blocks = [f"{k}={v}" for k, v in fields.items() if k.startswith("BLOCK")]
    return " ".join(blocks + [f"w{fields.get('num_warps', '?')}", f"s{fields.get('num_stages', '?')}"])


def servers_in_log(fmt: str, text: str) -> list[Server]:
    """Every server a log holds, in launch order (a server begins at its ``server_args=`` line)."""
    servers: list[Server] = []
    kernel = None
    for line in text.splitlines():
        t = _stamp(line)
        if t is None:  # Triton's autotuning report: four lines, no stamp
            if m := AUTOTUNED.match(line):
                kernel = m.group(1)
            elif (m := PICKED.match(line)) and kernel and servers:
                servers[-1].autotuned.append((kernel, _config(m.group(1))))
                kernel = None
            continue
        if "server_args=" in line:
            servers.append(Server(fmt, t))
            continue
        if not servers:
            continue
        s = servers[-1]
        if s.ready is None and "The server is fired up" in line:
            s.ready = t
        elif m := HELD.search(line):
            s.autotuned.append((HELD_KERNEL[m.group(1)], f"w{m.group(2)} s{m.group(3)} held"))
        elif (m := CAPTURE.search(line)) and s.capture_s is None:
            s.capture_s = float(m.group(1))
        elif m := NEW_TOKENS.search(line):
            s.prefill_tokens += int(m.group(1))
            s.prefill_stamps.append(t)
    return servers


def read_call(call_dir: Path) -> tuple[datetime, dict[str, list[float]], list[Server], str]:
    """The call's start, its rounds' seconds by format, the servers it launched, its GPU-samples line (or '')."""
    log = (call_dir / "call.log").read_text(errors="replace")
    m = START.search(log)
    if m is None:
        raise SystemExit(f"call_timings: {call_dir}/call.log has no 'accuracy_h200: start' line")
    start = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")
    rounds: dict[str, list[float]] = {}
    for fmt, _, seconds in ROUND.findall(log):
        rounds.setdefault(fmt, []).append(float(seconds))
    gpu = next((line for line in log.splitlines() if line.startswith("GPU samples:")), "")
    servers: list[Server] = []
    logs = call_dir / "logs.tgz"
    if logs.is_file():
        with tarfile.open(logs) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if not (member.isfile() and re.fullmatch(r"acc-server-.+\.log", name)):
                    continue
                text = tar.extractfile(member).read().decode(errors="replace")
                fmt = name[len("acc-server-"):-len(".log")]
                servers += [s for s in servers_in_log(fmt, text) if s.launched >= start]
    return start, rounds, sorted(servers, key=lambda s: s.launched), gpu


def table(call_dirs: list[Path], labels: list[str] | None = None) -> str:
    """A markdown row per server the calls launched (``labels``: the calls' names, default their folders')."""
    lines = ["| call | format | rounds | launch to ready s | CUDA-graph capture s | round s: first; later | "
             "prefill new tokens/s | autotuned |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for d, label in zip(call_dirs, labels or [d.name for d in call_dirs]):
        start, rounds, servers, gpu = read_call(d)
        for s in servers:
            r = rounds.get(s.fmt, [])
            ready = f"{(s.ready - s.launched).total_seconds():.0f}" if s.ready else "not ready"
            capture = f"{s.capture_s:.1f}" if s.capture_s is not None else "-"
            later = f"{min(r[1:]):.1f}-{max(r[1:]):.1f}" if len(r) > 1 else "-"
            first = f"{r[0]:.1f}" if r else "-"
            rate = f"{s.prefill_rate / 1000:.1f}k" if s.prefill_rate else "-"
            picks: dict[str, list[str]] = {}
            for kernel, config in s.autotuned:
                picks.setdefault(kernel.strip("_").removesuffix("_kernel"), []).append(config)
            tuned = "; ".join(f"{k} {', '.join(v)}" for k, v in picks.items()) or "-"
            lines.append(f"| {label} ({start:%H:%M} UTC) | {s.fmt} | {len(r)} | {ready} | {capture} | {first}; {later} "
                         f"| {rate} | {tuned} |")
        if gpu:
            notes.append(f"{label}: {gpu}")
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("calls", nargs="+", type=Path, help="the folders the calls returned")
    args = ap.parse_args(argv)
    for d in args.calls:
        if not (d / "call.log").is_file():
            ap.error(f"calls: {d} holds no call.log")
    print(table(args.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
