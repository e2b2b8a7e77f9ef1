"""The chunked CPU Gemma RMSNorm equals the reference bit for bit (fresh random inputs, edge row counts)."""

import pytest
import torch

import m3_kernels.ops.norm.cpu as cpu
from m3_kernels.ops.norm import gemma_rms_norm_cpu
from m3_kernels.ops.norm.naive import gemma_rms_norm_ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [0, 1, 127, 128, 129, 1000])
def test_equals_reference_bitwise(gen, dtype, rows, monkeypatch):
    monkeypatch.setattr(cpu, "_CHUNK_ELEMS", 3 * 128)  # chunks of 3 rows, the last one partial
    x = (torch.randn(rows, 4, 128, generator=gen) * 3).to(dtype)
    weight = torch.randn(128, generator=gen) * 0.2
    got = gemma_rms_norm_cpu(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, gemma_rms_norm_ref(x, weight, 1e-6))


def test_reference_formula_and_zero_rows(gen):
    """The reference against float64 arithmetic (within fp32 rounding); an all-zero row stays zero."""
    x = torch.randn(5, 128, generator=gen)
    x[2] = 0.0
    weight = torch.randn(128, generator=gen)
    want = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight.double())
    got = gemma_rms_norm_ref(x, weight, 1e-6)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(gemma_rms_norm_cpu(x, weight, 1e-6)[2], torch.zeros(128))
