import pytest
import torch

from m3_kernels.formats import FP8_DTYPE, FP8_E4M3_MAX
from m3_kernels.formats.fp8 import dequantize_fp8, quantize_fp8


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3fn value, from its bit pattern (float64, sorted)."""
    vals = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).double()
    return torch.unique(vals[torch.isfinite(vals)])


def test_quantize_is_round_to_nearest_even(gen):
    grid = _e4m3_grid()
    x = torch.cat([torch.randn(4096, generator=gen) * 40, (grid[1:] + grid[:-1]).float() / 2])  # includes exact ties
    x = x[: (x.numel() // 128) * 128].view(-1, 128)
    got = dequantize_fp8(quantize_fp8(x), torch.float64).flatten()
    xs = x.double().flatten().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    dist = (grid[None] - xs[:, None]).abs()
    best = dist.min(1, keepdim=True).values
    candidates = dist == best  # one or two nearest grid values
    # Where two are nearest (a tie), the pick must be the one whose mantissa is even.
    for i in range(xs.numel()):
        near = grid[candidates[i]]
        if near.numel() == 1:
            assert got[i].item() == near.item()
        else:
            bits = torch.tensor([near[0].item(), near[1].item()]).to(FP8_DTYPE).view(torch.uint8)
            even = near[(bits & 1) == 0]
            assert got[i].item() == even.item()


@pytest.mark.parametrize("value,expect", [(1e6, 448.0), (-1e6, -448.0), (float("inf"), 448.0), (float("-inf"), -448.0), (float("nan"), 0.0)])
def test_saturates_and_never_stores_nan(value, expect):
    k = torch.zeros(2, 128)
    k[0, 7] = value
    out = dequantize_fp8(quantize_fp8(k))
    assert out[0, 7].item() == expect
    assert torch.equal(out[1], torch.zeros(128))  # neighbouring token untouched


def test_rejects_bad_shape():
    with pytest.raises(ValueError, match="last dim 128"):
        quantize_fp8(torch.zeros(3, 127))
