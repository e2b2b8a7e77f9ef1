"""Plugin hooks that can be called without a server."""

import re
from types import SimpleNamespace

import pytest

from sglang_m3.config import MiniMaxM31Config
from sglang_m3.plugin import _build_index_k_pool, _check_input_ids_in_vocab


def _unreachable(*args, **kwargs):
    raise AssertionError("SGLang's own pool builder must not run for an index-K config")


def test_hierarchical_cache_is_refused_before_any_pool_is_built():
    hf_config = MiniMaxM31Config(sparse_attention_config={"sparse_index_dim": 128}, index_k_format="mxfp4")
    kvc = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config),
                          server_args=SimpleNamespace(enable_hierarchical_cache=True, page_size=128))
    with pytest.raises(NotImplementedError, match="--enable-hierarchical-cache"):
        _build_index_k_pool(_unreachable, kvc, max_total_num_tokens=1024)


@pytest.mark.parametrize("input_ids,shown", [
    ([5, 2048, -1, 2048], "-1, 2048"),
    ([1, [2, 3]], "[2, 3]"),  # unhashable: still a ValueError (HTTP 400), not a TypeError
    ([True, 4], "True"),
    ([1, 2.0], "2.0"),
])
def test_out_of_vocabulary_ids_raise_value_error(input_ids, shown):
    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=2048))
    with pytest.raises(ValueError, match=r"input_ids holds token ids outside the vocabulary \[0, 2048\): "
                                         + re.escape(shown) + "$"):
        _check_input_ids_in_vocab(manager, None, input_ids)
    assert _check_input_ids_in_vocab(manager, None, [0, 2047]) is None
    assert _check_input_ids_in_vocab(manager, None, None) is None
