"""Argument rules of the FlyDSL decode scorer (no FlyDSL import: usable on any machine)."""

import torch

from .....formats import VIEW_ALIGN_BYTES
from ...common import check_decode_args, q_aligned

INT32_LIMIT = 2**31  # buffer offsets and strides are 32-bit


def _byte_span(t: torch.Tensor) -> int:
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size() if t.numel() else 0


def check_flydsl_decode(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block=None, out=None,
                        cp_rank=0, cp_world=1):
    """``check_decode_args`` plus this kernel's own rules; returns the same tuple.

    Extra rules (ValueError): q rows are read 16 B at a time, so q's base address and its row and
    head strides must be 16-byte aligned; out and block_table offsets must fit int32.
    """
    batch, H, max_block, sm_scale = check_decode_args(
        q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block, out, cp_rank, cp_world
    )
    es = q.element_size()
    if not q_aligned(q):
        raise ValueError(
            f"q base address and row/head strides must be {VIEW_ALIGN_BYTES}-byte aligned for the FlyDSL scorer, "
            f"got address % {VIEW_ALIGN_BYTES} = {q.data_ptr() % VIEW_ALIGN_BYTES}, strides {q.stride()} x {es} B"
        )
    if _byte_span(q) >= INT32_LIMIT:
        raise ValueError(f"q spans {_byte_span(q)} B; the FlyDSL scorer needs < 2^31 B (32-bit offsets)")
    check_flydsl_plan(H, S, batch, max_block, block_table, out)
    return batch, H, max_block, sm_scale


def check_flydsl_plan(H, S, batch, max_block, block_table, out) -> None:
    """The batch-level rules: ``block_table``, ``out`` and a contiguous bf16 Q of the batch fit int32 offsets."""
    if batch * S * H * 128 * 2 >= INT32_LIMIT:
        raise ValueError(f"q [{batch * S}, {H}, 128] must be < 2^31 B for the FlyDSL scorer (32-bit offsets)")
    for name, t in (("block_table", block_table), ("out", out)):
        if t is not None and _byte_span(t) >= INT32_LIMIT:
            raise ValueError(f"{name} spans {_byte_span(t)} B; the FlyDSL scorer needs < 2^31 B (32-bit offsets)")
    if H * batch * S * max_block * 4 >= INT32_LIMIT:
        raise ValueError(f"out [{H}, {batch * S}, {max_block}] fp32 must be < 2^31 B for the FlyDSL scorer")


