"""Paged index-K cache layouts and their views.

A page holds ``PAGE_SIZE`` = 128 consecutive token slots (slot ``loc`` -> page ``loc // 128``,
row ``loc % 128``), so a page is one MSA block.

- bf16 / fp8: ``k [pages, 128, 128]`` of the format's dtype.
- MXFP4: two uint8 views, ``k_data [pages, 128, 64]`` and ``k_scale [pages, 128, 4]``, each with
  its own page stride. Kernels accept any pair that passes ``check_mxfp4_views``: separate
  tensors, or the single-region page of ``MXFP4_PAGE_BYTES`` = 8704 B,
  ``[128 x 64 B data][128 x 4 B scale]`` (``mxfp4_page_views``). Both must agree bitwise.
"""

import torch

from .config import IndexKFormat, parse_format
from .constants import (
    BF16_TOKEN_BYTES,
    FP8_TOKEN_BYTES,
    INDEX_DIM,
    MXFP4_DATA_BYTES,
    MXFP4_PAGE_BYTES,
    MXFP4_PAGE_DATA_BYTES,
    MXFP4_SCALE_BYTES,
    PAGE_SIZE,
    VIEW_ALIGN_BYTES,
)
from .fp8 import FP8_DTYPE


def mxfp4_page_views(pages: torch.Tensor):
    """Split single-region pages ``uint8 [num_pages, 8704]`` into ``(k_data, k_scale)`` views."""
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != MXFP4_PAGE_BYTES:
        raise ValueError(
            f"pages must be uint8 [num_pages, {MXFP4_PAGE_BYTES}], got {pages.dtype} {tuple(pages.shape)}"
        )
    if pages.stride(1) != 1:
        raise ValueError(f"pages must be contiguous within a page, got strides {pages.stride()}")
    n, stride = pages.shape[0], pages.stride(0)
    k_data = pages.as_strided((n, PAGE_SIZE, MXFP4_DATA_BYTES), (stride, MXFP4_DATA_BYTES, 1))
    k_scale = pages.as_strided(
        (n, PAGE_SIZE, MXFP4_SCALE_BYTES),
        (stride, MXFP4_SCALE_BYTES, 1),
        pages.storage_offset() + MXFP4_PAGE_DATA_BYTES,
    )
    return k_data, k_scale


def alloc_index_k_cache(num_pages: int, fmt, device=None, single_region: bool = True):
    """Allocate an empty cache: ``(k, None)`` for bf16/fp8, ``(k_data, k_scale)`` for MXFP4."""
    fmt = parse_format(fmt)
    if fmt.is_mxfp4:
        if single_region:
            return mxfp4_page_views(torch.zeros(num_pages, MXFP4_PAGE_BYTES, dtype=torch.uint8, device=device))
        return (
            torch.zeros(num_pages, PAGE_SIZE, MXFP4_DATA_BYTES, dtype=torch.uint8, device=device),
            torch.zeros(num_pages, PAGE_SIZE, MXFP4_SCALE_BYTES, dtype=torch.uint8, device=device),
        )
    dtype = torch.bfloat16 if fmt is IndexKFormat.BF16 else FP8_DTYPE
    return torch.zeros(num_pages, PAGE_SIZE, INDEX_DIM, dtype=dtype, device=device), None


def _byte_span(t: torch.Tensor):
    start = t.data_ptr()
    end = start + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) * t.element_size() + t.element_size()
    return start, end


def _check_view(name: str, t: torch.Tensor, dtype, row_bytes: int):
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != 3 or t.shape[1] != PAGE_SIZE or t.shape[2] * t.element_size() != row_bytes:
        raise ValueError(f"{name} must be [pages, {PAGE_SIZE}, {row_bytes // t.element_size()}], got {tuple(t.shape)}")
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        raise ValueError(f"{name} must be row-contiguous within a page (strides [*, {t.shape[2]}, 1]), got {t.stride()}")
    page_bytes = t.stride(0) * t.element_size()
    if t.shape[0] > 1 and page_bytes < PAGE_SIZE * row_bytes:
        raise ValueError(f"{name} page stride {page_bytes} B is smaller than a page ({PAGE_SIZE * row_bytes} B): pages overlap")
    if t.data_ptr() % VIEW_ALIGN_BYTES or page_bytes % VIEW_ALIGN_BYTES:
        raise ValueError(
            f"{name} base address and page stride must be {VIEW_ALIGN_BYTES}-byte aligned, "
            f"got address % {VIEW_ALIGN_BYTES} = {t.data_ptr() % VIEW_ALIGN_BYTES}, page stride {page_bytes} B"
        )


def check_index_k_cache(k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> IndexKFormat:
    """Validate a cache (views) and return its storage format (MXFP4 for uint8 + scale views).

    Raises ValueError naming the argument and the rule it broke: dtype, shape, inner contiguity,
    16-byte alignment of base and page stride, self-overlapping pages, and (MXFP4) data and scale
    views that overlap each other or disagree on the page count.
    """
    if k_scale is None:
        if k_cache.dtype == torch.bfloat16:
            _check_view("k_cache", k_cache, torch.bfloat16, BF16_TOKEN_BYTES)
            return IndexKFormat.BF16
        if k_cache.dtype == FP8_DTYPE:
            _check_view("k_cache", k_cache, FP8_DTYPE, FP8_TOKEN_BYTES)
            return IndexKFormat.FP8
        raise ValueError(
            f"k_cache must be bfloat16 or float8_e4m3fn (or uint8 MXFP4 data with k_scale), got {k_cache.dtype}"
        )
    check_mxfp4_views(k_cache, k_scale)
    return IndexKFormat.MXFP4


def check_mxfp4_views(k_data: torch.Tensor, k_scale: torch.Tensor) -> None:
    _check_view("k_data", k_data, torch.uint8, MXFP4_DATA_BYTES)
    _check_view("k_scale", k_scale, torch.uint8, MXFP4_SCALE_BYTES)
    if k_data.shape[0] != k_scale.shape[0]:
        raise ValueError(f"k_data and k_scale must have the same page count, got {k_data.shape[0]} and {k_scale.shape[0]}")
    if k_data.device != k_scale.device:
        raise ValueError(f"k_data and k_scale must be on one device, got {k_data.device} and {k_scale.device}")
    if k_data.numel() == 0:
        return
    d0, d1 = _byte_span(k_data)
    s0, s1 = _byte_span(k_scale)
    if d1 <= s0 or s1 <= d0:
        return  # disjoint address ranges
    # Interleaved (single-region) layout: same page stride, every scale block inside a data gap.
    stride = k_data.stride(0)
    if k_data.shape[0] == 1 or k_scale.stride(0) != stride:
        raise ValueError("k_data and k_scale overlap in memory (only the interleaved single-region page may share storage)")
    offset = (s0 - d0) % stride
    if offset < MXFP4_PAGE_DATA_BYTES or offset + PAGE_SIZE * MXFP4_SCALE_BYTES > stride:
        raise ValueError(
            f"k_data and k_scale overlap: scale block starts {offset} B into a {stride} B page "
            f"whose first {MXFP4_PAGE_DATA_BYTES} B are data"
        )
