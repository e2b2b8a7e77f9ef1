"""The supported SGLang range, the start-up error outside it, and the version-keyed hook table."""

import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.version import Version

from sglang_m3 import compat
from sglang_m3.plugin import Hook, hook_table

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version,release", [("0.5.16", "0.5.16"), ("0.5.19", "0.5.19"), ("0.5.23", "0.5.23"),
                                             ("0.5.23.post1", "0.5.23")])
def test_versions_inside_the_range_are_accepted(version, release):
    assert compat.check_sglang_version(version) == Version(release)


@pytest.mark.parametrize("version", ["0.5.15", "0.5.15.post2", "0.5.24", "0.5.24rc0", "0.6.0", "0.4.99"])
def test_versions_outside_the_range_name_it(version):
    with pytest.raises(compat.UnsupportedSGLangError,
                       match=rf"supports SGLang 0\.5\.16 through 0\.5\.23 \(tested: 0\.5\.16, 0\.5\.23\), "
                             rf"installed: {version}; .*pip install 'sglang>=0\.5\.16,<=0\.5\.23'"):
        compat.check_sglang_version(version)


def test_an_unsupported_sglang_loads_the_plugin_switched_off():
    """Outside the range the entry point returns (SGLang goes on): no hook row is registered but the three that
    refuse a MiniMax-M3.1 index-K launch (tests/sglang_m3/test_scope.py serves the rest)."""
    script = textwrap.dedent("""
        from importlib import metadata
        real = metadata.version
        metadata.version = lambda name: "0.5.24" if name == "sglang" else real(name)
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        load_plugins()
        print("plugins loaded", len(HookRegistry._patched))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plugins loaded 3" in proc.stdout


def test_rows_apply_in_their_half_open_release_range():
    row = Hook("x.y", print, "AFTER", since=Version("0.5.19"), until=Version("0.5.22"))
    assert [row.applies_to(Version(v)) for v in ("0.5.18", "0.5.19", "0.5.21", "0.5.22")] == [False, True, True, False]
    assert Hook("x.y", print, "AFTER").applies_to(Version("0.5.16"))


def test_each_target_exists_in_the_installed_sglang_exactly_where_its_row_applies():
    """A row that applies must resolve; a row that does not must name a target this release dropped
    or a job SGLang now does itself (the two CUDA-graph rows: one target per side of 0.5.19)."""
    version = compat.sglang_version()
    applied = [row for row in hook_table() if row.applies_to(version)]
    for row in applied:
        pkgutil.resolve_name(row.target)  # raises if SGLang moved it
    skipped = {row.target.rsplit(".", 1)[1] for row in hook_table() if not row.applies_to(version)}
    if version >= compat.RESOLUTION_PIPELINE:
        assert "_parse_cuda_graph_config" in skipped
        with pytest.raises(AttributeError):
            pkgutil.resolve_name("sglang.srt.server_args.ServerArgs._parse_cuda_graph_config")
    else:
        assert "handle_cuda_graph_config" in skipped
    if version >= compat.DETOKENIZER_LOADS_PLUGINS:
        assert {"_launch_detokenizer_subprocesses", "alloc_extend", "alloc_decode"} <= skipped
    if version >= compat.PARALLEL_SAMPLING_RELEASES_STATES:
        assert {"_handle_batch_request", "_send_one_request"} <= skipped


def test_every_applying_hook_is_patched_into_sglang():
    """SGLang logs and skips a hook whose target fails to resolve; after loading, every row of
    this release must have been applied."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugins()
    version = compat.sglang_version()
    missing = [r.target for r in hook_table() if r.applies_to(version) and r.target not in HookRegistry._patched]
    assert not missing
