"""lab/gpu/park.py: paths parked outside a checkout come back byte for byte; the xz copy it makes of a
weight file decompresses to the file and is gone afterwards; every refusal names its argument."""

import lzma
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "lab" / "gpu" / "park.py"


def _run(repo: Path, *args: str):
    return subprocess.run([sys.executable, str(SCRIPT), "--repo", str(repo), *args], capture_output=True, text=True)


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    for rel, n in [("docs/a.md", 300), ("docs/perf_data/x.jsonl", 5000), ("tests/t.py", 200),
                   ("configs/small/w.safetensors", 4000), ("configs/medium/config.json", 50),
                   ("configs/medium/model.safetensors", 70000), ("scripts/s.sh", 100)]:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_bytes(os.urandom(n // 2) + bytes(n - n // 2))  # half random: xz shrinks it
    return repo


def test_out_then_in_restores_the_tree(repo, tmp_path):
    before = _tree(repo)
    park = tmp_path / "park"
    proc = _run(repo, "out", str(park), "--xz", "configs/medium/model.safetensors", "docs", "tests", "configs/small")
    assert proc.returncode == 0, proc.stderr
    assert sorted(_tree(repo)) == ["configs/medium/config.json", "configs/medium/model.safetensors.xz", "scripts/s.sh"]
    xz = (repo / "configs/medium/model.safetensors.xz").read_bytes()
    assert lzma.decompress(xz) == before["configs/medium/model.safetensors"]
    assert len(xz) < len(before["configs/medium/model.safetensors"])
    assert (park / "parked.txt").read_text().splitlines() == [
        "xz configs/medium/model.safetensors", "path docs", "path tests", "path configs/small"]

    proc = _run(repo, "out", str(park), "scripts")  # a second parking into the same folder
    assert proc.returncode != 0 and "is not empty" in proc.stderr
    assert (repo / "scripts/s.sh").exists()

    proc = _run(repo, "in", str(park))
    assert proc.returncode == 0, proc.stderr
    assert _tree(repo) == before
    assert not park.exists()


def test_in_refuses_to_overwrite(repo, tmp_path):
    park = tmp_path / "park"
    assert _run(repo, "out", str(park), "docs").returncode == 0
    (repo / "docs").mkdir()
    (repo / "docs" / "new.md").write_text("written while parked")
    proc = _run(repo, "in", str(park))
    assert proc.returncode != 0 and "docs exist in the checkout again" in proc.stderr
    assert (park / "docs" / "a.md").exists() and (repo / "docs" / "new.md").exists()


def test_in_cut_short_is_finished_by_in_again(repo, tmp_path):
    before = _tree(repo)
    park = tmp_path / "park"
    assert _run(repo, "out", str(park), "--xz", "configs/medium/model.safetensors", "docs", "tests").returncode == 0
    (park / "docs").rename(repo / "docs")  # the first entry back, then the `in` was killed
    proc = _run(repo, "in", str(park))
    assert proc.returncode == 0, proc.stderr
    assert _tree(repo) == before and not park.exists()


@pytest.mark.parametrize("args,msg", [
    (["out", "{park}", "nope"], "nope does not exist"),
    (["out", "{park}", "../outside"], "must be a path inside the checkout"),
    (["out", "{park}", "."], "must be a path inside the checkout"),
    (["out", "{repo}/inner", "docs"], "must lie outside the checkout"),
    (["out", "{park}", "--xz", "docs", "tests"], "--xz docs must be a file"),
    (["out", "{park}", "docs", "docs"], "a path is named twice"),
    (["out", "{park}", "docs/perf_data", "docs"], "docs/perf_data lies inside docs, named too"),
    (["out", "{park}", "--xz", "configs/medium/model.safetensors", "configs"], "lies inside configs"),
    (["out", "{park}"], "name at least one path"),
    (["in", "{park}"], "nothing parked there"),
])
def test_refusals_name_the_argument_and_move_nothing(repo, tmp_path, args, msg):
    (tmp_path / "outside").write_text("x")
    before = _tree(repo)
    args = [a.format(park=tmp_path / "park", repo=repo) for a in args]
    proc = _run(repo, *args)
    assert proc.returncode != 0 and msg in proc.stderr, proc.stderr
    assert _tree(repo) == before


def test_an_empty_park_folder_and_a_path_with_spaces(repo, tmp_path):
    """PARK may exist if empty; a parked path may hold spaces (the manifest keeps the rest of its line)."""
    (repo / "my notes" / "two  spaces.md").parent.mkdir()
    (repo / "my notes" / "two  spaces.md").write_bytes(os.urandom(100))
    before = _tree(repo)
    park = tmp_path / "park"
    park.mkdir()
    proc = _run(repo, "out", str(park), "my notes", "docs")
    assert proc.returncode == 0, proc.stderr
    assert not (repo / "my notes").exists() and (park / "my notes" / "two  spaces.md").is_file()
    proc = _run(repo, "in", str(park))
    assert proc.returncode == 0, proc.stderr
    assert _tree(repo) == before and not park.exists()


def test_in_refuses_when_a_parked_path_is_gone_and_keeps_the_manifest(repo, tmp_path):
    park = tmp_path / "park"
    assert _run(repo, "out", str(park), "docs", "tests").returncode == 0
    manifest = (park / "parked.txt").read_text()
    for f in sorted((park / "tests").rglob("*"), reverse=True):  # lost meanwhile
        f.unlink() if f.is_file() else f.rmdir()
    (park / "tests").rmdir()
    proc = _run(repo, "in", str(park))
    assert proc.returncode != 0 and f"tests neither under {park} nor in the checkout" in proc.stderr
    assert (park / "parked.txt").read_text() == manifest and (park / "docs" / "a.md").is_file()
    assert not (repo / "docs").exists()
