"""The SGLang releases this plugin runs on, and the few SGLang internals that moved between them.

Supported: SGLang 0.5.16 through 0.5.23 (``OLDEST_SGLANG``, ``NEWEST_SGLANG``). Tested: 0.5.16 on a CPU and on an
H200, 0.5.23 on a CPU (``TESTED_SGLANG``); the releases in between are inside the range because
every hook target and accessor below was read in each of them, but no test runs there.

What moved, by the first release that has it:

- 0.5.19: server arguments are resolved by a pipeline of declarations (``arg_groups/pipeline.py``)
  over a sealed ``ServerArgs`` record, so a resolved value is read through
  ``resolving_view(server_args)`` instead of from the record, and the CUDA-graph config is
  resolved by ``arg_groups.cuda_graph_hook.handle_cuda_graph_config`` instead of
  ``ServerArgs._parse_cuda_graph_config``.
- 0.5.20: the tokenizer manager aborts the requests a batch handler sent when that handler ends
  early (its client cut the stream, a sample failed), the samples of an ``n > 1`` request among them.
- 0.5.22: the detokenizer process loads plugins itself, the paged allocator has torch paths
  for platforms without Triton, and the tokenizer manager releases every request state that an
  ``n > 1`` (parallel sampling) request registers before sending its samples.

The hook table in ``plugin.py`` keys its rows on these versions.
"""

import functools
from importlib import metadata

from packaging.version import Version

OLDEST_SGLANG, NEWEST_SGLANG = Version("0.5.16"), Version("0.5.23")  # the supported range, both ends in
TESTED_SGLANG = ("0.5.16", "0.5.23")
RESOLUTION_PIPELINE = Version("0.5.19")  # sealed ServerArgs, resolution by declarations
DETOKENIZER_LOADS_PLUGINS = Version("0.5.22")
ALLOCATOR_OFF_TRITON = Version("0.5.22")  # the paged allocator's torch paths where Triton is missing
BATCH_HANDLER_ABORTS_SENT = Version("0.5.20")  # an n > 1 handler ended early aborts its samples
PARALLEL_SAMPLING_RELEASES_STATES = Version("0.5.22")  # n > 1 leaves no initial request state behind


class UnsupportedSGLangError(RuntimeError):
    """The installed SGLang is outside ``OLDEST_SGLANG`` .. ``NEWEST_SGLANG``."""


def check_sglang_version(version: str | None = None) -> Version:
    """The release of the installed (or given) SGLang (``0.5.23.post1`` counts as 0.5.23).

    Raises UnsupportedSGLangError, naming the supported range, outside it.
    """
    text = metadata.version("sglang") if version is None else version
    release = Version(Version(text).base_version)
    if not OLDEST_SGLANG <= release <= NEWEST_SGLANG:
        raise UnsupportedSGLangError(
            f"sglang-m3 supports SGLang {OLDEST_SGLANG} through {NEWEST_SGLANG} (tested: {', '.join(TESTED_SGLANG)}), "
            f"installed: {text}; install one in that range: pip install 'sglang>={OLDEST_SGLANG},<={NEWEST_SGLANG}'"
        )
    return release


@functools.lru_cache(maxsize=1)
def sglang_version() -> Version:
    """The installed SGLang's release, checked against the supported range (cached)."""
    return check_sglang_version()


def at_least(version: Version) -> bool:
    return sglang_version() >= version


def setting(server_args, name: str, *default):
    """The value SGLang resolved for server argument ``name`` (``default``, if given, when it has
    none). From 0.5.19 the ``ServerArgs`` record holds only the input; resolution is declared on it."""
    if at_least(RESOLUTION_PIPELINE):
        from sglang.srt.arg_groups.model_override_base import resolving_view

        server_args = resolving_view(server_args)
    return getattr(server_args, name, *default)
