"""NVFP4 index keys, a format-only torch reference: e2m1 elements with one e4m3 scale per 16 elements.

The 4-bit format of Blackwell's tensor cores, here as a storage format for 128-dim index keys
(8 groups of ``NVFP4_GROUP`` = 16 elements; 64 bytes of codes + 8 scale bytes = 72 bytes a token):

- scale ``s = e4m3(amax(group) / 6)``: the fp32 quotient rounded to nearest-even e4m3 (saturating at
  448); an all-zero group (or one whose scale underflows to 0) stores scale 0 and codes 0;
- element ``x / s`` rounded to nearest e2m1, ties to the even code, saturating at +-6 (a scale
  rounded down can push the group maximum slightly past 6);
- no second-level (per-tensor fp32) scale: index keys leave a per-head RMSNorm, so their
  magnitudes sit far inside e4m3's range (a per-tensor scale is unknown when a cache is written
  token by token anyway).

The element rounding is the product's e2m1 encoder (``m3_kernels.formats.e2m1_encode``); only the
scale differs from MXFP4. Keys and dequantized values are fp32; the scorer sees ``dequantize``.
"""

import torch

from m3_kernels.formats import FP8_DTYPE, FP8_E4M3_MAX, F4_E2M1_MAX, INDEX_DIM, e2m1_decode, e2m1_encode

NVFP4_GROUP = 16
NVFP4_TOKEN_BYTES = INDEX_DIM // 2 + INDEX_DIM // NVFP4_GROUP  # 72


def quantize_nvfp4(k: torch.Tensor):
    """``k [..., 128]`` (fp32 or bf16, finite) -> ``(codes uint8 [..., 128], scales e4m3 [..., 8])``
    (codes unpacked, one per element; see the module doc for the rounding)."""
    if k.dtype not in (torch.float32, torch.bfloat16) or k.dim() < 1 or k.shape[-1] != INDEX_DIM:
        raise ValueError(f"k must be float32 or bfloat16 [..., {INDEX_DIM}], got {k.dtype} {tuple(k.shape)}")
    if not torch.isfinite(k).all():
        raise ValueError("k must be finite (NVFP4 reference: no NaN/inf handling)")
    groups = k.float().unflatten(-1, (-1, NVFP4_GROUP))
    scale = (groups.abs().amax(-1) / F4_E2M1_MAX).clamp(max=FP8_E4M3_MAX).to(FP8_DTYPE)
    s = scale.double().unsqueeze(-1)
    x_scaled = torch.where(s > 0, groups.double() / torch.where(s > 0, s, 1.0), 0.0)
    return e2m1_encode(x_scaled).flatten(-2), scale


def dequantize_nvfp4(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_nvfp4``: ``[..., 128]`` values ``e2m1(code) * scale`` in ``dtype``."""
    values = e2m1_decode(codes, torch.float64).unflatten(-1, (-1, NVFP4_GROUP))
    return (values * scales.double().unsqueeze(-1)).flatten(-2).to(dtype)


def nvfp4_roundtrip(k: torch.Tensor) -> torch.Tensor:
    """``dequantize_nvfp4(*quantize_nvfp4(k))`` in fp32: the keys an NVFP4 cache hands the scorer."""
    return dequantize_nvfp4(*quantize_nvfp4(k))
