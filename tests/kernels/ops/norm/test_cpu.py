"""The chunked CPU Gemma RMSNorm, and the norm followed by RoPE, equal the references bit for bit (fresh random
inputs, edge row counts); the RoPE reference against float64 rotations."""

import pytest
import torch

import m3_kernels.ops.norm.cpu as cpu
from m3_kernels.ops.norm import gemma_rms_norm_cpu, gemma_rms_norm_rope_cpu
from m3_kernels.ops.norm.naive import gemma_rms_norm_ref, rope_ref


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


def _rope_inputs(gen, dtype, tokens, heads, cache_dtype, max_pos=5000, rotary_dim=64):
    x = (torch.randn(tokens, heads * 128, generator=gen) * 3).to(dtype)
    weight = torch.randn(128, generator=gen) * 0.2
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    angle = torch.arange(max_pos)[:, None].double() * (5e6 ** (-torch.arange(0, rotary_dim, 2).double() / rotary_dim))
    cos_sin_cache = torch.cat([angle.cos(), angle.sin()], -1).to(cache_dtype)
    return x, weight, positions, cos_sin_cache


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.float32)])
@pytest.mark.parametrize("tokens", [0, 1, 127, 128, 129, 1000])
def test_norm_rope_equals_reference_bitwise(gen, dtype, cache_dtype, tokens, neox, monkeypatch):
    """Norm then RoPE in chunks (of 3 tokens x 4 heads here, the last one partial) equals the two references in
    turn, bit for bit; 2-D ``[tokens, heads * 128]`` and 3-D ``[tokens, heads, 128]`` inputs alike."""
    monkeypatch.setattr(cpu, "_CHUNK_ELEMS", 3 * 4 * 128)
    x, weight, positions, cache = _rope_inputs(gen, dtype, tokens, 4, cache_dtype)
    want = rope_ref(gemma_rms_norm_ref(x.view(-1, 128), weight, 1e-6).view(x.shape), positions, cache, 128, 64, neox)
    got = gemma_rms_norm_rope_cpu(x, weight, 1e-6, positions, cache, 128, 64, neox)
    assert got.dtype == dtype and got.shape == x.shape and torch.equal(got, want)
    got3 = gemma_rms_norm_rope_cpu(x.view(tokens, 4, 128), weight, 1e-6, positions, cache, 128, 64, neox)
    assert got3.shape == (tokens, 4, 128) and torch.equal(got3.view(x.shape), want)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_rope_reference_rotates_pairs_by_position(gen, neox):
    """The reference against float64 rotations: NeoX pairs dim i with i + rotary_dim / 2, GPT-J 2i with 2i + 1, by
    angle position * theta^(-2i / rotary_dim); dims past rotary_dim pass through unchanged."""
    x, _, positions, cache = _rope_inputs(gen, torch.float32, 9, 2, torch.float64)
    got = rope_ref(x, positions, cache.float(), 128, 64, neox).view(9, 2, 128).double()
    xh = x.view(9, 2, 128).double()
    angle = positions[:, None].double() * (5e6 ** (-torch.arange(0, 64, 2).double() / 64))  # [9, 32]
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    i1, i2 = (torch.arange(32), torch.arange(32, 64)) if neox else (torch.arange(0, 64, 2), torch.arange(1, 64, 2))
    torch.testing.assert_close(got[..., i1], xh[..., i1] * c - xh[..., i2] * s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[..., i2], xh[..., i2] * c + xh[..., i1] * s, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[..., 64:], xh[..., 64:])
