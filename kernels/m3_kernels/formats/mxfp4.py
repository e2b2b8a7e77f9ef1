"""MXFP4 index K: e2m1 elements with one e8m0 scale per 32 elements (OCP MX v1.0).

Encoding (the contract every kernel meets bit for bit):

- A 128-dim key is 4 groups of ``MX_GROUP_SIZE`` = 32 elements. Each group stores one e8m0
  byte ``s`` (value ``2^(s - 127)``; 255 is NaN, there is no zero) and 32 e2m1 codes.
- e2m1 code: bit 3 is the sign, bits 0-2 index ``F4_E2M1_MAGNITUDES`` (0, .5, 1, 1.5, 2, 3, 4, 6).
  No inf, no NaN. Two codes per byte, element ``2i`` in the LOW nibble, ``2i+1`` in the high one.
- Input: fp32 or bf16, quantized from fp32 with one rounding (no intermediate bf16 step).
- Non-finite and huge input: NaN is stored as +0, and every value (+-inf included) saturates at
  +-``MXFP4_INPUT_MAX`` = 6 * 2^125 before anything else, so a bad element can only move its own
  group's scale and its own code; neighbouring groups, tokens and pages are untouched, and every
  stored value dequantizes to a finite fp32 (6 * 2^125 is the largest that does under both rules).
- Scale: ``ScaleRule`` (``rceil`` default, ``floor``), biased exponent clamped to [1, 254]. An
  all-zero (or all-underflowing) group gets byte 1 and codes 0; bytes 0 and 255 are never written.
  Both rules are computed from fp32 bit fields, which is exact (see ``e8m0_scale``).
- Elements: ``x / 2^e`` rounded to nearest, ties to even code, saturating at 6. The sign bit is
  ``x < 0``, so a small negative value that rounds to zero is stored as code 8 (-0).

Dequantization is exact: ``e2m1 * 2^e`` is representable in fp32 and bf16 for every code and
every scale the writer emits (at most 2 significant bits, magnitude at most 6 * 2^125).
"""

import torch

from .config import ScaleRule, parse_scale_rule
from .constants import (
    E8M0_EXPONENT_BIAS,
    E8M0_MAX_WRITTEN,
    E8M0_MIN_WRITTEN,
    E8M0_NAN,
    F4_E2M1_MAGNITUDES,
    F4_E2M1_MAX,
    F4_E2M1_SIGN_BIT,
    F4_E2M1_TIES_DOWN,
    F4_E2M1_TIES_UP,
    INDEX_DIM,
    MX_GROUP_SIZE,
    MXFP4_INPUT_MAX,
)

_FP32_MANTISSA_BITS = 23
_FP32_FINITE_MAX = torch.finfo(torch.float32).max


def sanitize_fp32(x: torch.Tensor) -> torch.Tensor:
    """fp32 copy of ``x`` with NaN -> 0 and +-inf -> +-(largest finite fp32)."""
    return torch.nan_to_num(x.float(), nan=0.0, posinf=_FP32_FINITE_MAX, neginf=-_FP32_FINITE_MAX)


def e8m0_scale(amax: torch.Tensor, rule: ScaleRule | str = ScaleRule.RCEIL) -> torch.Tensor:
    """Biased e8m0 exponent (uint8, in [1, 254]) for group maxima ``amax`` (fp32, >= 0, finite).

    ``rceil``: the fp32 exponent field of ``amax / 6``, plus one if its mantissa is non-zero.
    This is ``ceil(log2(amax / 6))`` exactly: fp32 division rounds monotonically and never rounds
    a quotient above ``2^k`` down onto ``2^k`` (the gap is at least 2/3 ulp), and the fp32 and
    e8m0 biases are both 127. ``floor``: the exponent field of ``amax`` minus 2.
    """
    rule = parse_scale_rule(rule)
    amax = amax.float()
    if rule is ScaleRule.RCEIL:
        bits = (amax / F4_E2M1_MAX).view(torch.int32)
        biased = (bits >> _FP32_MANTISSA_BITS) + ((bits & ((1 << _FP32_MANTISSA_BITS) - 1)) != 0).int()
    else:
        biased = (amax.view(torch.int32) >> _FP32_MANTISSA_BITS) - 2
    return biased.clamp(E8M0_MIN_WRITTEN, E8M0_MAX_WRITTEN).to(torch.uint8)


