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
