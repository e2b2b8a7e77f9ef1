"""The files a call wrote outside its own folders, counted by folder: where the caches it does not redirect went.

A fresh H200 spent 26-36 s more than a held one in its first CUDA-graph capture, GPU idle and one core busy, with
the Triton, nvcc and Inductor caches carried. What a held machine keeps between calls and a fresh one rebuilds is
written somewhere: the CUDA driver's PTX cache, torch's NVRTC kernels, Python bytecode, a library's own cache.
This lists it.

    python lab/gpu/files_written.py MARKER [NAME=]ROOT ... [--skip DIR ...] [--depth 2] [--top 8] [--out FILE]

MARKER: a file touched when the call started; a file counts if it was modified after it. Each ROOT is walked
without following links, the ``--skip`` folders (the run directory, ``$OUT``) left out, a folder reached from
two roots counted once. Prints the total and the ``--top`` folders, cut ``--depth`` levels below their root,
with their files, ``.pyc`` files among them, and bytes; ``--out`` gets every folder, one a line. A folder under
a root given as ``NAME=ROOT`` is printed as ``$NAME/...``, so the log names no machine's paths.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path


def written_since(marker: Path, roots: list[Path], skip: list[Path]) -> dict[str, list[int]]:
    """Folder -> [files, .pyc files, bytes] of the files under ``roots`` modified after ``marker``."""
    since = marker.stat().st_mtime
    skipped = {os.path.realpath(s) for s in skip}
    seen: set[str] = set()
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for root in roots:
        for folder, dirs, files in os.walk(root):
            real = os.path.realpath(folder)
            if real in seen or real in skipped:
                dirs[:] = []
                continue
            seen.add(real)
            for name in files:
                try:
                    st = os.lstat(os.path.join(folder, name))
                except OSError:
                    continue
                if st.st_mtime > since:
                    row = out[real]
                    row[0] += 1
                    row[1] += name.endswith(".pyc")
                    row[2] += st.st_size
    return dict(out)


def summarize(rows: dict[str, list[int]], roots: list[Path], depth: int) -> dict[str, list[int]]:
    """``rows`` merged into folders at most ``depth`` levels below the deepest root holding them."""
    real_roots = sorted((os.path.realpath(r) for r in roots), key=len, reverse=True)
    merged: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for folder, row in rows.items():
        root = next((r for r in real_roots if folder == r or folder.startswith(r.rstrip("/") + "/")), "/")
        rel = Path(folder).relative_to(root).parts[:depth]
        key = str(Path(root, *rel))
        merged[key] = [a + b for a, b in zip(merged[key], row)]
    return dict(merged)


def _line(folder: str, row: list[int]) -> str:
    return f"{folder}: {row[0]} files ({row[1]} .pyc), {row[2] / 2**20:.1f} MiB"


def _named_root(arg: str) -> tuple[str | None, Path]:
    """``NAME=ROOT`` -> (NAME, ROOT); a bare ``ROOT`` -> (None, ROOT)."""
    name, sep, path = arg.partition("=")
    return (name, Path(path)) if sep and name.isidentifier() else (None, Path(arg))


def shown(folder: str, names: dict[str, str]) -> str:
    """``folder`` as ``$NAME/rest`` under the deepest named root holding it (``names``: real root -> NAME)."""
    for root in sorted(names, key=len, reverse=True):
        if folder == root or folder.startswith(root.rstrip("/") + "/"):
            return f"${names[root]}{folder[len(root.rstrip('/')):]}"
    return folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("marker", type=Path)
    ap.add_argument("roots", nargs="+", help="folders to search, each ROOT or NAME=ROOT")
    ap.add_argument("--skip", type=Path, action="append", default=[])
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not args.marker.is_file():
        ap.error(f"marker {args.marker} is not a file (touch it when the call starts)")
    named = [_named_root(a) for a in args.roots]
    roots = [r for _, r in named if r.is_dir()]
    names = {os.path.realpath(r): name for name, r in named if name}
    rows = written_since(args.marker, roots, args.skip)
    total = [sum(r[i] for r in rows.values()) for i in range(3)]
    print(_line("written during this call outside its run directory", total))
    merged = summarize(rows, roots, args.depth)
    for folder, row in sorted(merged.items(), key=lambda kv: (-kv[1][0], kv[0]))[: args.top]:
        print("  " + _line(shown(folder, names), row))
    if args.out:
        args.out.write_text("".join(_line(shown(f, names), r) + "\n" for f, r in sorted(rows.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
