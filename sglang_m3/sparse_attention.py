"""Main-head attention over the MSA-selected blocks.

On CUDA this calls SGLang's own Triton sparse-attention kernels (they take a block list per KV
head and query row); elsewhere (the CPU serving path) prefill runs ``sparse_attention_by_block``
and decode ``sparse_attention_gather``, which both read only the selected blocks.
``sparse_attention_torch`` is the plain version written for clarity (every row against its whole
context, masked), kept as the tests' reference. Block ids
are request-relative (block ``p`` = tokens ``p*block_size .. p*block_size + block_size - 1`` of
the request), -1 pads the end of a list.
"""

import itertools

import torch
import torch.nn.functional as F

_ROW_CHUNK = 256  # query rows attended at once (bounds the [Hkv, G, rows, L] logits)
_GATHER_ELEMS = 1 << 23  # mask entries (query row x head x key) one tile chunk of the gather path holds
_BY_BLOCK_ELEMS = 1 << 25  # fp32 logits (row x slot x head x key) one row chunk of the by-block path holds


def sparse_attention_torch(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, cu_rows, positions,
                           topk_idx, block_size: int, sm_scale: float):
    """Attention of each query row over the causally visible tokens of its selected blocks.

    Args:
        q: ``[rows, Hq, D]``; rows of request ``b`` are ``cu_rows[b]:cu_rows[b+1]``.
        k_cache, v_cache: ``[slots, Hkv, D]`` main cache; ``req_to_token[req_pool_indices[b], t]``
            is the slot of token ``t`` of request ``b``.
        seq_lens: ``[batch]`` tokens of each request (all new tokens included).
        positions: ``[rows]`` 0-based position of each query row; it sees tokens ``t <= position``.
        topk_idx: int ``[Hkv, rows, topk]`` selected block ids, -1 padded; query head ``h`` reads
            the list of KV head ``h // (Hq // Hkv)``.
    Returns:
        ``[rows, Hq, D]`` in q's dtype.
    """
    rows, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    out = torch.empty_like(q)
    seq_lens_cpu = seq_lens.tolist()
    cu = cu_rows.tolist()
    for b, length in enumerate(seq_lens_cpu):
        r0, r1 = cu[b], cu[b + 1]
        if r1 <= r0:
            continue
        slots = req_to_token[req_pool_indices[b], :length].long()
        k = k_cache[slots].float().transpose(0, 1)  # [Hkv, L, D]
        v = v_cache[slots].float().transpose(0, 1)
        n_blocks = (length + block_size - 1) // block_size
        token_block = torch.arange(length, device=q.device) // block_size
        token_pos = torch.arange(length, device=q.device)
        for c0 in range(r0, r1, _ROW_CHUNK):
            c1 = min(c0 + _ROW_CHUNK, r1)
            sel = topk_idx[:, c0:c1].long()
            sel = torch.where(sel < 0, n_blocks, sel)  # padding -> a spare column dropped below
            chosen = torch.zeros(hkv, c1 - c0, n_blocks + 1, dtype=torch.bool, device=q.device)
            chosen.scatter_(2, sel, True)
            visible = chosen[..., :n_blocks][..., token_block]  # [Hkv, R, L]
            visible &= token_pos[None, None, :] <= positions[c0:c1, None].long()
            qc = q[c0:c1].float().reshape(c1 - c0, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, R, D]
            logits = torch.matmul(qc, k.transpose(1, 2).unsqueeze(1)) * sm_scale  # [Hkv, G, R, L]
            logits = logits.masked_fill(~visible[:, None], float("-inf"))
            o = torch.matmul(torch.softmax(logits, dim=-1), v.unsqueeze(1))  # [Hkv, G, R, D]
            out[c0:c1] = o.permute(2, 0, 1, 3).reshape(c1 - c0, hq, d).to(q.dtype)
    return out


