"""Host side of the FlyDSL decode scorer: specialisation cache, marshalling, launch (``run``, a plan's); and
``prepare_decode``, the marshalling of a call given as loose tensors with its checks, for compiling a launch on
a machine without the GPU (the tests' and ``lab/scripts/flydsl_isa_report.py``'s).

Importing this module imports FlyDSL; ``backends.flydsl`` imports it lazily.
"""

import functools

import torch

from .....formats import FP8_DTYPE, IndexKFormat, check_index_k_cache
from ...common import aligned_q, minus_inf_scores
from .checks import check_flydsl_decode
from .decode import build_decode_scorer

NT_K_DEFAULT = {IndexKFormat.MXFP4: 6, IndexKFormat.FP8: 3, IndexKFormat.BF16: 3}  # seed: 6 beat 3 for MXFP4


@functools.lru_cache(maxsize=None)
def decode_launcher(k_format: str, q_fp8: bool, S: int, H: int, nt_k: int):
    """The ``@flyc.jit`` launcher of one specialisation (FlyDSL caches its compiled binaries)."""
    return build_decode_scorer(k_format, q_fp8, S, H, nt_k=nt_k)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def prepare_decode(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block=None, out=None, cp_rank=0,
                   cp_world=1, nt_k=None):
    """Validate a call given as loose tensors and marshal it: ``(launcher, args, out)``;
    ``launcher(*args, stream)`` scores it.

    ``launcher`` is None when there is nothing to launch (no rows or no columns). With
    ``out=None``, ``out`` is allocated and pre-filled with -inf (the kernel writes visible pages only).
    Works on any device, so the exact launch can be compile-checked on a CPU machine.
    """
    batch, H, max_block, sm_scale = check_flydsl_decode(
        q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block, out, cp_rank, cp_world
    )
    fmt = check_index_k_cache(k_cache, k_scale)
    return _marshal(fmt, batch, H, max_block, sm_scale, q, k_cache, k_scale, block_table, seq_lens, S, out, cp_rank,
                    cp_world, nt_k)


def prepare_run(plan, q, cache, out, nt_k=None):
    """``prepare_decode`` of a planned batch (``ops.score.plan_decode`` checked it and this kernel's
    batch rules): marshals without checking. A Q view whose base or strides are not 16-byte aligned is
    copied once (the kernel reads Q rows 16 B at a time)."""
    return _marshal(plan.fmt, plan.batch, plan.H, plan.max_block, plan.sm_scale, aligned_q(q), cache.data,
                    cache.scale_e8m0, plan.block_table, plan.seq_lens, plan.S, out, plan.cp_rank, plan.cp_world, nt_k)


def _marshal(fmt, batch, H, max_block, sm_scale, q, k_cache, k_scale, block_table, seq_lens, S, out, cp_rank,
             cp_world, nt_k):
    if out is None:
        out = minus_inf_scores(H, batch * S, max_block, q.device)
    if batch == 0 or max_block == 0:
        return None, (), out
    k_format = {IndexKFormat.MXFP4: "mxfp4", IndexKFormat.FP8: "fp8", IndexKFormat.BF16: "bf16"}[fmt]
    launcher = decode_launcher(k_format, q.dtype == FP8_DTYPE, S, H, nt_k or NT_K_DEFAULT[fmt])
    k_data = _as_bytes(k_cache)
    scale = k_scale if k_scale is not None else k_data  # unused by bf16/fp8 specialisations
    grid_y = -(-max_block // launcher.pages_per_cta)
    args = (
        _as_bytes(q), k_data, scale, block_table, seq_lens, out,
        q.stride(0) * q.element_size(), q.stride(1) * q.element_size(),
        k_data.stride(0), scale.stride(0), block_table.stride(0), out.stride(0), out.stride(1),
        max_block, cp_rank, cp_world, sm_scale, batch, grid_y,
    )
    return launcher, args, out


def run(plan, q, cache, out, nt_k=None):
    """Launch a planned batch on gfx950 (``ops.score.score_decode``'s FlyDSL run); checks nothing."""
    launcher, args, out = prepare_run(plan, q, cache, out, nt_k)
    if launcher is not None:
        launcher(*args, torch.cuda.current_stream(q.device))
    return out
