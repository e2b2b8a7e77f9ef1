"""Prefill block scorer for NVIDIA sm_90 (Hopper): large query tiles, each page decoded once per tile.

Contract: ``naive.score_prefill_ref`` (``docs/design.md``, "The block scorer contract"), its page-id and
non-finite-q rules included; validation: the plan (``common.check_batch``) and the run (``common.check_run``).
``out[h, r, p] = sm_scale * max over the tokens t of page p visible to row r of q[r, h] . K[t]``,
-inf for a page with no visible token, every column written.

Work map: one program per (query tile, chunk of ``PP`` pages). A query tile is ``BM // H`` consecutive
new tokens of one request times its ``H`` heads: ``BM`` (256) query vectors, held once in shared memory
as the tensor-core A operand. For each page of its chunk the program loads the page once, widens it
to bf16 (fp8 and MXFP4; a bf16 page as is), multiplies it with the tile in slices of ``TN`` (64 or 128)
tokens (``[BM, 128] x [128, TN]``, warpgroup MMA on sm_90), masks tokens past each row's position only on
the tile's diagonal pages and keeps the page max in registers. Launch settings per format:
``DEFAULT_LAUNCH``. A page is therefore fetched and decoded once per 256 query vectors, not once
per 64 as in ``triton.py``, and the decode is amortised over four times the columns.

The tile list is built on the device (``prefill_tiles_device``: torch ops, no host sync, a static
shape padded with a sentinel the kernel skips), so a caller can capture the call in a CUDA graph.

Numerics (exact operands, fp32 accumulation):
- Q: bf16 as given; an e4m3 Q widens to bf16 exactly.
- fp8 K: e4m3 widens to bf16 exactly (on the GPU by bit placement and an exact multiply by 2^120).
- MXFP4 K: ``e2m1 * 2^(s - 129)`` in bf16 for the group's e8m0 byte ``s``, exact for every byte 0..254
  (bf16's range is fp32's, down to the subnormal 2^-133): each e2m1 code is formed as fp16 ``2^-14 * e2m1``
  (exact; code 1 an fp16 subnormal), widened to fp32 and multiplied by ``2^(s - 115)`` in two normal fp32
  factors (``_mxfp4_page_split``), or made the exact fp16 e2m1 by one f16x2 multiply and multiplied by the
  one fp32 ``2^(s - 129)`` (``_mxfp4_page_joined``, ``mx_join=True``, the default). The page max is
  multiplied by ``4 * sm_scale`` (``_MX_FOLD_EXP``) afterwards.
- bf16 x bf16 products are exact in fp32; the tensor cores accumulate in fp32.
"""

import torch
import triton
import triton.language as tl

from ....formats import INDEX_DIM, MXFP4_DATA_BYTES, MXFP4_SCALE_BYTES, PAGE_SIZE
from .triton import (  # the e2m1 byte-permute decode and the kernels' small rules, shared with decode
    _E2M1_F16_ASM_TEXT,
    FMT_CODE,
    _e2m1_split_f16,
    _nonfinite,
    _page_id,
    _page_score,
    _pow2,
    _tile_vectors,
    interpret,
    use_asm,
)

BLOCK_Q = 256  # query vectors per tile (tokens x heads)
_MX_FOLD_EXP = 2  # MXFP4 K is formed as e2m1 * 2^(s - 127 - 2): exact in bf16 for every byte 0..254
SENTINEL = -1  # request id of a padding tile