def _row_tiles(cu_rows: list[int], positions: torch.Tensor, block_size: int):
    """Tiles of consecutive rows of one request in one query block: ``(tile_of_row [rows], starts, lens,
    request of each tile)``, all int64 tensors."""
    rows = positions.shape[0]
    request = torch.repeat_interleave(torch.arange(len(cu_rows) - 1), torch.tensor(cu_rows).diff())
    key = request * (1 << 40) + torch.div(positions.long().cpu(), block_size, rounding_mode="floor")
    new = torch.ones(rows, dtype=torch.bool)
    new[1:] = key[1:] != key[:-1]
    tile_of_row = torch.cumsum(new.long(), 0) - 1
    starts = new.nonzero().squeeze(1)
    lens = torch.diff(starts, append=torch.tensor([rows]))
    return tile_of_row, starts, lens, request[starts]


def _tile_chunks(widths: list[int], elems_per_key: int, block_size: int):
    """``(t0, t1, width)`` runs of consecutive tiles whose mask, K and V (``elems_per_key`` entries per key
    and tile) fit ``_GATHER_ELEMS`` at the run's widest union (in blocks); a single tile always runs."""
    t0 = 0
    while t0 < len(widths):
        t1, w = t0 + 1, widths[t0]
        while t1 < len(widths) and (t1 + 1 - t0) * max(w, widths[t1]) * block_size * elems_per_key <= _GATHER_ELEMS:
            w = max(w, widths[t1])
            t1 += 1
        yield t0, t1, w
        t0 = t1


def sparse_attention_gather(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, cu_rows, positions,
                            topk_idx, block_size: int, sm_scale: float):
    """``sparse_attention_torch``'s result, reading only selected blocks (the CPU serving path).

    Rows of one request inside one query block form a tile; per KV head a tile reads the union of
    its rows' selected blocks once (a decode row is a tile of one, reading its own blocks), and each
    row attends through a mask of its own blocks and its causal limit. Attention runs in
    ``scaled_dot_product_attention`` in the cache dtype. Same arguments and result as
    ``sparse_attention_torch``.
    """
    rows, hq, d = q.shape
    out = torch.empty_like(q)
    if rows == 0:
        return out
    hkv, topk = k_cache.shape[1], topk_idx.shape[2]
    group = hq // hkv
    dev, dtype = q.device, k_cache.dtype
    tile_of_row, starts, lens, tile_req = _row_tiles(cu_rows.tolist(), positions, block_size)
    n_tiles, tile_rows = starts.shape[0], int(lens.max())
    tile_of_row, starts, lens, tile_req = (t.to(dev) for t in (tile_of_row, starts, lens, tile_req))
    nb = (int(seq_lens.max()) + block_size - 1) // block_size
    sel = topk_idx.long()
    sel = torch.where(sel < 0, nb, sel)  # padding -> a spare column
    # Union of each tile's selected blocks, per KV head: [hkv, n_tiles, width] (width = the largest union);
    # a run of tiles reads the first w columns, w its widest union.
    chosen = torch.zeros(hkv, n_tiles * (nb + 1), dtype=torch.bool, device=dev)
    chosen.scatter_(1, (tile_of_row[None, :, None] * (nb + 1) + sel).view(hkv, -1), True)
    chosen = chosen.view(hkv, n_tiles, nb + 1)[..., :nb]
    n_union = chosen.sum(-1)  # [hkv, n_tiles]
    width = max(1, int(n_union.max()))
    union = torch.sort(chosen.to(torch.uint8), dim=-1, descending=True, stable=True).indices[..., :width]
    union_ok = torch.arange(width, device=dev) < n_union[..., None]  # [hkv, n_tiles, width]
    # Rows of each tile ([n_tiles, tile_rows], padding rows repeat the tile's first row and are not written back).
    offs = torch.arange(tile_rows, device=dev)
    row_ok = offs[None] < lens[:, None]
    row_idx = torch.where(row_ok, starts[:, None] + offs[None], starts[:, None])
    row_pos = positions.long()[row_idx]  # [n_tiles, tile_rows]
    heads = torch.arange(hkv, device=dev)[:, None, None]
    tok = torch.arange(block_size, device=dev)
    for t0, t1, w in _tile_chunks(n_union.amax(0).clamp(min=1).tolist(), hq * tile_rows + 2 * hkv * d, block_size):
        nt, keys = t1 - t0, w * block_size
        blocks = union[:, t0:t1, :w]  # [hkv, nt, w]
        tok_pos = (blocks[..., None] * block_size + tok).view(hkv, nt, keys)  # request-relative token positions
        req = tile_req[t0:t1]
        tok_ok = union_ok[:, t0:t1, :w, None].expand(-1, -1, -1, block_size).reshape(hkv, nt, keys)
        tok_ok = tok_ok & (tok_pos < seq_lens.long()[req][None, :, None])
        slots = req_to_token[req_pool_indices.long()[req][None, :, None], tok_pos.clamp(max=req_to_token.shape[1] - 1)]
        slots = torch.where(tok_ok, slots.long(), 0)
        k = k_cache[slots, heads].view(hkv * nt, 1, keys, d)
        v = v_cache[slots, heads].view(hkv * nt, 1, keys, d)
        # Row r keeps union block j when j is among its own selected blocks, and tokens up to its position.
        r_idx = row_idx[t0:t1]  # [nt, tile_rows]
        own = sel[:, r_idx]  # [hkv, nt, tile_rows, topk]
        member = (blocks[:, :, None, :, None] == own[:, :, :, None, :]).any(-1)  # [hkv, nt, tile_rows, width]
        mask = member[..., None].expand(-1, -1, -1, -1, block_size).reshape(hkv, nt, tile_rows, keys)
        mask = mask & tok_ok[:, :, None] & (tok_pos[:, :, None] <= row_pos[t0:t1][None, :, :, None])
        qt = q[r_idx].view(nt, tile_rows, hkv, group, d).permute(2, 0, 1, 3, 4).reshape(hkv * nt, 1, -1, d)
        mask = mask[:, :, :, None].expand(-1, -1, -1, group, -1).reshape(hkv * nt, 1, -1, keys)
        o = F.scaled_dot_product_attention(qt.to(dtype), k, v, attn_mask=mask, scale=sm_scale)
        o = o.view(hkv, nt, tile_rows, group, d).permute(1, 2, 0, 3, 4).reshape(nt, tile_rows, hq, d)
        ok = row_ok[t0:t1]
        out[r_idx[ok]] = o[ok].to(q.dtype)
    return out


