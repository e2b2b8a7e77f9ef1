"""Torch reference block scorers (decode and prefill): the oracle for every kernel, including the
fast torch scorer of ``cpu.py`` (the ``torch`` backend). Clear before clever; compute in float64
unless told otherwise.

Semantics (``docs/design.md``, "The block scorer contract"). For query row r of request b at position
``pos_r`` (0-based; decode: ``seq_lens[b] - S + tok``; prefill: ``seq_lens[b] - n_new_b + i``) and
index head h::

    out[h, r, p] = sm_scale * max over t of dot(K[block_table[b, p], t], q[r, h])
                   over tokens t of page p with  (p * cp_world + cp_rank) * 128 + t <= pos_r

A page with no visible token is -inf; every column of ``out`` is written (columns past a row's
last visible page read -inf). A page id outside the cache (``< 0`` or ``>= num_pages``) names no keys:
the page scores -inf (nothing is read; ``M3_SCORE_DEBUG=1`` makes the plans report such ids). A query
vector ``q[r, h]`` holding a NaN or an Inf scores NaN on every page with a token visible to row r
(-inf on the others), whatever K holds: the same scores, hence the same selection, on every backend. Context parallel: rank ``cp_rank`` of ``cp_world`` stores global
block ``p * cp_world + cp_rank`` at local column ``p``. K is dequantized exactly and q is taken
as stored (bf16 or e4m3), so the float64 result is the exact score rounded once.
"""

import torch

from ...formats import PAGE_SIZE, dequantize_index_k
from .backends.torch import finite_or_nan
from .common import check_decode_args, check_prefill_args

_ROW_CHUNK = 256  # query rows scored at once (bounds the [H, rows, pages, 128] temporary)


def _dequantize_pages(k_cache, k_scale, pages: torch.Tensor, dtype) -> torch.Tensor:
    if k_scale is None:
        return dequantize_index_k(k_cache[pages], None, dtype)
    return dequantize_index_k(k_cache[pages], k_scale[pages], dtype)


def _score_request(q, k_cache, k_scale, pages, positions, global_blocks, sm_scale, dtype):
    """Scores ``[H, rows, len(pages)]`` of one request's rows against its pages."""
    H, rows, npages = q.shape[1], q.shape[0], pages.shape[0]
    out = torch.full((H, rows, npages), float("-inf"), dtype=dtype, device=q.device)
    if npages == 0 or rows == 0:
        return out
    k = _dequantize_pages(k_cache, k_scale, pages.long(), dtype)  # [P, 128, 128]
    token_pos = global_blocks.long()[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=q.device)  # [P, 128]
    q = finite_or_nan(q)
    for r0 in range(0, rows, _ROW_CHUNK):
        qc = q[r0 : r0 + _ROW_CHUNK].to(dtype)  # [R, H, 128]
        dots = torch.einsum("rhd,ptd->hrpt", qc, k)
        visible = token_pos[None, None] <= positions[r0 : r0 + _ROW_CHUNK].long()[None, :, None, None]
        dots = dots.masked_fill(~visible, float("-inf"))
        out[:, r0 : r0 + _ROW_CHUNK] = dots.amax(dim=-1)
    return out * sm_scale


def _score_rows(q, k_cache, k_scale, block_table, row_ranges, positions, max_block, sm_scale, cp_rank, cp_world, dtype):
    H = q.shape[1]
    out = torch.full((H, q.shape[0], max_block), float("-inf"), dtype=dtype, device=q.device)
    for b, (r0, r1) in enumerate(row_ranges):
        if r1 <= r0:
            continue
        last_pos = int(positions[r0:r1].max())
        # Local pages holding any token at or before the last row's position.
        n_global = last_pos // PAGE_SIZE + 1 if last_pos >= 0 else 0
        n_local = min(max_block, max(0, (n_global - cp_rank + cp_world - 1) // cp_world))
        pages = block_table[b, :n_local].long()
        inside = (pages >= 0) & (pages < k_cache.shape[0])  # a page outside the cache scores -inf
        global_blocks = torch.arange(n_local, device=q.device) * cp_world + cp_rank
        scores = _score_request(q[r0:r1], k_cache, k_scale, pages[inside], positions[r0:r1], global_blocks[inside],
                                sm_scale, dtype)
        out[:, r0:r1, :n_local][:, :, inside] = scores
    return out


def score_decode_ref(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block=None, cp_rank=0, cp_world=1, dtype=torch.float64):
    """Decode block scores.

    Args:
        q: ``[batch*S, H, 128]`` bf16 or float8_e4m3fn; row ``b*S + tok``.
        k_cache, k_scale: a cache (``formats.pages``): ``k [pages,128,128]`` bf16/e4m3 and None,
            or MXFP4 ``k_data [pages,128,64]`` and ``k_scale [pages,128,4]`` uint8.
        block_table: int32 ``[batch, >= max_block]``, local page ids.
        seq_lens: int32 ``[batch]``, context length including the S new tokens.
        S: query rows per request (1 + speculative tokens).
        sm_scale: positive finite multiplier.
        max_block: output columns (default ``block_table.shape[1]``).
        dtype: compute and output dtype (float64 for the oracle; float32 for the CPU server).
    Returns:
        ``[H, batch*S, max_block]`` in ``dtype``.
    """
    batch, _, max_block, sm_scale = check_decode_args(
        q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block, None, cp_rank, cp_world
    )
    seq = seq_lens.long()
    positions = (seq[:, None] - S + torch.arange(S, device=q.device)).flatten()
    row_ranges = [(b * S, (b + 1) * S) for b in range(batch)]
    return _score_rows(q, k_cache, k_scale, block_table, row_ranges, positions, max_block, sm_scale, cp_rank, cp_world, dtype)


def score_prefill_ref(q, k_cache, k_scale, block_table, seq_lens, cu_seqlens_q, sm_scale, max_block=None, dtype=torch.float64):
    """Prefill block scores: each new token scores every page of its causal prefix, the cached
    (radix) prefix included, since the new tokens' keys are in the cache before scoring.

    Args:
        q: ``[total_new_tokens, H, 128]`` bf16 or float8_e4m3fn.
        cu_seqlens_q: int32 ``[batch + 1]``; request b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
        seq_lens: int32 ``[batch]``, context length after this chunk (prefix + new tokens).
        Others as ``score_decode_ref``.
    Returns:
        ``[H, total_new_tokens, max_block]`` in ``dtype``.
    """
    batch, _, max_block, sm_scale = check_prefill_args(
        q, k_cache, k_scale, block_table, seq_lens, cu_seqlens_q, sm_scale, max_block
    )
    cu = cu_seqlens_q.tolist()
    positions = torch.empty(q.shape[0], dtype=torch.long, device=q.device)
    for b in range(batch):
        n = cu[b + 1] - cu[b]
        positions[cu[b] : cu[b + 1]] = int(seq_lens[b]) - n + torch.arange(n, device=q.device)
    row_ranges = list(zip(cu[:-1], cu[1:]))
    return _score_rows(q, k_cache, k_scale, block_table, row_ranges, positions, max_block, sm_scale, 0, 1, dtype)
