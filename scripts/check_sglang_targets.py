"""Check the plugin's hook table against unpacked SGLang releases, without installing them.

    pip download sglang==0.5.20 --no-deps -d wheels && unzip -q wheels/sglang-0.5.20-*.whl -d trees/0.5.20
    python scripts/check_sglang_targets.py trees/0.5.16 trees/0.5.20 ...   # one unpacked wheel per argument

For every tree (its release read from the ``*.dist-info`` folder) and every row of
``sglang_m3.plugin.hook_table()`` that applies to that release, the target's module file must
define the named class and attribute (or function), read from source with ``ast``; it also lists
rows that do not apply but whose target still exists. Exit status 1 if any applying target is
missing. Needs only ``packaging`` and this repository on the path (no SGLang import: the table's
hook functions are referenced, not run). Existence is not behaviour: a release that passes here
is still untested until the tests run against it.
"""

import ast
import sys
import types
from pathlib import Path

from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def _release(tree: Path) -> Version:
    infos = sorted(tree.glob("sglang-*.dist-info"))
    if not infos:
        raise SystemExit(f"{tree}: no sglang-*.dist-info folder (pass an unpacked sglang wheel)")
    return Version(infos[0].name[len("sglang-"):-len(".dist-info")])


def _defined(tree: Path, target: str) -> bool:
    """Whether ``module.path.Name[.attr]`` is defined in the source under ``tree``."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = tree.joinpath(*parts[:cut])
        source = module.with_suffix(".py") if module.with_suffix(".py").exists() else module / "__init__.py"
        if source.exists():
            names = parts[cut:]
            break
    else:
        return False
    body = ast.parse(source.read_text()).body
    for depth, name in enumerate(names):
        defs = [n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and n.name == name]
        assigned = [n for n in body if isinstance(n, (ast.Assign, ast.AnnAssign)) and any(
            isinstance(t, ast.Name) and t.id == name for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
        # A class statement wins over a later rebinding (0.5.20 on: ServerArgs = a msgspec struct built from it).
        found = (defs or assigned or [None])[0]
        if found is None:
            return False
        if depth < len(names) - 1:
            if not isinstance(found, ast.ClassDef):
                return False
            body = found.body
    return True


def _hook_table():
    """The plugin's table, with the SGLang modules its rows import replaced by stubs."""
    sys.path[:0] = [str(REPO), str(REPO / "kernels")]
    stub = types.ModuleType("sglang_m3.cpu_alloc")
    stub.alloc_extend = stub.alloc_decode = lambda *a, **k: None
    sys.modules["sglang_m3.cpu_alloc"] = stub
    from sglang_m3.plugin import hook_table

    return hook_table()


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    rows, failed = _hook_table(), False
    for tree in map(Path, argv):
        version = _release(tree)
        missing = [r.target for r in rows if r.applies_to(version) and not _defined(tree, r.target)]
        still_there = [r.target for r in rows if not r.applies_to(version) and _defined(tree, r.target)]
        applying = sum(r.applies_to(version) for r in rows)
        print(f"SGLang {version}: {applying} rows apply, {len(missing)} targets missing"
              + "".join(f"\n  missing: {t}" for t in missing)
              + "".join(f"\n  not applied, target still defined: {t}" for t in still_there))
        failed |= bool(missing)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
