"""Main-head attention over the MSA-selected blocks.

On CUDA this calls SGLang's own Triton sparse-attention kernels (they take a block list per KV
head and query row); elsewhere (the CPU serving path) the torch kernels of
``m3_kernels.ops.attention.cpu``, which read only the selected blocks and are checked against the
masked whole-context reference beside them (``naive.sparse_attention_ref``). Block ids are
request-relative (block ``p`` = tokens ``p*block_size .. p*block_size + block_size - 1`` of the
request), -1 pads the end of a list.

SGLang's prefill kernel is ``triton.autotune``d over 9 (warps, stages) candidates on a key without the sequence
length, so each process keeps the pick of its first call, a server's 128-token warm-up. ``M3_SPARSE_PREFILL_CONFIG``
(``"WARPS,STAGES"``, e.g. ``"4,3"``) holds every server process to one candidate instead (the backend calls
``pin_prefill_from_env`` once at start-up; ``scripts/gpu/bench_sparse_prefill.py`` times them all at a model's
prefill shape).
"""

import functools
import logging
import os

from m3_kernels.ops.attention import sparse_attention_decode_cpu, sparse_attention_extend_cpu

PREFILL_CONFIG_ENV = "M3_SPARSE_PREFILL_CONFIG"
logger = logging.getLogger(__name__)


def prefill_autotuner():
    """The ``triton.runtime.Autotuner`` inside SGLang's sparse prefill kernel (under its ``heuristics``)."""
    from sglang.kernels.ops.attention.minimax_sparse.prefill import topk_sparse
    from triton.runtime.autotuner import Autotuner

    fn = topk_sparse._gqa_share_sparse_fwd_kernel
    while not isinstance(fn, Autotuner):
        if not hasattr(fn, "fn"):
            raise RuntimeError(f"{PREFILL_CONFIG_ENV}: this SGLang's sparse prefill kernel is not autotuned; unset it")
        fn = fn.fn
    return fn


def pin_prefill_config(spec: str | None, autotuner=None) -> tuple[int, int] | None:
    """Hold SGLang's sparse prefill kernel to the candidate ``spec`` names (``"WARPS,STAGES"``); None or ``""``
    gives the autotuner back all its candidates. Returns the (warps, stages) held, or None. ValueError names
    ``M3_SPARSE_PREFILL_CONFIG`` and the candidates when ``spec`` is none of them."""
    tuner = prefill_autotuner() if autotuner is None else autotuner
    if not hasattr(tuner, "m3_candidates"):
        tuner.m3_candidates = list(tuner.configs)
    candidates = {(c.num_warps, c.num_stages): c for c in tuner.m3_candidates}
    if not spec:
        tuner.configs = list(tuner.m3_candidates)
        tuner.cache.clear()  # the next call picks again
        return None
    try:
        warps, stages = (int(x) for x in spec.split(","))
    except ValueError:
        warps = stages = None
    if (warps, stages) not in candidates:
        raise ValueError(f"{PREFILL_CONFIG_ENV}={spec!r}: expected WARPS,STAGES, one of the kernel's candidates "
                         f"{', '.join(f'{w},{s}' for w, s in sorted(candidates))}")
    tuner.configs = [candidates[(warps, stages)]]
    tuner.cache.clear()  # a pick made before is not kept
    return warps, stages


@functools.cache
def pin_prefill_from_env() -> None:
    """``pin_prefill_config`` of ``M3_SPARSE_PREFILL_CONFIG``, once per process, logged; unset, SGLang's kernel is
    left as it is."""
    spec = os.environ.get(PREFILL_CONFIG_ENV)
    if spec:
        held = pin_prefill_config(spec)
        logger.info("sglang-m3: sparse prefill attention held to %d warps, %d stages (%s)", *held, PREFILL_CONFIG_ENV)


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
