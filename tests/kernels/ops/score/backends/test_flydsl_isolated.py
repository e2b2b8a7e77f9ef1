"""Runs ``test_flydsl.py`` in a fresh interpreter (see ``conftest.py``): its result is this test's."""

import os
import pathlib
import subprocess
import sys

SUITE = pathlib.Path(__file__).with_name("test_flydsl.py")


def test_flydsl_suite_in_own_process():
    env = dict(os.environ, M3_FLYDSL_INPROC="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(SUITE)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}"
