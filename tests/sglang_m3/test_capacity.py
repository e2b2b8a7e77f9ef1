"""SGLang's own pool configurator, with the plugin's budget hook, sizes the pool per format."""

from pathlib import Path

import pytest
import torch
from packaging.version import Version
from transformers import AutoConfig

from m3_kernels.formats import PAGE_SIZE, IndexKFormat
from sglang_m3.capacity import UPSTREAM_NVFP4_SINCE, all_sparse, pool_tokens
from sglang_m3.compat import sglang_version
from sglang_m3.plugin import register

FULL = Path(__file__).resolve().parents[2] / "configs" / "minimax-m3.1"


def test_capacity_grows_by_the_byte_ratio():
    register()
    cfg = AutoConfig.from_pretrained(FULL)
    budget = 80 << 30
    upstream = pool_tokens(cfg, budget, None)
    tokens = {f: pool_tokens(cfg, budget, f.value) for f in IndexKFormat}
    assert tokens[IndexKFormat.BF16] == upstream  # the hook charges bf16 exactly as SGLang does
    main_bytes = 60 * 2 * 4 * 128 * 2
    for fmt, n in tokens.items():
        cell = main_bytes + 57 * fmt.token_bytes
        assert n == budget // cell // PAGE_SIZE * PAGE_SIZE
    assert tokens[IndexKFormat.MXFP4] > tokens[IndexKFormat.FP8] > tokens[IndexKFormat.BF16]


def test_an_fp8_main_kv_cache_is_charged_one_byte_an_element():
    register()
    cfg = AutoConfig.from_pretrained(FULL)
    budget = 80 << 30
    for fmt in IndexKFormat:
        cell = 60 * 2 * 4 * 128 * 1 + 57 * fmt.token_bytes
        tokens = pool_tokens(cfg, budget, fmt.value, kv_dtype=torch.float8_e4m3fn)
        assert tokens == budget // cell // PAGE_SIZE * PAGE_SIZE


def test_upstream_nvfp4_stack_capacity_from_its_configurator():
    """SGLang 0.5.23's NVFP4 stack, sized by its own configurator: per sparse layer and token, main
    K/V as e2m1 (64 B) + e4m3 scales per 16 (8 B) per KV head, index K 64 + 8 B."""
    if sglang_version() < Version(UPSTREAM_NVFP4_SINCE):
        pytest.skip(f"SGLang {sglang_version()} has no NVFP4 index-K stack")
    register()
    cfg = all_sparse(AutoConfig.from_pretrained(FULL))
    budget = 80 << 30
    per_layer = 2 * 4 * (128 // 2 + 128 // 16) + (128 // 2 + 128 // 16)  # 648 B
    assert pool_tokens(cfg, budget, None, upstream_nvfp4=True) == budget // (60 * per_layer) // PAGE_SIZE * PAGE_SIZE
    assert pool_tokens(cfg, budget, "mxfp4") == budget // (60 * (2 * 4 * 128 * 2 + 68)) // PAGE_SIZE * PAGE_SIZE
