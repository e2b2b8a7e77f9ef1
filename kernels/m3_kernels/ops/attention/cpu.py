"""Main-head attention over MSA-selected blocks on the CPU (the serving path; ``naive.py`` is the reference).

Both entry points take ``naive.sparse_attention_ref``'s arguments and return its result in ``q``'s dtype;
attention runs in the cache's dtype (bf16 in a bf16 model, as SGLang's dense ``torch_native`` backend
does), in torch's flash attention kernel: logits and softmax in fp32, ``P @ V`` in the cache dtype.

Prefill/extend (``sparse_attention_extend_cpu``), three paths, all exact:

- dense runs: rows whose lists hold every block they can see (at most ``topk`` visible blocks: the start
  of every prompt) are plain causal attention over the request's prefix, one call per request;
- union tiles: the other rows of one (request, query block) form a tile; a tile whose lists span at most
  ``_UNION_MAX_BLOCKS`` blocks (over its KV heads) reads that union once and attends through a mask of
  each row's blocks and causal limit (tiles of similar width share one call per KV head). Its work is the
  union's, up to about twice the selected blocks': cheaper than the split below at such widths;
- split: a wider tile's rows split their lists into the own block (one causal call over all such tiles)
  and earlier blocks, whose (row, block) pairs are grouped by block: each block's keys attend to the rows
  that picked it in one call without a mask. Each call also returns the log-sum-exp of its logits per
  row and head, by which a row's partial results merge exactly (a softmax over the union of its blocks):
  the work of the selected blocks only, however different the rows' lists are, plus a gather of the
  rows' queries and a scatter of their partial results.

Decode (``sparse_attention_decode_cpu``): rows that pick every block they see in one masked call over
their whole contexts; the others read their own blocks (gathered) through a mask.

Gathers go through ``index_select`` (advanced indexing gathers element-wise on the CPU, several times
slower). A row that sees no selected token gets zeros, as torch's flash kernel gives a fully masked row.
"""

import torch
import torch.nn.functional as F

_UNION_MAX_BLOCKS = 32  # a tile whose rows' lists span at most this many blocks (all KV heads) reads their union
_UNION_ELEMS = 1 << 24  # mask entries (tile x KV head x row x key) one call over tiles holds (32 MiB of bf16)
_PAIR_ELEMS = 1 << 25  # partial-output entries (pair x query head of a KV group x D) one chunk of rows holds
_GATHER_ELEMS = 1 << 23  # mask entries (query row x head x key) one tile chunk of the decode gather holds


def _attend(q, k, v, sm_scale: float, causal: bool):
    """Flash attention and its log-sum-exp: ``q [B, H, Lq, D]``, ``k``/``v [B, H, Lk, D]`` ->
    ``(out [B, H, Lq, D]`` in q's dtype, ``lse`` fp32 ``[B, H, Lq])``; ``causal`` aligns row ``i`` with key ``i``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=sm_scale)


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for an int64 ``index`` of any shape over ``x``'s first dim, by ``index_select`` (several
    times faster on the CPU than advanced indexing, which gathers element-wise)."""
    return x.index_select(0, index.flatten()).view(*index.shape, *x.shape[1:])


def _head_rows(cache: torch.Tensor, slots: torch.Tensor, head: torch.Tensor | int) -> torch.Tensor:
    """``cache[slots, head]`` (``cache [slots, Hkv, D]``; ``head`` an int or a tensor broadcasting with ``slots``)
    as one row gather over the ``[slots * Hkv, D]`` view."""
    hkv, d = cache.shape[1], cache.shape[2]
    return _rows(cache.view(-1, d), slots * hkv + head)


def distinct_visible(topk_idx: torch.Tensor, own_block: torch.Tensor) -> torch.Tensor:
    """int64 ``[Hkv, rows, topk]``: each row's list sorted, with -1 for padding, blocks past the row's own
    block ``own_block [rows]`` and repeats (so each visible block appears once)."""
    sel = topk_idx.long()
    sel = torch.where((sel >= 0) & (sel <= own_block[None, :, None]), sel, -1).sort(dim=-1).values
    repeat = torch.zeros_like(sel, dtype=torch.bool)
    repeat[..., 1:] = sel[..., 1:] == sel[..., :-1]
    return sel.masked_fill_(repeat, -1)


def _leading_dense_rows(full: torch.Tensor, pos: torch.Tensor) -> int:
    """Rows at the start of a request that pick every block they see, at consecutive positions."""
    ok = full.clone()
    ok[1:] &= pos[1:] == pos[:-1] + 1
    bad = (~ok).nonzero()
    return int(bad[0]) if bad.numel() else ok.numel()


