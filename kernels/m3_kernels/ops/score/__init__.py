"""Block scorers as plan and run (``docs/design.md``, "Plan and run").

A **plan** is made once per batch, on the host, from the batch's metadata and any layer's
``IndexKCache`` (every layer of a pool shares format, geometry and device): it resolves the backend
(``resolve.resolve_backend``, the one place that decides), checks every metadata tensor and the
backend's own rules, and records the geometry (S, H, batch, max_block, sm_scale) and the work map.
A **run** per layer takes the plan, the index Q (``cache.prepare_q`` applied), the layer's cache
and the preallocated ``out``, and validates nothing.

    plan = plan_decode(cache, block_table, seq_lens, S, H, sm_scale, out=scores)   # once per batch
    scores = score_decode(plan, cache.prepare_q(q), cache, scores)                   # per layer

Backends: ``torch`` (``cpu.py``, the fast torch scorer; ``naive.py`` stays the float64 oracle),
``triton`` (CUDA and ROCm), ``cuda`` (the CUDA C++ MXFP4 decode scorer, NVIDIA sm_90+), ``flydsl``
(ROCm gfx950), ``aiter`` (aiter's installed MXFP4 scorer). ``M3_SCORE_BACKEND`` forces one.
"""

from dataclasses import dataclass

import torch

from ...formats import IndexKFormat
from .common import (  # noqa: F401
    _check_one_device,
    _check_q,
    check_decode_args,
    check_decode_meta,
    check_decode_q,
    check_prefill_args,
    check_prefill_meta,
    check_prefill_offsets,
    decode_supported,
)
from .resolve import BACKENDS, ENV_BACKEND, choose_backend, resolve_backend  # noqa: F401


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """One decode batch, checked: the backend, the geometry and the metadata tensors every layer's run reads.

    ``fmt``: the cache storage it was planned for; ``out``: the planned output buffer (None: each run
    allocates); ``pages_per_program``: the Triton work map (pages per program)."""

    backend: str
    fmt: IndexKFormat
    S: int
    H: int
    batch: int
    max_block: int
    sm_scale: float
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    out: torch.Tensor | None
    cp_rank: int
    cp_world: int
    pages_per_program: int


def plan_decode(cache, block_table, seq_lens, S, H, sm_scale, max_block=None, out=None, cp_rank=0, cp_world=1,
                backend=None) -> DecodePlan:
    """Plan one decode batch of ``batch = block_table.shape[0]`` requests with ``S`` query rows each and
    ``H`` index heads over caches like ``cache`` (an ``IndexKCache``).

    ``block_table int32 [batch, >= max_block]`` (page of each local block), ``seq_lens int32 [batch]``,
    ``max_block`` (default: ``out``'s columns, else ``block_table``'s), ``out fp32 [H, batch*S, max_block]``
    or None, ``cp_rank``/``cp_world`` (context-parallel shard: local page p is global block
    ``p * cp_world + cp_rank``), ``backend`` (default ``$M3_SCORE_BACKEND``, else auto). ValueError naming
    the argument and the rule it broke; NotImplementedError for a forced backend that cannot run here.
    No device synchronisation: safe between CUDA-graph replays.
    """
    batch, max_block, sm_scale = check_decode_meta(cache, block_table, seq_lens, S, H, sm_scale, max_block, out,
                                                   cp_rank, cp_world)
    fmt = cache.storage
    name = resolve_backend(cache.device, fmt, "decode", backend, S * H)
    pp = 0
    if name == "triton":
        from .triton import pages_per_program

        pp = pages_per_program(batch, max_block)
    elif name in ("cuda", "flydsl", "aiter"):
        from .backends import get_backend

        impl = get_backend(name)
        impl.check_plan(fmt, S, H, batch, max_block, block_table, out, cp_world)
        ok, why = impl.availability(cache.device)
        if not ok:
            raise NotImplementedError(f"score backend {name!r} cannot run here: {why}")
    elif name != "torch":
        raise NotImplementedError(f"score backend {name!r} is not available in this build")
    return DecodePlan(name, fmt, S, H, batch, max_block, sm_scale, block_table, seq_lens, out, cp_rank, cp_world, pp)