def tile_rows(H: int) -> int:
    """New tokens per query tile for ``H`` heads (``BLOCK_Q // H``, at least 1)."""
    return max(1, BLOCK_Q // H)


# ---------------------------------------------------------------- work map


def prefill_tiles_host(cu_seqlens_q: list[int], H: int) -> list[tuple[int, int]]:
    """The tile list on the host: ``(request, first row)`` of every tile, requests in order, each
    request's rows cut into tiles of ``tile_rows(H)``."""
    rows = tile_rows(H)
    cu = [int(x) for x in cu_seqlens_q]
    return [(b, r) for b in range(len(cu) - 1) for r in range(cu[b], cu[b + 1], rows)]


def max_prefill_tiles(total_new_tokens: int, batch: int, H: int) -> int:
    """An upper bound on the tiles of any batch of ``batch`` requests and ``total_new_tokens`` new
    tokens: ``sum ceil(n_b / rows) <= (total + batch * (rows - 1)) // rows``."""
    rows = tile_rows(H)
    return (total_new_tokens + batch * (rows - 1)) // rows


def prefill_tiles_device(cu_seqlens_q: torch.Tensor, H: int, max_tiles: int) -> torch.Tensor:
    """Device work map: int32 ``[max_tiles, 2]`` of ``(request, first row)``, the tiles of
    ``prefill_tiles_host`` in order, then rows ``(SENTINEL, 0)``. Torch ops on ``cu_seqlens_q``'s
    device only: no host sync, a static shape, so it can be captured in a CUDA graph. ``max_tiles``
    must be at least the batch's tile count (``max_prefill_tiles``); tiles past it are dropped."""
    rows = tile_rows(H)
    cu = cu_seqlens_q.to(torch.int64)
    n_tiles = (cu[1:] - cu[:-1] + rows - 1) // rows  # [batch]
    ends = torch.cumsum(n_tiles, 0)  # tile index past each request's last
    i = torch.arange(max_tiles, device=cu.device, dtype=torch.int64)
    b = torch.searchsorted(ends, i, right=True)  # request of tile i (batch past the last tile)
    valid = b < ends.shape[0]
    bc = b.clamp(max=max(ends.shape[0] - 1, 0))
    if ends.shape[0] == 0:
        return torch.stack([torch.full_like(i, SENTINEL), torch.zeros_like(i)], 1).to(torch.int32)
    first_tile = ends[bc] - n_tiles[bc]
    row0 = cu[bc] + (i - first_tile) * rows
    return torch.stack([torch.where(valid, b, SENTINEL), torch.where(valid, row0, 0)], 1).to(torch.int32)


# ---------------------------------------------------------------- kernel


# the same, then times 2^14 (fp16 0x7400) in one exact f16x2 multiply per pair: the e2m1 values themselves
_E2M1_F16_EXACT_ASM_TEXT = _E2M1_F16_ASM_TEXT.replace("""prmt.b32 $3, hh, z, 0x3424;
            }""", """prmt.b32 $3, hh, z, 0x3424;
            mov.b32 t, 0x74007400;
            mul.rn.f16x2 $0, $0, t;
            mul.rn.f16x2 $1, $1, t;
            mul.rn.f16x2 $2, $2, t;
            mul.rn.f16x2 $3, $3, t;
            }""")
_E2M1_F16_EXACT_ASM = tl.constexpr(_E2M1_F16_EXACT_ASM_TEXT)


@triton.jit
def _e2m1_f16(b_d, USE_ASM: tl.constexpr, UNIT: tl.constexpr):
    """uint8 ``[..., C]`` packed e2m1 -> (low nibbles, high nibbles), each ``[..., C]``: the fp16 bit
    pattern ``sign << 15 | code << 9``, i.e. ``2^-14 * e2m1`` (code 1 an fp16 subnormal; the decode
    scorer's ``_e2m1_split_f16``); ``UNIT``: times 2^14, the e2m1 values themselves (one exact f16x2
    multiply per pair; fp32 in the interpreter)."""
    if UNIT and USE_ASM:
        lo, hi = tl.inline_asm_elementwise(asm=_E2M1_F16_EXACT_ASM, constraints="=r,=r,=r,=r,r", args=[b_d],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        lo, hi = _e2m1_split_f16(b_d, USE_ASM)
        if UNIT:
            lo = lo.to(tl.float32) * 16384.0
            hi = hi.to(tl.float32) * 16384.0
    return lo, hi


def _e4m3_pair_asm(out: int, selector: str) -> str:
    """PTX placing two e4m3 bytes of ``$2`` (``prmt`` ``selector``) as ``2^-120``-scaled bf16 bit patterns and
    multiplying them by ``2^120`` into ``$out``."""
    return f"""
            prmt.b32 a, $2, c, {selector};
            shl.b32 m, a, 4;
            and.b32 m, m, 0x07F007F0;
            shl.b32 s, a, 8;
            and.b32 s, s, 0x80008000;
            or.b32 a, m, s;
            fma.rn.bf16x2 ${out}, a, f, z;"""


_E4M3_BF16_ASM = tl.constexpr("""
            {
            .reg .b32 a, c, m, s, f, z;
            mov.b32 c, 0;
            mov.b32 f, 0x7B807B80;
            mov.b32 z, 0x80008000;""" + _e4m3_pair_asm(0, "0x4140") + _e4m3_pair_asm(1, "0x4342") + """
            }
            """)


@triton.jit
def _e4m3_bf16(b_k, USE_ASM: tl.constexpr):
    """e4m3 ``[..., C]`` -> bf16 ``[..., C]``, exact. GPU: the bf16 bit pattern ``sign << 15 | (b & 0x7F) << 4``
    is ``2^-120`` times the e4m3 value (subnormals included: the field widths line up), then one exact bf16x2
    multiply by ``2^120`` per pair (integer and FMA pipes; no conversion unit)."""
    if USE_ASM:
        k = tl.inline_asm_elementwise(
            asm=_E4M3_BF16_ASM,
            constraints="=r,=r,r",
            args=[b_k.to(tl.uint8, bitcast=True)],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )
    else:
        k = b_k.to(tl.bfloat16)
    return k


@triton.jit
def _mxfp4_scales(s_ptr, page, stride_s_page, o_t, NG: tl.constexpr):
    """int32 ``[T, NG]``: the e8m0 bytes of tokens ``o_t``, read as one 32-bit word per token (the views
    are 4-byte aligned: ``check_index_k_cache``)."""
    o_g = tl.arange(0, NG)
    w_s = tl.load(s_ptr.to(tl.pointer_type(tl.int32)) + page * (stride_s_page // 4) + o_t)  # [T]
    return (w_s[:, None] >> (8 * o_g)[None, :]) & 0xFF


@triton.jit
def _mxfp4_page_split(k_ptr, s_ptr, page, stride_k_page, stride_s_page, o_t, T: tl.constexpr,
                      DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, USE_ASM: tl.constexpr,
                      KDT: tl.constexpr):
    """Tokens ``o_t`` (``T`` of them) of an MXFP4 page as two ``[T, DATA_BYTES]`` in ``KDT`` (bf16; fp32 in
    the interpreter): the even dims (low nibbles) and the odd dims (high nibbles), each
    ``e2m1 * 2^(s - 129)``: fp16 ``2^-14 * e2m1`` widened to fp32 times ``2^(s - 115)`` in two normal fp32
    factors ``2^(min(s, 242) - 115) * 2^(max(s, 242) - 242)`` (one would overflow for s > 242)."""
    NG: tl.constexpr = SCALE_BYTES
    GB: tl.constexpr = DATA_BYTES // NG  # bytes per MX group
    o_b = tl.arange(0, DATA_BYTES)
    b_d = tl.load(k_ptr + page * stride_k_page + o_t[:, None] * DATA_BYTES + o_b[None, :])  # [T, DATA_BYTES]
    s = _mxfp4_scales(s_ptr, page, stride_s_page, o_t, NG)
    f1 = tl.reshape(tl.broadcast_to(_pow2(tl.minimum(s, 242) + 12)[:, :, None], (T, NG, GB)), (T, DATA_BYTES))
    f2 = tl.reshape(tl.broadcast_to(_pow2(tl.maximum(s, 242) - 115)[:, :, None], (T, NG, GB)), (T, DATA_BYTES))
    lo, hi = _e2m1_f16(b_d, USE_ASM, False)
    k_even = ((lo.to(tl.float32) * f1) * f2).to(KDT)
    k_odd = ((hi.to(tl.float32) * f1) * f2).to(KDT)
    return k_even, k_odd


@triton.jit
def _mxfp4_page_joined(k_ptr, s_ptr, page, stride_k_page, stride_s_page, o_t, T: tl.constexpr,
                       DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, USE_ASM: tl.constexpr,
                       KDT: tl.constexpr):
    """Tokens ``o_t`` of an MXFP4 page as one ``[T, 2 * DATA_BYTES]`` in ``KDT``, dims in natural order (byte
    c: dims 2c, 2c + 1), each ``e2m1 * 2^(s - 129)``: the exact fp16 e2m1 widened to fp32 times the one fp32
    factor ``2^(s - 129)`` (bit pattern ``(s - 2) << 23``, or the subnormal ``1 << (s + 20)`` for s < 3)."""
    NG: tl.constexpr = SCALE_BYTES
    GB: tl.constexpr = DATA_BYTES // NG
    o_b = tl.arange(0, DATA_BYTES)
    b_d = tl.load(k_ptr + page * stride_k_page + o_t[:, None] * DATA_BYTES + o_b[None, :])
    s = _mxfp4_scales(s_ptr, page, stride_s_page, o_t, NG)
    f_bits = tl.where(s >= 3, (s - 2) << 23, 1 << (s + 20))
    f = tl.reshape(tl.broadcast_to(f_bits.to(tl.float32, bitcast=True)[:, :, None], (T, NG, GB)), (T, DATA_BYTES))
    lo, hi = _e2m1_f16(b_d, USE_ASM, True)
    k_even = (lo.to(tl.float32) * f).to(KDT)
    k_odd = (hi.to(tl.float32) * f).to(KDT)
    return tl.reshape(tl.join(k_even, k_odd), (T, 2 * DATA_BYTES))


@triton.jit
def _prefill_sm90_kernel(
    q_ptr, k_ptr, s_ptr, bt_ptr, seq_ptr, cu_ptr, tile_ptr, out_ptr,
    n_cols, n_pages, post_scale,
    stride_q_r, stride_q_h, stride_k_page, stride_s_page, stride_bt, stride_o_h, stride_o_r,
    FMT: tl.constexpr,  # 0 bf16, 1 fp8, 2 mxfp4
    H: tl.constexpr,
    ROWS: tl.constexpr,  # new tokens per tile
    BM: tl.constexpr,  # query vectors per tile (>= ROWS * H, power of two)
    PP: tl.constexpr,  # pages per program
    TN: tl.constexpr,  # tokens per product (T or T / 2)
    MX_JOIN: tl.constexpr,  # MXFP4: one K=128 product on the page joined to natural dim order
    NUM_STAGES: tl.constexpr,
    USE_ASM: tl.constexpr,
    INTERPRET: tl.constexpr,
    D: tl.constexpr,
    T: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    i_tile, i_c = tl.program_id(0), tl.program_id(1)
    b = tl.load(tile_ptr + 2 * i_tile)
    if b < 0:
        return  # padding tile of a device work map
    row0 = tl.load(tile_ptr + 2 * i_tile + 1)
    cu0 = tl.load(cu_ptr + b)
    cu1 = tl.load(cu_ptr + b + 1)
    n_rows = tl.minimum(cu1 - row0, ROWS)
    pos0 = tl.load(seq_ptr + b) - (cu1 - cu0) + (row0 - cu0)  # position of the tile's first token
    last_pos = pos0 + n_rows - 1
    n_vis = tl.minimum(tl.where(last_pos >= 0, last_pos // T + 1, 0), n_cols)
    p_start = i_c * PP
    p_stop = tl.minimum(p_start + PP, n_cols)

    m_n, rows, heads, pos, o_h = _tile_vectors(row0, pos0, n_rows, stride_o_h, stride_o_r, H, BM)
    o_out = out_ptr + o_h
    for p in range(tl.maximum(p_start, n_vis), p_stop):
        tl.store(o_out + p, tl.full([BM], float("-inf"), tl.float32), mask=m_n)
    p_end = tl.minimum(p_stop, n_vis)
    if p_start >= p_end:
        return

    o_d = tl.arange(0, D)
    o_t = tl.arange(0, TN)
    KDT: tl.constexpr = tl.float32 if INTERPRET else tl.bfloat16  # the interpreter's bf16 dot is not exact
    p_q = q_ptr + rows[:, None].to(tl.int64) * stride_q_r + heads[:, None] * stride_q_h
    bad = _nonfinite(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, D)
    if FMT == 2 and not MX_JOIN:  # even and odd dims apart, as _mxfp4_page_split decodes the page
        o_e = 2 * tl.arange(0, D // 2)
        b_qe = tl.load(p_q + o_e[None, :], mask=m_n[:, None], other=0.0).to(KDT)  # [BM, D / 2]
        b_qo = tl.load(p_q + o_e[None, :] + 1, mask=m_n[:, None], other=0.0).to(KDT)
    else:
        b_q = tl.load(p_q + o_d[None, :], mask=m_n[:, None], other=0.0).to(KDT)  # [BM, D]
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for p in tl.range(p_start, p_end, num_stages=NUM_STAGES):
        page, ok = _page_id(bt_row, p, n_pages)
        m = tl.full([BM], float("-inf"), tl.float32)
        for half in tl.static_range(T // TN):  # the page in slices of TN tokens (fewer accumulator registers)
            toks = half * TN + o_t
            if FMT == 2 and MX_JOIN:
                b_k = _mxfp4_page_joined(k_ptr, s_ptr, page, stride_k_page, stride_s_page, toks, TN, DATA_BYTES,
                                         SCALE_BYTES, USE_ASM, KDT)
                if INTERPRET:
                    acc = tl.dot(b_q, tl.trans(b_k), input_precision="ieee", out_dtype=tl.float32)  # [BM, TN]
                else:
                    acc = tl.dot(b_q, tl.trans(b_k), out_dtype=tl.float32)
            elif FMT == 2:
                k_e, k_o = _mxfp4_page_split(k_ptr, s_ptr, page, stride_k_page, stride_s_page, toks, TN, DATA_BYTES,
                                             SCALE_BYTES, USE_ASM, KDT)
                if INTERPRET:
                    acc = tl.dot(b_qe, tl.trans(k_e), input_precision="ieee", out_dtype=tl.float32)  # [BM, TN]
                    acc = tl.dot(b_qo, tl.trans(k_o), acc, input_precision="ieee", out_dtype=tl.float32)
                else:
                    acc = tl.dot(b_qe, tl.trans(k_e), out_dtype=tl.float32)
                    acc = tl.dot(b_qo, tl.trans(k_o), acc, out_dtype=tl.float32)
            else:
                b_k = tl.load(k_ptr + page * stride_k_page + toks[:, None] * D + o_d[None, :])
                if FMT == 1 and not INTERPRET:
                    b_k = _e4m3_bf16(b_k, USE_ASM)
                b_k = b_k.to(KDT)
                if INTERPRET:
                    acc = tl.dot(b_q, tl.trans(b_k), input_precision="ieee", out_dtype=tl.float32)  # [BM, TN]
                else:
                    acc = tl.dot(b_q, tl.trans(b_k), out_dtype=tl.float32)
            t0 = p * T + half * TN
            if t0 + TN - 1 > pos0:  # a diagonal slice: some row sees only part of it
                acc = tl.where((t0 + o_t)[None, :] <= pos[:, None], acc, float("-inf"))
            m = tl.maximum(m, tl.max(acc, axis=1))
        tl.store(o_out + p, _page_score(m, post_scale, ok, bad, p * T, pos), mask=m_n)


# ---------------------------------------------------------------- entry points


def device_ok(device: torch.device) -> tuple[bool, str]:
    """``(True, "")`` on an NVIDIA sm_90 GPU (or the CPU under the Triton interpreter), else ``(False, why)``."""
    if device.type == "cpu" and interpret():
        return True, ""
    if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return False, f"the sm_90 prefill scorer runs on NVIDIA CUDA devices, got {device}"
    cap = torch.cuda.get_device_capability(device)
    if cap[0] != 9:
        return False, f"the sm_90 prefill scorer needs compute capability 9.x (Hopper), got {cap[0]}.{cap[1]}"
    return True, ""


# Launch settings per cache format: those an H100 measured fastest (docs/perf.md, 2026-12-07) for chunks of
# 8192 tokens at 8k-128k. pp: pages per program; tn: tokens per product (64 or 128); maxnreg: a register cap
# per thread (128: two programs of 8 warps per multiprocessor; None: no cap); mx_join: MXFP4 page joined to
# natural dim order for one K=128 product. The MXFP4 setting is the sweep's best on an H100 (1.05-1.07x fp8's
# time at 8k-128k, against 1.41x for the split path at pp=64, tn=128 that was the default before).
DEFAULT_LAUNCH = {
    "fp8": dict(pp=32, tn=64, num_warps=8, num_stages=3, maxnreg=128, mx_join=False),
    "bf16": dict(pp=32, tn=64, num_warps=8, num_stages=3, maxnreg=128, mx_join=False),  # not timed
    "mxfp4": dict(pp=32, tn=64, num_warps=8, num_stages=3, maxnreg=128, mx_join=True),
}


def check_plan(plan, batch):
    """The device work map of a prefill batch (the plan's ``work``): no host lengths in it, so the run can be
    captured in a CUDA graph."""
    return prefill_tiles_device(plan.cu_seqlens_q, plan.H, max_prefill_tiles(plan.rows, plan.batch, plan.H))


def run(plan, q, cache, out, **launch):
    """Prefill scores of ``plan`` (``plan.work``: the device work map) for ``q`` over ``cache`` into ``out``
    (``ops.score.score_prefill`` checked all three): one launch with the format's ``DEFAULT_LAUNCH``, or with
    ``launch`` overrides of it (``pp``, ``tn``, ``num_warps``, ``num_stages``, ``maxnreg``, ``mx_join``: the
    benchmark's sweep). Every column of ``out`` is written (-inf past each row's last visible page)."""
    fmt = cache.storage
    settings = dict(DEFAULT_LAUNCH["mxfp4" if fmt.is_mxfp4 else fmt.value])
    if launch:
        unknown = set(launch) - set(settings)
        if unknown:
            raise TypeError(f"unknown launch settings {sorted(unknown)}; known: {sorted(settings)}")
        settings.update(launch)
        if settings["tn"] not in (64, 128) or not (isinstance(settings["pp"], int) and settings["pp"] >= 1):
            raise ValueError(f"need tn in (64, 128) and an int pp >= 1, got tn={settings['tn']!r}, "
                             f"pp={settings['pp']!r}")
    tiles, H = plan.work, plan.H
    if tiles.shape[0] == 0 or plan.max_block == 0 or plan.rows == 0:
        return out
    pp, tn, maxnreg = settings["pp"], settings["tn"], settings["maxnreg"]
    rows = tile_rows(H)
    bm = max(16, triton.next_power_of_2(rows * H))
    post = plan.sm_scale * 2.0**_MX_FOLD_EXP if fmt.is_mxfp4 else plan.sm_scale
    scale = cache.scale_e8m0 if fmt.is_mxfp4 else cache.data
    grid = (tiles.shape[0], triton.cdiv(plan.max_block, pp))
    _prefill_sm90_kernel[grid](
        q, cache.data, scale, plan.block_table, plan.seq_lens, plan.cu_seqlens_q, tiles, out,
        plan.max_block, cache.num_pages, post,
        q.stride(0), q.stride(1), cache.data.stride(0), scale.stride(0) if fmt.is_mxfp4 else 0,
        plan.block_table.stride(0), out.stride(0), out.stride(1),
        FMT=FMT_CODE[fmt], H=H, ROWS=rows, BM=bm, PP=pp, TN=tn, MX_JOIN=bool(settings["mx_join"]),
        NUM_STAGES=settings["num_stages"], USE_ASM=use_asm(), INTERPRET=interpret(), D=INDEX_DIM, T=PAGE_SIZE,
        DATA_BYTES=MXFP4_DATA_BYTES, SCALE_BYTES=MXFP4_SCALE_BYTES, num_warps=settings["num_warps"],
        **({} if maxnreg is None else dict(maxnreg=maxnreg)),
    )
    return out


__all__ = ["BLOCK_Q", "DEFAULT_LAUNCH", "SENTINEL", "check_plan", "device_ok", "max_prefill_tiles",
           "prefill_tiles_device", "prefill_tiles_host", "run", "tile_rows"]
