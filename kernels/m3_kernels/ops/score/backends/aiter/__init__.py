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

from .....formats import IndexKFormat
from ...common import aligned_q, run_guarded
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


def decode_call(plan, q, cache, out):
    """``(args, kwargs)`` of ``score_flydsl_fp4`` for a planned batch (the one place our call is built)."""
    args = (q, cache.data, cache.scale_e8m0, plan.block_table, plan.seq_lens, plan.S, plan.H, plan.sm_scale / LOG2E,
            plan.max_block)
    return args, {"out": out}


def check_plan(plan, batch) -> None:
    """The plan-time rules of aiter's scorer (``ops.score.plan_decode`` calls it once): MXFP4 cache, no CP shard."""
    if plan.fmt is not IndexKFormat.MXFP4:
        raise ValueError(f"aiter's {ENTRY_POINT} reads MXFP4 caches only, got a {plan.fmt.value} cache")
    if plan.cp_world != 1:
        raise ValueError(f"aiter's {ENTRY_POINT} takes no context-parallel shard, got cp_world={plan.cp_world}")


def run(plan, q, cache, out):
    """Decode block scores of ``plan`` through aiter into ``out`` (contract: ``ops.score.score_decode``, which
    checked the call). A Q view whose base or strides are not 16-byte aligned is copied once. aiter takes page
    ids as given and does not look for NaN / Inf in q: it runs under ``common.run_guarded`` (ids outside the
    cache score -inf and are never handed to it; a non-finite query vector scores NaN), a few small device ops
    per layer."""
    return run_guarded(plan, q, cache, out, _launch)


def _launch(plan, q, cache, out):
    """aiter's scorer on a planned batch (ids inside the cache)."""
    args, kwargs = decode_call(plan, aligned_q(q), cache, out)
    if out.shape[1] and out.shape[2]:
        find_scorer()(*args, **kwargs)
    return out
