"""bf16 index K: a rounding copy (the control). NaN -> 0 and values saturate at bf16's largest
finite magnitude, so the cache holds no non-finite value, as for the other formats."""

import torch

from .constants import BF16_MAX, INDEX_DIM
from .mxfp4 import sanitize_fp32


def quantize_bf16(k: torch.Tensor) -> torch.Tensor:
    """``[..., 128]`` fp32/bf16 -> ``[..., 128]`` bfloat16."""
    if k.shape[-1] != INDEX_DIM:
        raise ValueError(f"k must have last dim {INDEX_DIM}, got shape {tuple(k.shape)}")
    return sanitize_fp32(k).clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16)


def dequantize_bf16(k: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return k.to(dtype)
