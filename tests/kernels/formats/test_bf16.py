import pytest
import torch

from m3_kernels.formats import BF16_MAX
from m3_kernels.formats.bf16 import dequantize_bf16, quantize_bf16


def test_round_copy(gen):
    k = torch.randn(16, 128, generator=gen)
    assert torch.equal(quantize_bf16(k), k.bfloat16())
    assert torch.equal(quantize_bf16(k.bfloat16()), k.bfloat16())


@pytest.mark.parametrize("value,expect", [(float("nan"), 0.0), (float("inf"), BF16_MAX), (-3.4e38, -BF16_MAX)])
def test_non_finite_sanitized(value, expect):
    k = torch.ones(2, 128)
    k[1, 3] = value
    out = dequantize_bf16(quantize_bf16(k), torch.float64)
    assert out[1, 3].item() == expect
    assert torch.equal(out[0], torch.ones(128, dtype=torch.float64))
