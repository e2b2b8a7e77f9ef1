import pytest
import torch

from m3_kernels.formats import (
    MX_GROUP_SIZE,
    dequantize_index_k,
    prepare_index_q,
    quantize_index_k,
    quantize_mxfp4,
    rotate,
    rotation_matrix,
)


@pytest.mark.parametrize("sign_seed", [None, 7])
def test_rotation_is_orthonormal(sign_seed):
    r = rotation_matrix(128, sign_seed, torch.float64)
    assert torch.allclose(r @ r.T, torch.eye(128, dtype=torch.float64), atol=1e-14, rtol=0)
    assert torch.allclose(r.abs(), torch.full_like(r, 128**-0.5), rtol=1e-15, atol=0)


def test_plain_hadamard_is_symmetric_and_seeded_is_not():
    r = rotation_matrix(128, None, torch.float64)
    assert torch.equal(r, r.T)
    assert not torch.equal(rotation_matrix(128, 7, torch.float64), r)


def test_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        rotation_matrix(96)


def test_rotation_preserves_dot_products(gen):
    q = torch.randn(64, 128, generator=gen, dtype=torch.float64)
    k = torch.randn(64, 128, generator=gen, dtype=torch.float64)
    r = rotation_matrix(128, None, torch.float64)
    assert torch.allclose((q @ r.T) @ (k @ r.T).T, q @ k.T, atol=1e-11, rtol=0)


def test_bf16_scores_with_and_without_rotation_agree_to_rounding(gen):
    q = torch.randn(32, 128, generator=gen)
    k = torch.randn(512, 128, generator=gen)
    plain = q.bfloat16().double() @ k.bfloat16().double().T
    rotated = prepare_index_q(q, "mxfp4_rot").bfloat16().double() @ rotate(k).bfloat16().double().T
    # Each side carries bf16 rounding (2^-9 relative) of q and k: bound by sum |q_i||k_i| terms.
    bound = 4 * 2.0**-8 * (q.abs().double() @ k.abs().double().T + 1)
    assert ((plain - rotated).abs() <= bound).all()


def test_rotated_mxfp4_error_per_group_is_bounded(gen):
    k = torch.randn(256, 128, generator=gen)
    k[:, 3] *= 50  # one outlier channel
    rows, scales = quantize_index_k(k, "mxfp4_rot")
    deq = dequantize_index_k(rows, scales, torch.float64)
    target = rotate(k).double()
    step = torch.pow(2.0, scales.double() - 127).repeat_interleave(MX_GROUP_SIZE, 1)
    assert ((deq - target).abs() <= step).all()  # half of the widest grid step (2) times the scale
    # Rotation spreads the outlier: relative error of the rotated round trip beats the plain one.
    plain = dequantize_index_k(*quantize_mxfp4(k), torch.float64) - k.double()
    assert (deq - target).norm() < plain.norm()
