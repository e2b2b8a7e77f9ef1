"""SGLang's own pool configurator, with the plugin's budget hook, sizes the pool per format."""

from pathlib import Path

from transformers import AutoConfig

from m3_kernels.formats import PAGE_SIZE, IndexKFormat
from sglang_m3.capacity import pool_tokens
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