def score_decode(plan: DecodePlan, q, cache, out=None):
    """Decode block scores ``fp32 [H, batch*S, max_block]`` (contract: ``naive.score_decode_ref``) of one
    layer: ``q [batch*S, H, 128]`` bf16 | e4m3 (last dim contiguous; ``cache.prepare_q`` applied) over
    ``cache`` (same format and device as the plan's). ``out``: default the plan's buffer; with neither,
    a fresh buffer whose columns past a row's last visible page read -inf (a preallocated one is
    written up to each request's last page only). Validates nothing (the plan did)."""
    if out is None:
        out = plan.out
    name = plan.backend
    if name == "triton":
        from .triton import score_decode_triton

        return score_decode_triton(plan, q, cache, out)
    if name == "torch":
        from .cpu import decode_scores

        return decode_scores(q, cache.data, cache.scale_e8m0, plan.block_table, plan.seq_lens, plan.S, plan.sm_scale,
                             plan.max_block, out, plan.cp_rank, plan.cp_world)
    from .backends import get_backend

    return get_backend(name).score_decode(plan, q, cache, out)


def score_decode_once(q, cache, block_table, seq_lens, S, sm_scale, max_block=None, out=None, cp_rank=0, cp_world=1,
                      backend=None):
    """``plan_decode`` and ``score_decode`` in one call, with ``q`` checked against the plan too
    (``[batch*S, H, 128]`` bf16 | e4m3, last dim contiguous, on the cache's device): for tests, scripts
    and one-off calls; a server plans once per batch instead."""
    _check_q(q, None)
    plan = plan_decode(cache, block_table, seq_lens, S, q.shape[1], sm_scale, max_block, out, cp_rank, cp_world,
                       backend)
    check_decode_q(q, plan.batch * S, plan.H)
    _check_one_device(q, cache.data)
    return score_decode(plan, q, cache, out)


def score_and_select_decode(plan: DecodePlan, q, cache, out=None, topk=None):
    """Decode scores and the MSA top-k blocks of each row: ``(scores, int32 [H, batch*S, topk])``.

    Scores as ``score_decode``; blocks as ``select.select_blocks`` on them with each row's visible
    block count (``visible_blocks(seq_len - S + tok, 128)``). Plans without context parallelism only
    (``cp_world == 1``, checked here): a CP shard holds a subset of the blocks, so selection needs
    every rank. No host synchronisation on the GPU path.
    """
    from ...formats import PAGE_SIZE, TOPK_BLOCKS
    from ..select import select_blocks, visible_blocks

    if plan.cp_world != 1:
        raise ValueError(f"score_and_select_decode needs cp_world == 1 (selection sees every block), got "
                         f"{plan.cp_world}")
    scores = score_decode(plan, q, cache, out)
    positions = (plan.seq_lens.long()[:, None] - plan.S + torch.arange(plan.S, device=q.device)).flatten()
    n_visible = visible_blocks(positions, PAGE_SIZE).clamp(max=scores.shape[2])
    return scores, select_blocks(scores, n_visible, TOPK_BLOCKS if topk is None else topk)


@dataclass(frozen=True, eq=False)
class PrefillPlan:
    """One prefill batch, checked: the backend, the geometry, the metadata tensors and the work map (``tiles``
    int32 ``[n_tiles, 2]`` of (request, first row) on the device; Triton: built from host lengths, ``rows`` per
    tile; ``triton_sm90``: built on the device, padded with skipped tiles), so no layer reads lengths back.
    ``skip_rows_seeing`` (torch backend): rows seeing at most this many pages are left -inf."""

    backend: str
    fmt: IndexKFormat
    H: int
    batch: int
    num_tokens: int
    max_block: int
    sm_scale: float
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    out: torch.Tensor | None
    tiles: torch.Tensor | None
    rows: int
    skip_rows_seeing: int


