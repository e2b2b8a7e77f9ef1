import pytest
import torch

from m3_kernels.formats import IndexKFormat, quantize_index_k


@pytest.mark.parametrize("fmt", [f.value for f in IndexKFormat])
def test_every_format_rejects_the_same_bad_keys(fmt):
    """One rule for every format: ``k`` is float32 or bfloat16 with last dim 128."""
    with pytest.raises(ValueError, match="k must be float32 or bfloat16"):
        quantize_index_k(torch.zeros(2, 128, dtype=torch.float16), fmt)
    with pytest.raises(ValueError, match="k must be float32 or bfloat16"):
        quantize_index_k(torch.zeros(2, 64), fmt)
