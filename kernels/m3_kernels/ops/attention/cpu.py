"""Main-head attention over MSA-selected blocks on the CPU (the serving path; ``naive.py`` is the reference).

Both entry points take ``naive.sparse_attention_ref``'s arguments and return its result in ``q``'s dtype;
attention runs in the cache's dtype (bf16 in a bf16 model, as SGLang's dense ``torch_native`` backend
does), in torch's flash attention kernel: logits and softmax in fp32, ``P @ V`` in the cache dtype.

Prefill/extend (``sparse_attention_extend_cpu``), four paths, all exact:

- dense runs: rows whose lists hold every block they can see (at most ``topk`` visible blocks: the start
  of every prompt) are plain causal attention over the request's prefix, one call per request;
- prefix tiles: the other rows of one (request, query block) form a tile; a tile that sees at most
  ``_PREFIX_MAX_BLOCKS`` blocks and whose lists (over its KV heads) cover at least ``_PREFIX_MIN_FRACTION`` of
  them attends the request's whole prefix up to its last row through a mask of each row's blocks and causal
  limit, ``_PREFIX_TILES_PER_CALL`` consecutive tiles and all KV heads in one call; the request's K/V are
  gathered once (shared with its dense run). With rows whose lists are unrelated (dummy weights) a tile's
  union is nearly every block it sees, so this is the union's work without gathering it per tile;
- union tiles: a tile whose lists span at most ``_UNION_MAX_BLOCKS`` blocks, but a small part of its prefix,
  reads that union once and attends through a mask of each row's blocks and causal limit (tiles of similar
  width share one call per KV head). Its work is the union's, up to about twice the selected blocks';
- split: a wider tile's rows split their lists into the own block (one causal call over all such tiles)
  and earlier blocks, whose (row, block) pairs are grouped by block: each block's keys attend to the rows
  that picked it in one call without a mask. Each call also returns the log-sum-exp of its logits per
  row and head, by which a row's partial results merge exactly (a softmax over the union of its blocks):
  the work of the selected blocks only, however different the rows' lists are, plus a gather of the
  rows' queries and a scatter of their partial results.

Decode (``sparse_attention_decode_cpu``): rows that pick every block they see in one masked call over
their whole contexts; the others in one call over their own blocks (each row's and KV head's ``topk`` blocks
gathered), its query heads of a KV head as the call's query rows.

Gathers go through ``index_select`` (advanced indexing gathers element-wise on the CPU, several times
slower). A row that sees no selected token gets zeros, as torch's flash kernel gives a fully masked row.
"""

import torch
import torch.nn.functional as F

_UNION_MAX_BLOCKS = 32  # a tile whose rows' lists span at most this many blocks (all KV heads) reads their union
_PREFIX_MAX_BLOCKS = 64  # a tile that sees at most this many blocks and whose union is at least
_PREFIX_MIN_FRACTION = 0.75  # this part of them reads its request's prefix through a mask,
_PREFIX_TILES_PER_CALL = 2  # consecutive such tiles per call (256 query rows: about 20% faster per row than 128)
_UNION_ELEMS = 1 << 24  # mask entries (tile x KV head x row x key) one call over tiles holds (32 MiB of bf16)
_PAIR_ELEMS = 1 << 25  # partial-output entries (pair x query head of a KV group x D) one chunk of rows holds
_FOLD_MAX_ROWS = 64  # _attend_dense: up to this many rows after position 0 fold a KV head's query heads into rows


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


def _request_kv(cache: torch.Tensor, token_slots: torch.Tensor, length: int) -> torch.Tensor:
    """``[Hkv, length, D]`` contiguous: the first ``length`` tokens of one request (``token_slots``: its row of
    ``req_to_token``) from ``cache [slots, Hkv, D]``, one row gather and one transpose copy."""
    return _rows(cache, token_slots[:length].long()).transpose(0, 1).contiguous()


