"""The ``sglang.srt.plugins`` entry point: registers MiniMax-M3.1 with SGLang in every process.

Installing the package is all it takes (SGLang loads the entry point in the launcher, tokenizer
manager, scheduler and detokenizer). The vocabulary check and the allocator hooks (the last two
rows) act for every model served where this package is installed, the allocator only off CUDA; the
others engage only for a config with ``index_k_format`` (the flag only when given), so upstream
MiniMax-M3 configs keep SGLang's own path:

| target | kind | why |
|---|---|---|
| ``ServerArgs.add_cli_args`` / ``from_cli_args`` | after / before | ``--index-k-format`` flag, folded into ``--json-model-override-args`` |
| ``ServerArgs.from_cli_args`` | before | ``--device cpu``: ``OMP_WAIT_POLICY=PASSIVE`` for its processes unless set |
| ``ServerArgs._parse_cuda_graph_config`` | after | prefill without a CUDA graph (host-planned scorer); decode graphs stay |
| ``ModelConfig.__init__`` | after | validate the format at start-up (message names the choices) |
| ``get_model_architecture`` | around | serve ``MiniMaxM3SparseForCausalLM`` with this package's class |
| ``KVCacheConfigurator._build_minimax_sparse_kv_pool`` | around | build ``MiniMaxM31SparseKVPool`` (index cache in the format) |
| ``DefaultPoolConfigurator._compute_cell_size`` | around | budget the format's bytes, so ``max_total_num_tokens`` grows with a smaller format |
| ``attn_backend_wrapper`` | around | pair the dense backend with ``MiniMaxM31SparseAttnBackend`` |
| ``TokenizerManager._validate_one_request`` | before | reject token ids outside the vocabulary (HTTP 400) |
| ``PagedTokenToKVPoolAllocator.alloc_extend`` / ``alloc_decode`` | around | torch slots off CUDA (SGLang's are Triton) |

plus an SGLang model-override provider that defaults ``--page-size`` to 128 for this model.
"""

import json
import logging
import os

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from m3_kernels.formats import PAGE_SIZE, IndexKFormat

from .config import ARCHITECTURE, MODEL_TYPE, MiniMaxM31Config, index_k_settings

logger = logging.getLogger(__name__)

INDEX_K_FORMAT_FLAG = "--index-k-format"


# ---- server arguments ------------------------------------------------------------------------

def _add_index_k_format_flag(result, parser):
    parser.add_argument(
        INDEX_K_FORMAT_FLAG,
        type=str,
        choices=[f.value for f in IndexKFormat],
        default=None,
        help="MiniMax-M3.1 sparse-attention index-K cache format (default: the model config's index_k_format).",
    )


def _fold_index_k_format_flag(cls, args):
    fmt = getattr(args, "index_k_format", None)
    if fmt is None:
        return None
    overrides = json.loads(getattr(args, "json_model_override_args", None) or "{}")
    overrides["index_k_format"] = fmt
    args.json_model_override_args = json.dumps(overrides)
    return None


OMP_WAIT_POLICY = "OMP_WAIT_POLICY"


def _cpu_omp_passive(cls, args):
    """In the launcher, before the scheduler and its peers are spawned (they inherit the environment and
    read it when OpenMP starts): a ``--device cpu`` server gets ``OMP_WAIT_POLICY=PASSIVE`` unless the
    user set it. OpenMP's default spin-wait costs about 6 ms per torch op when another process holds
    one of the cores (measured on a 2-core box: 1-token decode at 0.9 tokens/s, 13.7 with PASSIVE)."""
    if getattr(args, "device", None) == "cpu" and OMP_WAIT_POLICY not in os.environ:
        os.environ[OMP_WAIT_POLICY] = "PASSIVE"
        logger.info("--device cpu: %s=PASSIVE for the server's processes (set it to override)", OMP_WAIT_POLICY)
    return None


def _page_size_default(server_args, hf_config) -> dict:
    """SGLang model-override provider: one cache page per MSA block unless the user chose."""
    if index_k_settings(hf_config) is not None and server_args.page_size is None:
        return {"page_size": PAGE_SIZE}
    return {}


def _no_prefill_cuda_graph(result, server_args, *args, **kwargs):
    """After SGLang resolves ``cuda_graph_config``: an index-K config runs prefill without a CUDA graph.

    The prefill scorer plans its page tiles on the host from each batch's lengths (read back from
    the device), which a captured graph can neither record nor replay, so SGLang's CUDA default
    (``breakable`` prefill graphs) is turned off; an explicitly requested prefill graph is refused.
    Decode CUDA graphs are unaffected.
    """
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase

    prefill = server_args.cuda_graph_config.prefill
    if prefill.backend == Backend.DISABLED or index_k_settings(server_args.get_model_config().hf_config) is None:
        return None
    if (Phase.PREFILL, "backend") in server_args._cuda_graph_config_locked:
        raise ValueError(
            f"cuda_graph_config prefill backend {prefill.backend!r}: MiniMax-M3.1 with an index-K cache "
            "runs prefill without a CUDA graph; use --cuda-graph-backend-prefill disabled (decode graphs stay on)"
        )
    logger.info("MiniMax-M3.1 index-K cache: prefill CUDA graph %r turned off (decode graphs stay on)",
                prefill.backend)
    prefill.backend = Backend.DISABLED
    server_args._cuda_graph_config_locked.add((Phase.PREFILL, "backend"))
    return None