def e8m0_to_float(scale_e8m0: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Value of e8m0 bytes: ``2^(byte - 127)``, NaN for byte 255 (byte 0 is 2^-127)."""
    exponent = scale_e8m0.to(torch.float64) - E8M0_EXPONENT_BIAS
    value = torch.pow(2.0, exponent)
    value = torch.where(scale_e8m0 == E8M0_NAN, torch.full_like(value, float("nan")), value)
    return value.to(dtype)


def e2m1_encode(x_scaled: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 in [0, 15]) of already-scaled values, round-to-nearest-even, saturating.

    Uses float64 comparisons against the midpoints between grid values: a magnitude above a
    ``TIES_DOWN`` midpoint, or at/above a ``TIES_UP`` one, moves to the next code.
    """
    mag = x_scaled.double().abs()
    code = torch.zeros(x_scaled.shape, dtype=torch.int32, device=x_scaled.device)
    for t in F4_E2M1_TIES_DOWN:
        code += (mag > t).int()
    for t in F4_E2M1_TIES_UP:
        code += (mag >= t).int()
    code += torch.where(x_scaled < 0, F4_E2M1_SIGN_BIT, 0).int()
    return code.to(torch.uint8)


def e2m1_decode(code: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Value of e2m1 codes (low 4 bits of ``code``)."""
    table = torch.tensor(F4_E2M1_MAGNITUDES, dtype=torch.float64, device=code.device)
    code = code.long() & 0xF
    mag = table[code & 0x7]
    return torch.where(code >= F4_E2M1_SIGN_BIT, -mag, mag).to(dtype)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes; element 2i in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes; inverse of ``pack_e2m1``."""
    low = packed & 0xF
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def quantize_mxfp4(k: torch.Tensor, rule: ScaleRule | str = ScaleRule.RCEIL):
    """Quantize index keys to MXFP4.

    Args:
        k: ``[tokens, 128]`` fp32 or bf16 (any leading shape works; last dim 128).
        rule: ``ScaleRule`` or its name.
    Returns:
        ``(k_data, scale_e8m0)``: uint8 ``[tokens, 64]`` packed codes and uint8 ``[tokens, 4]``.
    """
    if k.shape[-1] != INDEX_DIM:
        raise ValueError(f"k must have last dim {INDEX_DIM}, got shape {tuple(k.shape)}")
    if k.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"k must be float32 or bfloat16, got {k.dtype}")
    x = sanitize_fp32(k).clamp(-MXFP4_INPUT_MAX, MXFP4_INPUT_MAX)
    groups = x.unflatten(-1, (-1, MX_GROUP_SIZE))  # [..., 4, 32]
    scale_e8m0 = e8m0_scale(groups.abs().amax(dim=-1), rule)  # [..., 4]
    exponent = scale_e8m0.double() - E8M0_EXPONENT_BIAS
    x_scaled = groups.double() * torch.pow(2.0, -exponent).unsqueeze(-1)  # exact in float64
    codes = e2m1_encode(x_scaled).flatten(-2)
    return pack_e2m1(codes), scale_e8m0


def dequantize_mxfp4(k_data: torch.Tensor, scale_e8m0: torch.Tensor, dtype: torch.dtype = torch.float32):
    """``[..., 64]`` packed codes + ``[..., 4]`` e8m0 bytes -> ``[..., 128]`` values in ``dtype``."""
    values = e2m1_decode(unpack_e2m1(k_data), torch.float64).unflatten(-1, (-1, MX_GROUP_SIZE))
    scale = e8m0_to_float(scale_e8m0, torch.float64).unsqueeze(-1)
    return (values * scale).flatten(-2).to(dtype)
