"""What one device call would carry: the working tree as it travels (tracked files that are present, and
untracked files git does not ignore) plus the ignored paths named in the call's carry, against the 64 MiB a
call takes. Prints each part, the total, the room left and the ``compile_cache.py trim --max-mib`` that
fits it (the room less a 0.25 MiB margin).

    python lab/gpu/carry_size.py [CARRY ...]      # from the repo root, after parking what stays behind
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

LIMIT = 64 * 2**20
MARGIN = 2**18


def tree_bytes(repo: Path) -> int:
    """Bytes of the files a call copies from the working tree of ``repo``."""
    names = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True).stdout.decode().split("\0")
    return sum((repo / n).stat().st_size for n in set(names) if n and (repo / n).is_file())


def path_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("carry", nargs="*", type=Path, help="the ignored paths the call carries")
    ap.add_argument("--repo", type=Path, default=Path("."), help="the checkout (default: here)")
    args = ap.parse_args(argv)
    missing = [str(c) for c in args.carry if not (args.repo / c).exists()]
    if missing:
        ap.error(f"carry paths not found: {', '.join(missing)}")
    parts = {"working tree": tree_bytes(args.repo)}
    parts.update({str(c): path_bytes(args.repo / c) for c in args.carry})
    total = sum(parts.values())
    for name, n in parts.items():
        print(f"{n / 2**20:9.2f} MiB  {name}")
    room = LIMIT - total
    print(f"{total / 2**20:9.2f} MiB  in all, of {LIMIT / 2**20:.0f} MiB: room {room / 2**20:.2f} MiB")
    if room > MARGIN:
        print(f"compile caches that fit: compile_cache.py trim ... --max-mib {(room - MARGIN) / 2**20:.2f}")
    else:
        print("no room for compile caches" + ("; over the limit: park more" if room < 0 else ""))
    return 0 if room >= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
