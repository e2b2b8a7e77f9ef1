"""KV-pool capacity per index-K format, from SGLang's own pool configurator.

    python -m sglang_m3.capacity [--config configs/minimax-m3.1] [--budget-gib 100] [--tp 1]

Runs ``DefaultPoolConfigurator`` (the class SGLang sizes pools with, ``max_total_num_tokens =
budget // cell_size``) with this plugin's hooks applied, for one fixed KV budget, once per format
and once without the plugin (SGLang's own bf16 index row). No server, no GPU: the budget is an
argument instead of free device memory, so the numbers are exact and repeatable.
"""

import argparse
import contextlib
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
from packaging.version import Version

from m3_kernels.formats import PAGE_SIZE, IndexKFormat

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "minimax-m3.1"


def _kv_configurator(hf_config, tp: int, kv_dtype: torch.dtype):
    """The attributes of SGLang's KVCacheConfigurator that the pool configurator reads."""
    layers = hf_config.num_hidden_layers
    model_config = SimpleNamespace(
        hf_config=hf_config,
        hf_text_config=hf_config,
        head_dim=hf_config.head_dim,
        v_head_dim=hf_config.head_dim,
        get_num_kv_heads=lambda tp_size: max(1, hf_config.num_key_value_heads // tp_size),
        linear_attn_registry_result=None,
        quantization=None,
        context_len=getattr(hf_config, "max_position_embeddings", 0),
    )
    no_spec = SimpleNamespace(is_eagle=lambda: False, is_standalone=lambda: False, is_dflash_family=lambda: False)
    server_args = SimpleNamespace(kv_cache_dtype="auto", attention_backend=None, enable_hisparse=False)
    return SimpleNamespace(
        model_config=model_config, kv_cache_dtype=kv_dtype, kv_cache_dtype_str="auto", model_dtype=torch.bfloat16,
        use_mla_backend=False, layer_info=SimpleNamespace(start_layer=0, end_layer=layers, num_effective_layers=layers),
        spec_algorithm=no_spec, is_draft_worker=False, pp_size=1, server_args=server_args,
    )


UPSTREAM_NVFP4_SINCE = "0.5.23"  # SGLang's own M3.1 NVFP4 stack (NVFP4 main K/V and index K, Blackwell only)


def all_sparse(hf_config):
    """A copy of ``hf_config`` with every layer sparse and K-only (the layout SGLang's NVFP4 stack requires)."""
    cfg = hf_config.__class__.from_dict(hf_config.to_dict())
    sparse = dict(cfg.sparse_attention_config)
    sparse["sparse_attention_freq"] = [1] * cfg.num_hidden_layers
    sparse["sparse_disable_index_value"] = [1] * cfg.num_hidden_layers
    cfg.sparse_attention_config = sparse
    return cfg


def pool_tokens(hf_config, budget_bytes: int, index_k_format: str | None, tp: int = 1,
                kv_dtype: torch.dtype = torch.bfloat16, upstream_nvfp4: bool = False) -> int:
    """``max_total_num_tokens`` SGLang picks for ``budget_bytes`` (``index_k_format=None``: no plugin).

    ``upstream_nvfp4``: size SGLang's own NVFP4 stack instead (quantization ``minimax_m3_nvfp4``
    on a Blackwell GPU, as its configurator sees it; SGLang >= 0.5.23, ``index_k_format`` None).
    """
    from sglang.srt.model_executor import pool_configurator
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    from .plugin import _index_k_cell_size

    cfg = hf_config.__class__.from_dict(hf_config.to_dict())
    cfg.index_k_format = index_k_format
    parallel = SimpleNamespace(attn_tp_size=tp, tp_size=tp, attn_dcp_size=1)
    # What a server publishes at start-up (SGLang >= 0.5.17 reads these from its runtime context):
    # no fixed token cap, no HiSparse, no KV-shard scratch.
    bags = {"get_parallel": lambda: parallel, "get_schedule": lambda: SimpleNamespace(max_total_tokens=None),
            "get_memory": lambda: SimpleNamespace(enable_hisparse=False),
            "compute_page_shard_scratch_bytes": lambda kvc, **kwargs: 0}
    with contextlib.ExitStack() as patches:
        for name, value in bags.items():
            if hasattr(pool_configurator, name):
                patches.enter_context(mock.patch.object(pool_configurator, name, value))
        patches.enter_context(mock.patch("sglang.srt.runtime_context.get_parallel", lambda: parallel))
        if upstream_nvfp4:
            blackwell = SimpleNamespace(is_blackwell=True, is_sm100=True, is_sm90=False, is_hip=False, is_cuda=True)
            patches.enter_context(mock.patch("sglang.srt.runtime_context.get_platform", lambda: blackwell))
        patches.enter_context(mock.patch("sglang.srt.layers.cp.utils.get_glm_dsa_layer_split_effective_num_layers",
                                         lambda kvc, n: n, create=True))
        kvc = _kv_configurator(cfg, tp, kv_dtype)
        if upstream_nvfp4:
            kvc.model_config.quantization = "minimax_m3_nvfp4"
        if index_k_format is None:
            configurator = DefaultPoolConfigurator(kvc)
        else:
            with mock.patch.object(DefaultPoolConfigurator, "_compute_cell_size",
                                   lambda self, k, n, _orig=DefaultPoolConfigurator._compute_cell_size:
                                   _index_k_cell_size(_orig, self, k, n)):
                configurator = DefaultPoolConfigurator(kvc)
        return configurator.calculate_pool_sizes(budget_bytes, PAGE_SIZE).max_total_num_tokens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--budget-gib", type=float, default=100.0)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args(argv)
    from transformers import AutoConfig

    from .plugin import register

    register()
    hf_config = AutoConfig.from_pretrained(args.config)
    budget = int(args.budget_gib * (1 << 30))
    base = pool_tokens(hf_config, budget, None, args.tp)
    print(f"config {args.config}, KV budget {args.budget_gib} GiB, attention TP {args.tp}, page {PAGE_SIZE}")
    print("| index-K cache | max_total_num_tokens | vs SGLang (bf16 index) |\n|---|---:|---:|")
    print(f"| SGLang, no plugin | {base} | 1.000 |")
    for fmt in IndexKFormat:
        tokens = pool_tokens(hf_config, budget, fmt.value, args.tp)
        print(f"| {fmt.value} | {tokens} | {tokens / base:.3f} |")
    from .compat import sglang_version

    if sglang_version() >= Version(UPSTREAM_NVFP4_SINCE):
        # Its pool refuses dense layers, so both sides are sized with every layer sparse.
        sparse_cfg = all_sparse(hf_config)
        sparse_base = pool_tokens(sparse_cfg, budget, None, args.tp)
        print(f"\nevery layer sparse ({sparse_cfg.num_hidden_layers}), as SGLang {UPSTREAM_NVFP4_SINCE}'s NVFP4 stack "
              "requires; that stack also stores main K/V in NVFP4")
        print("| index-K cache | main K/V | max_total_num_tokens | vs SGLang (bf16 index) |\n|---|---|---:|---:|")
        print(f"| SGLang, no plugin | bf16 | {sparse_base} | 1.000 |")
        for fmt in (IndexKFormat.FP8, IndexKFormat.MXFP4):
            tokens = pool_tokens(sparse_cfg, budget, fmt.value, args.tp)
            print(f"| {fmt.value} | bf16 | {tokens} | {tokens / sparse_base:.3f} |")
        tokens = pool_tokens(sparse_cfg, budget, None, args.tp, upstream_nvfp4=True)
        print(f"| SGLang nvfp4 (minimax_m3_nvfp4) | nvfp4 | {tokens} | {tokens / sparse_base:.3f} |")


if __name__ == "__main__":
    main()
