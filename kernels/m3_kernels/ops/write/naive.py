"""Torch reference index-cache writer: quantize index K and store it at token slots."""

import torch

from ...formats import (
    INDEX_DIM,
    PAGE_SIZE,
    IndexKCache,
    IndexKFormat,
    ScaleRule,
    check_index_k_cache,
    parse_format,
    quantize_index_k,
)


def check_write_rows(k, loc, k_cache) -> None:
    """The per-call rules of a write (the cache itself is checked when made): ``k`` fp32/bf16
    ``[tokens, 128]``, ``loc`` int32/int64 ``[tokens]``, both on the cache's device."""
    if k.dtype not in (torch.float32, torch.bfloat16) or k.dim() != 2 or k.shape[1] != INDEX_DIM:
        raise ValueError(f"k must be float32 or bfloat16 [tokens, {INDEX_DIM}], got {k.dtype} {tuple(k.shape)}")
    if loc.dtype not in (torch.int32, torch.int64) or loc.dim() != 1 or loc.shape[0] != k.shape[0]:
        raise ValueError(f"loc must be int32/int64 [tokens={k.shape[0]}], got {loc.dtype} {tuple(loc.shape)}")
    if not (k.device == loc.device == k_cache.device):
        raise ValueError(f"k, loc and k_cache must be on one device, got {k.device}, {loc.device}, {k_cache.device}")


def check_loc_range(loc, capacity: int) -> None:
    """ValueError unless every slot of ``loc`` lies in ``[0, capacity)`` (reads ``loc`` back: a sync on a GPU)."""
    if loc.numel():
        lo, hi = int(loc.min()), int(loc.max())
        if lo < 0 or hi >= capacity:
            raise ValueError(f"loc values must lie in [0, {capacity}), got min {lo}, max {hi}")


def check_write_args(k, loc, k_cache, k_scale, fmt):
    """A write given as loose tensors: the cache views, ``fmt`` against their storage, ``check_write_rows``."""
    fmt = parse_format(fmt)
    stored = check_index_k_cache(k_cache, k_scale)
    if (stored is IndexKFormat.MXFP4) != fmt.is_mxfp4 or (not fmt.is_mxfp4 and stored is not fmt):
        raise ValueError(f"fmt {fmt.value!r} does not match the cache's storage ({stored.value})")
    check_write_rows(k, loc, k_cache)
    return fmt


def write_index_k_ref(k, loc, k_cache, k_scale, fmt, scale_rule: ScaleRule | str = ScaleRule.RCEIL, sign_seed=None):
    """Store ``k [tokens, 128]`` (fp32/bf16, after norm + RoPE) at slots ``loc [tokens]``.

    Slot ``loc`` is page ``loc // 128``, row ``loc % 128``. Every slot is checked before anything
    is written, so a bad ``loc`` raises ValueError and leaves the cache untouched.
    """
    fmt = check_write_args(k, loc, k_cache, k_scale, fmt)
    cache = IndexKCache(fmt, k_cache, k_scale, scale_rule, sign_seed)
    check_loc_range(loc, cache.capacity)
    write_rows(cache, k, loc)


def write_rows(cache, k, loc) -> None:
    """``write_index_k_ref`` into an ``IndexKCache`` (checked when made; ``k``, ``loc`` and the slots' range,
    ``check_loc_range``, by the caller: once per batch when planned)."""
    k_cache, k_scale, fmt = cache.data, cache.scale_e8m0, cache.fmt
    rows, scale_rows = quantize_index_k(k, fmt, cache.scale_rule, cache.sign_seed)
    page, row = loc.long() // PAGE_SIZE, loc.long() % PAGE_SIZE
    k_cache[page, row] = rows
    if k_scale is not None:
        k_scale[page, row] = scale_rows
