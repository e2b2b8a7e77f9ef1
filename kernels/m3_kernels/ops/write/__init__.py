"""Index-cache writer: quantize index K on insert and store it at token slots.

CUDA/ROCm tensors go to the Triton writer (``triton.py``; bitwise equal to the formats module for
bf16, fp8 and mxfp4, within the documented rotation bound for mxfp4_rot), others to the torch
reference ``naive.write_index_k_ref``. The format, scale rule and sign seed are the cache's.
"""

from .naive import check_write_rows


def write_index_k(cache, k, loc, check_loc=True):
    """Store ``k [tokens, 128]`` (fp32/bf16) at slots ``loc [tokens]`` (int32/int64) of ``cache`` (an
    ``IndexKCache``; contract: ``naive.write_index_k_ref``), quantized in the cache's format.

    ``check_loc`` (GPU path): verify every slot lies in the cache before writing (one device
    sync; a bad slot raises ValueError and nothing is written). Skipped automatically while the
    current stream is capturing a CUDA graph, and when False: the kernel then skips out-of-range
    slots instead of raising. The CPU path always checks.
    """
    from ...formats import check_cache

    check_write_rows(k, loc, check_cache(cache).data)
    if k.device.type != "cuda":
        from .naive import write_rows

        write_rows(cache, k, loc)
        return
    import torch

    from .triton import write_index_k_triton

    if k.stride(1) != 1:
        raise ValueError(f"k must be contiguous in its last dim, got strides {k.stride()}")
    if check_loc and loc.numel() and not torch.cuda.is_current_stream_capturing():
        lo, hi = int(loc.min()), int(loc.max())
        if lo < 0 or hi >= cache.capacity:
            raise ValueError(f"loc values must lie in [0, {cache.capacity}), got min {lo}, max {hi}")
    write_index_k_triton(cache, k, loc)
