"""Compile caches that travel to a fresh machine: the Triton kernels, the nvcc-built (TVM-FFI) modules and
torch Inductor's compiled graphs that a server built on one machine, packed so that the next machine's first
server start loads them instead of building them again. On an H200 a fresh start took 150 s, a held machine's
34 s, and a fresh one with the Triton and nvcc caches carried 81 s, 38 s of it in the first CUDA-graph capture
(6 s held), where Inductor compiles SGLang's ``torch.compile`` activations: hence its cache too, which saved 8 s
of the 43; other caches a fresh machine may rebuild travel as ``--extra`` (lab/logs/accuracy-h200-log.md).

    python lab/gpu/compile_cache.py pack TRITON_DIR JIT_DIR OUT.tar.xz [--inductor-dir DIR] [--extra NAME=DIR ...]
        [--max-mib 15]
    python lab/gpu/compile_cache.py trim IN.tar.xz OUT.tar.xz --max-mib M
    python lab/gpu/compile_cache.py unpack IN.tar.xz TRITON_DIR JIT_DIR [--inductor-dir DIR] [--extra NAME=DIR ...]

``pack`` keeps what a cache hit reads. From Triton's cache (``TRITON_CACHE_DIR``): each kernel's binary
(``.cubin``), metadata and group files (``.json``) and the compiled launchers (``.so``); not the
intermediate IRs (``.ptx``, ``.llir``, ``.ttir``, ``.ttgir``, ``.source``). From the JIT cache
(``TVM_FFI_CACHE_DIR``): each build folder's ``<folder module name>.so``, which SGLang's ``load_jit`` loads
without building when it exists. From Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``): every file but its
``locks/``, ``triton/`` (Triton's own cache holds those kernels when ``TRITON_CACHE_DIR`` is set) and
``precompiled_headers/`` (CPU builds) folders, so that its FX graph cache hits and loads the generated code
instead of compiling again. Each ``--extra NAME=DIR`` (the CUDA driver's PTX cache, ``CUDA_CACHE_PATH``; torch's
NVRTC kernel cache, ``PYTORCH_KERNEL_CACHE_PATH``) travels whole, as ``extra/NAME/``. Past ``--max-mib`` (a call
returns files of at most 16 MiB) it writes nothing and exits non-zero.

``trim`` makes an archive fit what a call can still carry (on any machine, before the call): it keeps whole
units (a JIT module, a top-level folder of Inductor's cache, a Triton cache entry, an extra cache), the JIT
modules first (each saves a nvcc build of 10-20 s), then Inductor's folders (small; a graph is of no use without
its code), then the Triton entries smallest first, then each extra cache whole (what they save is not measured
yet), as many as fit in ``--max-mib`` packed together (the whole archive when it fits; 26.9 MiB of an H200's
caches packed to 1.8 MiB).

``unpack`` fills only caches that are empty (a machine that built its own keeps them) and points each
Triton group file at the new folder: those files name their members by absolute path, and Triton skips
a member whose path does not exist. Every file it writes, the rewritten group files too, keeps the archive's
time, 1970-01-01, so that ``find -newermt 1971-01-01`` lists what the machine built itself.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import os
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

TRITON_KEEP = (".cubin", ".json", ".so")
INDUCTOR_SKIP = ("locks", "triton", "precompiled_headers")  # top-level folders of Inductor's cache left behind
UNIT_ORDER = ("jit", "inductor", "triton", "extra")  # what trim keeps first
EXTRA_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")


def _members(triton_dir: Path, jit_dir: Path, inductor_dir: Path | None = None,
             extra: dict[str, Path] | None = None) -> list[tuple[Path, str]]:
    """(file, name in the archive) for everything ``pack`` keeps, sorted by name."""
    out = []
    for name, d in (extra or {}).items():
        if d.is_dir():
            out += [(f, f"extra/{name}/{f.relative_to(d)}") for f in d.rglob("*") if f.is_file()]
    if inductor_dir is not None and inductor_dir.is_dir():
        out += [(f, f"inductor/{f.relative_to(inductor_dir)}") for f in inductor_dir.rglob("*")
                if f.is_file() and f.relative_to(inductor_dir).parts[0] not in INDUCTOR_SKIP]
    if triton_dir.is_dir():
        out += [(f, f"triton/{f.relative_to(triton_dir)}") for f in triton_dir.rglob("*")
                if f.is_file() and f.suffix in TRITON_KEEP]
    if jit_dir.is_dir():
        out += [(f, f"jit/{f.relative_to(jit_dir)}") for f in jit_dir.glob("*/*.so")
                if f.is_file() and f.name == f.parent.name.split("__arch_")[0] + ".so"]
    return sorted(out, key=lambda m: m[1])


def _xz_tar(members: list[tuple[str, bytes]]) -> bytes:
    """A tar.xz of (name, data) members, owners and times cleared."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz", preset=6) as tar:  # 9: the same size, twice the time
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755 if name.endswith(".so") else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _stats(members: list[tuple[str, bytes]], packed: bytes) -> dict:
    return {"triton_files": sum(n.startswith("triton/") for n, _ in members),
            "jit_modules": sum(n.startswith("jit/") for n, _ in members),
            "inductor_files": sum(n.startswith("inductor/") for n, _ in members),
            "extra_files": sum(n.startswith("extra/") for n, _ in members),
            "raw_bytes": sum(len(d) for _, d in members), "bytes": len(packed)}


