"""scripts/setup.sh says what it does: a line per step, and pip's own progress for the long install (no -q),
instead of minutes of silence. Run on a stand-in venv whose python records its arguments."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls"
case "$*" in
  *"import sglang"*) echo "SGLang 0.0-fake" ;;
  *) echo "python $*" ;;
esac
"""


def test_setup_prints_a_line_per_step_and_leaves_pip_talking(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = {**os.environ, "VENV": str(venv), "SGLANG_VERSION": "0.5.16", "EXTRAS": "test"}
    done = subprocess.run([str(ROOT / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    steps = [line for line in done.stdout.splitlines() if line.startswith("setup.sh [")]
    assert [s.split("] ", 1)[1][:3] for s in steps] == ["1/3", "2/3", "3/3", "don"], done.stdout
    assert "SGLang 0.5.16" in steps[2] and "SGLang 0.0-fake" in steps[3]
    calls = (venv / "bin" / "calls").read_text().splitlines()
    install = next(c for c in calls if "sglang==0.5.16" in c)
    assert " -q" not in f" {install}" and "-e .[test]" in install  # pip's progress shows