def sparse_attention_by_block(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, cu_rows, positions,
                              topk_idx, block_size: int, sm_scale: float):
    """``sparse_attention_torch``'s result in fp32 arithmetic, organised by key block (the CPU prefill path).

    Per chunk of rows and KV head, the (row, selected block) pairs are grouped by block: each block's keys
    and values are read once and multiplied by the query rows that picked it, so the work is that of the
    selected blocks only, however different the rows' lists are. A row's logits over its blocks are then
    softmaxed together. A block listed twice in a row counts once, as in ``sparse_attention_torch``.
    Same arguments and result as ``sparse_attention_torch``.
    """
    rows, hq, d = q.shape
    hkv, topk = k_cache.shape[1], topk_idx.shape[2]
    group = hq // hkv
    dev = q.device
    out = torch.empty_like(q)
    if rows == 0:
        return out
    request = torch.repeat_interleave(torch.arange(cu_rows.shape[0] - 1, device=dev), torch.diff(cu_rows.long()))
    nb = (int(seq_lens.max()) + block_size - 1) // block_size
    seq = seq_lens.long()
    pos = positions.long()
    tok = torch.arange(block_size, device=dev)
    step = max(1, _BY_BLOCK_ELEMS // (topk * group * block_size))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        n = r1 - r0
        local = torch.arange(n, device=dev)
        for h in range(hkv):
            sel = topk_idx[h, r0:r1].long()  # [n, topk]
            key = request[r0:r1, None] * nb + sel.clamp(min=0)  # (request, block) of each pair
            pair = (sel >= 0).flatten().nonzero().squeeze(1)  # pair id = row * topk + slot
            flat = (key * n + local[:, None]).flatten()[pair]
            flat, order = torch.sort(flat)
            pair = pair[order]
            first = torch.ones_like(flat, dtype=torch.bool)
            first[1:] = flat[1:] != flat[:-1]  # drops a block listed twice in one row
            pair, flat = pair[first], flat[first]
            blocks, counts = torch.unique_consecutive(flat // n, return_counts=True)
            req, blk = blocks // nb, blocks % nb
            tok_pos = blk[:, None] * block_size + tok  # [U, block_size]
            tok_ok = tok_pos < seq[req][:, None]
            slots = req_to_token[req_pool_indices.long()[req][:, None], tok_pos.clamp(max=req_to_token.shape[1] - 1)]
            slots = torch.where(tok_ok, slots.long(), 0)
            k = k_cache[slots, h].float()  # [U, block_size, d]
            v = v_cache[slots, h].float()
            # Pairs sorted by block: block u owns pairs ends[u-1]:ends[u]; rr = their rows (chunk-local).
            rr = pair // topk
            qp = q[r0 + rr, h * group : (h + 1) * group].float()  # [P, G, d]
            ends = list(itertools.accumulate(counts.tolist()))
            spans = list(zip([0, *ends[:-1]], ends))
            logits = torch.empty(rr.shape[0], group, block_size, device=dev)
            for u, (c0, c1) in enumerate(spans):
                torch.matmul(qp[c0:c1], k[u].t(), out=logits[c0:c1])
            u_of_pair = torch.repeat_interleave(torch.arange(len(spans), device=dev), counts)
            seen = tok_ok[u_of_pair] & (tok_pos[u_of_pair] <= pos[r0 + rr][:, None])  # [P, block_size]
            logits = logits.mul_(sm_scale).masked_fill_(~seen[:, None], float("-inf"))
            # Softmax over each row's pairs: row max, exp, row sum (scatter over rows).
            row_max = torch.full((n, group), float("-inf"), device=dev)
            row_max.scatter_reduce_(0, rr[:, None].expand(-1, group), logits.amax(-1), "amax")
            w = torch.exp(logits - row_max[rr][..., None])  # [P, G, block_size]
            row_sum = torch.zeros(n, group, device=dev).index_add_(0, rr, w.sum(-1))
            o = torch.empty(rr.shape[0], group, d, device=dev)
            for u, (c0, c1) in enumerate(spans):
                torch.matmul(w[c0:c1], v[u], out=o[c0:c1])
            oh = torch.zeros(n, group, d, device=dev).index_add_(0, rr, o) / row_sum[..., None]
            out[r0:r1, h * group : (h + 1) * group] = oh.to(q.dtype)
    return out


def sparse_attention_extend(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, prefix_lens, cu_seqlens_q,
                            max_seqlen_q: int, positions, topk_idx, block_size: int, sm_scale: float):
    """Prefill/extend rows (``[tokens, Hq, D]``) over their selected blocks."""
    if q.is_cuda:
        from sglang.kernels.ops.attention.minimax_sparse.prefill.topk_sparse import flash_prefill_with_gqa_share_sparse

        return flash_prefill_with_gqa_share_sparse(
            q=q, k_cache=k_cache, v_cache=v_cache, sink=None, req_to_token=req_to_token, slot_ids=req_pool_indices,
            topk_idx=topk_idx, block_size_q=1, block_size_k=block_size, cu_seqlens=cu_seqlens_q, seq_lens=seq_lens,
            prefix_lens=prefix_lens, max_seqlen_q=max_seqlen_q, sm_scale=sm_scale,
        )
    return sparse_attention_by_block(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, cu_seqlens_q,
                                     positions, topk_idx, block_size, sm_scale)


def sparse_attention_decode(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, topk_idx, block_size: int,
                            sm_scale: float):
    """One decode row per request (``q [batch, Hq, D]``); its position is ``seq_lens - 1``."""
    if q.is_cuda:
        from sglang.kernels.ops.attention.minimax_sparse.decode.topk_sparse import flash_decode_with_gqa_share_sparse

        return flash_decode_with_gqa_share_sparse(
            q=q, sink=None, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, seq_lens=seq_lens,
            slot_ids=req_pool_indices, block_size=block_size, topk_idx=topk_idx, sm_scale=sm_scale,
        )
    batch = q.shape[0]
    cu_rows = torch.arange(batch + 1, device=q.device)
    return sparse_attention_gather(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, cu_rows,
                                   seq_lens - 1, topk_idx, block_size, sm_scale)
