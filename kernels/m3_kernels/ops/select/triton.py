"""Triton MSA block selector: top-k blocks per (index head, query row), as ``naive.select_blocks_ref``.

One program per (row, head) holds the row's scores in registers as int64 rank keys, larger is better
and no two equal: the score's fp32 bits mapped to an order-preserving unsigned integer (-0 as +0, NaN
below -inf, as in the reference), then the complement of the block id (ties to the lower id). It picks
the ``topk - init - local`` best candidates one at a time, each pick one max reduction (unrolled up
to ``MAX_UNROLLED`` picks; a loop beyond, e.g. for the dense control's top-k of every block); then it
appends the local blocks in order, the row's own block last. Rows that see at most ``topk`` blocks get
``0 .. n-1`` and -1 padding. No host synchronisation: ``n_visible`` is read on the device (clamped to
``[0, nb]``), so the call can be captured in a CUDA graph. With ``M3_PDL=1`` on sm_90+ it is launched
with programmatic dependent launch (``ops.pdl``).
"""

import torch
import triton
import triton.language as tl

from ..pdl import triton_launch_kwargs, use_pdl

_ID_BITS = 31  # low bits of a rank key: MAX_ID - block id
_MAX_ID = (1 << _ID_BITS) - 1
MAX_UNROLLED = 64  # picks unrolled at compile time (M3 makes 15); more run as a loop


@triton.jit
def _rank_keys(b_s, o_b, ID_BITS: tl.constexpr, MAX_ID: tl.constexpr):
    """int64 keys, unique per block and ordered as (score, then lower id): see the module docstring."""
    bits = tl.where(b_s == 0.0, 0.0, b_s).to(tl.int32, bitcast=True)  # -0 -> +0
    order = tl.where(bits < 0, ~bits, bits | -2147483648)  # as uint32: monotone in the score
    order = tl.where(b_s != b_s, 0, order)  # NaN below -inf (whose key is 0x007FFFFF)
    return (order.to(tl.uint32, bitcast=True).to(tl.int64) << ID_BITS) | (MAX_ID - o_b).to(tl.int64)


@triton.jit
def _pick(key, res, o_k, slot, MAX_ID: tl.constexpr):
    """The best remaining block: its id into ``res[slot]``, its key out of the running."""
    best = tl.max(key, axis=0)
    key = tl.where(key == best, -1, key)
    res = tl.where(o_k == slot, (MAX_ID - (best & MAX_ID)).to(tl.int32), res)
    return key, res


@triton.jit
def _select_kernel(
    s_ptr, nvis_ptr, out_ptr, nb, stride_s_h, stride_s_r, stride_o_h, stride_o_r,
    TOPK: tl.constexpr, LOCAL: tl.constexpr, INIT: tl.constexpr, BLOCK: tl.constexpr, TOPK_P2: tl.constexpr,
    USE_PDL: tl.constexpr, ID_BITS: tl.constexpr, MAX_ID: tl.constexpr, MAX_UNROLLED: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i_r, i_h = tl.program_id(0), tl.program_id(1)
    n = tl.minimum(tl.maximum(tl.load(nvis_ptr + i_r).to(tl.int32), 0), nb)
    o_k = tl.arange(0, TOPK_P2)
    res = tl.where(o_k < n, o_k, -1)  # dense rows: every visible block in order
    if n > TOPK:
        RANKED: tl.constexpr = TOPK - INIT - LOCAL
        o_b = tl.arange(0, BLOCK)
        b_s = tl.load(s_ptr + i_h.to(tl.int64) * stride_s_h + i_r.to(tl.int64) * stride_s_r + o_b,
                      mask=o_b < n, other=0.0).to(tl.float32)
        cand = (o_b >= INIT) & (o_b < n - LOCAL)
        key = tl.where(cand, _rank_keys(b_s, o_b, ID_BITS, MAX_ID), -1)
        res = tl.where(o_k < INIT, o_k, n - LOCAL + (o_k - INIT - RANKED))
        if RANKED <= MAX_UNROLLED:
            for k in tl.static_range(RANKED):
                key, res = _pick(key, res, o_k, INIT + k, MAX_ID)
        else:  # e.g. the dense control's top-k of every block: unrolled, it would not compile in useful time
            for k in range(RANKED):
                key, res = _pick(key, res, o_k, INIT + k, MAX_ID)
    tl.store(out_ptr + i_h.to(tl.int64) * stride_o_h + i_r.to(tl.int64) * stride_o_r + o_k, res, mask=o_k < TOPK)


def _num_warps(block: int, programs: int) -> int:
    """Warps per (row, head) program. Measured on an H200 (2026-12-01, docs/perf.md): one warp up to 256
    blocks (32k tokens: 3.8-4.2 us against 4.2-5.8 with four); at 1024 blocks four warps while the
    programs are few (32-256 rows: 5.1-7.6 us against 8.2-9.6) and one from 512 programs (10.5 against
    11.2 us); 4 up to 4096 blocks, 8 beyond (registers)."""
    if block <= 256 or (block <= 1024 and programs >= 512):
        return 1
    return 4 if block <= 4096 else 8


def select_blocks_triton(scores, n_visible, topk, local_blocks, init_blocks, out=None, num_warps=None, pdl=None):
    """int32 ``[H, rows, topk]``; ``scores [H, rows, nb]`` fp32/bf16 with a contiguous last dim,
    ``n_visible [rows]`` int32/int64 on the same device. Parameters validated by the caller.
    ``num_warps``: per program (default ``_num_warps``); ``pdl``: launch with programmatic dependent
    launch (default ``ops.pdl.use_pdl``); the benchmark compares both."""
    H, rows, nb = scores.shape
    if nb > _MAX_ID:
        raise ValueError(f"scores may hold at most {_MAX_ID} blocks per row, got {nb}")
    if out is None:
        out = torch.empty((H, rows, topk), dtype=torch.int32, device=scores.device)
    if H == 0 or rows == 0:
        return out
    if scores.stride(2) != 1:
        scores = scores.contiguous()
    nvis = n_visible if n_visible.dtype == torch.int32 else n_visible.to(torch.int32)
    block = max(16, triton.next_power_of_2(max(nb, 1)))
    _select_kernel[(rows, H)](
        scores, nvis.contiguous(), out, nb, scores.stride(0), scores.stride(1), out.stride(0), out.stride(1),
        TOPK=topk, LOCAL=local_blocks, INIT=init_blocks, BLOCK=block, TOPK_P2=triton.next_power_of_2(topk),
        ID_BITS=_ID_BITS, MAX_ID=_MAX_ID, MAX_UNROLLED=MAX_UNROLLED, num_warps=num_warps or _num_warps(block, rows * H),
        **triton_launch_kwargs(use_pdl(scores.device) if pdl is None else pdl),
    )
    return out


__all__ = ["select_blocks_triton"]
