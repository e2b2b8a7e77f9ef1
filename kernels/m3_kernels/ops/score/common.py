"""Argument rules of the block scorers, shared by every backend (torch, Triton, CUDA, FlyDSL, aiter).

``check_decode_meta`` / ``check_prefill_meta`` check one batch's metadata against an ``IndexKCache``
(the plans call them once per batch); ``check_decode_args`` / ``check_prefill_args`` check a call given
as loose tensors (the ROCm backends' own entry points and the CPU scorers' public functions).

``check_decode_args`` raises ValueError naming the argument and the rule it broke;
``decode_supported`` answers the same question with ``(ok, reason)`` and never raises.
"""

import math
import operator

import torch

from ...formats import FP8_DTYPE, INDEX_DIM, IndexKFormat, check_index_k_cache

Q_DTYPES = (torch.bfloat16, FP8_DTYPE)


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
        raise ValueError(f"q must have batch*S = {rows} rows, got {q.shape[0]}")
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
    if not isinstance(S, int) or S < 1:
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


def check_decode_meta(cache, block_table, seq_lens, S, H, sm_scale, max_block=None, out=None, cp_rank=0, cp_world=1):
    """Validate one decode batch's metadata against ``cache`` (an ``IndexKCache``, validated when made);
    returns ``(batch, max_block, sm_scale)``. ``decode.plan_decode`` calls it once per batch.

    ``block_table int32 [batch, >= max_block]`` (last dim contiguous); ``seq_lens int32 [batch]``;
    ``S >= 1`` query rows per request, ``H >= 1`` index heads; ``out fp32 [H, batch*S, max_block]``
    with a contiguous last dim, or None; every tensor on the cache's device.
    """
    _check_rows_per_request(S)
    batch = _check_block_table(block_table)
    _check_int32_vector("seq_lens", seq_lens, batch)
    H = _check_heads(H)
    max_block = _check_max_block(max_block, block_table, out)
    _check_out(out, H, "batch*S", batch * S, max_block)
    _check_one_device(cache.data, block_table, seq_lens, out)
    check_cp(cp_rank, cp_world)
    return batch, max_block, check_sm_scale(sm_scale)


def check_decode_args(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block=None, out=None, cp_rank=0,
                      cp_world=1):
    """Validate a decode scoring call given as loose tensors (the ROCm backends' own entry points);
    returns ``(format, batch, H, max_block, sm_scale)``: the cache views (``check_index_k_cache``),
    ``check_decode_meta``'s rules and ``q [batch*S, H, 128]`` bf16 | e4m3 (last dim contiguous)."""
    fmt = check_index_k_cache(k_cache, k_scale)
    _check_rows_per_request(S)
    batch = _check_block_table(block_table)
    _check_int32_vector("seq_lens", seq_lens, batch)
    _check_q(q, batch * S)
    H = q.shape[1]
    max_block = _check_max_block(max_block, block_table, out)
    _check_out(out, H, "batch*S", batch * S, max_block)
    _check_one_device(q, k_cache, block_table, seq_lens, out)
    check_cp(cp_rank, cp_world)
    return fmt, batch, H, max_block, check_sm_scale(sm_scale)


def check_decode_q(q, rows: int, H: int) -> None:
    """``q [rows, H, 128]`` bf16 | e4m3, last dim contiguous (for callers that check a Q against a plan)."""
    _check_q(q, rows)
    if q.shape[1] != H:
        raise ValueError(f"q must have H = {H} heads (the plan's), got {q.shape[1]}")


def check_prefill_meta(cache, block_table, seq_lens, cu_seqlens_q, H, num_tokens, sm_scale, max_block=None,
                       out=None):
    """Validate one prefill batch's metadata against ``cache``; returns ``(batch, max_block, sm_scale)``.

    ``cu_seqlens_q int32 [batch + 1]``: request b's new tokens are q rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, the last of them at position ``seq_lens[b] - 1``;
    ``out fp32 [H, num_tokens, max_block]`` (last dim contiguous) or None.
    """
    batch = _check_block_table(block_table)
    _check_int32_vector("seq_lens", seq_lens, batch)
    _check_int32_vector("cu_seqlens_q", cu_seqlens_q, batch + 1)
    H = _check_heads(H)
    max_block = _check_max_block(max_block, block_table, out)
    _check_out(out, H, "total_new_tokens", num_tokens, max_block)
    _check_one_device(cache.data, block_table, seq_lens, cu_seqlens_q, out)
    return batch, max_block, check_sm_scale(sm_scale)


def check_prefill_args(q, k_cache, k_scale, block_table, seq_lens, cu_seqlens_q, sm_scale, max_block=None, out=None):
    """Validate a prefill scoring call given as loose tensors; returns ``(format, batch, H, max_block, sm_scale)``
    (the cache views, ``q [total_new_tokens, H, 128]`` and ``check_prefill_meta``'s rules)."""
    fmt = check_index_k_cache(k_cache, k_scale)
    batch = _check_block_table(block_table)
    _check_int32_vector("seq_lens", seq_lens, batch)
    _check_int32_vector("cu_seqlens_q", cu_seqlens_q, batch + 1)
    _check_q(q, None)
    H = q.shape[1]
    max_block = _check_max_block(max_block, block_table, out)
    _check_out(out, H, "total_new_tokens", q.shape[0], max_block)
    _check_one_device(q, k_cache, block_table, seq_lens, cu_seqlens_q, out)
    return fmt, batch, H, max_block, check_sm_scale(sm_scale)


def check_prefill_lengths(q, seq_lens, cu_seqlens_q) -> None:
    """Host check (one sync) that ``cu_seqlens_q`` rises from 0 to ``q.shape[0]`` and that no request
    has more new tokens than its ``seq_lens`` entry."""
    check_prefill_offsets(cu_seqlens_q.tolist(), seq_lens.tolist(), q.shape[0])


def check_prefill_offsets(cu: list[int], lens: list[int], total_new_tokens: int) -> None:
    """``check_prefill_lengths`` on host copies: ``cu`` (``cu_seqlens_q``), ``lens`` (``seq_lens``)."""
    if len(cu) != len(lens) + 1:
        raise ValueError(f"cu_seqlens_q must have len(seq_lens) + 1 = {len(lens) + 1} entries, got {len(cu)}")
    if cu[0] != 0 or cu[-1] != total_new_tokens or any(a > b for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens_q must rise from 0 to q.shape[0] = {total_new_tokens}, got {cu}")
    for b, n in enumerate(b1 - b0 for b0, b1 in zip(cu, cu[1:])):
        if n > lens[b]:
            raise ValueError(f"request {b} has {n} new tokens but seq_lens[{b}] = {lens[b]}")


def supported(check, *args, **kwargs):
    """``(True, "")`` if ``check(*args, **kwargs)`` accepts the call, else ``(False, reason)``."""
    try:
        check(*args, **kwargs)
    except ValueError as e:
        return False, str(e)
    return True, ""


def decode_supported(*args, **kwargs):
    """Same arguments as ``check_decode_args``; ``(ok, reason)``, never raises."""
    return supported(check_decode_args, *args, **kwargs)


__all__ = ["IndexKFormat", "check_decode_args", "check_decode_meta", "check_decode_q", "check_prefill_args",
           "check_prefill_meta", "check_prefill_lengths", "check_prefill_offsets",
           "check_sm_scale", "decode_supported", "supported"]
