"""The ``sglang.srt.plugins`` entry point: registers MiniMax-M3.1 with SGLang in every process.

Installing the package is all it takes (SGLang loads the entry point in the launcher, tokenizer
manager, scheduler and, from 0.5.22, detokenizer). The plugin minds its own model: every row below
passes SGLang's call through unchanged unless the served model is a MiniMax-M3.1 config with an
index-K format (``scope.is_index_k_launch`` / ``scope.is_index_k_config``: ``model_type
minimax_m3_1`` and ``index_k_format`` named in ``config.json``, ``--json-model-override-args`` or
``--index-k-format``). A ``minimax_m3_1`` config that names no format is refused at start-up with
a message naming the choices. ``--index-k-format`` is refused for any other model.

The entry point checks that the installed SGLang is one this plugin supports (``compat``: 0.5.16
through 0.5.23). Outside that range it logs one warning, registers no row below, and refuses only
a MiniMax-M3.1 index-K launch, naming the range (``_register_outside_range``).

One table, keyed by SGLang release (``since`` inclusive, ``until`` exclusive; blank: every
supported release); "M3.1" means a MiniMax-M3.1 index-K launch, where each row engages:

| target | kind | SGLang | why |
|---|---|---|---|
| ``ServerArgs.add_cli_args`` / ``from_cli_args`` | after / before | | ``--index-k-format`` into the model overrides |
| ``ServerArgs.from_cli_args`` | before | | M3.1: refuse a bad launch before any process starts (``check_launch``) |
| ``ServerArgs.from_cli_args`` | around | | this package's refusals there: one line, exit 2 (``_refusals_in_one_line``) |
| ``ServerArgs.from_cli_args`` | before | | M3.1, ``--device cpu``: OpenMP waits (``CPU_OPENMP_WAITS``) |
| ``engine._set_envs_and_config`` | after | | M3.1, ``--device cpu``: fork the children where safe |
| ``ServerArgs._parse_cuda_graph_config`` | after | < 0.5.19 | M3.1: no prefill CUDA graph (host-planned scorer) |
| ``cuda_graph_hook.handle_cuda_graph_config`` | after | >= 0.5.19 | the same, declared as a resolution |
| ``ModelConfig.__init__`` | after | | M3.1: validate the format at start-up (naming the choices) |
| ``get_model_architecture`` | around | | M3.1: serve ``MiniMaxM3SparseForCausalLM`` with this package's class |
| ``KVCacheConfigurator._build_minimax_sparse_kv_pool`` | around | | M3.1: build ``MiniMaxM31SparseKVPool`` |
| ``hybrid_pool_assembler.MHATokenToKOnlyPoolHost`` | replace | | M3.1 pool: its HiCache host tier (``host_pool``) |
| ``hybrid_pool_assembler.build_minimax_sparse_hicache_stack`` | around | | M3.1: index bytes in ``--hicache-size`` |
| ``DefaultPoolConfigurator._compute_cell_size`` | around | | M3.1: budget the format's bytes (capacity grows with it) |
| ``attn_backend_wrapper`` | around | | M3.1: dense + ``MiniMaxM31SparseAttnBackend``; CPU dense decode, extend |
| ``TokenizerManager._validate_one_request`` | before | | workaround W1 |
| ``TokenizerManager._handle_batch_request`` | before | < 0.5.22 | workaround W2 |
| ``TokenizerManager._handle_batch_request`` | around | < 0.5.20 | workaround W3 |
| ``TokenizerManager._send_one_request`` | before | < 0.5.20 | workaround W3 (notes the samples' rids) |
| ``Engine._launch_detokenizer_subprocesses`` | around | < 0.5.22 | M3.1: the detokenizer loads plugins |
| ``PagedTokenToKVPoolAllocator.alloc_extend`` / ``_decode`` | around | < 0.5.22 | M3.1 pool, off CUDA: torch |
| ``http_server.server_info`` / ``model_info`` | around | | M3.1: the server and model info add ``m3_index_k`` (``server_info``) |
| ``http_server.launch_server`` | before | | M3.1: ``/server_info`` and ``/model_info`` answer through those two |
| ``DecodePreallocQueue._init_kv_manager`` | after | | M3.1 pool, PD decode: the KV manager notes its settings (``pd``) |
| ``CommonKVReceiver.init`` | around | | M3.1 pool, PD decode: refuse pages of another index-K format |

plus an SGLang model-override provider that defaults ``--page-size`` to 128 for an M3.1 config.

The SGLang bug workarounds, M3.1 servers only ("all": every supported release; details in
``parallel_sampling`` and the reports ready to file upstream, ``docs/upstream.md``):

| id | target | SGLang | why |
|---|---|---|---|
| W1 | ``TokenizerManager._validate_one_request`` | all | an id outside ``[0, vocab_size)`` kills the server; HTTP 400 |
| W2 | ``TokenizerManager._handle_batch_request`` | < 0.5.22 | ``n > 1`` leaves request states behind |
| W3 | ``_handle_batch_request``, ``_send_one_request`` | < 0.5.20 | a cut ``n > 1`` stream keeps decoding |
"""

