"""Index-cache writer: quantize index K on insert and store it at token slots.

CUDA/ROCm tensors go to the Triton writer (``triton.py``; bitwise equal to the formats module for
bf16, fp8 and mxfp4, within the documented rotation bound for mxfp4_rot), others to the torch
reference ``naive.write_index_k_ref``.
"""

from ...formats import PAGE_SIZE, ScaleRule


def write_index_k(k, loc, k_cache, k_scale, fmt, scale_rule=ScaleRule.RCEIL, sign_seed=None, check_loc=True):
    """Store ``k [tokens, 128]`` (fp32/bf16) at slots ``loc [tokens]`` (contract: ``naive.write_index_k_ref``).

    ``check_loc`` (GPU path): verify every slot lies in the cache before writing (one device
    sync; a bad slot raises ValueError and nothing is written). Skipped automatically while the
    current stream is capturing a CUDA graph, and when False: the kernel then skips out-of-range
    slots instead of raising.
    """
    if k.device.type != "cuda":
        from .naive import write_index_k_ref

        write_index_k_ref(k, loc, k_cache, k_scale, fmt, scale_rule, sign_seed)
        return
    from .naive import check_write_args
    from .triton import write_index_k_triton

    fmt = check_write_args(k, loc, k_cache, k_scale, fmt)
    if k.stride(1) != 1:
        raise ValueError(f"k must be contiguous in its last dim, got strides {k.stride()}")
    import torch

    if check_loc and loc.numel() and not torch.cuda.is_current_stream_capturing():
        capacity = k_cache.shape[0] * PAGE_SIZE
        lo, hi = int(loc.min()), int(loc.max())
        if lo < 0 or hi >= capacity:
            raise ValueError(f"loc values must lie in [0, {capacity}), got min {lo}, max {hi}")
    write_index_k_triton(k, loc, k_cache, k_scale, fmt, scale_rule, sign_seed)
