"""Main-head attention over the MSA-selected blocks.

On CUDA this calls SGLang's own Triton sparse-attention kernels (they take a block list per KV
head and query row); elsewhere (the CPU serving path) the torch kernels of
``m3_kernels.ops.attention.cpu``, which read only the selected blocks and are checked against the
masked whole-context reference beside them (``naive.sparse_attention_ref``). Block ids are
request-relative (block ``p`` = tokens ``p*block_size .. p*block_size + block_size - 1`` of the
request), -1 pads the end of a list.
"""

from m3_kernels.ops.attention import sparse_attention_decode_cpu, sparse_attention_extend_cpu


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
    return sparse_attention_extend_cpu(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, cu_seqlens_q,
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
    return sparse_attention_decode_cpu(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, topk_idx,
                                       block_size, sm_scale)
