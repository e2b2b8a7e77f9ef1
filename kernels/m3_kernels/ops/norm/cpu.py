"""Gemma RMSNorm on the CPU, bit for bit ``naive.gemma_rms_norm_ref``: the same fp32 operations in the same
order, over chunks of rows small enough that each chunk's fp32 temporaries stay in cache (the reference makes
five full-size fp32 passes; for M3's per-head q norm at a 4k prefill that is 4096 x 16 rows of 128)."""

import torch

_CHUNK_ELEMS = 1 << 18  # fp32 elements one chunk of rows holds (1 MiB)


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
