"""Argument rules of the block scorers, shared by every backend (torch, Triton, CUDA, FlyDSL, aiter).

Two checks: ``check_batch`` (a plan's, once per batch: the metadata against an ``IndexKCache``) and
``check_run`` (each run's, on the host without a sync: q, ``out`` and the cache against the plan).
``check_decode_args`` / ``check_prefill_args`` put a call given as loose tensors (the float64 oracles')
through ``check_batch``. Every rule raises ValueError naming the argument and the rule it broke (a cache
that is not an ``IndexKCache``: TypeError).

Values held on the device are checked where that costs nothing, on host tensors; on a GPU only under
``M3_SCORE_DEBUG=1``: decode ``seq_lens >= 0`` and prefill's host lengths equal to the device ones. Page
ids outside the cache are not an error: such a page scores -inf, and nothing reads outside the cache (torch,
Triton, the sm_90 scorer and the CUDA kernel read page 0 in its place; the ROCm FlyDSL and aiter kernels,
which take ids as given, are run through ``run_guarded``, which hands them a table whose outside ids are page
0); ``M3_SCORE_DEBUG=1`` reports them as ValueError at plan time. A query vector (one row, one head) holding
a NaN or an Inf scores NaN on every page it sees (torch and Triton in their kernels, FlyDSL and aiter through
``run_guarded``; the CUDA kernel does not keep this rule).
"""

import dataclasses
import math
import operator
import os
from typing import NamedTuple

import torch

from ...formats import FP8_DTYPE, INDEX_DIM, PAGE_SIZE, VIEW_ALIGN_BYTES, IndexKCache, check_cache

ENV_DEBUG = "M3_SCORE_DEBUG"  # "1": the plans also check values held on a GPU (one sync each)

Q_DTYPES = (torch.bfloat16, FP8_DTYPE)


class DecodeBatch(NamedTuple):
    """One decode batch's metadata: ``block_table int32 [batch, >= max_block]`` (page of each local block),
    ``seq_lens int32 [batch]`` (context including the ``S`` new rows), ``S`` query rows and ``H`` index heads
    per request, ``sm_scale``, ``max_block`` (default: ``out``'s columns, else ``block_table``'s), ``out fp32
    [H, batch*S, max_block]`` or None (each run then gets a fresh buffer), ``cp_rank``/``cp_world`` (context-
    parallel shard: local page p is global block ``p * cp_world + cp_rank``)."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    S: int
    H: int
    sm_scale: float
    max_block: int | None = None
    out: torch.Tensor | None = None
    cp_rank: int = 0
    cp_world: int = 1


class PrefillBatch(NamedTuple):
    """One prefill batch's metadata: ``cu_seqlens_q int32 [batch + 1]`` (request b's new tokens are q rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, the last at position ``seq_lens[b] - 1``); ``cu_seqlens_host`` /
    ``seq_lens_host``: the same as host lists of ints (the server holds them; else read back at plan time, one
    sync each); ``out fp32 [H, total_new_tokens, max_block]`` or None; ``skip_rows_seeing``: rows seeing at most
    this many pages are left -inf (the torch backend only; MSA selection takes every block of such a row).
    Others as ``DecodeBatch``."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    H: int
    sm_scale: float
    max_block: int | None = None
    out: torch.Tensor | None = None
    cu_seqlens_host: list | None = None
    seq_lens_host: list | None = None
    skip_rows_seeing: int = 0


def check_sm_scale(sm_scale) -> float:
    try:
        value = float(sm_scale)
    except (TypeError, ValueError):
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"sm_scale must be positive and finite (the page max is taken before scaling), got {sm_scale!r}"
        )
    return value