def _block_slots(req_to_token, pool_rows, blocks, block_size: int, seq_lens=None):
    """int64 ``[n, block_size]`` cache slots of ``blocks [n]`` of the requests in ``req_to_token`` rows
    ``pool_rows [n]``; tokens at or past ``seq_lens [n]`` (when given) read slot 0."""
    tok = blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)
    slots = req_to_token[pool_rows[:, None], tok.clamp(max=req_to_token.shape[1] - 1)].long()
    return slots if seq_lens is None else torch.where(tok < seq_lens[:, None], slots, 0)


def _attend_dense(q, k_cache, v_cache, token_slots, pos, sm_scale: float):
    """``[n, Hq, D]`` in the cache dtype: rows ``q [n, Hq, D]`` at consecutive positions ``pos`` of one request
    (``token_slots``: its row of ``req_to_token``) over every token up to their position, in one call (causal
    from position 0, else through a mask)."""
    p0, p1 = int(pos[0]), int(pos[-1])
    slots = token_slots[: p1 + 1].long()
    k = _rows(k_cache, slots).transpose(0, 1)[None]  # [1, Hkv, L, D]
    v = _rows(v_cache, slots).transpose(0, 1)[None]
    mask = None if p0 == 0 else torch.arange(p1 + 1, device=q.device) <= pos[:, None]
    o = F.scaled_dot_product_attention(q.to(k_cache.dtype).transpose(0, 1)[None], k, v, attn_mask=mask,
                                       is_causal=p0 == 0, scale=sm_scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def sparse_attention_extend_cpu(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, cu_rows, positions,
                                topk_idx, block_size: int, sm_scale: float):
    """Prefill/extend rows over their selected blocks (see the module docstring); arguments and result
    as ``naive.sparse_attention_ref`` (the result in ``q``'s dtype)."""
    rows, hq, d = q.shape
    out = torch.empty_like(q)
    if rows == 0:
        return out
    pos = positions.long()
    own = torch.div(pos, block_size, rounding_mode="floor")
    sel = distinct_visible(topk_idx, own)
    full = ((sel >= 0).sum(-1) == own + 1).all(0)  # [rows]: every head picked every visible block
    cu, pools = cu_rows.tolist(), req_pool_indices.tolist()
    sparse = torch.ones(rows, dtype=torch.bool, device=q.device)
    for b in range(len(cu) - 1):
        r0, r1 = cu[b], cu[b + 1]
        n = _leading_dense_rows(full[r0:r1], pos[r0:r1]) if r1 > r0 else 0
        if n:
            out[r0 : r0 + n] = _attend_dense(q[r0 : r0 + n], k_cache, v_cache, req_to_token[pools[b]], pos[r0 : r0 + n],
                                             sm_scale)
            sparse[r0 : r0 + n] = False
    rest = sparse.nonzero().squeeze(1)
    if rest.numel() == 0:
        return out
    hkv, topk = k_cache.shape[1], sel.shape[2]
    group = hq // hkv
    request = torch.repeat_interleave(torch.arange(len(cu) - 1, device=q.device), torch.diff(cu_rows.long()))[rest]
    pos, own, sel = pos[rest], own[rest], sel[:, rest]
    req_pool, seq = req_pool_indices.long(), seq_lens.long()
    # Tiles: the rows of one (request, query block); a tile whose lists span few blocks reads their union.
    nb = int(own.max()) + 1
    tile_key, tile_of_row = torch.unique(request * nb + own, return_inverse=True)
    n_tiles = tile_key.shape[0]
    chosen = torch.zeros(hkv, n_tiles, nb + 1, dtype=torch.bool, device=q.device)
    flat = (tile_of_row[None, :, None] * (nb + 1) + torch.where(sel < 0, nb, sel)).view(hkv, -1)
    chosen.view(hkv, -1).scatter_(1, flat, True)
    union = chosen[..., :nb].any(0)  # [tiles, nb]: the blocks any KV head of the tile picked
    width = union.sum(-1)
    narrow_tile = width <= _UNION_MAX_BLOCKS
    narrow = narrow_tile[tile_of_row]
    tile_req = torch.div(tile_key, nb, rounding_mode="floor")
    for tiles in _union_groups(narrow_tile, width, hkv * block_size * block_size):
        in_group = torch.full((n_tiles,), -1, dtype=torch.long, device=q.device)
        in_group[tiles] = torch.arange(tiles.numel(), device=q.device)
        r = (in_group[tile_of_row] >= 0).nonzero().squeeze(1)
        w = int(width[tiles].max())
        blocks = torch.sort(union[tiles].to(torch.uint8), dim=-1, descending=True, stable=True).indices[:, :w]
        out[rest[r]] = _attend_union(_rows(q, rest[r]), k_cache, v_cache, req_to_token, req_pool[tile_req[tiles]],
                                     seq[tile_req[tiles]], pos[r], sel[:, r], in_group[tile_of_row[r]],
                                     tile_key[tiles] % nb, blocks, width[tiles], block_size, sm_scale)
    wide = (~narrow).nonzero().squeeze(1)
    step = max(1, _PAIR_ELEMS // (topk * group * d))
    for c0 in range(0, wide.numel(), step):
        r = wide[c0 : c0 + step]
        out[rest[r]] = _attend_split(_rows(q, rest[r]), k_cache, v_cache, req_to_token, req_pool, seq, request[r],
                                     pos[r], own[r], sel[:, r], block_size, sm_scale)
    return out


def _union_groups(narrow: torch.Tensor, width: torch.Tensor, elems_per_block: int):
    """int64 tensors of tile ids: the ``narrow`` tiles in order of union ``width`` (blocks), in runs whose widths
    lie within a quarter of the run's first (its calls pad every tile to the widest) and whose masks
    (``elems_per_block`` entries per tile and block) fit ``_UNION_ELEMS``."""
    ids = narrow.nonzero().squeeze(1)
    ids = ids[torch.argsort(width[ids], stable=True)]
    widths = width[ids].tolist()
    i = 0
    while i < len(widths):
        j = i + 1
        while (j < len(widths) and widths[j] <= widths[i] + widths[i] // 4
               and (j + 1 - i) * max(widths[j], 1) * elems_per_block <= _UNION_ELEMS):
            j += 1
        yield ids[i:j]
        i = j


def _attend_union(q, k_cache, v_cache, req_to_token, pool_rows, seq_lens, pos, sel, tile, own_block, blocks, n_blocks,
                  block_size: int, sm_scale: float):
    """``[n, Hq, D]`` in the cache dtype: rows ``q [n, Hq, D]`` of ``T`` tiles (``tile [n]`` in ``0..T-1``, ``pos``,
    distinct visible lists ``sel [Hkv, n, topk]``) against the union of their tile's lists over the KV heads
    (``blocks [T, W]``, the first ``n_blocks [T]`` of each row valid; tile ``t`` holds query block ``own_block[t]``
    of the request in ``req_to_token`` row ``pool_rows[t]``, ``seq_lens[t]`` tokens long). One call: tiles padded
    to ``block_size`` rows and ``W`` blocks, each (tile, KV head) a batch entry whose mask keeps a row's own blocks
    up to its position."""
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    dtype, dev = k_cache.dtype, q.device
    n_tiles, w = blocks.shape
    keys = w * block_size
    tok = torch.arange(block_size, device=dev)
    at = tile * block_size + pos % block_size  # each row's place in the padded tiles
    qt = torch.zeros(n_tiles * block_size, hq, d, dtype=dtype, device=dev).index_copy_(0, at, q.to(dtype))
    qt = qt.view(n_tiles, block_size, hkv, group, d)
    tok_pos = (blocks[:, :, None] * block_size + tok).view(n_tiles, keys)  # request-relative positions
    slots = req_to_token[pool_rows[:, None], torch.minimum(tok_pos, seq_lens[:, None] - 1)].long()
    k, v = _rows(k_cache, slots), _rows(v_cache, slots)  # [T, keys, Hkv, D]
    valid = torch.arange(w, device=dev) < n_blocks[:, None]  # [T, W]
    member = (sel[:, :, :, None] == blocks[tile][None, :, None, :]).any(2) & valid[tile][None]  # [Hkv, n, W]
    seen = torch.zeros(n_tiles * block_size, hkv, w, dtype=torch.bool, device=dev)
    seen.index_copy_(0, at, member.permute(1, 0, 2))
    seen = seen.view(n_tiles, block_size, hkv, w, 1).expand(-1, -1, -1, -1, block_size).reshape(n_tiles, block_size,
                                                                                                hkv, keys)
    row_pos = own_block[:, None] * block_size + tok  # [T, bs]: position of each padded row
    seen = seen & (tok_pos[:, None, :] <= row_pos[:, :, None])[:, :, None]
    zero, ninf = (torch.full((), x, dtype=dtype, device=dev) for x in (0.0, float("-inf")))
    mask = torch.where(seen, zero, ninf)  # [T, bs, Hkv, keys], additive
    out = torch.empty(n_tiles, block_size, hkv, group, d, dtype=dtype, device=dev)
    for h in range(hkv):  # strided views of the gathered rows: no copies of K, V or the mask
        o = F.scaled_dot_product_attention(qt[:, :, h].transpose(1, 2), k[:, None, :, h], v[:, None, :, h],
                                           attn_mask=mask[:, None, :, h], scale=sm_scale, enable_gqa=True)
        out[:, :, h] = o.transpose(1, 2)  # o: [T, G, bs, D]
    return _rows(out.view(n_tiles * block_size, hq, d), at)


def _attend_split(q, k_cache, v_cache, req_to_token, req_pool, seq_lens, request, pos, own, sel, block_size: int,
                  sm_scale: float):
    """``[n, Hq, D]`` in the cache dtype: rows ``q [n, Hq, D]`` (their ``request``, ``pos``, ``own`` block and
    distinct visible lists ``sel [Hkv, n, topk]``) over their own blocks (one causal call over all tiles) and
    earlier blocks (one call per KV head and block), merged by log-sum-exp."""
    n, hq, d = q.shape
    hkv, topk = k_cache.shape[1], sel.shape[2]
    group = hq // hkv
    dtype, dev = k_cache.dtype, q.device
    q = q.to(dtype)
    nb = int(own.max()) + 1
    # Own blocks: tiles of rows of one (request, block), padded to block_size rows at positions block_start + i.
    tile_key, tile_of_row = torch.unique(request * nb + own, return_inverse=True)
    n_tiles = tile_key.shape[0]
    at = tile_of_row * block_size + pos % block_size  # each row's place in the padded tiles
    qt = q.new_zeros(n_tiles * block_size, hq, d)
    qt.index_copy_(0, at, q)
    treq = torch.div(tile_key, nb, rounding_mode="floor")
    slots = _block_slots(req_to_token, req_pool[treq], tile_key % nb, block_size, seq_lens[treq])  # [T, bs]
    kt = _rows(k_cache, slots).transpose(1, 2).repeat_interleave(group, dim=1)  # [T, Hq, bs, D]
    vt = _rows(v_cache, slots).transpose(1, 2).repeat_interleave(group, dim=1)
    o_own, lse_own = _attend(qt.view(n_tiles, block_size, hq, d).transpose(1, 2), kt, vt, sm_scale, causal=True)
    off = pos % block_size
    o_own = o_own.view(n_tiles, hkv, group, block_size, d)
    lse_own = lse_own.view(n_tiles, hkv, group, block_size)
    # Partial results of each (row, list slot): [n * topk, G, D] and their log-sum-exp [n * topk, G], merged by
    # a softmax over the slots.
    part = torch.empty(n * topk, group, d, dtype=dtype, device=dev)
    part_lse = torch.empty(n * topk, group, device=dev)
    out = torch.empty(n, hkv, group, d, dtype=dtype, device=dev)
    qg = q.view(n, hkv, group, d)
    for h in range(hkv):
        blk = sel[h]  # [n, topk]
        part_lse.fill_(float("-inf"))
        part.index_fill_(0, (blk < 0).flatten().nonzero().squeeze(1), 0.0)  # empty slots: weight 0 times 0
        row, slot = (blk == own[:, None]).nonzero(as_tuple=True)
        part.index_copy_(0, row * topk + slot, o_own[tile_of_row[row], h, :, off[row]])
        part_lse.index_copy_(0, row * topk + slot, lse_own[tile_of_row[row], h, :, off[row]])
        row, slot = ((blk >= 0) & (blk < own[:, None])).nonzero(as_tuple=True)
        key = request[row] * nb + blk[row, slot]
        order = torch.argsort(key, stable=True)  # rows ascending inside a block: increasing writes
        row, slot, key = row[order], slot[order], key[order]
        keys, counts = torch.unique_consecutive(key, return_counts=True)
        greq = torch.div(keys, nb, rounding_mode="floor")
        gslots = _block_slots(req_to_token, req_pool[greq], keys % nb, block_size)  # earlier blocks: all tokens exist
        kg, vg = _head_rows(k_cache, gslots, h), _head_rows(v_cache, gslots, h)  # [U, bs, D]
        qh = qg[:, h].index_select(0, row)  # [P, G, D], pairs grouped by block
        at_part = row * topk + slot
        c0 = 0
        for u, c in enumerate(counts.tolist()):
            o_u, lse_u = _attend(qh[c0 : c0 + c].view(1, 1, c * group, d), kg[u][None, None], vg[u][None, None],
                                 sm_scale, causal=False)
            part.index_copy_(0, at_part[c0 : c0 + c], o_u.view(c, group, d))
            part_lse.index_copy_(0, at_part[c0 : c0 + c], lse_u.view(c, group))
            c0 += c
        # out[r, g] = sum_s w[r, s, g] part[r, s, g]: one [G, topk] x [topk, G * D] product per row, of which
        # the G diagonal [D] blocks are kept (the products off the diagonal are cheap next to reading part).
        lse = part_lse.view(n, topk, group)
        w = torch.softmax(lse, dim=1).masked_fill_(torch.isneginf(lse).all(1, keepdim=True), 0.0)  # no token: zeros
        w = w.to(dtype).transpose(1, 2)  # [n, G, topk]
        both = torch.bmm(w, part.view(n, topk, group * d)).view(n, group, group, d)
        out[:, h] = both.diagonal(dim1=1, dim2=2).transpose(1, 2)
    return out.view(n, hq, d)


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


def sparse_attention_gather_cpu(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, cu_rows, positions,
                                topk_idx, block_size: int, sm_scale: float):
    """``naive.sparse_attention_ref``'s result, reading only selected blocks through a mask (the decode path).

    Rows of one request inside one query block form a tile; per KV head a tile reads the union of
    its rows' selected blocks once (a decode row is a tile of one, reading its own blocks), and each
    row attends through a mask of its own blocks and its causal limit. Attention runs in
    ``scaled_dot_product_attention`` in the cache dtype.
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
    sel = torch.where((sel < 0) | (sel >= nb), nb, sel)  # padding -> a spare column
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
        k = _head_rows(k_cache, slots, heads).view(hkv * nt, 1, keys, d)
        v = _head_rows(v_cache, slots, heads).view(hkv * nt, 1, keys, d)
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


def _decode_dense(q, k_cache, v_cache, req_to_token, pool_rows, seq_lens, sm_scale: float):
    """``[n, Hq, D]`` in the cache dtype: decode rows ``q [n, Hq, D]`` (``pool_rows``, ``seq_lens [n]``) over
    every token of their requests, in one call over the requests' slots padded to the longest (masked)."""
    width = int(seq_lens.max())
    tok = torch.arange(width, device=q.device)
    slots = req_to_token[pool_rows[:, None], tok.clamp(max=req_to_token.shape[1] - 1)[None]].long()
    seen = tok[None] < seq_lens[:, None]  # [n, L]
    slots = torch.where(seen, slots, 0)
    k = _rows(k_cache, slots).transpose(1, 2)  # [n, Hkv, L, D]
    v = _rows(v_cache, slots).transpose(1, 2)
    mask = torch.zeros(seen.shape, dtype=k_cache.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
    o = F.scaled_dot_product_attention(q.to(k_cache.dtype)[:, :, None], k, v, attn_mask=mask[:, None, None],
                                       scale=sm_scale, enable_gqa=True)
    return o[:, :, 0]


def sparse_attention_decode_cpu(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, topk_idx,
                                block_size: int, sm_scale: float):
    """One decode row per request (``q [batch, Hq, D]``) at position ``seq_lens - 1``: rows whose lists hold every
    block they see (contexts of at most ``topk`` blocks) in one call over their whole contexts, the others through
    ``sparse_attention_gather_cpu``."""
    batch = q.shape[0]
    out = torch.empty_like(q)
    if batch == 0:
        return out
    seq = seq_lens.long()
    own = torch.div(seq - 1, block_size, rounding_mode="floor")
    full = ((distinct_visible(topk_idx, own) >= 0).sum(-1) == own + 1).all(0)
    pools = req_pool_indices.long()
    rows = full.nonzero().squeeze(1)
    if rows.numel():
        out[rows] = _decode_dense(_rows(q, rows), k_cache, v_cache, req_to_token, pools[rows], seq[rows],
                                  sm_scale).to(q.dtype)
    rows = (~full).nonzero().squeeze(1)
    if rows.numel():
        cu_rows = torch.arange(rows.numel() + 1, device=q.device)
        out[rows] = sparse_attention_gather_cpu(_rows(q, rows), k_cache, v_cache, req_to_token, pools[rows], seq[rows],
                                                cu_rows, seq[rows] - 1, topk_idx[:, rows], block_size, sm_scale)
    return out
