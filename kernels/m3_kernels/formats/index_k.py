"""Index-K formats chosen by name: quantize rows, dequantize rows, dequantize pages.

``quantize_index_k`` returns the cache rows of one format:
- bf16: ``(bf16 [T, 128], None)``; fp8: ``(e4m3 [T, 128], None)``;
- mxfp4 / mxfp4_rot: ``(uint8 [T, 64] packed e2m1, uint8 [T, 4] e8m0)``.
"""

import torch

from .bf16 import dequantize_bf16, quantize_bf16
from .config import IndexKFormat, ScaleRule, parse_format
from .constants import INDEX_DIM
from .fp8 import dequantize_fp8, quantize_fp8
from .mxfp4 import dequantize_mxfp4, quantize_mxfp4, sanitize_fp32
from .rotation import rotate


def quantize_index_k(k: torch.Tensor, fmt, scale_rule: ScaleRule | str = ScaleRule.RCEIL, sign_seed: int | None = None):
    """Quantize index keys ``[T, 128]`` (fp32 or bf16, after norm + RoPE) into cache rows.

    ``scale_rule`` applies to the MXFP4 formats only; ``sign_seed`` to ``mxfp4_rot`` only
    (see ``rotation``). Returns ``(rows, scale_rows_or_None)``.
    """
    fmt = parse_format(fmt)
    if k.dtype not in (torch.float32, torch.bfloat16) or k.dim() < 1 or k.shape[-1] != INDEX_DIM:
        raise ValueError(f"k must be float32 or bfloat16 [..., {INDEX_DIM}], got {k.dtype} {tuple(k.shape)}")
    if fmt is IndexKFormat.BF16:
        return quantize_bf16(k), None
    if fmt is IndexKFormat.FP8:
        return quantize_fp8(k), None
    if fmt.is_rotated:
        k = rotate(sanitize_fp32(k), sign_seed)
    return quantize_mxfp4(k, scale_rule)


def dequantize_index_k(rows: torch.Tensor, scale_rows: torch.Tensor | None, dtype: torch.dtype = torch.float32):
    """Inverse of ``quantize_index_k`` (rotated keys stay rotated); format read off the dtypes."""
    if scale_rows is not None:
        return dequantize_mxfp4(rows, scale_rows, dtype)
    if rows.dtype == torch.bfloat16:
        return dequantize_bf16(rows, dtype)
    return dequantize_fp8(rows, dtype)


def prepare_index_q(q: torch.Tensor, fmt, sign_seed: int | None = None) -> torch.Tensor:
    """Index Q as the scorers must see it: rotated (same ``R`` as the keys) for ``mxfp4_rot``,
    unchanged otherwise. ``q [..., 128]``; the dtype is kept."""
    fmt = parse_format(fmt)
    if not fmt.is_rotated:
        return q
    return rotate(q.float(), sign_seed).to(q.dtype)