def pack(triton_dir: Path, jit_dir: Path, out: Path, max_mib: float = 15.0, inductor_dir: Path | None = None,
         extra: dict[str, Path] | None = None) -> dict:
    """Write ``out`` (tar.xz) from the caches (``extra``: name -> folder, each kept whole); returns counts and
    sizes. Raises SystemExit, writing nothing, when the archive would exceed ``max_mib``."""
    members = [(name, path.read_bytes()) for path, name in _members(triton_dir, jit_dir, inductor_dir, extra)]
    packed = _xz_tar(members)
    if len(packed) > max_mib * 2**20:
        raise SystemExit(f"compile caches: {len(packed) / 2**20:.1f} MiB packed, over --max-mib {max_mib:g}; "
                         "nothing written")
    out.write_bytes(packed)
    return _stats(members, packed)


def _unit(name: str) -> str:
    """The unit a member belongs to: ``jit/<build folder>``, ``inductor/<top folder>``, ``extra/<name>`` or
    ``triton/<cache key>``."""
    return "/".join(name.split("/")[:2])


def _read(archive: Path) -> list[tuple[str, bytes]]:
    """The (name, data) members of a tar.xz written by ``pack`` or ``trim``."""
    with tarfile.open(archive, mode="r:xz") as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]


def trim(archive: Path, out: Path, max_mib: float) -> dict:
    """Write ``out`` with the units of ``archive`` that fit ``max_mib``: the longest run of them (JIT modules
    first, then Inductor's folders, then Triton entries, then the extra caches, each kind smallest first) whose
    archive fits, found by bisection (at most about 8 packings); returns the kept counts and sizes plus
    ``dropped_units``. Units compress far better together than alone (Triton variants of one kernel share most
    bytes), so only the archive written is measured."""
    units: dict[str, list[tuple[str, bytes]]] = {}
    for name, data in _read(archive):
        units.setdefault(_unit(name), []).append((name, data))
    order = sorted(units, key=lambda u: (UNIT_ORDER.index(u.split("/")[0]), sum(len(d) for _, d in units[u])))
    limit = max_mib * 2**20

    def first(k: int) -> tuple[list[tuple[str, bytes]], bytes]:
        chosen = [m for u in order[:k] for m in units[u]]
        return chosen, _xz_tar(chosen)

    kept, (chosen, packed) = len(order), first(len(order))
    if len(packed) > limit:
        lo, hi, best = 0, len(order), None  # first(lo) fits (none at all does), first(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            trial = first(mid)
            if len(trial[1]) <= limit:
                lo, best = mid, trial
            else:
                hi = mid
        kept, (chosen, packed) = lo, best or first(0)
    out.write_bytes(packed)
    return {**_stats(chosen, packed), "dropped_units": len(units) - kept}


def _is_empty(d: Path) -> bool:
    return not d.exists() or not any(d.iterdir())


def _fill(src: Path, dst: Path | None) -> bool:
    """Move ``src``'s entries (unpacked from an archive) into ``dst`` if ``dst`` is empty; whether it did."""
    if dst is None or not src.is_dir() or not _is_empty(dst):
        return False
    dst.mkdir(parents=True, exist_ok=True)
    for entry in src.iterdir():
        shutil.move(str(entry), dst / entry.name)
    return True


