"""Test support (the serving path never imports this)."""

import importlib
import os


def triton_module(name: str, kernel: str):
    """Module ``name`` whose ``@triton.jit`` function ``kernel`` runs in Triton's interpreter when
    ``TRITON_INTERPRET=1``: a module imported before the variable was set holds compiled kernels,
    so it is reloaded once. Without the variable the module is returned as imported."""
    mod = importlib.import_module(name)
    if os.environ.get("TRITON_INTERPRET") != "1":
        return mod
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(getattr(mod, kernel), InterpretedFunction):
        mod = importlib.reload(mod)
    return mod


def fill_random_index_k(gen, k_cache, k_scale, scale_lo: int = 122, scale_hi: int = 127):
    """Fill an index-K cache (from ``alloc_index_k_cache``) with random contents, in place: MXFP4
    every e2m1 code and e8m0 scale bytes in ``[scale_lo, scale_hi]``; fp8 random e4m3 bytes without
    the NaN code; bf16 standard normals. ``gen``: a ``torch.Generator``."""
    import torch

    from .formats import FP8_DTYPE

    if k_scale is not None:
        k_cache.copy_(torch.randint(0, 256, k_cache.shape, generator=gen, dtype=torch.uint8))
        k_scale.copy_(torch.randint(scale_lo, scale_hi + 1, k_scale.shape, generator=gen, dtype=torch.uint8))
    elif k_cache.dtype == FP8_DTYPE:
        b = torch.randint(0, 256, k_cache.shape, generator=gen, dtype=torch.uint8)
        b -= ((b & 0x7F) == 0x7F).to(torch.uint8)
        k_cache.view(torch.uint8).copy_(b)
    else:
        k_cache.copy_(torch.randn(k_cache.shape, generator=gen))


def abs_index_k(k_cache, k_scale):
    """The cache of |K| (sign bits cleared), for the scorers' error bound."""
    import torch

    from .formats import FP8_DTYPE

    if k_scale is not None:
        return k_cache & 0x77, k_scale
    if k_cache.dtype == FP8_DTYPE:
        return (k_cache.view(torch.uint8) & 0x7F).view(FP8_DTYPE), None
    return k_cache.abs(), None
