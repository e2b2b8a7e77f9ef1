"""retrofit.nvfp4 against a float64 brute-force oracle: every e4m3 scale and every e2m1 value tried."""

import pytest
import torch

from m3_kernels.formats import FP8_DTYPE, F4_E2M1_MAGNITUDES
from retrofit.nvfp4 import NVFP4_GROUP, dequantize_nvfp4, nvfp4_roundtrip, quantize_nvfp4

# Every finite non-negative e4m3 value, by bit pattern (0x7F is NaN).
E4M3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8_DTYPE).double()


def _nearest(x: float, grid: torch.Tensor) -> int:
    """Index of the grid value nearest ``x``; a tie goes to the even index (even code / even mantissa)."""
    d = (grid - x).abs()
    best = torch.nonzero(d == d.min()).flatten().tolist()
    return min(best, key=lambda i: (i % 2, i))


def oracle(k: torch.Tensor) -> torch.Tensor:
    """float64 dequantized NVFP4 of ``k [rows, 128]``, one element at a time."""
    out = torch.empty(k.shape, dtype=torch.float64)
    mags = torch.tensor(F4_E2M1_MAGNITUDES, dtype=torch.float64)
    for r in range(k.shape[0]):
        for g in range(0, k.shape[1], NVFP4_GROUP):
            group = k[r, g : g + NVFP4_GROUP].float()
            q = float((group.abs().max() / 6.0).item())  # the fp32 quotient the format rounds
            scale = 448.0 if q >= 464.0 else float(E4M3[_nearest(q, E4M3)])
            for j, x in enumerate(group.double().tolist()):
                v = 0.0 if scale == 0 else float(mags[_nearest(abs(x) / scale, mags)]) * scale
                out[r, g + j] = -v if x < 0 else v
    return out


def test_matches_float64_oracle(gen):
    k = torch.randn(6, 128, generator=gen) * torch.exp2(torch.randint(-12, 8, (6, 1), generator=gen).float())
    k[0, :16] = 0.0  # an all-zero group
    k[1, 16:32] = torch.tensor([6.0, 3.0, 1.5, 0.75, 0.25, 1.25, 2.5, 5.0, -6.0, -1.75, -3.5, 0.0, 0.5, 1.0, 2.0, 4.0])
    k[2, 32:48] *= 1e-6  # scale in e4m3's subnormals
    k[3, :] *= 200.0  # scales near the top of e4m3
    got = nvfp4_roundtrip(k)
    assert got.dtype == torch.float32 and got.shape == k.shape
    torch.testing.assert_close(got.double(), oracle(k), rtol=0, atol=0)


def test_ties_round_to_even_code():
    # Group max 6 -> scale 1 exactly; 0.25 ties 0 / 0.5 (even: 0), 0.75 ties 0.5 / 1 (even: 1), 2.5 -> 2, 5 -> 4.
    k = torch.zeros(1, 128)
    k[0, :6] = torch.tensor([6.0, 0.25, 0.75, 2.5, 5.0, -1.25])
    assert nvfp4_roundtrip(k)[0, :6].tolist() == [6.0, 0.0, 1.0, 2.0, 4.0, -1.0]


def test_shapes_bytes_and_bf16_input(gen):
    k = torch.randn(3, 5, 128, generator=gen).bfloat16()
    codes, scales = quantize_nvfp4(k)
    assert codes.shape == (3, 5, 128) and codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert scales.shape == (3, 5, 8) and scales.dtype == FP8_DTYPE
    assert dequantize_nvfp4(codes, scales).shape == (3, 5, 128)
    # 4-bit with a 16-element scale: relative error well under MXFP4's worst case, never zero for random data.
    err = (nvfp4_roundtrip(k) - k.float()).norm() / k.float().norm()
    assert 0 < err < 0.2


@pytest.mark.parametrize("bad", [torch.zeros(4, 64), torch.zeros(4, 128, dtype=torch.float64),
                                 torch.full((2, 128), float("nan"))])
def test_bad_input_names_k(bad):
    with pytest.raises(ValueError, match="k must be"):
        quantize_nvfp4(bad)
