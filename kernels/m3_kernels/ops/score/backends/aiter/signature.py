"""The call signature of aiter's MXFP4 decode scorer as documented by its pull request, kept so a
GPU-free test can bind our call to it when aiter is not installed.

Source: ROCm/aiter pull request #7060 ("[FlyDSL] MiniMax-M3 index score: MXFP4 index-cache decode
scorer"). Its text names the entry point ``score_flydsl_fp4`` (exported lazily from
``aiter.ops.flydsl`` as ``minimax_m3_index_score_fp4_flydsl``), says the kernel takes the cache as
two views ``k_data [pages,128,64]`` and ``k_scale [pages,128,4]``, that the MXFP4 entry points take
no ``q_scale`` and no context-parallel shard, and that everything else (work map, geometry, Q
loading, causal cutoff, score store) is shared with the fp8 entry point ``score_flydsl(idx_q, cache,
block_table, seq_lens, S, H, sm_scale, max_block, out=None, cfg=None, work_map=None, **cfg_kwargs)``.
The PR text does not print the full MXFP4 signature: the one below is that fp8 signature with
``cache`` replaced by the two views, an inference. When aiter is installed, the test binds to the
real function instead, and that is the check that counts.
"""

import inspect

PR = "ROCm/aiter#7060"
ENTRY_POINT = "score_flydsl_fp4"
# Where the installed aiter may expose it, tried in order.
LOCATIONS = (
    ("aiter.ops.flydsl.kernels.minimax_m3_index_score", "score_flydsl_fp4"),
    ("aiter.ops.flydsl", "minimax_m3_index_score_fp4_flydsl"),
)


def score_flydsl_fp4(idx_q, k_data, k_scale, block_table, seq_lens, S, H, sm_scale, max_block, out=None, cfg=None,
                     work_map=None, **cfg_kwargs):
    """Documented signature only (see the module docstring); never called.

    ``idx_q [batch*S, H, 128]`` bf16 | e4m3; ``k_data`` uint8 ``[pages, 128, 64]``; ``k_scale`` uint8
    ``[pages, 128, 4]``; ``block_table`` int32 ``[batch, >= max_block]``; ``seq_lens`` int32
    ``[batch]``; ``out`` fp32 ``[H, batch*S, max_block]``. Stores ``max_t dot * sm_scale * log2(e)``.
    """
    raise NotImplementedError(f"signature spec of {PR}'s {ENTRY_POINT}, not an implementation")


SPEC = inspect.signature(score_flydsl_fp4)
