"""Block scorers as plan and run (``docs/design.md``, "Plan and run").

A **plan** is made once per batch, on the host, from the batch's metadata (one value: a ``DecodeBatch`` or
a ``PrefillBatch``) and any layer's ``IndexKCache`` (every layer of a pool shares format, geometry and
device): it resolves the backend (``resolve.resolve_backend``, the one place that decides), checks the
batch (``common.check_batch``) and the backend's own rules, and binds the backend's run and work map.
A **run** per layer takes the plan, the index Q (``cache.prepare_q`` applied), the layer's cache and
optionally ``out``; it checks them against the plan on the host (``common.check_run``: no device sync)
and calls the bound run.

    plan = plan_decode(cache, DecodeBatch(block_table, seq_lens, S, H, sm_scale, out=scores))  # per batch
    scores = score_decode(plan, cache.prepare_q(q), cache)                                    # per layer

Backends (``backends/``, each a module with ``check_plan(plan, batch)`` and ``run(plan, q, cache, out)``):
``torch`` (the fast torch scorer; ``naive.py`` stays the float64 oracle), ``triton`` (CUDA and ROCm),
``triton_sm90`` (prefill on Hopper), ``cuda`` (the CUDA C++ MXFP4 decode scorer, NVIDIA sm_90+), ``flydsl``
(ROCm gfx950), ``aiter`` (aiter's installed MXFP4 scorer). ``M3_SCORE_BACKEND`` forces one.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...formats import PAGE_SIZE, TOPK_BLOCKS, IndexKFormat
from .backends import check_available, get_backend
from .common import DecodeBatch, PrefillBatch, check_batch, check_run
from .resolve import BACKENDS, ENV_BACKEND, choose_backend, resolve_backend  # noqa: F401


@dataclass(frozen=True, eq=False)
class Plan:
    """One batch, checked: the bound backend run, what the plan was made for (the cache's storage format,
    page count and device; ``rows``/``H``/``max_block`` of q and ``out``), the metadata tensors every layer's
    run reads and the backend's ``work`` map (Triton decode: pages per program; Triton prefill: the host tile
    list and rows per tile; ``triton_sm90``: the device tile list)."""

    op: str
    backend: str
    run: Callable
    fmt: IndexKFormat
    num_pages: int
    device: torch.device
    H: int
    batch: int
    rows: int
    max_block: int
    sm_scale: float
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    out: torch.Tensor | None
    work: Any = None
    S: int = 0
    cp_rank: int = 0
    cp_world: int = 1
    cu_seqlens_q: torch.Tensor | None = None
    skip_rows_seeing: int = 0


DecodePlan = PrefillPlan = Plan  # the plan of either op (``plan.op``)


def _plan(op: str, cache, batch, backend: str | None) -> Plan:
    n, max_block, sm_scale, rows = check_batch(cache, batch)
    name = resolve_backend(cache.device, cache.storage, op, backend, batch.S * batch.H if op == "decode" else None)
    impl = get_backend(name, op)
    extra = (dict(S=batch.S, cp_rank=batch.cp_rank, cp_world=batch.cp_world) if op == "decode" else
             dict(cu_seqlens_q=batch.cu_seqlens_q, skip_rows_seeing=batch.skip_rows_seeing))
    plan = Plan(op, name, impl.run, cache.storage, cache.num_pages, cache.device, batch.H, n, rows, max_block,
                sm_scale, batch.block_table, batch.seq_lens, batch.out, **extra)
    plan = dataclasses.replace(plan, work=impl.check_plan(plan, batch))  # the backend's rules, then its device
    check_available(impl, cache.device)
    return plan


def plan_decode(cache, batch: DecodeBatch, backend: str | None = None) -> Plan:
    """Plan one ``DecodeBatch`` over caches like ``cache`` (an ``IndexKCache``). ``backend``: default
    ``$M3_SCORE_BACKEND``, else auto. ValueError naming the argument and the rule it broke (TypeError for a
    cache that is not an ``IndexKCache``); NotImplementedError for a forced backend that cannot run here. No
    device synchronisation (outside ``M3_SCORE_DEBUG=1``): safe between CUDA-graph replays."""
    return _plan("decode", cache, batch, backend)


def plan_prefill(cache, batch: PrefillBatch, backend: str | None = None) -> Plan:
    """Plan one ``PrefillBatch`` over caches like ``cache``; errors as ``plan_decode``. Without the batch's
    host lengths they are read back here (one sync each)."""
    return _plan("prefill", cache, batch, backend)


def score_decode(plan: Plan, q, cache, out=None):
    """Decode block scores ``fp32 [H, batch*S, max_block]`` (contract: ``naive.score_decode_ref``) of one
    layer: ``q [batch*S, H, 128]`` bf16 | e4m3 (last dim contiguous; ``cache.prepare_q`` applied) over
    ``cache``, checked against the plan (``common.check_run``). ``out``: default the plan's buffer; with
    neither, a fresh buffer whose columns past a row's last visible page read -inf (a given one is written up
    to each request's last page only)."""
    return plan.run(plan, q, cache, check_run(plan, q, cache, out))


def score_prefill(plan: Plan, q, cache, out=None):
    """Prefill block scores ``fp32 [H, total_new_tokens, max_block]`` (contract: ``naive.score_prefill_ref``)
    of one layer: ``q [total_new_tokens, H, 128]`` bf16 | e4m3 (``cache.prepare_q`` applied), checked as
    ``score_decode``'s. ``out``: default the plan's buffer, else fresh; every column is written."""
    return plan.run(plan, q, cache, check_run(plan, q, cache, out))


def score_and_select_decode(plan: Plan, q, cache, out=None, topk=None):
    """Decode scores and the MSA top-k blocks of each row: ``(scores, int32 [H, batch*S, topk])``.

    Scores as ``score_decode``; blocks as ``select.select_blocks`` on them with each row's visible
    block count (``visible_blocks(seq_len - S + tok, 128)``). Plans without context parallelism only
    (``cp_world == 1``) whose ``max_block`` holds every visible block of every row (checked on host
    ``seq_lens``, or under ``M3_SCORE_DEBUG=1``: a narrower buffer would drop the row's own block).
    No host synchronisation on the GPU path.
    """
    from ..select import select_blocks, visible_blocks
    from .common import debug

    if plan.cp_world != 1:
        raise ValueError(f"score_and_select_decode needs cp_world == 1 (selection sees every block), got "
                         f"{plan.cp_world}")
    positions = (plan.seq_lens.long()[:, None] - plan.S + torch.arange(plan.S, device=q.device)).flatten()
    n_visible = visible_blocks(positions, PAGE_SIZE)
    if plan.seq_lens.device.type == "cpu" or debug():
        need = n_visible.view(plan.batch, plan.S).amax(dim=1).tolist() if plan.batch else []
        wide = [b for b, x in enumerate(need) if x > plan.max_block]
        if wide:
            raise ValueError(f"max_block = {plan.max_block} must hold every visible block: request {wide[0]} sees "
                             f"{need[wide[0]]} blocks")
    scores = score_decode(plan, q, cache, out)
    return scores, select_blocks(scores, n_visible.clamp(max=plan.max_block), TOPK_BLOCKS if topk is None else topk)


__all__ = ["BACKENDS", "ENV_BACKEND", "DecodeBatch", "DecodePlan", "Plan", "PrefillBatch", "PrefillPlan",
           "choose_backend", "plan_decode", "plan_prefill", "resolve_backend", "score_and_select_decode",
           "score_decode", "score_prefill"]
