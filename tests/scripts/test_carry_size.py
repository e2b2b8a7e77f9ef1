"""scripts/gpu/carry_size.py: a call's payload is the tree as it travels (tracked files present, untracked ones
git does not ignore) plus the carried ignored paths, against 64 MiB."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "carry_size.py"


def _write(path: Path, n: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(n))


def _run(repo: Path, *carry: str):
    return subprocess.run([sys.executable, str(SCRIPT), "--repo", str(repo), *carry], capture_output=True, text=True)


def test_the_tree_as_it_travels_plus_the_carry(tmp_path):
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/big/\n*.xz\n")
    _write(repo / "code.py", 3000)
    _write(repo / "parked" / "weights.bin", 5000)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), "commit", "-qm", "x"],
                   check=True)
    (repo / "parked" / "weights.bin").unlink()  # a tracked file moved out for the call: not carried
    _write(repo / "new.py", 700)  # untracked, not ignored: carried
    _write(repo / "big" / "part", 2**20)  # ignored: only when named
    _write(repo / "w.bin.xz", 20000)
    tree = 3000 + 700 + len((repo / ".gitignore").read_bytes())

    proc = _run(repo)
    assert proc.returncode == 0, proc.stderr
    assert f"{tree / 2**20:9.2f} MiB  working tree" in proc.stdout
    proc = _run(repo, "big", "w.bin.xz")
    total = tree + 2**20 + 20000
    assert proc.returncode == 0 and f"{total / 2**20:9.2f} MiB  in all" in proc.stdout
    room = 64 * 2**20 - total
    assert f"--max-mib {(room - 2**18) / 2**20:.2f}" in proc.stdout

    with open(repo / "big" / "more", "wb") as f:  # over the limit (a sparse file: its size, not its blocks)
        f.truncate(64 * 2**20)
    proc = _run(repo, "big")
    assert proc.returncode == 1 and "over the limit" in proc.stdout
    proc = _run(repo, "nowhere")
    assert proc.returncode == 2 and "carry paths not found: nowhere" in proc.stderr
