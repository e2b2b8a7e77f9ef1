"""Backend construction checks that need no model runner."""

from types import SimpleNamespace

import pytest

from m3_kernels.formats import IndexKFormat, ScaleRule
from sglang_m3.backend import MiniMaxM31SparseAttnBackend
from sglang_m3.config import IndexKSettings


@pytest.mark.parametrize("algorithm", ["EAGLE", "NGRAM"])
def test_speculative_decoding_is_refused_at_start_up(algorithm):
    runner = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm=algorithm))
    with pytest.raises(NotImplementedError, match=rf"speculative_algorithm='{algorithm}'.*--speculative-algorithm"):
        MiniMaxM31SparseAttnBackend(runner, IndexKSettings(IndexKFormat.MXFP4, ScaleRule.RCEIL, None))
