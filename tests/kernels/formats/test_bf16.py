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


def test_round_to_nearest_even_on_bit_patterns(gen):
    """Independent of torch's conversion: fp32 bits rounded to their top 16 with ties to even,
    exact halfway cases included."""
    k = torch.randn(8, 128, generator=gen) * torch.exp2(torch.randint(-60, 60, (8, 1), generator=gen).float())
    bits = k.view(torch.int32)
    k[:4] = ((bits[:4] & ~0xFFFF) | 0x8000).view(torch.float32)  # exactly halfway between two bf16 values
    bits = k.view(torch.int32).long()
    keep = bits >> 16
    rest = bits & 0xFFFF
    up = (rest > 0x8000) | ((rest == 0x8000) & (keep & 1 == 1))
    want = ((keep + up.long()) << 16).to(torch.int32).view(torch.float32)
    assert torch.equal(quantize_bf16(k).float(), want)