import functools
import json
import logging
import os
from typing import Callable, NamedTuple

from packaging.version import Version

from m3_kernels.formats import PAGE_SIZE, IndexKFormat

from . import compat, parallel_sampling
from .compat import (
    ALLOCATOR_OFF_TRITON,
    BATCH_HANDLER_ABORTS_SENT,
    DETOKENIZER_LOADS_PLUGINS,
    PARALLEL_SAMPLING_RELEASES_STATES,
    RESOLUTION_PIPELINE,
    setting,
)
from .config import ARCHITECTURE, MODEL_TYPE, index_k_settings, register_config
from .scope import is_index_k_config, is_index_k_launch, model_config_dict

logger = logging.getLogger(__name__)

INDEX_K_FORMAT_FLAG = "--index-k-format"


def _settings(hf_config):
    """The index-K settings of a MiniMax-M3.1 index-K ``hf_config`` (``scope.is_index_k_config``); None for
    any other model, whose SGLang path then runs unchanged."""
    return index_k_settings(hf_config) if is_index_k_config(hf_config, strict=False) else None


# ---- server arguments ------------------------------------------------------------------------

def _add_index_k_format_flag(result, parser):
    parser.add_argument(
        INDEX_K_FORMAT_FLAG,
        type=str,
        choices=[f.value for f in IndexKFormat],
        default=None,
        help="sglang-m3, MiniMax-M3.1 (model_type minimax_m3_1) only: the sparse-attention index-K cache format "
             "(default: the config's index_k_format); refused for any other model.",
    )


WEIGHT_LOAD_FORMATS = ("auto", "pt", "safetensors")  # SGLang's load formats that read weight files from the folder
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


PACKAGES = ("sglang_m3", "m3_kernels")  # a refusal raised in their code is this package's


