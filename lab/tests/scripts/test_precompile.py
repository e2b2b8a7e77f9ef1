"""lab/gpu/precompile.py: bytecode written on all cores even where the interpreter writes none itself, read
by the next import (no invalid-escape warning, which only compiling from source raises: a SyntaxWarning from
Python 3.12, a DeprecationWarning before), nothing compiled twice, and folders or packages that are not there
skipped."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "lab" / "gpu" / "precompile.py"


def _run(*args, cwd=None, env_extra=None):
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env_extra or {})}
    env.pop("PYTHONPYCACHEPREFIX", None)
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env)


def test_bytecode_is_written_despite_dontwritebytecode_and_then_read(tmp_path):
    pkg = tmp_path / "site" / "warnpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub import mod\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text('PATTERN = "a\\.b"  # an invalid escape: a SyntaxWarning when compiled\n')
    (pkg / "broken.py").write_text("def (:\n")  # not valid Python: left without bytecode, not an error
    site = tmp_path / "site"

    # from source, as the servers did: the warning, and no bytecode written
    imp = _run("-W", "always", "-c", "import warnpkg", cwd=site)
    assert imp.returncode == 0 and "invalid escape sequence" in imp.stderr
    assert not list(site.rglob("*.pyc"))

    proc = _run(SCRIPT, site, "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert "writes off" in proc.stdout and f"{site}: 0 -> 3 of 4 modules" in proc.stdout
    assert "invalid escape sequence" not in proc.stderr
    for rel in ("warnpkg/__init__.py", "warnpkg/sub/mod.py"):
        assert os.path.exists(importlib.util.cache_from_source(str(site / rel)))

    imp = _run("-W", "always", "-c", "import warnpkg; print(warnpkg.mod.PATTERN)", cwd=site)
    assert imp.returncode == 0 and imp.stdout.strip() == "a\\.b" and "invalid escape sequence" not in imp.stderr

    again = _run(SCRIPT, site)
    assert f"{site}: 3 -> 3 of 4 modules" in again.stdout


def test_a_package_name_is_its_folder_and_missing_ones_are_skipped(tmp_path):
    pkg = tmp_path / "findme"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    proc = _run(SCRIPT, "findme", "no_such_package_m3", tmp_path / "no-such-dir", cwd=tmp_path,
                env_extra={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "findme: 0 -> 1 of 1 modules" in proc.stdout
    assert "no_such_package_m3: no such folder or package, skipped" in proc.stdout
    assert f"{tmp_path / 'no-such-dir'}: no such folder or package, skipped" in proc.stdout
    assert os.path.exists(importlib.util.cache_from_source(str(pkg / "__init__.py")))