# ---- model config, model class ---------------------------------------------------------------

def _validate_index_k_settings(result, model_config, *args, **kwargs):
    settings = index_k_settings(model_config.hf_config)
    if settings is not None:
        logger.info("MiniMax-M3.1 index-K cache: %s (scale rule %s)", settings.fmt.value, settings.scale_rule.value)


def _model_architecture(original, model_config):
    model_cls, arch = original(model_config)
    if arch == ARCHITECTURE and index_k_settings(model_config.hf_config) is not None:
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
    settings = index_k_settings(kvc.model_config.hf_config)
    if settings is None:
        return original(kvc, max_total_num_tokens=max_total_num_tokens)
    if getattr(kvc.server_args, "enable_hierarchical_cache", False):
        # SGLang's host copy of the index cache assumes one [slots, 1, 128] row per token slot;
        # the paged index layout (and MXFP4's per-page scales) would be copied wrongly.
        raise NotImplementedError(
            "enable_hierarchical_cache: the MiniMax-M3.1 index-K cache has no host (HiCache) copy; "
            "launch without --enable-hierarchical-cache"
        )
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
        page_size=kvc.server_args.page_size,
        dtype=kvc.kv_cache_dtype,
        head_num=kvc.model_config.get_num_kv_heads(get_parallel().attn_tp_size),
        head_dim=kvc.model_config.head_dim,
        idx_head_dim=sparse_cfg["sparse_index_dim"],
        dense_layer_ids=dense_ids,
        sparse_layer_ids=sparse_ids,
        disable_value_sparse_layer_ids=get_minimax_sparse_disable_value_layer_ids(sparse_cfg),
        device=kvc.device,
        settings=settings,
        enable_memory_saver=kvc.server_args.enable_memory_saver,
        start_layer=kvc.layer_info.start_layer,
        end_layer=kvc.layer_info.end_layer,
    )


def _index_k_cell_size(original, configurator, kvc, num_layers: int) -> int:
    settings = index_k_settings(kvc.model_config.hf_config)
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
    settings = index_k_settings(runner.model_config.hf_config)
    if settings is None:
        return original(runner, full_attn_backend)
    from sglang.srt.layers.attention.minimax_sparse_backend import MiniMaxHybridAttnBackend

    from .backend import MiniMaxM31SparseAttnBackend

    sparse = MiniMaxM31SparseAttnBackend(runner, settings)
    return MiniMaxHybridAttnBackend(full_attn_backend, sparse, sparse.sparse_layer_ids)


# ---- request validation ----------------------------------------------------------------------

def _check_input_ids_in_vocab(tokenizer_manager, obj, input_ids, *args, **kwargs):
    """ValueError (HTTP 400) naming the token ids outside ``[0, vocab_size)``."""
    if not input_ids:
        return None
    vocab_size = tokenizer_manager.model_config.vocab_size
    # Kept as text: an id may be unhashable (a nested list) or a bool, which is no token id either.
    bad = sorted({repr(t) for t in input_ids
                  if isinstance(t, bool) or not isinstance(t, int) or t < 0 or t >= vocab_size})
    if bad:
        shown = ", ".join(bad[:16]) + (" ..." if len(bad) > 16 else "")
        raise ValueError(f"input_ids holds token ids outside the vocabulary [0, {vocab_size}): {shown}")
    return None


# ---- entry point -----------------------------------------------------------------------------

def _hooks():
    from . import cpu_alloc

    return (
        ("sglang.srt.server_args.ServerArgs.add_cli_args", _add_index_k_format_flag, HookType.AFTER),
        ("sglang.srt.server_args.ServerArgs.from_cli_args", _fold_index_k_format_flag, HookType.BEFORE),
        ("sglang.srt.server_args.ServerArgs.from_cli_args", _cpu_omp_passive, HookType.BEFORE),
        ("sglang.srt.server_args.ServerArgs._parse_cuda_graph_config", _no_prefill_cuda_graph, HookType.AFTER),
        ("sglang.srt.configs.model_config.ModelConfig.__init__", _validate_index_k_settings, HookType.AFTER),
        ("sglang.srt.model_loader.utils.get_model_architecture", _model_architecture, HookType.AROUND),
        ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_minimax_sparse_kv_pool",
         _build_index_k_pool, HookType.AROUND),
        ("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
         _index_k_cell_size, HookType.AROUND),
        ("sglang.srt.layers.attention.attention_registry.attn_backend_wrapper", _attn_backend, HookType.AROUND),
        ("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
         _check_input_ids_in_vocab, HookType.BEFORE),
        ("sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_extend", cpu_alloc.alloc_extend,
         HookType.AROUND),
        ("sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_decode", cpu_alloc.alloc_decode,
         HookType.AROUND),
    )


_registered = False


def register() -> None:
    """Register the config class, the hooks and the page-size default (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    from transformers import AutoConfig

    from sglang.srt.arg_groups.overrides import register_model_override

    AutoConfig.register(MODEL_TYPE, MiniMaxM31Config, exist_ok=True)
    register_model_override(ARCHITECTURE)(_page_size_default)
    for target, hook, kind in _hooks():
        HookRegistry.register(target, hook, kind)
