"""lab/gpu/files_written.py: only files modified after the marker count, the skipped folders and links are
not walked, a folder under two roots counts once, and the summary cuts folders below their own root."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "lab" / "gpu"))
import files_written  # noqa: E402


def _write(path: Path, size: int, old: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    if old:
        os.utime(path, (1_000_000, 1_000_000))


def test_counts_what_was_written_after_the_marker(tmp_path):
    home, prefix, run = tmp_path / "home", tmp_path / "prefix", tmp_path / "home" / "repo" / "run"
    _write(home / ".nv" / "ComputeCache" / "index", 10, old=True)  # before the call: not counted
    marker = tmp_path / "marker"
    marker.touch()
    os.utime(marker, (2_000_000, 2_000_000))
    _write(home / ".nv" / "ComputeCache" / "3" / "a" / "k1", 1000)
    _write(home / ".nv" / "ComputeCache" / "7" / "k2", 3000)
    _write(home / "repo" / "build" / "site" / "__pycache__" / "m.cpython-312.pyc", 200)
    _write(run / "triton" / "x.cubin", 5000)  # the run directory: skipped
    _write(prefix / "lib" / "python3.12" / "site-packages" / "torch" / "__pycache__" / "t.cpython-312.pyc", 100)
    (home / "loop").symlink_to(home)  # a link: not followed
    (home / "repo" / "prefix-link").symlink_to(prefix, target_is_directory=True)

    rows = files_written.written_since(marker, [home, prefix, home / "repo"], skip=[run])
    assert sum(r[0] for r in rows.values()) == 4 and sum(r[1] for r in rows.values()) == 2
    assert rows[os.path.realpath(home / ".nv" / "ComputeCache" / "7")] == [1, 0, 3000]
    merged = files_written.summarize(rows, [home, prefix, home / "repo"], depth=2)
    assert merged == {str(home / ".nv" / "ComputeCache"): [2, 0, 4000],
                      str(home / "repo" / "build" / "site"): [1, 1, 200],
                      str(prefix / "lib" / "python3.12"): [1, 1, 100]}

    out = tmp_path / "all.txt"
    proc = subprocess.run([sys.executable, str(ROOT / "lab" / "gpu" / "files_written.py"), str(marker),
                           str(home), str(prefix), "--skip", str(run), "--top", "1", "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "written during this call outside its run directory: 4 files (2 .pyc), 0.0 MiB"
    assert lines[1:] == [f"  {home / '.nv' / 'ComputeCache'}: 2 files (0 .pyc), 0.0 MiB"]
    assert len(out.read_text().splitlines()) == 4


def test_named_roots_print_their_folders_without_the_machine_path(tmp_path):
    home, prefix = tmp_path / "home", tmp_path / "home" / "venv"
    marker = tmp_path / "marker"
    marker.touch()
    os.utime(marker, (2_000_000, 2_000_000))
    _write(home / ".cache" / "lib" / "a", 10)
    _write(prefix / "lib" / "python3.12" / "b.pyc", 20)  # under both: the deeper root names it
    out = tmp_path / "all.txt"
    proc = subprocess.run([sys.executable, str(ROOT / "lab" / "gpu" / "files_written.py"), str(marker),
                           f"HOME={home}", f"PREFIX={prefix}", "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1:] == ["  $HOME/.cache/lib: 1 files (0 .pyc), 0.0 MiB",
                                            "  $PREFIX/lib/python3.12: 1 files (1 .pyc), 0.0 MiB"]
    assert str(tmp_path) not in proc.stdout + out.read_text()


def test_a_missing_marker_is_an_error_naming_it(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "lab" / "gpu" / "files_written.py"),
                           str(tmp_path / "nope"), str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "marker" in proc.stderr and "nope" in proc.stderr


def test_a_file_as_old_as_the_marker_is_not_counted(tmp_path):
    marker = tmp_path / "marker"
    marker.touch()
    os.utime(marker, (2_000_000, 2_000_000))
    _write(tmp_path / "r" / "same", 10)
    os.utime(tmp_path / "r" / "same", (2_000_000, 2_000_000))
    _write(tmp_path / "r" / "later", 30)
    os.utime(tmp_path / "r" / "later", (2_000_001, 2_000_001))
    assert files_written.written_since(marker, [tmp_path / "r"], skip=[]) == {
        os.path.realpath(tmp_path / "r"): [1, 0, 30]}


def test_a_root_is_a_folder_not_a_name_prefix(tmp_path):
    """Roots ``a`` and its parent: ``ab/x/y`` lies under the parent only, though its path starts with ``.../a``."""
    t = os.path.realpath(tmp_path)
    rows = {f"{t}/ab/x/y": [1, 0, 5], f"{t}/a/q": [2, 1, 7]}
    assert files_written.summarize(rows, [tmp_path / "a", tmp_path], depth=2) == {
        f"{t}/ab/x": [1, 0, 5], f"{t}/a/q": [2, 1, 7]}
    names = {f"{t}/a": "A", t: "T"}
    assert files_written.shown(f"{t}/ab/x", names) == "$T/ab/x"
    assert files_written.shown(f"{t}/a", names) == "$A" and files_written.shown(f"{t}/a/q", names) == "$A/q"


def test_a_root_whose_path_holds_an_equals_sign_is_a_bare_root(tmp_path):
    root = tmp_path / "k=v"
    assert files_written._named_root(str(root)) == (None, root)
    assert files_written._named_root(f"HOME={root}") == ("HOME", root)