def unpack(archive: Path, triton_dir: Path, jit_dir: Path, inductor_dir: Path | None = None,
           extra: dict[str, Path] | None = None) -> dict:
    """Fill the empty ones of ``triton_dir``, ``jit_dir``, ``inductor_dir`` and ``extra``'s folders (name ->
    folder) from ``archive``; returns what was filled."""
    filled = {"triton_files": 0, "jit_modules": 0, "inductor_files": 0, "extra_files": 0}
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive, mode="r:xz") as tar:
            tar.extractall(tmp, filter="data")
        if _fill(Path(tmp) / "triton", triton_dir):
            for grp in triton_dir.glob("*/__grp__*.json"):
                data = json.loads(grp.read_text())
                paths = {name: str(grp.parent / Path(p).name) for name, p in data.get("child_paths", {}).items()}
                data["child_paths"] = {name: p for name, p in paths.items() if os.path.exists(p)}
                grp.write_text(json.dumps(data))
                os.utime(grp, (0, 0))  # the archive's time: not a file this machine built
            filled["triton_files"] = sum(1 for f in triton_dir.rglob("*") if f.is_file())
        if _fill(Path(tmp) / "jit", jit_dir):
            filled["jit_modules"] = sum(1 for _ in jit_dir.glob("*/*.so"))
        if _fill(Path(tmp) / "inductor", inductor_dir):
            filled["inductor_files"] = sum(1 for f in inductor_dir.rglob("*") if f.is_file())
        for name, d in (extra or {}).items():
            if _fill(Path(tmp) / "extra" / name, d):
                filled["extra_files"] += sum(1 for f in d.rglob("*") if f.is_file())
    return filled


def unxz(path: Path) -> Path:
    """``path`` (``<file>.xz``) decompressed beside it as ``<file>``, unless that exists; returns ``<file>``."""
    dst = path.with_suffix("")
    if not dst.exists():
        tmp = dst.with_name(dst.name + ".part")
        with lzma.open(path) as src, open(tmp, "wb") as f:
            shutil.copyfileobj(src, f, 1 << 20)
        tmp.rename(dst)
    return dst


def _extra(arg: str) -> tuple[str, Path]:
    """``NAME=DIR`` of ``--extra``."""
    name, sep, d = arg.partition("=")
    if not sep or not d or not EXTRA_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"--extra {arg!r}: expected NAME=DIR, NAME of lowercase letters, digits, "
                                         "'-' and '_'")
    return name, Path(d)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("triton_dir", type=Path)
    p.add_argument("jit_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--max-mib", type=float, default=15.0)
    p.add_argument("--inductor-dir", type=Path, help="torch Inductor's cache (TORCHINDUCTOR_CACHE_DIR) to pack too")
    p.add_argument("--extra", type=_extra, action="append", default=[], metavar="NAME=DIR",
                   help="another cache to pack whole, as extra/NAME/ (repeatable)")
    t = sub.add_parser("trim")
    t.add_argument("archive", type=Path)
    t.add_argument("out", type=Path)
    t.add_argument("--max-mib", type=float, required=True)
    u = sub.add_parser("unpack")
    u.add_argument("archive", type=Path)
    u.add_argument("triton_dir", type=Path)
    u.add_argument("jit_dir", type=Path)
    u.add_argument("--inductor-dir", type=Path, help="torch Inductor's cache to fill, if empty")
    u.add_argument("--extra", type=_extra, action="append", default=[], metavar="NAME=DIR",
                   help="the folder to fill, if empty, with the archive's extra/NAME/ (repeatable)")
    x = sub.add_parser("unxz", help="decompress FILE.xz beside it unless FILE exists (weights carried as xz)")
    x.add_argument("files", type=Path, nargs="+")
    args = ap.parse_args(argv)
    if args.cmd in ("trim", "unpack") and not args.archive.is_file():
        ap.error(f"{args.cmd}: archive {args.archive} is not a file")
    if args.cmd == "pack":
        s = pack(args.triton_dir, args.jit_dir, args.out, args.max_mib, args.inductor_dir, dict(args.extra))
        print(f"compile caches packed: {s['triton_files']} Triton files, {s['jit_modules']} JIT modules, "
              f"{s['inductor_files']} Inductor files, {s['extra_files']} files of other caches, "
              f"{s['raw_bytes'] / 2**20:.1f} MiB -> {s['bytes'] / 2**20:.1f} MiB ({args.out.name})")
    elif args.cmd == "trim":
        s = trim(args.archive, args.out, args.max_mib)
        print(f"compile caches trimmed to {s['bytes'] / 2**20:.2f} MiB: {s['triton_files']} Triton files, "
              f"{s['jit_modules']} JIT modules, {s['inductor_files']} Inductor files, "
              f"{s['extra_files']} files of other caches kept, "
              f"{s['dropped_units']} units dropped ({args.out.name})")
    elif args.cmd == "unpack":
        s = unpack(args.archive, args.triton_dir, args.jit_dir, args.inductor_dir, dict(args.extra))
        print(f"compile caches unpacked: {s['triton_files']} Triton files, {s['jit_modules']} JIT modules, "
              f"{s['inductor_files']} Inductor files, {s['extra_files']} files of other caches "
              "(a cache already filled on this machine is kept)")
    else:
        for f in args.files:
            if f.suffix != ".xz" or not f.is_file():
                ap.error(f"unxz: {f} is not an existing .xz file")
            print(f"unxz: {unxz(f)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
