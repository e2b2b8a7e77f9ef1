"""lab/gpu/carry_size.py: a call's payload is the tree as it travels (tracked files present, untracked ones
git does not ignore) plus the carried ignored paths, against 64 MiB."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "lab" / "gpu" / "carry_size.py"
sys.path.insert(0, str(SCRIPT.parent))
import carry_size  # noqa: E402

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]


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


def test_a_conflicted_file_counts_once(tmp_path):
    """Mid-merge, git lists a conflicted file once per stage: it is still one file in the tree."""
    repo = tmp_path / "repo"

    def git(*args):
        subprocess.run([*GIT, "-C", str(repo), *args], check=True, capture_output=True)

    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f").write_text("base\n")
    git("add", "f")
    git("commit", "-qm", "base")
    git("checkout", "-qb", "other")
    (repo / "f").write_text("theirs\n" * 50)
    git("commit", "-qam", "theirs")
    git("checkout", "-q", "-")
    (repo / "f").write_text("ours\n" * 20)
    git("commit", "-qam", "ours")
    merge = subprocess.run([*GIT, "-C", str(repo), "merge", "-q", "other"], capture_output=True, text=True)
    assert merge.returncode != 0 and "CONFLICT" in merge.stdout + merge.stderr
    _write(repo / "g.py", 321)
    assert carry_size.tree_bytes(repo) == (repo / "f").stat().st_size + 321


def test_a_carried_folder_counts_its_files_only(tmp_path):
    rng = random.Random()
    sizes = {}
    for _ in range(30):
        rel = Path(*[f"d{rng.randrange(4)}" for _ in range(rng.randrange(1, 5))], f"f{len(sizes)}")
        sizes[rel] = rng.randrange(0, 5000)
        _write(tmp_path / "carry" / rel, sizes[rel])
    assert carry_size.path_bytes(tmp_path / "carry") == sum(sizes.values())
    assert carry_size.path_bytes(tmp_path / "carry" / rel) == sizes[rel]


@pytest.mark.parametrize("room,rc,says,not_said", [
    (carry_size.MARGIN + 2**20, 0, "--max-mib 1.00", "no room"),
    (carry_size.MARGIN, 0, "no room for compile caches\n", "--max-mib"),  # the margin is not room
    (1000, 0, "no room for compile caches\n", "--max-mib"),
    (0, 0, "no room for compile caches\n", "over the limit"),  # exactly full still travels
    (-1, 1, "no room for compile caches; over the limit: park more", "--max-mib"),
])
def test_room_at_the_edges(tmp_path, capsys, room, rc, says, not_said):
    """An empty repo carrying one ignored sparse file of LIMIT - room bytes."""
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".git" / "info").mkdir(exist_ok=True)
    (repo / ".git" / "info" / "exclude").write_text("/big/\n")  # ignored, and no .gitignore in the tree
    (repo / "big").mkdir()
    with open(repo / "big" / "w", "wb") as f:
        f.truncate(carry_size.LIMIT - room)
    assert carry_size.main(["--repo", str(repo), "big"]) == rc
    out = capsys.readouterr().out
    assert says in out and not_said not in out, out
