"""Torch reference of Gemma RMSNorm: SGLang's ``GemmaRMSNorm.forward_native`` formula, written out."""

import torch


def gemma_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., D]`` (any float dtype), ``weight [D]`` -> ``x``'s dtype and shape: in fp32,
    ``(x * rsqrt(mean(x^2, -1) + eps)) * (1 + weight)``, rounded once to ``x``'s dtype."""
    xf = x.float()
    variance = xf.pow(2).mean(dim=-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    xf = xf * (1.0 + weight.float())
    return xf.to(x.dtype)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int, rotary_dim: int,
             neox: bool = True) -> torch.Tensor:
    """SGLang's ``RotaryEmbedding.forward_native`` on one tensor, written out: ``x [tokens, heads * head_dim]`` (or
    ``[tokens, heads, head_dim]``), ``positions [tokens]``, ``cos_sin_cache [max_pos, rotary_dim]`` (cos half, then
    sin half) -> ``x``'s shape and dtype. The first ``rotary_dim`` dims of each head rotate (NeoX halves or GPT-J
    pairs) in ``x``'s dtype, the rest pass through."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    heads = x.shape[-1] // head_dim if x.dim() == 2 else x.shape[-2]
    xh = x.reshape(positions.shape[0], heads, head_dim)
    rot, rest = xh[..., :rotary_dim], xh[..., rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1) if neox else (rot[..., ::2], rot[..., 1::2])
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    rot = torch.cat((o1, o2), dim=-1) if neox else torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((rot, rest), dim=-1).reshape(x.shape)
