"""Main-head attention over the MSA-selected blocks.

On CUDA this calls SGLang's own Triton sparse-attention kernels (they take a block list per KV
head and query row); elsewhere it runs ``sparse_attention_torch``, a plain torch version written
for clarity (the CPU serving path). Block ids are request-relative (block ``p`` = tokens
``p*block_size .. p*block_size + block_size - 1`` of the request), -1 pads the end of a list.
"""

import torch

_ROW_CHUNK = 256  # query rows attended at once (bounds the [Hkv, G, rows, L] logits)


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
    return sparse_attention_torch(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, cu_seqlens_q,
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
    return sparse_attention_torch(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, cu_rows,
                                  seq_lens - 1, topk_idx, block_size, sm_scale)
