"""Park what a device call need not carry outside the checkout, and put it back afterwards.

A call carries the working tree as it is (64 MiB a call with the carried paths). The accuracy calls need
``scripts/``, ``accuracy/``, the packages and one model, not ``docs/`` or ``tests/``; a model's weights travel
smaller as xz (``accuracy_h200.sh`` decompresses ``<shard>.safetensors.xz`` beside itself).

    python lab/gpu/park.py out ../park --xz configs/msa-medium/model-00001-of-00001.safetensors \\
        docs tests configs/msa-small            # from the repo root
    python lab/gpu/park.py in ../park       # everything back, the xz copies removed, ../park gone

``out`` moves each PATH (relative to the repo root) to the same relative path under PARK and records it in
``PARK/parked.txt``; ``--xz FILE`` first writes ``FILE.xz`` beside FILE (kept in the tree, to be carried),
then parks FILE; a path inside another one named is refused. ``in`` refuses to overwrite anything that came
back into the tree meanwhile, and finishes an ``in`` that was cut short.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

MANIFEST = "parked.txt"


def _inside(repo: Path, rel: str) -> Path:
    path = (repo / rel).resolve()
    if path == repo or repo not in path.parents:
        raise SystemExit(f"park: {rel!r} must be a path inside the checkout {repo}, not the checkout or outside it")
    return path


def park_out(repo: Path, park: Path, paths: list[str], xz: list[str]) -> list[str]:
    """Move ``paths`` and ``xz`` (after compressing each beside itself) under ``park``; returns the manifest."""
    if park.exists() and any(park.iterdir()):
        raise SystemExit(f"park: {park} is not empty (a parking not yet brought back? `park.py in {park}`)")
    if repo == park.resolve() or repo in park.resolve().parents:
        raise SystemExit(f"park: PARK {park} must lie outside the checkout (a call carries what is inside)")
    rels = [*xz, *paths]
    if len(set(rels)) != len(rels):
        raise SystemExit(f"park: a path is named twice: {rels}")
    for rel in rels:
        if not _inside(repo, rel).exists():
            raise SystemExit(f"park: {rel} does not exist")
    nested = [(a, b) for a in rels for b in rels if _inside(repo, b) in _inside(repo, a).parents]  # a inside b
    if nested:
        raise SystemExit(f"park: {nested[0][0]} lies inside {nested[0][1]}, named too: name only the outer one")
    for rel in xz:
        if not _inside(repo, rel).is_file():
            raise SystemExit(f"park: --xz {rel} must be a file")
    for rel in xz:
        src = _inside(repo, rel)
        subprocess.run(["xz", "-T0", "-6", "-k", "-f", str(src)], check=True)
    park.mkdir(parents=True, exist_ok=True)
    lines = []
    for rel in rels:
        dst = park / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(_inside(repo, rel)), str(dst))
        lines.append(f"{'xz' if rel in xz else 'path'} {rel}")
        (park / MANIFEST).write_text("\n".join(lines) + "\n")  # after each move: an interrupted run can come back
    return lines


def park_in(repo: Path, park: Path) -> list[str]:
    """Move everything recorded under ``park`` back, delete the xz copies ``out`` made, remove ``park``."""
    manifest = park / MANIFEST
    if not manifest.is_file():
        raise SystemExit(f"park: {manifest} not found: nothing parked there")
    entries = [line.split(" ", 1) for line in manifest.read_text().splitlines() if line.strip()]
    # An entry no longer under PARK but in the checkout was brought back by an `in` cut short: skipped.
    clash = [rel for _, rel in entries if _inside(repo, rel).exists() and (park / rel).exists()]
    if clash:
        raise SystemExit(f"park: {', '.join(clash)} exist in the checkout again; move them aside first")
    lost = [rel for _, rel in entries if not _inside(repo, rel).exists() and not (park / rel).exists()]
    if lost:
        raise SystemExit(f"park: {', '.join(lost)} neither under {park} nor in the checkout")
    for kind, rel in entries:
        dst = _inside(repo, rel)
        if not (park / rel).exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(park / rel), str(dst))
        if kind == "xz":
            dst.with_name(dst.name + ".xz").unlink(missing_ok=True)
    manifest.unlink()
    for d in sorted((p for p in park.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        d.rmdir()  # only the folders the moves left empty; anything else stops here with an error
    park.rmdir()
    return [rel for _, rel in entries]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("out", help="park paths outside the checkout")
    o.add_argument("park", type=Path, help="a folder outside the checkout, absent or empty")
    o.add_argument("paths", nargs="*", help="paths relative to the repo root")
    o.add_argument("--xz", action="append", default=[], metavar="FILE",
                   help="compress FILE to FILE.xz in the tree, then park FILE (repeatable)")
    i = sub.add_parser("in", help="bring a parking back")
    i.add_argument("park", type=Path)
    ap.add_argument("--repo", type=Path, default=Path("."), help="the checkout (default: here)")
    args, extra = ap.parse_known_args(argv)
    if args.cmd == "out":  # paths after --xz FILE (argparse stops filling a positional at an option)
        args.paths += [e for e in extra if not e.startswith("-")]
        extra = [e for e in extra if e.startswith("-")]
    if extra:
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    repo = args.repo.resolve()
    if args.cmd == "out":
        if not args.paths and not args.xz:
            ap.error("out: name at least one path or --xz FILE")
        for line in park_out(repo, args.park, args.paths, args.xz):
            print(f"parked {line}")
    else:
        for rel in park_in(repo, args.park):
            print(f"back {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
