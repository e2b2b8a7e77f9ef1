"""Torch reference of main-head attention over MSA-selected blocks: every query row against its
whole context, masked. Clear before clever; compute in float64 unless told otherwise.

Semantics. Block ids are request-relative (block ``p`` = tokens ``p*block_size .. p*block_size +
block_size - 1`` of the request), -1 pads the end of a list, a block listed twice counts once. Query
head ``h`` of a row at position ``pos`` attends, with softmax weights ``exp(sm_scale * q.k_t)``, to the
tokens ``t <= pos`` whose block is in the list of KV head ``h // (Hq // Hkv)``; blocks past the row
hold no visible token. A row that sees no token at all gets zeros (as torch's flash attention
gives for a fully masked row).
"""

import torch

_ROW_CHUNK = 256  # query rows attended at once (bounds the [Hkv, G, rows, L] logits)


def sparse_attention_ref(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, cu_rows, positions, topk_idx,
                         block_size: int, sm_scale: float, dtype=torch.float64):
    """Attention of each query row over the causally visible tokens of its selected blocks.

    Args:
        q: ``[rows, Hq, D]``; rows of request ``b`` are ``cu_rows[b]:cu_rows[b+1]``.
        k_cache, v_cache: ``[slots, Hkv, D]`` main cache; ``req_to_token[req_pool_indices[b], t]``
            is the slot of token ``t`` of request ``b``.
        seq_lens: ``[batch]`` tokens of each request (all new tokens included).
        cu_rows: int ``[batch + 1]`` row offsets.
        positions: ``[rows]`` 0-based position of each query row; it sees tokens ``t <= position``.
        topk_idx: int ``[Hkv, rows, topk]`` selected block ids, -1 padded; query head ``h`` reads
            the list of KV head ``h // (Hq // Hkv)``.
        dtype: compute and output dtype (float64 for the oracle).
    Returns:
        ``[rows, Hq, D]`` in ``dtype``.
    """
    rows, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    out = torch.empty(rows, hq, d, dtype=dtype, device=q.device)
    cu = cu_rows.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        r0, r1 = cu[b], cu[b + 1]
        if r1 <= r0:
            continue
        slots = req_to_token[req_pool_indices[b], :length].long()
        k = k_cache[slots].to(dtype).transpose(0, 1)  # [Hkv, L, D]
        v = v_cache[slots].to(dtype).transpose(0, 1)
        n_blocks = (length + block_size - 1) // block_size
        token_block = torch.arange(length, device=q.device) // block_size
        token_pos = torch.arange(length, device=q.device)
        for c0 in range(r0, r1, _ROW_CHUNK):
            c1 = min(c0 + _ROW_CHUNK, r1)
            sel = topk_idx[:, c0:c1].long()
            sel = torch.where((sel < 0) | (sel >= n_blocks), n_blocks, sel)  # padding -> a spare column dropped below
            chosen = torch.zeros(hkv, c1 - c0, n_blocks + 1, dtype=torch.bool, device=q.device)
            chosen.scatter_(2, sel, True)
            visible = chosen[..., :n_blocks][..., token_block]  # [Hkv, R, L]
            visible &= token_pos[None, None, :] <= positions[c0:c1, None].long()
            qc = q[c0:c1].to(dtype).reshape(c1 - c0, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, R, D]
            logits = torch.matmul(qc, k.transpose(1, 2).unsqueeze(1)) * sm_scale  # [Hkv, G, R, L]
            logits = logits.masked_fill(~visible[:, None], float("-inf"))
            o = torch.matmul(torch.softmax(logits, dim=-1), v.unsqueeze(1))  # [Hkv, G, R, D]
            o = o.masked_fill(~visible.any(-1)[:, None, :, None], 0.0)  # no visible token: zeros, not NaN
            out[c0:c1] = o.permute(2, 0, 1, 3).reshape(c1 - c0, hq, d)
    return out