def plan_prefill(cache, block_table, seq_lens, cu_seqlens_q, H, sm_scale, max_block=None, out=None,
                 cu_seqlens_host=None, seq_lens_host=None, backend=None, skip_rows_seeing: int = 0) -> PrefillPlan:
    """Plan one prefill batch over caches like ``cache``.

    ``cu_seqlens_q int32 [batch + 1]``: request b's new tokens are q rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``,
    the last at position ``seq_lens[b] - 1``; ``cu_seqlens_host`` / ``seq_lens_host``: the same as host lists of
    ints (the server holds them), else read back here (one sync each). ``out fp32 [H, total_new_tokens,
    max_block]`` or None. ``skip_rows_seeing``: see ``cpu.score_prefill_cpu`` (the torch backend only; MSA
    selection takes every block of a row that sees at most ``topk``). ValueError as ``common.check_prefill_meta``
    and ``check_prefill_offsets``.
    """
    cu = [int(x) for x in (cu_seqlens_q.tolist() if cu_seqlens_host is None else cu_seqlens_host)]
    lens = [int(x) for x in (seq_lens.tolist() if seq_lens_host is None else seq_lens_host)]
    num_tokens = cu[-1] if cu else 0
    batch, max_block, sm_scale = check_prefill_meta(cache, block_table, seq_lens, cu_seqlens_q, H, num_tokens, sm_scale,
                                                    max_block, out)
    check_prefill_offsets(cu, lens, num_tokens)
    name = resolve_backend(cache.device, cache.storage, "prefill", backend)
    tiles, rows = None, 0
    if name == "triton":
        from .triton import prefill_tiles

        tiles, rows = prefill_tiles(cu, H, cache.device)
    elif name == "triton_sm90":  # the work map on the device: no host lengths in it, so it can be captured
        from .triton_sm90 import max_prefill_tiles, prefill_tiles_device

        tiles = prefill_tiles_device(cu_seqlens_q, H, max_prefill_tiles(num_tokens, batch, H))
    elif name != "torch":
        raise NotImplementedError(f"score backend {name!r} has no prefill scorer in this build")
    return PrefillPlan(name, cache.storage, H, batch, num_tokens, max_block, sm_scale, block_table, seq_lens,
                       cu_seqlens_q, out, tiles, rows, skip_rows_seeing)


def score_prefill(plan: PrefillPlan, q, cache, out=None):
    """Prefill block scores ``fp32 [H, total_new_tokens, max_block]`` (contract: ``naive.score_prefill_ref``)
    of one layer: ``q [total_new_tokens, H, 128]`` bf16 | e4m3 (``cache.prepare_q`` applied). ``out``:
    default the plan's buffer, else fresh; every column is written. Validates nothing (the plan did)."""
    if out is None:
        out = plan.out
    if plan.backend == "triton":
        from .triton import score_prefill_triton

        return score_prefill_triton(plan, q, cache, out)
    if plan.backend == "triton_sm90":
        from .triton_sm90 import score_prefill_planned

        return score_prefill_planned(plan, q, cache, out)
    from .cpu import prefill_scores

    return prefill_scores(q, cache.data, cache.scale_e8m0, plan.block_table, plan.seq_lens, plan.cu_seqlens_q,
                          plan.sm_scale, plan.max_block, out, plan.skip_rows_seeing)


def score_prefill_once(q, cache, block_table, seq_lens, cu_seqlens_q, sm_scale, max_block=None, out=None,
                       backend=None):
    """``plan_prefill`` and ``score_prefill`` in one call (lengths read back: one sync each), ``q`` checked
    too; for tests, scripts and one-off calls."""
    _check_q(q, None)
    plan = plan_prefill(cache, block_table, seq_lens, cu_seqlens_q, q.shape[1], sm_scale, max_block, out,
                        backend=backend)
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"cu_seqlens_q must rise from 0 to q.shape[0] = {q.shape[0]}, got {cu_seqlens_q.tolist()}")
    _check_one_device(q, cache.data)
    return score_prefill(plan, q, cache, out)


__all__ = ["BACKENDS", "ENV_BACKEND", "DecodePlan", "PrefillPlan", "choose_backend", "plan_decode", "plan_prefill",
           "resolve_backend", "score_and_select_decode", "score_decode", "score_decode_once", "score_prefill",
           "score_prefill_once"]
