"""lab/scripts/sass_report.py: every decode variant still compiles for sm_90 with the kernel's constexprs as
launched (a new constexpr the report does not set broke it silently once), and its page loop is found.
Needs Triton's bundled ptxas and cuobjdump; no GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "lab" / "scripts" / "sass_report.py"
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.skipif(not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(),
                    reason="Triton's bundled ptxas/cuobjdump are not installed")
def test_every_decode_variant_compiles_for_sm90_and_reports_its_page_loop():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1]
            for line in run.stdout.splitlines() if line.startswith("| ") and not line.startswith("| variant")}
    assert {"fp8", "mxfp4", "mxfp4_per_group"} <= set(rows), run.stdout
    cols = [c.strip() for c in next(line for line in run.stdout.splitlines()
                                     if line.startswith("| variant")).split("|")[2:-1]]
    for name in ("fp8", "mxfp4", "mxfp4_per_group"):
        row = dict(zip(cols, (int(v) for v in rows[name])))
        assert row["loop_instrs"] > 0 and row["HGMMA"] > 0, (name, row)  # the page loop, on the tensor cores
        assert row["STL"] == 0 and row["LDL"] == 0, (name, row)  # no spills in the loop