def raised_by_package(error: BaseException) -> bool:
    """Whether ``error`` was raised by this package's code: its innermost frame is in a module of ``PACKAGES``."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0] in PACKAGES


def _refusals_in_one_line(original, cls, args):
    """Around ``ServerArgs.from_cli_args``, where SGLang parses a launch (checks, model config, resolution) before
    any of its processes start: a ValueError or NotImplementedError this package raised there (a caller's mistake
    or an unsupported combination: ``check_launch``, the format flag, the model-config checks) ends the launch as a
    usage error, one ``sglang-m3: error:`` line on stderr and exit status 2, not a traceback of 10-30 frames.
    SGLang's own errors pass as they are."""
    try:
        return original(cls, args)
    except (ValueError, NotImplementedError) as e:
        if not raised_by_package(e):
            raise
        import sys

        print(f"sglang-m3: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def check_launch(cls, args):
    """Before SGLang parses a launch into ``ServerArgs``: what a MiniMax-M3.1 launch gets wrong, refused before any
    process starts: a ``minimax_m3_1`` config that names no format (``scope.MissingIndexKFormat``); an index-K
    setting that is not one (``index_k_format``, ``index_k_scale_rule``, ``index_k_sign_seed``, from ``config.json``,
    ``--json-model-override-args`` or ``--index-k-format``); a local model folder without weight files, loaded
    from them (the tiny config: "add --load-format dummy"); the flags the index-K cache does not serve
    (``--enable-hisparse``, ``--speculative-algorithm``, a HiCache launch ``host_pool.check_hicache_launch``
    refuses). Other models pass unchanged."""
    from m3_kernels.formats import parse_format, parse_scale_rule

    from .config import check_sign_seed

    if not is_index_k_launch(args):  # raises MissingIndexKFormat for a minimax_m3_1 config without a format
        return None
    model_path = str(args.model_path)
    merged = {**(model_config_dict(model_path, getattr(args, "revision", None)) or {}),
              **json.loads(getattr(args, "json_model_override_args", None) or "{}")}
    if getattr(args, "index_k_format", None) is not None:
        merged["index_k_format"] = args.index_k_format
    parse_format(merged["index_k_format"], "index_k_format")
    parse_scale_rule(merged.get("index_k_scale_rule", "rceil"), "index_k_scale_rule")
    check_sign_seed(merged.get("index_k_sign_seed"))
    load_format = str(getattr(args, "load_format", "auto") or "auto")
    if os.path.isdir(model_path) and load_format in WEIGHT_LOAD_FORMATS:
        import glob

        if not any(glob.glob(os.path.join(model_path, pattern)) for pattern in WEIGHT_PATTERNS):
            raise ValueError(f"{model_path} holds no weights ({', '.join(WEIGHT_PATTERNS)}) for --load-format "
                             f"{load_format}: add --load-format dummy to serve it with random weights")
    if str(getattr(args, "dtype", "auto")) in ("float16", "half"):  # SGLang 0.5.23 checks the model config later
        raise NotImplementedError(FLOAT16_REFUSAL)
    if getattr(args, "enable_hisparse", False):
        raise NotImplementedError(HISPARSE_REFUSAL)
    if getattr(args, "speculative_algorithm", None):
        raise NotImplementedError(f"--speculative-algorithm {args.speculative_algorithm}: {SPECULATIVE_REFUSAL}")
    if getattr(args, "enable_hierarchical_cache", False):
        from .host_pool import check_hicache_launch

        check_hicache_launch(args)
    return None


def _fold_index_k_format_flag(cls, args):
    """``--index-k-format`` into ``--json-model-override-args``; ValueError for a model whose config is
    readable and not ``minimax_m3_1`` (the flag would be a silent no-op there)."""
    fmt = getattr(args, "index_k_format", None)
    if fmt is None:
        return None
    model_path = getattr(args, "model_path", None)
    config = model_config_dict(str(model_path), getattr(args, "revision", None)) if model_path else None
    if config is not None and not is_index_k_launch(args):
        raise ValueError(f"{INDEX_K_FORMAT_FLAG} {fmt}: the flag is for MiniMax-M3.1 configs (model_type "
                         f"{MODEL_TYPE!r}); {model_path} has model_type {config.get('model_type')!r}: drop it")
    overrides = json.loads(getattr(args, "json_model_override_args", None) or "{}")
    overrides["index_k_format"] = fmt
    args.json_model_override_args = json.dumps(overrides)
    return None


OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
GOMP_SPINCOUNT = "GOMP_SPINCOUNT"
CPU_SPINCOUNT = "3000"  # libgomp spins ~100,000 per ms: about 30 us of spinning before a thread sleeps
CPU_OPENMP_WAITS = {OMP_WAIT_POLICY: "PASSIVE", GOMP_SPINCOUNT: CPU_SPINCOUNT}  # a CPU server's, unless either is set
FLOAT16_REFUSAL = ("dtype torch.float16: the MiniMax-M3.1 index-K cache takes bfloat16 (or float32) index keys, not "
                   "float16; launch with --dtype bfloat16")
HISPARSE_REFUSAL = ("enable_hisparse: the MiniMax-M3.1 index-K cache has no hierarchical sparse (HiSparse) host "
                    "path; launch without --enable-hisparse")
SPECULATIVE_REFUSAL = ("speculative decoding is not supported with the MiniMax-M3.1 index-K cache (the decode plan "
                       "scores one query row per request; verify batches are not planned); launch without "
                       "--speculative-algorithm")
PREFILL_GRAPH_ENV = "SGLANG_M3_PREFILL_GRAPH"  # "1": keep SGLang's breakable prefill graph for index-K configs
CPU_START_ENV = "SGLANG_M3_CPU_START"  # "spawn": keep SGLang's spawned children on the CPU too


def _cpu_openmp_waits(cls, args):
    """In the launcher, before the scheduler and its peers start: a ``--device cpu`` server gets
    ``OMP_WAIT_POLICY=PASSIVE`` and ``GOMP_SPINCOUNT=3000`` unless the user set either. OpenMP reads them
    once, when a process loads it, so they reach spawned children only (``_cpu_children_start``).
    OpenMP's default spin-wait (3 ms) costs about 6 ms per torch op when another process holds one of the
    cores (measured on a 2-core box: 1-token decode at 0.9 tokens/s, 13.7 with PASSIVE); no spin at all
    makes a thread sleep between the many small ops of a decode step (PASSIVE alone: 31 tokens/s at
    batch 1 and 4k on a quiet box, 40 with 3000 spins, which cost 15% when a busy process holds a core;
    lab/logs/perf-cpu-log.md, fourth round)."""
    if getattr(args, "device", None) != "cpu" or OMP_WAIT_POLICY in os.environ or GOMP_SPINCOUNT in os.environ:
        return None
    if not is_index_k_launch(args):
        return None
    # neither is set: the two defaults, and nothing else (SGLang's crash diagnostics stay as the user set them:
    # only launchers that stop a server through its process group turn them off, sglang_m3.server.server_env)
    os.environ.update(CPU_OPENMP_WAITS)
    logger.info("--device cpu: %s for the server's processes (set either to override; exported before the "
                "launch, they also let its children be forked: ready about 2x sooner)",
                " ".join(f"{name}={value}" for name, value in CPU_OPENMP_WAITS.items()))
    return None


def _initial_environ() -> dict[str, str] | None:
    """The environment this process started with (Linux ``/proc/self/environ``; None elsewhere)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _launched_by_sglang(main_module, argv: list[str]) -> bool:
    """Whether this process is ``python -m sglang.launch_server`` or ``sglang serve``."""
    spec = getattr(main_module, "__spec__", None)
    if spec is not None and spec.name == "sglang.launch_server":
        return True
    return bool(argv) and os.path.basename(argv[0]) == "sglang" and argv[1:2] == ["serve"]


def cpu_children_start(device: str, initial_env: dict | None, launched_by_sglang: bool, choice: str | None) -> str:
    """``"fork"`` or ``"spawn"`` for a server's scheduler and detokenizer processes.

    Fork (ready in about half the time: a spawned child imports SGLang again, ~13 s on a 2-core box) needs
    all of: ``--device cpu`` (CUDA needs spawn); SGLang's own launcher as this process, which has run no
    torch op yet (a child forked after OpenMP started its threads hangs at its first parallel op); and
    ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the environment the process started with (a forked child
    keeps the OpenMP settings read at that start, and without short waits a CPU server under load is an
    order of magnitude slower; ``_cpu_openmp_waits``). ``SGLANG_M3_CPU_START=spawn`` keeps spawn."""
    if device != "cpu" or choice == "spawn" or not launched_by_sglang or initial_env is None:
        return "spawn"
    return "fork" if OMP_WAIT_POLICY in initial_env or GOMP_SPINCOUNT in initial_env else "spawn"


def _cpu_children_start(result, server_args):
    """After SGLang chose spawn for its children: fork them instead where ``cpu_children_start`` allows
    (MiniMax-M3.1 index-K launches only)."""
    import multiprocessing
    import sys

    if getattr(server_args, "device", None) != "cpu" or not is_index_k_launch(server_args):
        return result

    launched = _launched_by_sglang(sys.modules.get("__main__"), sys.argv)
    start = cpu_children_start(getattr(server_args, "device", None), _initial_environ(), launched,
                               os.environ.get(CPU_START_ENV))
    if start == "fork":
        multiprocessing.set_start_method("fork", force=True)
        logger.info("--device cpu: scheduler and detokenizer forked from the launcher (%s=spawn to spawn them)",
                    CPU_START_ENV)
    return result


def _page_size_default(server_args, hf_config) -> dict:
    """SGLang model-override provider: one cache page per MSA block unless the user chose."""
    if _settings(hf_config) is not None and server_args.page_size is None:  # the input, not the resolution
        return {"page_size": PAGE_SIZE}
    return {}


def _turn_off_prefill_graph(prefill_backend, explicit: bool, hf_config: Callable) -> bool:
    """Whether an index-K config's prefill CUDA graph must be turned off (``hf_config()`` is read
    only when a graph is on); ValueError when the user asked for that graph explicitly.

    Why: our prefill metadata (block table, offsets, the scorer's plan) is made on the host per batch, so
    prefill attention must run eagerly between graph segments: SGLang 0.5.23's ``breakable`` graph does so,
    and on 0.5.16 the backend ends the segment itself (``backend``, module docstring); ``full`` and
    ``tc_piecewise`` do not. Greedy tokens with the graph against without it have not been compared on a GPU,
    so SGLang's CUDA default is still turned off (``docs/design.md``, "Prefill and CUDA graphs"); decode
    CUDA graphs are unaffected. ``SGLANG_M3_PREFILL_GRAPH=1`` keeps a ``breakable`` prefill graph, with a
    warning; it refuses any other prefill graph.
    """
    from sglang.srt.model_executor.cuda_graph_config import Backend

    if prefill_backend == Backend.DISABLED or _settings(hf_config()) is None:
        return False
    if os.environ.get(PREFILL_GRAPH_ENV) == "1":
        if prefill_backend != Backend.BREAKABLE:
            raise ValueError(f"cuda_graph_config prefill backend {prefill_backend!r} with {PREFILL_GRAPH_ENV}=1: "
                             "MiniMax-M3.1's host-planned prefill attention runs only in the 'breakable' prefill "
                             "graph (eagerly between segments); use --cuda-graph-backend-prefill breakable or disabled")
        logger.warning("MiniMax-M3.1 index-K cache: prefill CUDA graph %r kept (%s=1); not verified on a GPU with "
                       "this model: compare greedy tokens with the graph off before trusting it",
                       prefill_backend, PREFILL_GRAPH_ENV)
        return False
    if explicit:
        raise ValueError(
            f"cuda_graph_config prefill backend {prefill_backend!r}: MiniMax-M3.1 with an index-K cache "
            "runs prefill without a CUDA graph, since its prefill metadata is planned on the host per batch and "
            "a captured prefill may replay the captured batch's; use --cuda-graph-backend-prefill disabled "
            f"(decode graphs stay on), or set {PREFILL_GRAPH_ENV}=1 to try the graph (unverified)"
        )
    logger.info("MiniMax-M3.1 index-K cache: prefill CUDA graph %r turned off (decode graphs stay on)", prefill_backend)
    return True


def _no_prefill_cuda_graph(result, server_args, *args, **kwargs):
    """After ``ServerArgs._parse_cuda_graph_config`` (SGLang < 0.5.19): see ``_turn_off_prefill_graph``."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase

    prefill, locked = server_args.cuda_graph_config.prefill, server_args._cuda_graph_config_locked
    if _turn_off_prefill_graph(prefill.backend, (Phase.PREFILL, "backend") in locked,
                               lambda: server_args.get_model_config().hf_config):
        prefill.backend = Backend.DISABLED
        locked.add((Phase.PREFILL, "backend"))


def _no_prefill_cuda_graph_declared(result, server_args, *args, **kwargs):
    """After ``handle_cuda_graph_config`` (SGLang >= 0.5.19): the same, declared as a resolution
    and locked, so SGLang's later defaults (prefill context parallelism) leave it alone."""
    from sglang.srt.arg_groups.model_override_base import model_config_of, resolving_view
    from sglang.srt.arg_groups.overrides import declare_resolution
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    config, locked = resolving_view(server_args).cuda_graph_config, server_args._cuda_graph_config_locked
    if _turn_off_prefill_graph(config.prefill.backend, (Phase.PREFILL, "backend") in locked,
                               lambda: model_config_of(server_args).hf_config):
        declare_resolution(server_args, "sglang_m3", cuda_graph_config=with_phase(config, Phase.PREFILL,
                                                                                   backend=Backend.DISABLED))
        locked.add((Phase.PREFILL, "backend"))


# ---- model config, model class ---------------------------------------------------------------

UPSTREAM_NVFP4_QUANTIZATION = "minimax_m3_nvfp4"  # SGLang 0.5.23's M3.1 NVFP4 stack: its own index-K pool


def _validate_index_k_settings(result, model_config, *args, **kwargs):
    """After ``ModelConfig.__init__``: refuse, at start-up, what the index-K path cannot serve (SGLang's
    NVFP4 stack; a float16 model, whose index keys the cache writers reject: bfloat16, or float32 on CPU) and a
    ``minimax_m3_1`` config that names no index-K format (``scope.MissingIndexKFormat``, naming the choices)."""
    is_index_k_launch(model_config)  # the config.json as given (SGLang's hf_config fills in a default format)
    settings = _settings(model_config.hf_config)
    if settings is not None:
        if getattr(model_config, "quantization", None) == UPSTREAM_NVFP4_QUANTIZATION:
            raise NotImplementedError(
                f"quantization {UPSTREAM_NVFP4_QUANTIZATION!r} brings SGLang's own NVFP4 index-K cache; it cannot be "
                f"combined with index_k_format={settings.fmt.value!r}: drop one of them"
            )
        import torch

        dtype = getattr(model_config, "dtype", None)
        if dtype == torch.float16:  # "auto" resolves a float32 (or unset) torch_dtype to float16 too
            raise NotImplementedError(FLOAT16_REFUSAL)
        logger.info("MiniMax-M3.1 index-K cache: %s (scale rule %s)", settings.fmt.value, settings.scale_rule.value)


def _model_architecture(original, model_config):
    model_cls, arch = original(model_config)
    if arch == ARCHITECTURE and _settings(model_config.hf_config) is not None:
        from .models.minimax_m3_1 import MiniMaxM3SparseForCausalLM

        return MiniMaxM3SparseForCausalLM, arch
    return model_cls, arch


# ---- memory pool and budget ------------------------------------------------------------------

def _local_sparse_layers(model_config, start_layer: int, end_layer: int):
    from sglang.srt.configs.model_config import get_minimax_sparse_attention_config, get_minimax_sparse_layer_ids

    dense, sparse = get_minimax_sparse_layer_ids(get_minimax_sparse_attention_config(model_config.hf_config))
    local = lambda ids: [i for i in ids if start_layer <= i < end_layer]  # noqa: E731
    return local(dense), local(sparse)


def _build_index_k_pool(original, kvc, *, max_total_num_tokens: int):
    settings = _settings(kvc.model_config.hf_config)
    if settings is None:
        return original(kvc, max_total_num_tokens=max_total_num_tokens)
    if setting(kvc.server_args, "enable_hisparse", False):
        raise NotImplementedError(HISPARSE_REFUSAL)
    if setting(kvc.server_args, "enable_hierarchical_cache", False):
        from .host_pool import check_hicache_launch  # the host tier: sglang_m3.host_pool

        check_hicache_launch(kvc.server_args)
    from sglang.srt.configs.model_config import (
        get_minimax_sparse_attention_config,
        get_minimax_sparse_disable_value_layer_ids,
        get_minimax_sparse_layer_ids,
    )
    from sglang.srt.runtime_context import get_parallel

    from .pool import MiniMaxM31SparseKVPool

    sparse_cfg = get_minimax_sparse_attention_config(kvc.model_config.hf_config)
    dense_ids, sparse_ids = get_minimax_sparse_layer_ids(sparse_cfg)
    return MiniMaxM31SparseKVPool(
        size=max_total_num_tokens,
        page_size=setting(kvc.server_args, "page_size"),
        dtype=kvc.kv_cache_dtype,
        head_num=kvc.model_config.get_num_kv_heads(get_parallel().attn_tp_size),
        head_dim=kvc.model_config.head_dim,
        idx_head_dim=sparse_cfg["sparse_index_dim"],
        dense_layer_ids=dense_ids,
        sparse_layer_ids=sparse_ids,
        disable_value_sparse_layer_ids=get_minimax_sparse_disable_value_layer_ids(sparse_cfg),
        device=kvc.device,
        settings=settings,
        enable_memory_saver=setting(kvc.server_args, "enable_memory_saver"),
        start_layer=kvc.layer_info.start_layer,
        end_layer=kvc.layer_info.end_layer,
    )


def _index_k_cell_size(original, configurator, kvc, num_layers: int) -> int:
    settings = _settings(kvc.model_config.hf_config)
    if settings is None:
        return original(configurator, kvc, num_layers)
    import torch

    from sglang.srt.runtime_context import get_parallel

    from .pool import cell_bytes

    dense, sparse = _local_sparse_layers(kvc.model_config, kvc.layer_info.start_layer, kvc.layer_info.end_layer)
    kv_heads = kvc.model_config.get_num_kv_heads(get_parallel().attn_tp_size)
    return cell_bytes(len(dense), len(sparse), kv_heads, kvc.model_config.head_dim,
                      torch._utils._element_size(kvc.kv_cache_dtype), settings)


# ---- attention backend -----------------------------------------------------------------------

def _attn_backend(original, runner, full_attn_backend):
    settings = _settings(runner.model_config.hf_config)
    if settings is None:
        return original(runner, full_attn_backend)
    from sglang.srt.layers.attention.minimax_sparse_backend import MiniMaxHybridAttnBackend

    from .backend import MiniMaxM31SparseAttnBackend

    sparse = MiniMaxM31SparseAttnBackend(runner, settings)
    if str(runner.device) == "cpu" and hasattr(full_attn_backend, "_run_sdpa_forward_decode"):  # torch_native
        full_attn_backend._run_sdpa_forward_decode = functools.partial(
            _dense_decode_cpu, full_attn_backend._run_sdpa_forward_decode)
        full_attn_backend._run_sdpa_forward_extend = functools.partial(
            _dense_extend_cpu, full_attn_backend._run_sdpa_forward_extend)
    return MiniMaxHybridAttnBackend(full_attn_backend, sparse, sparse.sparse_layer_ids)


def _plain_self_attention(query, k_cache, v_cache, encoder_lens, is_cross_attn, sliding_window_size) -> bool:
    """Whether a torch_native SDPA call is what the dense CPU kernels serve: self attention without a sliding
    window, one dtype, whole query-head groups per KV head."""
    return (encoder_lens is None and not is_cross_attn
            and (sliding_window_size is None or sliding_window_size <= -1)
            and query.dtype == k_cache.dtype == v_cache.dtype and query.shape[1] % k_cache.shape[1] == 0)


def _dense_decode_cpu(original, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                      encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                      sliding_window_size=None):
    """SGLang's ``TorchNativeAttnBackend._run_sdpa_forward_decode`` (``query``/``output [batch, Hq, D]``) for the
    model's dense layers on the CPU, through ``m3_kernels.ops.attention.dense_attention_decode_cpu`` (one call, a
    KV head's query heads as its rows, where SGLang makes one ``enable_gqa`` call per request); cross attention,
    sliding windows and mixed dtypes keep SGLang's."""
    from m3_kernels.ops.attention import dense_attention_decode_cpu

    if causal or not _plain_self_attention(query, k_cache, v_cache, encoder_lens, is_cross_attn, sliding_window_size):
        return original(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, encoder_lens,
                        scaling=scaling, enable_gqa=enable_gqa, causal=causal, is_cross_attn=is_cross_attn,
                        sliding_window_size=sliding_window_size)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    output.copy_(dense_attention_decode_cpu(query, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale))
    return output


def _dense_extend_cpu(original, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                      extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
                      causal=False, is_cross_attn=False, sliding_window_size=None):
    """SGLang's ``TorchNativeAttnBackend._run_sdpa_forward_extend`` (``query``/``output [tokens, Hq, D]``) for the
    model's dense layers on the CPU, through ``m3_kernels.ops.attention.dense_attention_extend_cpu`` (the new rows
    only, where SGLang pads each request's query to its whole sequence); cross attention, non-causal calls,
    sliding windows and mixed dtypes keep SGLang's."""
    from m3_kernels.ops.attention import dense_attention_extend_cpu

    if not causal or not _plain_self_attention(query, k_cache, v_cache, encoder_lens, is_cross_attn,
                                               sliding_window_size):
        return original(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                        extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                        is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    output.copy_(dense_attention_extend_cpu(query, k_cache, v_cache, req_to_token, req_pool_indices,
                                            extend_prefix_lens, extend_seq_lens, scale))
    return output


# ---- requests: SGLang bug workarounds, M3.1 index-K servers only -------------------------------

def _serves_index_k(tokenizer_manager) -> bool:
    return is_index_k_config(tokenizer_manager.model_config.hf_config, strict=False)


def _release_unsent_states(tokenizer_manager, obj, *args, **kwargs):
    """``parallel_sampling.release_unsent_states`` on a MiniMax-M3.1 index-K server."""
    if _serves_index_k(tokenizer_manager):
        return parallel_sampling.release_unsent_states(tokenizer_manager, obj, *args, **kwargs)
    return None


def _abort_unfinished_samples(original, tokenizer_manager, obj, *args, **kwargs):
    """``parallel_sampling.abort_unfinished_samples`` on a MiniMax-M3.1 index-K server; SGLang's handler elsewhere."""
    if _serves_index_k(tokenizer_manager):
        return parallel_sampling.abort_unfinished_samples(original, tokenizer_manager, obj, *args, **kwargs)
    return original(tokenizer_manager, obj, *args, **kwargs)


def _note_sent_rid(tokenizer_manager, tokenized_obj, *args, **kwargs):
    """``parallel_sampling.note_sent_rid`` on a MiniMax-M3.1 index-K server."""
    if _serves_index_k(tokenizer_manager):
        return parallel_sampling.note_sent_rid(tokenizer_manager, tokenized_obj, *args, **kwargs)
    return None


def _check_input_ids_in_vocab(tokenizer_manager, obj, input_ids, *args, **kwargs):
    """ValueError (HTTP 400) naming the token ids outside ``[0, vocab_size)`` (MiniMax-M3.1 index-K servers only:
    see ``docs/upstream.md``, out-of-vocabulary ids)."""
    if not input_ids or not _serves_index_k(tokenizer_manager):
        return None
    vocab_size = tokenizer_manager.model_config.vocab_size
    # Kept as text: an id may be unhashable (a nested list) or a bool, which is no token id either.
    bad = sorted({repr(t) for t in input_ids
                  if isinstance(t, bool) or not isinstance(t, int) or t < 0 or t >= vocab_size})
    if bad:
        shown = ", ".join(bad[:16]) + (" ..." if len(bad) > 16 else "")
        raise ValueError(f"input_ids holds token ids outside the vocabulary [0, {vocab_size}): {shown}")
    return None


# ---- processes ---------------------------------------------------------------------------------

def _run_after_loading_plugins(target, *args, **kwargs):
    """Child-process entry: load SGLang plugins (this package's config class among them), then run."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return target(*args, **kwargs)


def _detokenizer_loads_plugins(original, engine_cls, server_args, port_args, run_detokenizer_process_func):
    """Before 0.5.22 the detokenizer never loaded plugins, so transformers did not know
    ``minimax_m3_1`` there and warned while loading the tokenizer ("a model of type ``"); on a MiniMax-M3.1
    index-K launch its process now starts through ``_run_after_loading_plugins``."""
    if not is_index_k_launch(server_args):
        return original(engine_cls, server_args=server_args, port_args=port_args,
                        run_detokenizer_process_func=run_detokenizer_process_func)
    target = functools.partial(_run_after_loading_plugins, run_detokenizer_process_func)
    return original(engine_cls, server_args=server_args, port_args=port_args, run_detokenizer_process_func=target)


# ---- entry point -----------------------------------------------------------------------------

class Hook(NamedTuple):
    """One row of the hook table: applies to SGLang releases in ``[since, until)`` (None: open)."""

    target: str
    hook: Callable
    kind: str  # HookType member name
    since: Version | None = None
    until: Version | None = None

    def applies_to(self, version: Version) -> bool:
        return (self.since is None or version >= self.since) and (self.until is None or version < self.until)


def hook_table() -> tuple[Hook, ...]:
    """Every hooked SGLang target (see the module docstring), for every supported release."""
    from . import cpu_alloc, host_pool, pd, server_info

    server_args = "sglang.srt.server_args.ServerArgs"
    tokenizer_manager = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
    allocator = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"
    assembler = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
    return (
        Hook(f"{server_args}.add_cli_args", _add_index_k_format_flag, "AFTER"),
        # hooks on one target run last-registered first: the launch is checked before anything else reads it, and
        # the package's refusals in any of them (or in SGLang's parse past them) end in one line
        Hook(f"{server_args}.from_cli_args", _fold_index_k_format_flag, "BEFORE"),
        Hook(f"{server_args}.from_cli_args", _cpu_openmp_waits, "BEFORE"),
        Hook(f"{server_args}.from_cli_args", check_launch, "BEFORE"),
        Hook(f"{server_args}.from_cli_args", _refusals_in_one_line, "AROUND"),
        Hook("sglang.srt.entrypoints.engine._set_envs_and_config", _cpu_children_start, "AFTER"),
        Hook(f"{server_args}._parse_cuda_graph_config", _no_prefill_cuda_graph, "AFTER", until=RESOLUTION_PIPELINE),
        Hook("sglang.srt.arg_groups.cuda_graph_hook.handle_cuda_graph_config", _no_prefill_cuda_graph_declared,
             "AFTER", since=RESOLUTION_PIPELINE),
        Hook("sglang.srt.configs.model_config.ModelConfig.__init__", _validate_index_k_settings, "AFTER"),
        Hook("sglang.srt.model_loader.utils.get_model_architecture", _model_architecture, "AROUND"),
        Hook("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_minimax_sparse_kv_pool",
             _build_index_k_pool, "AROUND"),
        Hook(f"{assembler}.MHATokenToKOnlyPoolHost", host_pool.KOnlyPoolHost, "REPLACE"),
        Hook(f"{assembler}.build_minimax_sparse_hicache_stack", host_pool.hicache_stack_counting_index_bytes, "AROUND"),
        Hook("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
             _index_k_cell_size, "AROUND"),
        Hook("sglang.srt.layers.attention.attention_registry.attn_backend_wrapper", _attn_backend, "AROUND"),
        Hook(f"{tokenizer_manager}._validate_one_request", _check_input_ids_in_vocab, "BEFORE"),
        Hook(f"{tokenizer_manager}._handle_batch_request", _release_unsent_states, "BEFORE",
             until=PARALLEL_SAMPLING_RELEASES_STATES),
        Hook(f"{tokenizer_manager}._handle_batch_request", _abort_unfinished_samples, "AROUND",
             until=BATCH_HANDLER_ABORTS_SENT),
        Hook(f"{tokenizer_manager}._send_one_request", _note_sent_rid, "BEFORE", until=BATCH_HANDLER_ABORTS_SENT),
        Hook("sglang.srt.entrypoints.engine.Engine._launch_detokenizer_subprocesses", _detokenizer_loads_plugins,
             "AROUND", until=DETOKENIZER_LOADS_PLUGINS),
        Hook(f"{allocator}.alloc_extend", cpu_alloc.alloc_extend, "AROUND", until=ALLOCATOR_OFF_TRITON),
        Hook(f"{allocator}.alloc_decode", cpu_alloc.alloc_decode, "AROUND", until=ALLOCATOR_OFF_TRITON),
        Hook("sglang.srt.entrypoints.http_server.server_info", server_info.add_index_k_info, "AROUND"),
        Hook("sglang.srt.entrypoints.http_server.model_info", server_info.add_index_k_info, "AROUND"),
        Hook("sglang.srt.entrypoints.http_server.launch_server", server_info.route_index_k_info, "BEFORE"),
        Hook("sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager", pd.note_decode_index_k, "AFTER"),
        Hook("sglang.srt.disaggregation.common.conn.CommonKVReceiver.init", pd.check_prefill_index_k, "AROUND"),
    )


_registered = False


def _refuse_index_k_launch(error: "compat.UnsupportedSGLangError"):
    """After ``ModelConfig.__init__`` on an SGLang outside the supported range: refuse a MiniMax-M3.1
    index-K launch, naming the range; any other model goes on."""

    def refuse(result, model_config, *args, **kwargs):
        if is_index_k_launch(model_config):
            raise compat.UnsupportedSGLangError(f"MiniMax-M3.1 with an index-K cache: {error}")
        return result

    return refuse


def _register_outside_range(error) -> None:
    """SGLang outside the supported range: one log line, no hook for other models; an M3.1 index-K launch
    (its config known to transformers, its ``--index-k-format`` parsed) is refused when SGLang builds its
    model config."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    logger.warning("sglang-m3 is off: %s; other models are served as without it, a MiniMax-M3.1 index-K launch "
                   "is refused", error)
    register_config()
    server_args = "sglang.srt.server_args.ServerArgs"
    HookRegistry.register(f"{server_args}.add_cli_args", _add_index_k_format_flag, HookType.AFTER)
    HookRegistry.register(f"{server_args}.from_cli_args", _fold_index_k_format_flag, HookType.BEFORE)
    HookRegistry.register(f"{server_args}.from_cli_args", _refusals_in_one_line, HookType.AROUND)
    HookRegistry.register("sglang.srt.configs.model_config.ModelConfig.__init__", _refuse_index_k_launch(error),
                          HookType.AFTER)


def register() -> None:
    """Entry point: check the SGLang release, then register the config class, the hooks of that
    release and the page-size default (idempotent). Every hook passes SGLang's call through unless
    the served model is MiniMax-M3.1 with an index-K format (``scope``).

    Outside the supported range: one warning line, and only what it takes to refuse an M3.1
    index-K launch naming the range (``_register_outside_range``); other models run as without
    this package.
    """
    global _registered
    if _registered:
        return
    _registered = True
    try:
        version = compat.sglang_version()
    except compat.UnsupportedSGLangError as e:
        _register_outside_range(e)
        return
    from sglang.srt.arg_groups.overrides import register_model_override
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    register_config()
    register_model_override(ARCHITECTURE)(_page_size_default)
    for row in hook_table():
        if row.applies_to(version):
            HookRegistry.register(row.target, row.hook, HookType[row.kind])
