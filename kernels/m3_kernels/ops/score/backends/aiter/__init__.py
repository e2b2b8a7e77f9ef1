"""aiter's MXFP4 decode scorer (``score_flydsl_fp4``, ROCm/aiter#7060) as a score backend.

Only used when the installed aiter exposes that entry point. Our call is built in one place,
``decode_call``, so a test can bind it to the installed function's signature (or, without aiter,
to the documented one in ``signature.py``).

Differences handled here: aiter stores ``max * sm_scale * log2(e)`` (we pass ``sm_scale / log2(e)``,
so the product is ``sm_scale`` up to one fp32 rounding); it takes no context-parallel shard
(``cp_world`` must be 1) and reads only MXFP4 caches.
"""

import importlib
import importlib.util
import math

import torch

from ...common import check_decode_args, supported
from .....formats import IndexKFormat, VIEW_ALIGN_BYTES
from .signature import ENTRY_POINT, LOCATIONS

NAME = "aiter"
LOG2E = math.log2(math.e)


def find_scorer():
    """The installed ``score_flydsl_fp4``, or None (aiter missing or older than the MXFP4 PR)."""
    if importlib.util.find_spec("aiter") is None:
        return None
    for module, attr in LOCATIONS:
        try:
            fn = getattr(importlib.import_module(module), attr, None)
        except Exception:  # aiter imports its compiled ops eagerly; a broken install counts as absent
            fn = None
        if fn is not None:
            return fn
    return None


def availability(device=None) -> tuple[bool, str]:
    """``(True, "")`` if aiter's scorer can run on ``device`` (default: the current GPU)."""
    from ..flydsl import default_device

    device = default_device() if device is None else device
    if importlib.util.find_spec("aiter") is None:
        return False, "aiter is not installed"
    if find_scorer() is None:
        return False, f"the installed aiter has no {ENTRY_POINT} (needs ROCm/aiter#7060)"
    if torch.device(device).type != "cuda" or not getattr(torch.version, "hip", None):
        return False, f"aiter's scorer runs on ROCm GPUs; {torch.device(device)} is not one"
    return True, ""


def is_available(device=None) -> bool:
    """``device`` defaults to the current GPU (or the CPU when there is none)."""
    return availability(device)[0]


def check_aiter_decode(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block=None, out=None, cp_rank=0,
                       cp_world=1):
    """The shared rules plus aiter's: MXFP4 cache, no CP shard, 16-byte aligned q rows."""
    fmt, batch, H, max_block, sm_scale = check_decode_args(
        q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block, out, cp_rank, cp_world
    )
    if fmt is not IndexKFormat.MXFP4:
        raise ValueError(f"aiter's {ENTRY_POINT} reads MXFP4 caches only, got a {fmt.value} cache")
    if cp_world != 1:
        raise ValueError(f"aiter's {ENTRY_POINT} takes no context-parallel shard, got cp_world={cp_world}")
    es = q.element_size()
    if any(x % VIEW_ALIGN_BYTES for x in (q.data_ptr(), q.stride(0) * es, q.stride(1) * es)):
        raise ValueError(
            f"q base address and row/head strides must be {VIEW_ALIGN_BYTES}-byte aligned for aiter, "
            f"got address % {VIEW_ALIGN_BYTES} = {q.data_ptr() % VIEW_ALIGN_BYTES}, strides {q.stride()} x {es} B"
        )
    return fmt, batch, H, max_block, sm_scale


def decode_call(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block=None, out=None, cp_rank=0,
                cp_world=1):
    """Validate and build ``(args, kwargs, out)`` for ``score_flydsl_fp4``; allocates ``out`` (-inf) if None."""
    _, batch, H, max_block, sm_scale = check_aiter_decode(
        q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block, out, cp_rank, cp_world
    )
    return _call(q, k_cache, k_scale, block_table, seq_lens, S, H, batch, max_block, sm_scale, out)


def _call(q, k_cache, k_scale, block_table, seq_lens, S, H, batch, max_block, sm_scale, out):
    if out is None:
        out = torch.full((H, batch * S, max_block), float("-inf"), dtype=torch.float32, device=q.device)
    args = (q, k_cache, k_scale, block_table, seq_lens, S, H, sm_scale / LOG2E, max_block)
    return args, {"out": out}, out


def verify_decode(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block=None, out=None, cp_rank=0,
                  cp_world=1) -> tuple[bool, str]:
    ok, reason = supported(check_aiter_decode, q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block,
                           out, cp_rank, cp_world)
    if not ok:
        return ok, reason
    return availability(q.device)


def check_plan(fmt, S, H, batch, max_block, block_table, out, cp_world) -> None:
    """The plan-time rules of aiter's scorer (``ops.score.plan_decode``'s hook): MXFP4 cache, no CP shard."""
    if fmt is not IndexKFormat.MXFP4:
        raise ValueError(f"aiter's {ENTRY_POINT} reads MXFP4 caches only, got a {fmt.value} cache")
    if cp_world != 1:
        raise ValueError(f"aiter's {ENTRY_POINT} takes no context-parallel shard, got cp_world={cp_world}")


def score_decode(plan, q, cache, out=None):
    """Decode block scores of ``plan`` through aiter (contract: ``ops.score.score_decode``); checks nothing
    (the plan did). A Q view whose base or strides are not 16-byte aligned is copied once."""
    es = q.element_size()
    if any(x % VIEW_ALIGN_BYTES for x in (q.data_ptr(), q.stride(0) * es, q.stride(1) * es)):
        q = q.clone(memory_format=torch.contiguous_format)
    args, kwargs, out = _call(q, cache.data, cache.scale_e8m0, plan.block_table, plan.seq_lens, plan.S, plan.H,
                              plan.batch, plan.max_block, plan.sm_scale, out)
    if out.shape[1] and out.shape[2]:
        find_scorer()(*args, **kwargs)
    return out
