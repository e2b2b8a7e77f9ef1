"""Index-cache writer: quantize index K on insert and store it at token slots.

CUDA/ROCm tensors go to the Triton writer (``triton.py``; bitwise equal to the formats module for
bf16, fp8 and mxfp4, within the documented rotation bound for mxfp4_rot), others to the torch
reference ``naive.write_index_k_ref``. The format, scale rule and sign seed are the cache's.
"""

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ...formats import IndexKFormat, check_cache
from .naive import check_loc_range, check_write_rows


@dataclass(frozen=True, eq=False)
class WritePlan:
    """One batch's write, checked once: the slots ``loc``, the caches it was made for (storage format and
    capacity, on ``device``) and the bound run (the Triton writer on a GPU, else the torch reference)."""

    loc: torch.Tensor
    fmt: IndexKFormat
    capacity: int
    device: torch.device
    run: Callable

    def first(self, n: int) -> "WritePlan":
        """The plan of the first ``n`` slots only (checked with the rest: nothing is checked again)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.loc.shape[0]:
            raise ValueError(f"n must be an int in [0, {self.loc.shape[0]}] (the plan's slots), got {n!r}")
        return replace(self, loc=self.loc[:n])


def plan_write(cache, loc, check_loc=True) -> WritePlan:
    """Plan the write of a batch's ``loc [tokens]`` (int32/int64) slots into caches like ``cache`` (an
    ``IndexKCache``; every layer of a pool shares format and capacity).

    ``check_loc`` (GPU path): verify every slot lies in the cache (one device sync; a bad slot raises
    ValueError and nothing is written). Skipped automatically while the current stream is capturing a CUDA
    graph, and when False: the kernel then skips out-of-range slots instead of raising. The CPU path always
    checks (its writes would otherwise index outside the cache)."""
    check_cache(cache)
    if not isinstance(loc, torch.Tensor) or loc.dtype not in (torch.int32, torch.int64) or loc.dim() != 1:
        raise ValueError(f"loc must be int32/int64 [tokens], got {getattr(loc, 'dtype', type(loc).__name__)} "
                         f"{tuple(getattr(loc, 'shape', ()))}")
    if loc.device != cache.device:
        raise ValueError(f"loc and the cache must be on one device, got {loc.device} and {cache.device}")
    on_gpu = loc.device.type == "cuda"
    if not on_gpu or (check_loc and not torch.cuda.is_current_stream_capturing()):
        check_loc_range(loc, cache.capacity)
    if on_gpu:
        from .triton import write_index_k_triton as run
    else:
        from .naive import write_rows as run
    return WritePlan(loc, cache.storage, cache.capacity, cache.device, run)


def write_planned(plan: WritePlan, cache, k) -> None:
    """Store ``k [tokens, 128]`` (fp32/bf16, last dim contiguous on a GPU) at the plan's slots of ``cache``
    (contract: ``naive.write_index_k_ref``), quantized in the cache's format; checked against the plan on the
    host (no sync): the cache's storage format, capacity and device, ``k``'s shape, dtype and device."""
    check_cache(cache)
    if cache.storage is not plan.fmt or cache.capacity != plan.capacity or cache.device != plan.device:
        raise ValueError(f"cache must be a {plan.fmt.value} cache of {plan.capacity} slots on {plan.device} (the "
                         f"plan's), got {cache!r}")
    check_write_rows(k, plan.loc, cache.data)
    if plan.device.type == "cuda" and k.stride(1) != 1:
        raise ValueError(f"k must be contiguous in its last dim, got strides {k.stride()}")
    plan.run(cache, k, plan.loc)


def write_index_k(cache, k, loc, check_loc=True):
    """Store ``k [tokens, 128]`` (fp32/bf16) at slots ``loc [tokens]`` (int32/int64) of ``cache`` (an
    ``IndexKCache``; contract: ``naive.write_index_k_ref``), quantized in the cache's format: ``plan_write`` and
    ``write_planned`` in one call (a server plans once per batch and writes per layer)."""
    write_planned(plan_write(cache, loc, check_loc), cache, k)


__all__ = ["WritePlan", "plan_write", "write_index_k", "write_planned"]
