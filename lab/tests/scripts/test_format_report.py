"""lab/scripts/format_report.py: one row per index-K format, bf16 agreeing with itself, on a small run."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "format_report.py"


def test_prints_a_row_per_format():
    from m3_kernels.formats import IndexKFormat

    res = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "1024", "--queries", "4"], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line for line in res.stdout.splitlines() if line.startswith("| ")
            and not line.startswith("| format")}
    assert set(rows) == {f.value for f in IndexKFormat}
    assert rows["bf16"].rstrip().endswith("| 100.0% |")
