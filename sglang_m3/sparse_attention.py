"""Main-head attention over the MSA-selected blocks.

On CUDA this calls SGLang's own Triton sparse-attention kernels (they take a block list per KV
head and query row); elsewhere (the CPU serving path) the torch kernels of
``m3_kernels.ops.attention.cpu``, which read only the selected blocks and are checked against the
masked whole-context reference beside them (``naive.sparse_attention_ref``). Block ids are
request-relative (block ``p`` = tokens ``p*block_size .. p*block_size + block_size - 1`` of the
request), -1 pads the end of a list.

SGLang's two sparse-attention kernels are ``triton.autotune``d over (warps, stages) candidates: prefill over 9 on a
key without the sequence length, so each process keeps the pick of its first call, a server's 128-token warm-up;
decode over 8 per batch-size bucket, picked during CUDA-graph capture (SGLang 0.5.23 launches its paged decode on
Hopper with a fixed 8 warps, 2 stages instead, which no variable here reaches). Candidates with different warps need
not round alike, so two servers of one model can differ in their last bits. ``M3_SPARSE_PREFILL_CONFIG`` and
``M3_SPARSE_DECODE_CONFIG`` (``"WARPS,STAGES"``, e.g. ``"4,3"``) hold every server process to one candidate instead
(the backend calls ``pin_from_env`` once at start-up; ``lab/gpu/bench_sparse_prefill.py`` and
``lab/gpu/bench_sparse_decode.py`` time them all at a model's shapes).
"""

import functools
import importlib
import logging
import os

from m3_kernels.ops.attention import sparse_attention_decode_cpu, sparse_attention_extend_cpu

PREFILL_CONFIG_ENV = "M3_SPARSE_PREFILL_CONFIG"
DECODE_CONFIG_ENV = "M3_SPARSE_DECODE_CONFIG"
_SPARSE = "sglang.kernels.ops.attention.minimax_sparse"
# which kernel: (the variable that holds it, SGLang's module, the autotuned kernel in it)
KERNELS = {
    "prefill": (PREFILL_CONFIG_ENV, f"{_SPARSE}.prefill.topk_sparse", "_gqa_share_sparse_fwd_kernel"),
    "decode": (DECODE_CONFIG_ENV, f"{_SPARSE}.decode.topk_sparse", "_gqa_share_sparse_decode_kernel"),
}
logger = logging.getLogger(__name__)


def autotuner(which: str):
    """The ``triton.runtime.Autotuner`` inside SGLang's sparse ``which`` ("prefill" or "decode") kernel, under its
    ``heuristics``."""
    from triton.runtime.autotuner import Autotuner

    env, module, name = KERNELS[which]
    fn = getattr(importlib.import_module(module), name)
    while not isinstance(fn, Autotuner):
        if not hasattr(fn, "fn"):
            raise RuntimeError(f"{env}: this SGLang's sparse {which} kernel is not autotuned; unset it")
        fn = fn.fn
    return fn


def _candidate(which: str, spec: str, tuner):
    """The candidate of ``tuner`` that ``spec`` ("WARPS,STAGES") names; ValueError naming the kernel's variable
    (``KERNELS``) and its candidates when it names none."""
    if not hasattr(tuner, "m3_candidates"):
        tuner.m3_candidates = list(tuner.configs)  # all of them, before any hold
    candidates = {(c.num_warps, c.num_stages): c for c in tuner.m3_candidates}
    try:
        warps, stages = (int(x) for x in spec.split(","))
    except ValueError:
        warps = stages = None
    if (warps, stages) not in candidates:
        raise ValueError(f"{KERNELS[which][0]}={spec!r}: expected WARPS,STAGES, one of the kernel's candidates "
                         f"{', '.join(f'{w},{s}' for w, s in sorted(candidates))}")
    return candidates[(warps, stages)]


def pin_config(which: str, spec: str | None, tuner=None) -> tuple[int, int] | None:
    """Hold SGLang's sparse ``which`` kernel to the candidate ``spec`` names (``"WARPS,STAGES"``); None or ``""``
    gives the autotuner back all its candidates. Returns the (warps, stages) held, or None. A ``spec`` that names no
    candidate raises ValueError (``_candidate``) and leaves the kernel as it was."""
    tuner = autotuner(which) if tuner is None else tuner
    if not spec:
        tuner.configs = list(getattr(tuner, "m3_candidates", tuner.configs))
        tuner.cache.clear()  # the next call picks again
        return None
    config = _candidate(which, spec, tuner)
    tuner.configs = [config]
    tuner.cache.clear()  # a pick made before is not kept
    return config.num_warps, config.num_stages


@functools.cache
def pin_from_env() -> None:
    """``pin_config`` of each kernel whose variable is set, once per process, logged; a kernel whose variable is
    unset is left as SGLang has it (not even looked up). Both variables are checked before either kernel is held."""
    specs = {which: spec for which, (env, _, _) in KERNELS.items() if (spec := os.environ.get(env))}
    tuners = {which: autotuner(which) for which in specs}
    for which, spec in specs.items():
        _candidate(which, spec, tuners[which])
    for which, spec in specs.items():
        held = pin_config(which, spec, tuners[which])
        logger.info("sglang-m3: sparse %s attention held to %d warps, %d stages (%s)", which, *held, KERNELS[which][0])
    if "decode" in specs and hasattr(importlib.import_module(KERNELS["decode"][1]), "_gqa_share_sparse_decode_pinned"):
        logger.warning("sglang-m3: this SGLang launches its paged decode attention on Hopper with a fixed config of "
                       "its own, not the autotuned kernel: %s holds only its other launches", DECODE_CONFIG_ENV)


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
