"""fp8 index K: float8 e4m3fn with unit scale (the layout vLLM, ATOM and SGLang ship).

Quantized from fp32 with one rounding (round-to-nearest-even). Non-finite input is sanitized as in
``mxfp4`` (NaN -> 0, +-inf -> +-fp32 max) and every value saturates at +-448, so the cache never
holds e4m3's NaN code.
"""

import torch

from .constants import FP8_E4M3_MAX, INDEX_DIM
from .mxfp4 import sanitize_fp32

FP8_DTYPE = torch.float8_e4m3fn


def quantize_fp8(k: torch.Tensor) -> torch.Tensor:
    """``[..., 128]`` fp32/bf16 -> ``[..., 128]`` float8_e4m3fn."""
    if k.shape[-1] != INDEX_DIM:
        raise ValueError(f"k must have last dim {INDEX_DIM}, got shape {tuple(k.shape)}")
    return sanitize_fp32(k).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def dequantize_fp8(k: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return k.to(dtype)
