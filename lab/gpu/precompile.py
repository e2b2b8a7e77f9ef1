"""Python bytecode for the packages a server imports, written once per machine, on all cores.

Every SGLang server start on an H200 printed a ``SyntaxWarning`` that Python raises only when it compiles a module
from source (torchao's ``quant_api.py``, in the unpacked bundle), on a held machine too: no bytecode of the bundle
was kept, so each process (the import check, every server's processes, each lm-eval client) compiled the modules
it imported, each time. On a 2-core box, importing SGLang's HTTP server took 25-27 s from source against 12-13 s
from bytecode. ``compileall`` writes the files whatever ``PYTHONDONTWRITEBYTECODE`` says, and imports read them;
the first line printed says whether the interpreter writes bytecode itself.

    python lab/gpu/precompile.py DIR_OR_PACKAGE [...]

Each argument is a folder, or the name of an importable package (its folder is found without importing it).
Prints, per folder, its modules with bytecode before and after, and whether the interpreter writes bytecode
itself. A folder it cannot write to is reported, not an error.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import os
import sys
import time
import warnings
from pathlib import Path


def coverage(root: Path) -> tuple[int, int]:
    """(modules under ``root`` whose bytecode for this interpreter exists, modules)."""
    sources = [p for p in root.rglob("*.py") if p.is_file()]
    return sum(os.path.exists(importlib.util.cache_from_source(str(p))) for p in sources), len(sources)


def folder(arg: str) -> Path | None:
    """``arg`` as a folder, or the folder of the importable package named ``arg``; None if neither."""
    if os.sep in arg or Path(arg).is_dir():
        return Path(arg) if Path(arg).is_dir() else None
    spec = importlib.util.find_spec(arg)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="+", help="folders or importable package names")
    ap.add_argument("--workers", type=int, default=0, help="processes (0: every core)")
    args = ap.parse_args(argv)
    # third-party modules' SyntaxWarnings (invalid escapes), one per file, here and in the worker processes
    warnings.filterwarnings("ignore", category=SyntaxWarning)
    os.environ["PYTHONWARNINGS"] = "ignore::SyntaxWarning"
    writes = "off" if sys.flags.dont_write_bytecode else "on"
    prefix = f", cache prefix {sys.pycache_prefix}" if sys.pycache_prefix else ""
    print(f"bytecode: the interpreter's own writes {writes}{prefix}")
    for target in args.targets:
        root = folder(target)
        if root is None:
            print(f"bytecode: {target}: no such folder or package, skipped")
            continue
        t0 = time.monotonic()
        before, total = coverage(root)
        if before < total:
            compileall.compile_dir(str(root), quiet=2, workers=args.workers)
        after, _ = coverage(root)
        print(f"bytecode: {target}: {before} -> {after} of {total} modules ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
