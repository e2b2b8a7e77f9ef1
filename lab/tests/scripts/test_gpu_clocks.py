"""lab/gpu/gpu_clocks.py: the sampler against a stand-in ``nvidia-smi`` on PATH (this machine has no GPU),
and the summary over hand-written rows."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "lab" / "gpu" / "gpu_clocks.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_clocks  # noqa: E402

# A stand-in nvidia-smi: prints one reading per call (clocks from $FAKE_SM); fails a query naming the reasons
# field when $FAKE_NO_REASONS is set, and every query when $FAKE_BROKEN is.
FAKE_SMI = """#!/bin/sh
[ -n "$FAKE_BROKEN" ] && exit 9
case "$*" in
  *clocks_event_reasons*) [ -n "$FAKE_NO_REASONS" ] && exit 2
                          echo "${FAKE_SM}, 3201, 612.40, 61, 98, 0x0000000000000004" ;;
  *) echo "${FAKE_SM}, 3201, 612.40, 61, 98" ;;
esac
"""


def _fake_path(tmp_path) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def _sample(tmp_path, every="0.1", rows=3, **env):
    """Run the sampler on the stand-in until it has written ``rows`` rows (or exited by itself), then SIGTERM it."""
    out = tmp_path / "clocks.csv"
    environ = {**os.environ, "PATH": _fake_path(tmp_path), "FAKE_SM": "1755", **env}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "sample", str(out), "--every", every], env=environ,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        if out.exists() and len(out.read_text().splitlines()) > rows:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    return proc, out


def test_sampler_writes_rows_until_terminated(tmp_path):
    proc, out = _sample(tmp_path)
    assert proc.returncode == 0, proc.stderr.read()
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 3
    assert list(rows[0]) == gpu_clocks.COLUMNS
    r = rows[-1]
    readings = (r["sm_mhz"], r["mem_mhz"], r["power_w"], r["temp_c"], r["util_pct"])
    assert readings == ("1755", "3201", "612.40", "61", "98")
    assert int(r["reasons"], 16) == 0x4
    assert int(r["cores"]) == os.cpu_count()
    assert float(r["load1"]) >= 0


def test_sampler_stops_at_once_mid_sleep(tmp_path):
    """SIGTERM while it sleeps for 60 s after its first row: it exits within seconds, the row kept."""
    t0 = time.monotonic()
    proc, out = _sample(tmp_path, every="60", rows=1)
    assert proc.returncode == 0 and time.monotonic() - t0 < 30
    with open(out, newline="") as f:
        assert len(list(csv.DictReader(f))) == 1


def test_sampler_without_the_reasons_field_and_without_a_driver(tmp_path):
    proc, out = _sample(tmp_path, FAKE_NO_REASONS="1")
    assert proc.returncode == 0
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["reasons"] == "-" for r in rows)
    assert "not reported" in gpu_clocks.summarize(out, 50)

    (tmp_path / "broken").mkdir()
    proc, out = _sample(tmp_path / "broken", FAKE_BROKEN="1")
    assert proc.returncode == 1
    assert "not sampling" in proc.stderr.read()
    assert not out.exists()


def _rows(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(gpu_clocks.COLUMNS)
        for r in rows:
            w.writerow(r)


def test_summary_reads_the_busy_rows_only(tmp_path):
    path = tmp_path / "c.csv"
    _rows(path, [
        ("10:00:00", 345, 3201, 75.0, 30, 0, "0x1", 0.5, 16),  # idle: left out
        ("10:00:05", 1980, 3201, 600.0, 50, 99, "0x0", 1.0, 16),
        ("10:00:10", 1500, 3201, 700.0, 71, 100, "0x4", 3.0, 16),  # capped by power
        ("10:00:15", 1700, 3201, "[N/A]", 65, 97, "0x44", 2.0, 16),  # power cap and HW thermal
        ("10:00:20", 1100, 3201, 300.0, 40, 49, "0x8", 9.0, 16),  # below --busy 50: left out
    ])
    line = gpu_clocks.summarize(path, 50)
    assert line.startswith("GPU samples: 3 of 5 at >= 50% utilization: SM 1700 MHz, memory 3201 MHz, 650 W")
    assert "up to 71 C" in line
    assert "sw-power-cap 2, hw-thermal 1" in line
    assert "hw-slowdown" not in line and "idle" not in line
    assert "host load 2.0 on 16 cores" in line
    assert gpu_clocks.summarize(path, 101) == "GPU samples: 5, none at >= 101% utilization"


def test_reason_names_keeps_unknown_bits():
    assert gpu_clocks.reason_names(0) == []
    assert gpu_clocks.reason_names(0x84) == ["sw-power-cap", "hw-power-brake"]
    assert gpu_clocks.reason_names(0x1001) == ["idle", "0x1000"]


@pytest.mark.parametrize("argv,msg", [
    (["sample", "x.csv", "--every", "0"], "--every must be > 0"),
    (["summarize", "no-such.csv"], "csv: no such file"),
])
def test_bad_arguments_are_named(tmp_path, argv, msg):
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2
    assert msg in proc.stderr


def test_summary_edges(tmp_path):
    """A row at exactly --busy counts; the hottest idle row (cooling after work) is not the busy rows' top; bits
    reported but none set read "none", not "not reported"."""
    path = tmp_path / "c.csv"
    _rows(path, [
        ("10:00:00", 1980, 3201, 600.0, 64, 50, "0x0", 1.0, 16),
        ("10:00:05", 1980, 3201, 620.0, 66, 90, "0x0", 1.0, 16),
        ("10:00:10", 345, 3201, 90.0, 80, 0, "0x1", 1.0, 16),
    ])
    line = gpu_clocks.summarize(path, 50)
    assert line.startswith("GPU samples: 2 of 3 at >= 50% utilization: SM 1980 MHz, memory 3201 MHz, 610 W")
    assert "up to 66 C" in line and "clock-event reasons (samples): none;" in line


def test_reason_names_of_every_known_bit():
    assert gpu_clocks.reason_names(0x1FF) == list(gpu_clocks.REASON_BITS.values())
    assert gpu_clocks.reason_names(0x101) == ["idle", "display-clocks"]
    assert gpu_clocks.reason_names(0x300) == ["display-clocks", "0x200"]


def test_sampler_appends_to_an_existing_file_under_one_header(tmp_path):
    _sample(tmp_path, rows=1)
    proc, out = _sample(tmp_path, rows=3)  # the same OUT.csv again: a call resumed on a held machine
    assert proc.returncode == 0
    lines = out.read_text().splitlines()
    assert lines[0] == ",".join(gpu_clocks.COLUMNS) and lines.count(lines[0]) == 1 and len(lines) >= 4