def check_cp(cp_rank: int, cp_world: int) -> None:
    """Context-parallel shard: plain ints (bools, floats, tensors refused: the launchers take them as
    they are), ``cp_world >= 1`` and ``0 <= cp_rank < cp_world``."""
    for name, value in (("cp_rank", cp_rank), ("cp_world", cp_world)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if cp_world < 1 or not (0 <= cp_rank < cp_world):
        raise ValueError(f"need cp_world >= 1 and 0 <= cp_rank < cp_world, got cp_rank={cp_rank}, cp_world={cp_world}")


def _check_q(q: torch.Tensor, rows: int | None) -> None:
    if q.dtype not in Q_DTYPES:
        raise ValueError(f"q must be bfloat16 or float8_e4m3fn, got {q.dtype}")
    if q.dim() != 3 or q.shape[2] != INDEX_DIM or q.shape[1] < 1:
        raise ValueError(f"q must be [rows, H >= 1, {INDEX_DIM}], got {tuple(q.shape)}")
    if rows is not None and q.shape[0] != rows:
        raise ValueError(f"q must have {rows} rows (batch*S, or the new tokens), got {q.shape[0]}")
    if q.stride(2) != 1:
        raise ValueError(f"q must be contiguous in its last dim, got strides {q.stride()}")


def _check_int32_vector(name: str, t: torch.Tensor, length: int | None = None) -> None:
    if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous int32 vector, got {t.dtype} {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries, got {t.shape[0]}")


def _check_max_block(max_block, block_table: torch.Tensor, out: torch.Tensor | None) -> int:
    """``max_block`` as an int (default: ``out``'s columns, else ``block_table``'s), in range."""
    if max_block is None:
        max_block = out.shape[2] if out is not None else block_table.shape[1]
    try:
        value = operator.index(max_block)  # int, numpy or 0-dim integer tensor; not a float
    except TypeError:
        value = -1
    if not 0 <= value <= block_table.shape[1]:
        raise ValueError(f"max_block must be in [0, block_table.shape[1] = {block_table.shape[1]}] (an int), "
                         f"got {max_block!r}")
    return value


def _check_one_device(*tensors) -> None:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")


def _check_block_table(block_table: torch.Tensor) -> int:
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError(
            f"block_table must be int32 [batch, max_block] with a contiguous last dim, got {block_table.dtype} "
            f"{tuple(block_table.shape)} strides {block_table.stride()}"
        )
    return block_table.shape[0]


def _check_rows_per_request(S) -> None:
    if isinstance(S, bool) or not isinstance(S, int) or S < 1:
        raise ValueError(f"S (query rows per request) must be an int >= 1, got {S!r}")


def _check_out(out, H: int, rows_name: str, rows: int, max_block: int) -> None:
    """``out``: None or float32 ``[H, rows, max_block]`` with a contiguous last dim."""
    if out is not None and (out.dtype != torch.float32 or tuple(out.shape) != (H, rows, max_block)
                            or out.stride(2) != 1):
        raise ValueError(
            f"out must be float32 [H={H}, {rows_name}={rows}, max_block={max_block}] with a contiguous last dim, "
            f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )


def _check_heads(H) -> int:
    if isinstance(H, bool) or not isinstance(H, int) or H < 1:
        raise ValueError(f"H (index heads) must be an int >= 1, got {H!r}")
    return H


def check_batch(cache, batch):
    """Validate one batch (a ``DecodeBatch`` or ``PrefillBatch``) against ``cache`` (an ``IndexKCache``, whose
    views were validated when it was made): the scorers' one plan-time check. Returns ``(batch_size, max_block,
    sm_scale, num_tokens)`` (``num_tokens``: prefill's new tokens, decode's ``batch*S``).

    ``block_table int32 [batch, >= max_block]`` (last dim contiguous); ``seq_lens int32 [batch]``;
    decode: ``S >= 1`` query rows per request; prefill: ``cu_seqlens_q int32 [batch + 1]`` (request b's new
    tokens are q rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, the last at position ``seq_lens[b] - 1``) and its
    host copies; ``H >= 1`` index heads; ``out fp32 [H, rows, max_block]`` (last dim contiguous) or None; every
    tensor on the cache's device; a cache of at least one page when anything is read.

    Values on the device (page ids, lengths) are checked where that costs nothing, i.e. when the tensors are
    on the host, and on a GPU only under ``M3_SCORE_DEBUG=1`` (``debug``), since reading them back syncs.
    """
    check_cache(cache)
    decode = hasattr(batch, "S")
    if decode:
        _check_rows_per_request(batch.S)
    n = _check_block_table(batch.block_table)
    _check_int32_vector("seq_lens", batch.seq_lens, n)
    H = _check_heads(batch.H)
    max_block = _check_max_block(batch.max_block, batch.block_table, batch.out)
    if decode:
        rows = n * batch.S
        _check_out(batch.out, H, "batch*S", rows, max_block)
        _check_one_device(cache.data, batch.block_table, batch.seq_lens, batch.out)
        check_cp(batch.cp_rank, batch.cp_world)
    else:
        _check_int32_vector("cu_seqlens_q", batch.cu_seqlens_q, n + 1)
        cu, lens = _prefill_host_lengths(batch)
        rows = cu[-1] if cu else 0
        _check_out(batch.out, H, "total_new_tokens", rows, max_block)
        _check_one_device(cache.data, batch.block_table, batch.seq_lens, batch.cu_seqlens_q, batch.out)
    if not decode:
        check_prefill_offsets(cu, lens, rows)
    if batch.seq_lens.device.type == "cpu" or debug():
        _check_lengths(batch, decode)
    if max_block and n and cache.num_pages < 1:
        raise ValueError("cache must hold at least one page (the kernels read pages of it)")
    sm_scale = check_sm_scale(batch.sm_scale)
    if debug():
        _check_page_ids(cache, batch, n, max_block, decode)
    return n, max_block, sm_scale, rows


def _prefill_host_lengths(batch) -> tuple[list[int], list[int]]:
    """``(cu_seqlens_q, seq_lens)`` as host lists: the batch's host copies, else read back (one sync each)."""
    cu = batch.cu_seqlens_q.tolist() if batch.cu_seqlens_host is None else batch.cu_seqlens_host
    lens = batch.seq_lens.tolist() if batch.seq_lens_host is None else batch.seq_lens_host
    return [int(x) for x in cu], [int(x) for x in lens]


def _check_lengths(batch, decode: bool) -> None:
    """The length rules on device values (one read-back): decode ``seq_lens >= 0``; prefill host lengths equal
    to the device ones."""
    lens = batch.seq_lens.tolist()
    if decode:
        neg = [b for b, x in enumerate(lens) if x < 0]
        if neg:
            raise ValueError(f"seq_lens must be >= 0, got {lens[neg[0]]} at [{neg[0]}]")
    else:
        cu = batch.cu_seqlens_q.tolist()
        if batch.cu_seqlens_host is not None and [int(x) for x in batch.cu_seqlens_host] != cu:
            raise ValueError(f"cu_seqlens_host must equal cu_seqlens_q, got {list(batch.cu_seqlens_host)} and {cu}")
        if batch.seq_lens_host is not None and [int(x) for x in batch.seq_lens_host] != lens:
            raise ValueError(f"seq_lens_host must equal seq_lens, got {list(batch.seq_lens_host)} and {lens}")


def _check_page_ids(cache, batch, n: int, max_block: int, decode: bool) -> None:
    """Every visible page id inside the cache (the debug report of ids the backends score -inf)."""
    last = [x - 1 for x in batch.seq_lens.tolist()]
    cp_rank, cp_world = (batch.cp_rank, batch.cp_world) if decode else (0, 1)
    table = batch.block_table.tolist()
    for b in range(n):
        n_global = last[b] // PAGE_SIZE + 1 if last[b] >= 0 else 0
        n_local = min(max_block, max(0, (n_global - cp_rank + cp_world - 1) // cp_world))
        if any(not 0 <= p < cache.num_pages for p in table[b][:n_local]):
            raise ValueError(f"block_table[{b}] holds page ids outside [0, {cache.num_pages}) among its {n_local} "
                             f"visible pages")


def debug() -> bool:
    """``M3_SCORE_DEBUG=1``: the plans also check the values on a GPU (page ids, lengths), one sync each."""
    return os.environ.get(ENV_DEBUG, "0") == "1"


def check_run(plan, q, cache, out):
    """The run's host check (no device sync, a few attribute reads): ``q [rows, H, 128]`` bf16 | e4m3 with a
    contiguous last dim, ``cache`` an ``IndexKCache`` of the plan's storage format and page count, ``out``
    None or the plan's shape, all on the plan's device. Returns the output buffer: ``out``, else the plan's,
    else a fresh one (``new_out``)."""
    check_cache(cache)
    _check_q(q, plan.rows)
    if q.shape[1] != plan.H:
        raise ValueError(f"q must have H = {plan.H} heads (the plan's), got {q.shape[1]}")
    if cache.storage is not plan.fmt or cache.num_pages != plan.num_pages or cache.device != plan.device:
        raise ValueError(f"cache must be a {plan.fmt.value} cache on {plan.device} (the plan's), and cache must "
                         f"hold {plan.num_pages} pages as the plan's, got {cache!r}")
    if q.device != plan.device:
        raise ValueError(f"q must be on {plan.device} (the plan's), got {q.device}")
    if out is None:
        return plan.out if plan.out is not None else new_out(plan)
    _check_out(out, plan.H, "rows", plan.rows, plan.max_block)
    if out.device != plan.device:
        raise ValueError(f"out must be on {plan.device} (the plan's), got {out.device}")
    return out


def new_out(plan) -> torch.Tensor:
    """A fresh output buffer ``fp32 [H, rows, max_block]``: decode's filled with -inf (a decode run writes
    up to each request's last visible page only); prefill's left empty (every column is written)."""
    if plan.op == "decode":
        return minus_inf_scores(plan.H, plan.rows, plan.max_block, plan.device)
    return torch.empty((plan.H, plan.rows, plan.max_block), dtype=torch.float32, device=plan.device)


def minus_inf_scores(H: int, rows: int, max_block: int, device) -> torch.Tensor:
    """``fp32 [H, rows, max_block]`` of -inf: a decode buffer before any page is scored."""
    return torch.full((H, rows, max_block), float("-inf"), dtype=torch.float32, device=device)


def run_guarded(plan, q, cache, out, launch):
    """Run ``launch(plan, q, cache, out) -> out``, a decode kernel that takes page ids as given and does not
    look for NaN / Inf in q (FlyDSL, aiter), under the two rules every decode backend keeps:

    - a visible page id outside ``[0, plan.num_pages)`` scores -inf, and the kernel never sees it: it gets the
      plan with a copy of ``block_table[:, :max_block]`` whose outside ids are page 0;
    - a query vector (one row, one head) holding a NaN or an Inf scores NaN on every page it sees (the page's
      first token position <= the row's) whose id is inside the cache.

    Device ops only (no host sync; CUDA-graph capturable). Cost, per layer on those backends: about twenty
    small elementwise launches, over the block table (``batch x max_block`` ids), q (one ``isfinite`` pass)
    and ``out`` (two masked fills of ``H x batch*S x max_block``), beside the kernel."""
    table = plan.block_table[:, : plan.max_block]
    outside = (table < 0) | (table >= plan.num_pages)  # [batch, max_block]
    out = launch(dataclasses.replace(plan, block_table=table.masked_fill(outside, 0)), q, cache, out)
    batch, S, cols = plan.batch, plan.S, plan.max_block
    out.masked_fill_(outside[:, None, :].expand(batch, S, cols).reshape(1, batch * S, cols), float("-inf"))
    positions = plan.seq_lens.long()[:, None] - S + torch.arange(S, device=out.device)  # [batch, S]
    first = (torch.arange(cols, device=out.device) * plan.cp_world + plan.cp_rank) * PAGE_SIZE  # local page p
    sees = (first <= positions[:, :, None]) & ~outside[:, None, :]  # [batch, S, max_block]
    bad = ~torch.isfinite(q.float() if q.element_size() == 1 else q).all(dim=2)  # [rows, H]; e4m3 has no isfinite
    out.masked_fill_(bad.t()[:, :, None] & sees.reshape(1, batch * S, cols), float("nan"))
    return out


def q_aligned(q) -> bool:
    """Q's base address and row/head strides are 16-byte aligned (the CUDA, FlyDSL and aiter kernels read Q
    rows in 16-byte vectors)."""
    es = q.element_size()
    return not (q.data_ptr() % VIEW_ALIGN_BYTES or (q.stride(0) * es) % VIEW_ALIGN_BYTES
                or (q.stride(1) * es) % VIEW_ALIGN_BYTES)


def aligned_q(q):
    """``q``, or a contiguous copy of it where ``q_aligned`` does not hold (one copy per run)."""
    return q if q_aligned(q) else q.clone(memory_format=torch.contiguous_format)


def check_decode_args(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block=None, out=None, cp_rank=0,
                      cp_world=1):
    """The float64 oracles' check of a decode call given as loose tensors (``naive.score_decode_ref``): the
    cache views (``IndexKCache.of``), ``check_batch`` and ``q [batch*S, H, 128]``. Returns ``(batch, H,
    max_block, sm_scale)``."""
    _check_q(q, None)
    cache = IndexKCache.of(k_cache, k_scale)
    n, max_block, sm_scale, rows = check_batch(cache, DecodeBatch(block_table, seq_lens, S, q.shape[1], sm_scale,
                                                                  max_block, out, cp_rank, cp_world))
    _check_q(q, rows)
    _check_one_device(q, k_cache)
    return n, q.shape[1], max_block, sm_scale


def check_prefill_args(q, k_cache, k_scale, block_table, seq_lens, cu_seqlens_q, sm_scale, max_block=None, out=None):
    """The oracles' check of a prefill call as loose tensors (lengths read back: one sync each), as
    ``check_decode_args``; ``cu_seqlens_q`` must rise from 0 to ``q.shape[0]``."""
    _check_q(q, None)
    cache = IndexKCache.of(k_cache, k_scale)
    n, max_block, sm_scale, rows = check_batch(cache, PrefillBatch(block_table, seq_lens, cu_seqlens_q, q.shape[1],
                                                                   sm_scale, max_block, out))
    if rows != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must rise from 0 to q.shape[0] = {q.shape[0]}, got {cu_seqlens_q.tolist()}")
    _check_one_device(q, k_cache)
    return n, q.shape[1], max_block, sm_scale


def check_prefill_offsets(cu: list[int], lens: list[int], total_new_tokens: int) -> None:
    """Host lengths of a prefill batch: ``cu`` (``cu_seqlens_q``) rises from 0 to ``total_new_tokens`` and no
    request has more new tokens than its ``lens`` (``seq_lens``) entry."""
    if len(cu) != len(lens) + 1:
        raise ValueError(f"cu_seqlens_q must have len(seq_lens) + 1 = {len(lens) + 1} entries, got {len(cu)}")
    if cu[0] != 0 or cu[-1] != total_new_tokens or any(a > b for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens_q must rise from 0 to q.shape[0] = {total_new_tokens}, got {cu}")
    for b, n in enumerate(b1 - b0 for b0, b1 in zip(cu, cu[1:])):
        if n > lens[b]:
            raise ValueError(f"request {b} has {n} new tokens but seq_lens[{b}] = {lens[b]}")


__all__ = ["ENV_DEBUG", "DecodeBatch", "PrefillBatch", "aligned_q", "check_batch", "check_decode_args",
           "check_prefill_args", "check_prefill_offsets", "check_run", "check_sm_scale", "debug", "minus_inf_scores",
           "new_out", "q_aligned", "run_guarded"]
