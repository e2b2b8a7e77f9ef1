"""Plugin hooks that can be called without a server."""

from types import SimpleNamespace

import pytest

from sglang_m3.config import MiniMaxM31Config
from sglang_m3.plugin import _build_index_k_pool


def _unreachable(*args, **kwargs):
    raise AssertionError("SGLang's own pool builder must not run for an index-K config")


def test_hierarchical_cache_is_refused_before_any_pool_is_built():
    hf_config = MiniMaxM31Config(sparse_attention_config={"sparse_index_dim": 128}, index_k_format="mxfp4")
    kvc = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config),
                          server_args=SimpleNamespace(enable_hierarchical_cache=True, page_size=128))
    with pytest.raises(NotImplementedError, match="--enable-hierarchical-cache"):
        _build_index_k_pool(_unreachable, kvc, max_total_num_tokens=1024)
