"""Index-K formats chosen by name: quantize rows, dequantize rows, dequantize pages.

``quantize_index_k`` returns the cache rows of one format:
- bf16: ``(bf16 [T, 128], None)``; fp8: ``(e4m3 [T, 128], None)``;
- mxfp4 / mxfp4_rot: ``(uint8 [T, 64] packed e2m1, uint8 [T, 4] e8m0)``.
"""

import torch

from .bf16 import dequantize_bf16, quantize_bf16
from .config import IndexKFormat, ScaleRule, parse_format
from .constants import INDEX_DIM, MXFP4_DATA_BYTES, MXFP4_SCALE_BYTES
from .fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8
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
    """Inverse of ``quantize_index_k`` (rotated keys stay rotated); format read off the dtypes:
    bf16 ``rows [..., 128]`` (no scales), e4m3 ``rows [..., 128]`` (no scales), or uint8 ``rows [..., 64]``
    with uint8 ``scale_rows [..., 4]`` (MXFP4). ValueError for any other combination."""
    if scale_rows is not None:
        if (rows.dtype != torch.uint8 or scale_rows.dtype != torch.uint8 or rows.dim() < 1
                or rows.shape[-1] != MXFP4_DATA_BYTES
                or tuple(scale_rows.shape) != (*rows.shape[:-1], MXFP4_SCALE_BYTES)):
            raise ValueError(
                f"with scale_rows (MXFP4), rows must be uint8 [..., {MXFP4_DATA_BYTES}] and scale_rows uint8 "
                f"[..., {MXFP4_SCALE_BYTES}] over the same rows, got rows {rows.dtype} {tuple(rows.shape)}, "
                f"scale_rows {scale_rows.dtype} {tuple(scale_rows.shape)}"
            )
        return dequantize_mxfp4(rows, scale_rows, dtype)
    if rows.dtype not in (torch.bfloat16, FP8_DTYPE) or rows.dim() < 1 or rows.shape[-1] != INDEX_DIM:
        raise ValueError(
            f"without scale_rows, rows must be bfloat16 or float8_e4m3fn [..., {INDEX_DIM}] (bf16 / fp8 rows); "
            f"MXFP4 rows (uint8) need their scale_rows; got rows {rows.dtype} {tuple(rows.shape)}"
        )
    if rows.dtype == torch.bfloat16:
        return dequantize_bf16(rows, dtype)
    return dequantize_fp8(rows, dtype)


def prepare_index_q(q: torch.Tensor, fmt, sign_seed: int | None = None) -> torch.Tensor:
    """Index Q as the scorers must see it: rotated (same ``R`` as the keys) for ``mxfp4_rot``,
    unchanged otherwise. ``q [..., 128]``; the dtype is kept. A rotated format takes a bf16 (or
    fp32) Q only: rotate before any fp8 cast (ValueError otherwise)."""
    fmt = parse_format(fmt)
    if q.dim() < 1 or q.shape[-1] != INDEX_DIM:
        raise ValueError(f"q must be [..., {INDEX_DIM}] (the index head dim), got {tuple(q.shape)}")
    if not fmt.is_rotated:
        return q
    if q.dtype not in (torch.bfloat16, torch.float32):
        # An e4m3 Q rotated and cast back would round twice and turn |Rq| > 448 into NaN.
        raise ValueError(f"q (the index Q) must be bfloat16 or float32 for {fmt.value!r}, got {q.dtype}: "
                         "pass the bf16 Q (it is rotated here, before any fp8 cast)")
    return rotate(q.float(), sign_seed).to(q.dtype)