def _attend_dense(q, k_req, v_req, pos, sm_scale: float):
    """``[n, Hq, D]`` in the cache dtype: rows ``q [n, Hq, D]`` at consecutive positions ``pos`` of one request
    (``k_req``/``v_req [Hkv, >= pos[-1] + 1, D]``: its tokens, ``_request_kv``) over every token up to their
    position, in one call (causal from position 0, else through a mask). Up to ``_FOLD_MAX_ROWS`` rows after
    position 0 go in as a KV head's query heads x rows (``enable_gqa`` with few rows per head is the slow case
    of torch's CPU kernel: 1 row over 4097 keys 9.4 ms, folded 1.1; 128 rows 38 and 35; a 2-core AMD EPYC)."""
    n, hq, d = q.shape
    hkv = k_req.shape[0]
    p0, p1 = int(pos[0]), int(pos[-1])
    k, v = k_req[None, :, : p1 + 1], v_req[None, :, : p1 + 1]  # [1, Hkv, L, D]
    q = q.to(k_req.dtype)
    mask = None if p0 == 0 else torch.arange(p1 + 1, device=q.device) <= pos[:, None]  # [n, L]
    if mask is None or n > _FOLD_MAX_ROWS:
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=sm_scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    group = hq // hkv
    qf = q.view(n, hkv, group, d).permute(1, 2, 0, 3).reshape(1, hkv, group * n, d)  # rows: (query head, row)
    o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask.repeat(group, 1), scale=sm_scale)
    return o.view(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


def _attend_prefix(q, k_req, v_req, pos, sel, block_size: int, sm_scale: float):
    """``[n, Hq, D]`` in the cache dtype: the rows ``q [n, Hq, D]`` of one request (positions ``pos``, distinct
    visible lists ``sel [Hkv, n, topk]``; in practice the rows of up to ``_PREFIX_TILES_PER_CALL`` consecutive
    tiles) over the request's whole prefix up to the last row (``k_req``/``v_req [Hkv, > max(pos), D]``,
    ``_request_kv``) through an additive mask of each row's blocks and causal limit: one call for all KV heads, no
    gather (for tiles whose union of lists is most of the prefix, the usual case with unrelated rows)."""
    n, hq, d = q.shape
    hkv = sel.shape[0]
    group = hq // hkv
    dtype, dev = k_req.dtype, q.device
    p_last = int(pos.max())
    last = p_last // block_size
    keys = p_last + 1
    member = torch.zeros(hkv, n, last + 2, dtype=torch.bool, device=dev)  # a spare column takes the -1 padding
    member.scatter_(2, torch.where(sel < 0, last + 1, sel), True)
    ninf = torch.full((), float("-inf"), dtype=dtype, device=dev)
    block_mask = torch.where(member[..., : last + 1], torch.zeros((), dtype=dtype, device=dev), ninf)
    mask = block_mask[..., None].expand(-1, -1, -1, block_size).reshape(hkv, n, -1)[..., :keys]
    start = int(pos.min()) // block_size * block_size  # from the first row's block on, keys after a row are hidden
    hidden = torch.arange(start, keys, device=dev)[None] > pos[:, None]  # [n, keys - start]
    mask[..., start:].masked_fill_(hidden[None], float("-inf"))
    qt = q.to(dtype).view(n, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    o = F.scaled_dot_product_attention(qt, k_req[:, None, :keys], v_req[:, None, :keys], attn_mask=mask[:, None],
                                       scale=sm_scale, enable_gqa=True)
    return o.permute(2, 0, 1, 3).reshape(n, hq, d)


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
    cu, pools, lens = cu_rows.tolist(), req_pool_indices.tolist(), seq_lens.tolist()
    n_req = len(cu) - 1
    sparse = torch.ones(rows, dtype=torch.bool, device=q.device)
    n_dense = [0] * n_req
    for b in range(n_req):
        r0, r1 = cu[b], cu[b + 1]
        n_dense[b] = _leading_dense_rows(full[r0:r1], pos[r0:r1]) if r1 > r0 else 0
        sparse[r0 : r0 + n_dense[b]] = False
    rest = sparse.nonzero().squeeze(1)
    hkv, topk = k_cache.shape[1], sel.shape[2]
    group = hq // hkv
    req_pool, seq = req_pool_indices.long(), seq_lens.long()
    if rest.numel():
        request = torch.repeat_interleave(torch.arange(n_req, device=q.device), torch.diff(cu_rows.long()))[rest]
        pos_r, own_r, sel_r = pos[rest], own[rest], sel[:, rest]
        # Tiles: the rows of one (request, query block); a tile whose lists span few blocks reads their union, the
        # whole prefix when that union is most of it.
        nb = int(own_r.max()) + 1
        tile_key, tile_of_row = torch.unique(request * nb + own_r, return_inverse=True)
        n_tiles = tile_key.shape[0]
        chosen = torch.zeros(hkv, n_tiles, nb + 1, dtype=torch.bool, device=q.device)
        flat = (tile_of_row[None, :, None] * (nb + 1) + torch.where(sel_r < 0, nb, sel_r)).view(hkv, -1)
        chosen.view(hkv, -1).scatter_(1, flat, True)
        union = chosen[..., :nb].any(0)  # [tiles, nb]: the blocks any KV head of the tile picked
        width = union.sum(-1)
        tile_req = torch.div(tile_key, nb, rounding_mode="floor")
        tile_own = (tile_key % nb).tolist()
        seen_blocks = tile_key % nb + 1
        prefix_tile = (seen_blocks <= _PREFIX_MAX_BLOCKS) & (width >= _PREFIX_MIN_FRACTION * seen_blocks)
        narrow_tile = (width <= _UNION_MAX_BLOCKS) & ~prefix_tile
        narrow = narrow_tile[tile_of_row]
        wide = ~(narrow | prefix_tile[tile_of_row])
        by_tile = torch.argsort(tile_of_row, stable=True)
        tile_end = torch.bincount(tile_of_row, minlength=n_tiles).cumsum(0).tolist()
        prefix_tiles = {}  # request -> its prefix tiles
        for t, b in zip(prefix_tile.nonzero().squeeze(1).tolist(), tile_req[prefix_tile].tolist()):
            prefix_tiles.setdefault(b, []).append(t)
    else:
        prefix_tiles, tile_own = {}, []
    # Per request: its dense run and its prefix tiles read the request's K/V, gathered once.
    for b in range(n_req):
        if not n_dense[b] and b not in prefix_tiles:
            continue
        k_req, v_req = (_request_kv(c, req_to_token[pools[b]], lens[b]) for c in (k_cache, v_cache))
        r0, n = cu[b], n_dense[b]
        if n:
            out[r0 : r0 + n] = _attend_dense(q[r0 : r0 + n], k_req, v_req, pos[r0 : r0 + n], sm_scale)
        for t0, t1 in _tile_runs(prefix_tiles.get(b, []), tile_own, _PREFIX_TILES_PER_CALL):
            r = by_tile[(tile_end[t0 - 1] if t0 else 0) : tile_end[t1 - 1]]
            out[rest[r]] = _attend_prefix(_rows(q, rest[r]), k_req, v_req, pos_r[r], sel_r[:, r], block_size,
                                          sm_scale).to(q.dtype)
    if rest.numel() == 0:
        return out
    pos, own, sel = pos_r, own_r, sel_r
    for tiles in _union_groups(narrow_tile, width, hkv * block_size * block_size):
        in_group = torch.full((n_tiles,), -1, dtype=torch.long, device=q.device)
        in_group[tiles] = torch.arange(tiles.numel(), device=q.device)
        r = (in_group[tile_of_row] >= 0).nonzero().squeeze(1)
        w = int(width[tiles].max())
        blocks = torch.sort(union[tiles].to(torch.uint8), dim=-1, descending=True, stable=True).indices[:, :w]
        out[rest[r]] = _attend_union(_rows(q, rest[r]), k_cache, v_cache, req_to_token, req_pool[tile_req[tiles]],
                                     seq[tile_req[tiles]], pos[r], sel[:, r], in_group[tile_of_row[r]],
                                     tile_key[tiles] % nb, blocks, width[tiles], block_size, sm_scale)
    wide = wide.nonzero().squeeze(1)
    step = max(1, _PAIR_ELEMS // (topk * group * d))
    for c0 in range(0, wide.numel(), step):
        r = wide[c0 : c0 + step]
        out[rest[r]] = _attend_split(_rows(q, rest[r]), k_cache, v_cache, req_to_token, req_pool, seq, request[r],
                                     pos[r], own[r], sel[:, r], block_size, sm_scale)
    return out


def _tile_runs(tiles: list[int], tile_own: list[int], most: int):
    """``(t0, t1)``: runs of at most ``most`` consecutive tile ids from ``tiles`` (ascending, one request's) whose
    query blocks ``tile_own[t]`` follow one another."""
    i = 0
    while i < len(tiles):
        j = i + 1
        while j < len(tiles) and j - i < most and tiles[j] == tiles[j - 1] + 1 and tile_own[tiles[j]] == tile_own[
                tiles[j - 1]] + 1:
            j += 1
        yield tiles[i], tiles[j - 1] + 1
        i = j


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


def _decode_selected(q, k_cache, v_cache, req_to_token, pool_rows, seq_lens, sel, block_size: int, sm_scale: float):
    """``[n, Hq, D]`` in the cache dtype: decode rows ``q [n, Hq, D]`` (``pool_rows``, ``seq_lens [n]``, position
    ``seq_lens - 1``) over their own blocks (distinct visible lists ``sel [Hkv, n, topk]``, -1 padded): per row and
    KV head the ``topk`` blocks' tokens gathered, one call with the KV heads as the batch's heads and a row's query
    heads of one KV head as its query rows, empty slots and tokens past the row masked."""
    n, hq, d = q.shape
    hkv = sel.shape[0]
    dev = q.device
    blocks = sel.permute(1, 0, 2)  # [n, Hkv, topk]
    tok = (blocks[..., None] * block_size + torch.arange(block_size, device=dev)).view(n, hkv, -1)  # positions
    seen = (blocks >= 0)[..., None].expand(-1, -1, -1, block_size).reshape(n, hkv, -1) & (tok < seq_lens[:, None, None])
    slots = req_to_token[pool_rows[:, None, None], tok.clamp(0, req_to_token.shape[1] - 1)].long()
    slots = torch.where(seen, slots, 0)
    heads = torch.arange(hkv, device=dev)[None, :, None]
    k, v = _head_rows(k_cache, slots, heads), _head_rows(v_cache, slots, heads)  # [n, Hkv, topk * bs, D]
    mask = torch.zeros(seen.shape, dtype=k_cache.dtype, device=dev).masked_fill_(~seen, float("-inf"))
    o = F.scaled_dot_product_attention(q.to(k_cache.dtype).view(n, hkv, hq // hkv, d), k, v, attn_mask=mask[:, :, None],
                                       scale=sm_scale)
    return o.reshape(n, hq, d)


def _decode_dense(q, k_cache, v_cache, req_to_token, pool_rows, seq_lens, sm_scale: float):
    """``[n, Hq, D]`` in the cache dtype: decode rows ``q [n, Hq, D]`` (``pool_rows``, ``seq_lens [n]``) over
    every token of their requests, in one call over the requests' slots padded to the longest (masked), a KV head's
    query heads as its query rows (query head ``h`` reads KV head ``h // (Hq / Hkv)``). That layout, not
    ``enable_gqa`` with one query row per head, is what torch's CPU kernel runs fast: 1 query x 16 heads over 4096
    bf16 keys of 4 KV heads took 14.7 ms that way against 1.2 ms as 4 rows x 4 heads (a 2-core AMD EPYC)."""
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    width = int(seq_lens.max())
    tok = torch.arange(width, device=q.device)
    slots = req_to_token[pool_rows[:, None], tok.clamp(max=req_to_token.shape[1] - 1)[None]].long()
    seen = tok[None] < seq_lens[:, None]  # [n, L]
    slots = torch.where(seen, slots, 0)
    k = _rows(k_cache, slots).transpose(1, 2)  # [n, Hkv, L, D]
    v = _rows(v_cache, slots).transpose(1, 2)
    mask = torch.zeros(seen.shape, dtype=k_cache.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
    o = F.scaled_dot_product_attention(q.to(k_cache.dtype).view(n, hkv, hq // hkv, d), k, v,
                                       attn_mask=mask[:, None, None], scale=sm_scale)
    return o.reshape(n, hq, -1)


def dense_attention_extend_cpu(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                               sm_scale: float):
    """Causal extend attention over whole contexts, for the dense layers: ``q [rows, Hq, D]`` holds each request's
    ``extend_lens`` new rows in turn, at positions ``prefix_lens .. prefix_lens + extend_lens - 1``;
    ``k_cache``/``v_cache [slots, Hkv, D]`` (``Hq`` a multiple of ``Hkv``) already hold the new tokens ->
    ``[rows, Hq, D]`` in ``q``'s dtype. Per request its K/V gathered once and one call for its new rows only
    (SGLang's torch_native backend pads the query to the whole sequence: a 128-token extend over a 4k prefix
    then costs a 4k causal prefill)."""
    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=q.dtype, device=q.device)
    r0 = 0
    for pool, prefix, n in zip(req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist()):
        if n:
            k_req, v_req = (_request_kv(c, req_to_token[pool], prefix + n) for c in (k_cache, v_cache))
            pos = torch.arange(prefix, prefix + n, device=q.device)
            out[r0 : r0 + n] = _attend_dense(q[r0 : r0 + n], k_req, v_req, pos, sm_scale)
        r0 += n
    return out


def dense_attention_decode_cpu(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, sm_scale: float):
    """Causal decode attention over whole contexts, for the dense layers: ``q [batch, Hq, D]`` (one row per request
    at position ``seq_lens - 1``), ``k_cache``/``v_cache [slots, Hkv, D]`` (``Hq`` a multiple of ``Hkv``),
    ``req_to_token [pool rows, max len]`` -> ``[batch, Hq, D]`` in ``q``'s dtype."""
    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=q.dtype, device=q.device)
    if q.shape[0]:
        out.copy_(_decode_dense(q, k_cache, v_cache, req_to_token, req_pool_indices.long(), seq_lens.long(), sm_scale))
    return out


def sparse_attention_decode_cpu(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, topk_idx,
                                block_size: int, sm_scale: float):
    """One decode row per request (``q [batch, Hq, D]``) at position ``seq_lens - 1``: rows whose lists hold every
    block they see (contexts of at most ``topk`` blocks) in one call over their whole contexts, the others in one
    call over their own blocks."""
    batch = q.shape[0]
    out = torch.empty_like(q)
    if batch == 0:
        return out
    seq = seq_lens.long()
    own = torch.div(seq - 1, block_size, rounding_mode="floor")
    sel = distinct_visible(topk_idx, own)
    full = ((sel >= 0).sum(-1) == own + 1).all(0)
    pools = req_pool_indices.long()
    rows = full.nonzero().squeeze(1)
    if rows.numel():
        out[rows] = _decode_dense(_rows(q, rows), k_cache, v_cache, req_to_token, pools[rows], seq[rows],
                                  sm_scale).to(q.dtype)
    rows = (~full).nonzero().squeeze(1)
    if rows.numel():
        out[rows] = _decode_selected(_rows(q, rows), k_cache, v_cache, req_to_token, pools[rows], seq[rows],
                                     sel[:, rows], block_size, sm_scale).to(q.dtype)
    return out
