"""Gemma RMSNorm, and the norm followed by RoPE, on the CPU, bit for bit the references in ``naive.py``
(``gemma_rms_norm_ref``, ``rope_ref(gemma_rms_norm_ref(...))``): the same operations in the same order and dtypes,
over chunks of rows, so that each chunk's fp32 temporaries stay in the last-level cache (the reference makes five
full-size fp32 passes for the norm, and RoPE another seven, with two concatenations; for M3's per-head q norm at a
4k prefill that is 4096 x 16 rows of 128)."""

import torch

_CHUNK_ELEMS = 1 << 20  # fp32 elements one chunk of rows holds (4 MiB: a 4k prefill's q, 4096 x 16 x 128, in 8 chunks;
# 1 MiB chunks paid more in per-op overhead than they saved in cache: 23 against 13 ms for that q on 2 cores)


def gemma_rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., D]``, ``weight [D]`` -> ``x``'s dtype and shape (contract: ``naive.gemma_rms_norm_ref``)."""
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    out = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    scale = 1.0 + weight.float()
    step = max(1, _CHUNK_ELEMS // max(d, 1))
    for r0 in range(0, flat.shape[0], step):
        xf = flat[r0 : r0 + step].float()
        variance = xf.pow(2).mean(dim=-1, keepdim=True)
        out[r0 : r0 + step] = (xf * torch.rsqrt(variance + eps)).mul_(scale)
    return out.view(x.shape)


def gemma_rms_norm_rope_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                            cos_sin_cache: torch.Tensor, head_dim: int, rotary_dim: int,
                            neox: bool = True) -> torch.Tensor:
    """Per-head Gemma RMSNorm, then RoPE: ``x [tokens, heads * head_dim]`` (or ``[tokens, heads, head_dim]``) ->
    ``x``'s shape and dtype, equal to ``naive.rope_ref(naive.gemma_rms_norm_ref(x, weight, eps), positions,
    cos_sin_cache, head_dim, rotary_dim, neox)``; each chunk of tokens is normed, rounded to ``x``'s dtype and
    rotated into the output while it is in cache."""
    tokens = positions.shape[0]
    heads = x.shape[-1] // head_dim if x.dim() == 2 else x.shape[-2]
    xh = x.reshape(tokens, heads, head_dim)
    out = torch.empty(xh.shape, dtype=x.dtype, device=x.device)
    scale = 1.0 + weight.detach().float()  # inference: out= writes below take no autograd inputs
    half = rotary_dim // 2
    step = max(1, _CHUNK_ELEMS // max(xh.shape[1] * head_dim, 1))
    for t0 in range(0, tokens, step):
        xf = xh[t0 : t0 + step].float()
        variance = xf.pow(2).mean(dim=-1, keepdim=True)
        y = (xf * torch.rsqrt(variance + eps)).mul_(scale).to(x.dtype)  # the norm's output, [n, heads, head_dim]
        cos, sin = cos_sin_cache.index_select(0, positions[t0 : t0 + step]).chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
        o = out[t0 : t0 + step]
        if neox:
            x1, x2, o1, o2 = y[..., :half], y[..., half:rotary_dim], o[..., :half], o[..., half:rotary_dim]
        else:
            x1, x2 = y[..., 0:rotary_dim:2], y[..., 1:rotary_dim:2]
            o1, o2 = o[..., 0:rotary_dim:2], o[..., 1:rotary_dim:2]
        torch.sub(x1 * cos, x2 * sin, out=o1)
        torch.add(x2 * cos, x1 * sin, out=o2)
        o[..., rotary_dim:] = y[..., rotary_dim:]
    return out.view(x.shape)
