"""Triton block scorers (decode and prefill) over the paged index-K cache: bf16, fp8 and MXFP4.

Contract: ``naive.score_decode_ref`` / ``naive.score_prefill_ref`` (DESIGN section 3). Validation is
``common.check_decode_args`` / ``check_prefill_args``; nothing here re-checks what they check.

Work map: one program per (chunk of ``PP`` local pages, query tile). A decode query tile is one
request's ``S`` rows; a prefill tile is up to ``64 // H`` consecutive new tokens of one request.
Each program loads its tile's ``S*H`` query vectors once, then for every page: loads the page,
forms K on the tensor-core operand, one ``tl.dot`` per page (fp8/bf16) or per 32-wide MX group
(MXFP4), masks tokens past each row's position, takes the page max and stores
``sm_scale * max``. Splitting pages over programs fills the GPU at small batch.

MXFP4 modes (``M3_TRITON_MX_MODE``; exact by construction, but see ``e4m3``): ``tile16`` (default;
fastest measured on an H200, 0.94-0.99 of the fp8 scorer's time on the seed's nine cells, where
``split`` took 1.08-1.35) is ``e4m3`` below without its e4m3 parts: the stacked loop with the fp16
decode and fp16 tensor cores (a query tile whose Q the fp16 form cannot hold exactly falls back to
``split``); ``split`` feeds each group's even and odd elements as two K=16 operands, with bytes and Q
permuted so that a thread's tensor-core fragment is 4 consecutive bytes; ``groups`` decodes each
group to a K=32 fp16 tile in element order; ``stacked`` does one dot per page against a
block-diagonal Q (every group's partial dot in one product); ``e4m3`` (experimental; on an H200 its fp8 tensor-core paths miss the score tolerance
by 2-5x, since Hopper's fp8 MMA accumulates in reduced precision: do not use) decodes K to e4m3
and runs fp8 x fp8 dots with each group's even elements first, so that a thread's 4 consecutive
bytes give two whole fragments (no byte permutes).
For tiles of at most 8 query vectors it is "stacked": one K=128 dot per page against a
block-diagonal Q of 4 x NV columns (NV = the tile's vectors padded to a power of two >= 4, so no
padding columns at S*H = 4), each group's scale applied to its columns, groups summed; larger
tiles take one K=32 dot per group.

Numerics:
- MXFP4: each e2m1 code becomes the fp16 bit pattern ``sign << 15 | code << 9``, i.e. exactly
  ``2^-14 * e2m1`` (code 1 is an fp16 subnormal); each group's fp32 partial dot product is
  multiplied by one power of two, the product of the group's e8m0 scale, ``2^14`` and the Q
  row's power of two below, so it leaves fp32's range only where the exact score does. Exact.
- MXFP4 mode ``e4m3``: code c becomes the e4m3 byte ``(c & 8) << 4 | (c & 7) << 2`` = ``2^-6 * e2m1``
  exactly (code 1 an e4m3 subnormal); an e4m3 Q is used as stored. A bf16 Q tile is multiplied by
  one power of two (its largest magnitude to [2^8, 2^9)) and split into 2 (or 4) e4m3 parts
  (``_e4m3_levels``); where any part is inexact, the tile is instead rounded to fp16 with one power
  of two for the tile (largest magnitude in [2^14, 2^15)) and the fp16 decode; where that is inexact
  too (query vectors of very different sizes in one tile), the ``split`` path below. Each choice is
  one in-kernel branch per program, taken only when exact (checked element by element, NaN counting
  as inexact), so the products are always exact, accumulated in fp32.
- fp8: e4m3 widens to fp16 exactly.
- Q: e4m3 widens to fp16 exactly. A bf16 Q row is multiplied by a power of two that puts its
  largest magnitude in [2^14, 2^15) and then rounded to fp16 (11 significant bits, so exact for
  every element within 2^28 of the row's largest; smaller ones round at 2^-39 of it), and the
  power of two is undone after the max. A bf16 cache is scored in bf16 directly.
- Products are exact in fp32 and accumulated in fp32 by the tensor cores.
"""

import os

import torch
import triton
import triton.language as tl

from ...formats import (
    FP8_DTYPE,
    INDEX_DIM,
    MX_GROUP_SIZE,
    MXFP4_DATA_BYTES,
    MXFP4_SCALE_BYTES,
    PAGE_SIZE,
    IndexKFormat,
)

_FMT_CODE = {IndexKFormat.BF16: 0, IndexKFormat.FP8: 1, IndexKFormat.MXFP4: 2}
_F16_K_EXP = 14  # MXFP4 K is formed as 2^-14 * e2m1 in fp16
_Q_F16_TOP = 14  # a bf16 Q row's largest magnitude is moved to [2^14, 2^15)
_PREFILL_ROWS_X_HEADS = 64  # query vectors per prefill tile
_E4M3_K_EXP = 6  # MXFP4 K is formed as 2^-6 * e2m1 in e4m3 (mode "e4m3")
_Q_E4M3_TOP = 8  # mode "e4m3": a bf16 Q tile's largest magnitude is moved to [2^8, 2^9)
_E4M3_STACKED = True  # mode "e4m3": one dot per page against a block-diagonal Q (tiles of <= 8 vectors)
_E4M3_STACK_MAX_NV = 8
_Q_E4M3_SHIFT = 9  # mode "e4m3": the second e4m3 level of a bf16 Q row is scaled by 2^9
_Q_E4M3_TERMS = 2  # mode "e4m3": e4m3 parts per bf16 Q element (2, 4; 0: none, fp16 with one power of two)
ENV_NO_ASM = "M3_TRITON_NO_ASM"  # "1": decode e2m1 with plain Triton ops on the GPU too (no inline PTX)
ENV_MX_MODE = "M3_TRITON_MX_MODE"  # "tile16" (default), "split", "groups", "stacked", "e4m3": docstring


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


MX_MODES = ("split", "groups", "stacked", "e4m3", "tile16")


def _mx_mode() -> str:
    mode = os.environ.get(ENV_MX_MODE, "tile16")
    if mode not in MX_MODES:
        raise ValueError(f"{ENV_MX_MODE} must be one of {list(MX_MODES)}, got {mode!r}")
    return mode


def _mode_flags(mode: str) -> dict:
    """Constexpr switches of ``_score_kernel`` for an MXFP4 mode (``e4m3`` and ``tile16`` fall back to
    ``split``; ``tile16`` is ``e4m3`` without e4m3 parts: fp16 decode and fp16 tensor cores only)."""
    return dict(MX_STACKED=mode == "stacked", MX_SPLIT=mode in ("split", "e4m3", "tile16"),
                MX_E4M3=mode in ("e4m3", "tile16"), Q8_TERMS=_Q_E4M3_TERMS if mode == "e4m3" else 0)


def _stacked(mode: str, nv: int) -> bool:
    """Whether modes e4m3/tile16 use the stacked page loop for tiles of ``nv`` (padded) vectors."""
    terms = _mode_flags(mode)["Q8_TERMS"]
    return mode in ("e4m3", "tile16") and _E4M3_STACKED and nv <= _E4M3_STACK_MAX_NV and terms in (0, 2)


def _use_asm() -> bool:
    return not _interpret() and os.environ.get(ENV_NO_ASM, "0") != "1"


@triton.jit
def _e2m1_to_f16(b_d, USE_ASM: tl.constexpr):
    """uint8 ``[T, C]`` packed e2m1 codes -> fp16 ``[T, 2C]`` = 2^-14 * e2m1, element order kept.

    fp16 of nibble n is ``(n & 8) << 12 | (n & 7) << 9``: its low byte is zero and its high byte
    is ``(n & 8) << 4 | (n & 7) << 1``, so the GPU path builds four high bytes per 32-bit word
    with two masks and shifts and places them with byte permutes (about 1.6 instructions per
    element).
    """
    lo, hi = _e2m1_split_f16(b_d, USE_ASM)
    return tl.interleave(lo, hi)


@triton.jit
def _pow2(e):
    """fp32 2^(e - 127) for biased exponents e in [1, 254] (int32)."""
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _q_exponent(amax, Q_TOP: tl.constexpr):
    """Biased fp32 exponent of each column's largest |q| (int32), clamped to [Q_TOP + 1, 254] so
    that 2^(Q_TOP - e) and 2^e stay normal."""
    return tl.minimum(tl.maximum(amax.to(tl.int32, bitcast=True) >> 23, Q_TOP + 1), 254)


@triton.jit
def _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, o_d):
    """fp32 ``[len(o_d), NQ]``: dims ``o_d`` of the query vectors (zero where masked)."""
    p_q = q_ptr + rows[None, :].to(tl.int64) * stride_q_r + heads[None, :] * stride_q_h + o_d[:, None]
    return tl.load(p_q, mask=m_n[None, :], other=0.0).to(tl.float32)


@triton.jit
def _split_dims(g: tl.constexpr, odd: tl.constexpr, GB: tl.constexpr):
    """Dims of MX group ``g`` in the order of ``_mx_group_dot_split``'s operand: logical column
    j = 8h + 2c + i holds byte b = 4c + 2h + i, i.e. element 2b (even) or 2b + 1 (odd)."""
    j = tl.arange(0, GB)
    b = 4 * ((j % 8) // 2) + 2 * (j // 8) + (j % 2)
    return g * 2 * GB + 2 * b + odd


@triton.jit
def _load_q(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, d0, DK: tl.constexpr):
    """fp32 ``[DK, NQ]`` slice ``d0 : d0 + DK`` of the query vectors (zero where masked)."""
    return _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, d0 + tl.arange(0, DK))


@triton.jit
def _e2m1_split_f16(b_d, USE_ASM: tl.constexpr):
    """uint8 ``[T, C]`` packed e2m1 -> (low-nibble fp16 ``[T, C]``, high-nibble fp16 ``[T, C]``), each
    ``2^-14 * e2m1`` (see ``_e2m1_to_f16``), without interleaving."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 hl, hh, t, z;
            mov.b32 z, 0;
            and.b32 t, $4, 0x08080808;
            shl.b32 t, t, 4;
            and.b32 hl, $4, 0x07070707;
            shl.b32 hl, hl, 1;
            or.b32 hl, hl, t;
            and.b32 t, $4, 0x80808080;
            shr.u32 hh, $4, 3;
            and.b32 hh, hh, 0x0E0E0E0E;
            or.b32 hh, hh, t;
            prmt.b32 $0, hl, z, 0x1404;
            prmt.b32 $1, hl, z, 0x3424;
            prmt.b32 $2, hh, z, 0x1404;
            prmt.b32 $3, hh, z, 0x3424;
            }
            """,
            constraints="=r,=r,=r,=r,r",
            args=[b_d],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        x = b_d.to(tl.int32)
        lo = ((((x & 0x8) << 12) | ((x & 0x7) << 9)).to(tl.int16)).to(tl.float16, bitcast=True)
        hi = ((((x & 0x80) << 8) | ((x & 0x70) << 5)).to(tl.int16)).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _mx_group_dot_split(k_ptr, s_ptr, base_d, base_s, o_t, b_qe, b_qo, col_scale, g: tl.constexpr,
                        DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, GB: tl.constexpr,
                        USE_ASM: tl.constexpr):
    """As ``_mx_group_dot`` with the group's even elements (low nibbles) and odd elements (high
    nibbles) as two K=16 operands, in the byte order of ``split_order`` (``b_qe``/``b_qo`` are the
    query's even/odd elements of the group in that order): each thread's tensor-core fragment then
    comes from 4 consecutive bytes and needs no shuffling."""
    o_c = tl.arange(0, GB)
    b_d = tl.load(k_ptr + base_d + o_t[:, None] * DATA_BYTES + g * GB + o_c[None, :])
    b_s = tl.load(s_ptr + base_s + o_t * SCALE_BYTES + g)
    T: tl.constexpr = b_d.shape[0]
    # physical byte 4c + 2h + i -> logical column 8h + 2c + i
    b_d = tl.reshape(tl.permute(tl.reshape(b_d, (T, GB // 4, 2, 2)), (0, 2, 1, 3)), (T, GB))
    lo, hi = _e2m1_split_f16(b_d, USE_ASM)
    part = tl.dot(hi, b_qo, tl.dot(lo, b_qe, out_dtype=tl.float32), out_dtype=tl.float32)
    return part * (_pow2(b_s.to(tl.int32))[:, None] * col_scale[None, :])


@triton.jit
def _mx_group_dot(k_ptr, s_ptr, base_d, base_s, o_t, b_q, col_scale, g: tl.constexpr,
                  DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, GB: tl.constexpr,
                  USE_ASM: tl.constexpr):
    """fp32 ``[T, NQ]``: the dot of MX group ``g`` of every token with ``b_q``, times the group's
    e8m0 scale and the column's power of two (one product of powers of two: it leaves fp32's
    range only where the exact score does)."""
    o_c = tl.arange(0, GB)
    b_d = tl.load(k_ptr + base_d + o_t[:, None] * DATA_BYTES + g * GB + o_c[None, :])
    b_s = tl.load(s_ptr + base_s + o_t * SCALE_BYTES + g)
    b_k = _e2m1_to_f16(b_d, USE_ASM)
    part = tl.dot(b_k, b_q, out_dtype=tl.float32)
    return part * (_pow2(b_s.to(tl.int32))[:, None] * col_scale[None, :])


@triton.jit
def _e2m1_split_e4m3(b_d, USE_ASM: tl.constexpr):
    """uint8 ``[T, C]`` packed e2m1 -> (low-nibble, high-nibble) as e4m3 ``[T, C]`` each, ``2^-6 * e2m1``.

    The e4m3 byte of code c is ``(c & 8) << 4 | (c & 7) << 2``: the e2m1 exponent field lands in the
    two low e4m3 exponent bits, so a normal code keeps its mantissa and gains 2^-6, and code 1 (0.5)
    becomes the e4m3 subnormal 4 * 2^-9 = 2^-7. On the GPU: shifts and masks on 32-bit words, four
    codes at a time (about 0.9 instructions per element), no byte permutes.
    """
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t;
            shl.b32 $0, $2, 2;
            and.b32 $0, $0, 0x1C1C1C1C;
            shl.b32 t, $2, 4;
            and.b32 t, t, 0x80808080;
            or.b32 $0, $0, t;
            shr.b32 $1, $2, 2;
            and.b32 $1, $1, 0x1C1C1C1C;
            and.b32 t, $2, 0x80808080;
            or.b32 $1, $1, t;
            }
            """,
            constraints="=r,=r,r",
            args=[b_d],
            dtype=(tl.uint8, tl.uint8),
            is_pure=True,
            pack=4,
        )
    else:
        x = b_d.to(tl.int32)
        lo = (((x & 0x8) << 4) | ((x & 0x7) << 2)).to(tl.uint8)
        hi = ((x & 0x80) | ((x >> 2) & 0x1C)).to(tl.uint8)
    return lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _e4m3_dims(g: tl.constexpr, G: tl.constexpr):
    """Dims of MX group ``g`` in the order of ``_mx_group_dot_e4m3``'s operand: position p < G/2 holds
    the even element of the group's byte p (element 2p), position G/2 + p its odd element."""
    j = tl.arange(0, G)
    return g * G + 2 * (j % (G // 2)) + j // (G // 2)


@triton.jit
def _e4m3_levels(x, SHIFT: tl.constexpr, TERMS: tl.constexpr):
    """fp32 ``x`` (bf16 values times a power of two, largest magnitude in [2^8, 2^9)) ->
    ``(h0, l0, h1, l1, residual)`` e4m3 parts with ``x = h0 + l0 + residual`` (TERMS 2; h1, l1 unused)
    or ``x = h0 + l0 + 2^-SHIFT (h1 + l1) + 2^-SHIFT residual`` (TERMS 4). Each step is exact in fp32
    (a difference of a value and its rounding), so ``residual == 0`` means the parts are exact
    (a part that overflowed e4m3, saturated or NaN, leaves a nonzero or NaN residual).

    When it is exact (the range condition): a bf16 element y = 1.b1..b7 * 2^E has 8 significant bits;
    h = e4m3(y) keeps 4 of them and y - h is a multiple of 2^(E-7) of magnitude <= 2^(E-3), i.e. at
    most 4 significant bits, so it is an e4m3 value whenever 2^(E-7) >= 2^-9 (e4m3's smallest step),
    i.e. E >= -2, and h fits e4m3 (max 448) for |y| < 464. With the largest magnitude in [2^8, 2^9),
    TERMS 2 is exact for every element within 2^10 of it (zeros included) except elements in
    [464, 512), which overflow; TERMS 4 repeats the split on the residual times 2^SHIFT (SHIFT 9),
    reaching 2^19 below. Anything else leaves a residual, and the kernel takes a wider path.
    """
    h0 = x.to(tl.float8e4nv)
    r = x - h0.to(tl.float32)
    l0 = r.to(tl.float8e4nv)
    r = r - l0.to(tl.float32)
    if TERMS == 4:
        r = r * (2.0**SHIFT)
        h1 = r.to(tl.float8e4nv)
        r = r - h1.to(tl.float32)
        l1 = r.to(tl.float8e4nv)
        r = r - l1.to(tl.float32)
    else:
        h1 = h0
        l1 = l0
    return h0, l0, h1, l1, r


@triton.jit
def _n_nonzero(x):
    """How many elements of a 2-D fp32 tile are not zero (NaN counts), int32 scalar."""
    return tl.sum(tl.sum((x != 0.0).to(tl.int32), axis=1), axis=0)


@triton.jit
def _dot_e4m3(a, b, acc, INTERPRET: tl.constexpr):
    """``tl.dot`` of e4m3 operands with fp32 accumulation (the CPU interpreter's fp8 dot is wrong:
    it widens both operands to fp32 there, exactly)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)
    else:
        return tl.dot(a, b, acc, out_dtype=tl.float32)


@triton.jit
def _mx_group_dot_e4m3(k_ptr, base_d, o_t, w_s, qh0, ql0, qh1, ql1, tile_scale, g: tl.constexpr,
                       Q_TERMS: tl.constexpr, SHIFT: tl.constexpr, DATA_BYTES: tl.constexpr, GB: tl.constexpr,
                       USE_ASM: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``[T, NQ]``: MX group ``g`` of every token dotted with Q, times the group's e8m0 scale (byte
    ``g`` of the token's scale word ``w_s``) and the tile's power of two ``tile_scale``, one product of
    powers of two per token. K is ``2^-6 * e2m1`` in e4m3 with the group's even elements first
    (``_e4m3_dims`` order), so a thread's 4 consecutive bytes give two whole 4-element fragments.
    ``Q_TERMS`` 1: ``qh0`` is Q itself (e4m3 Q); 2: ``qh0 + ql0``; 4: ``qh0 + ql0 + 2^-SHIFT (qh1 + ql1)``
    (``_e4m3_levels``)."""
    o_c = tl.arange(0, GB)
    b_d = tl.load(k_ptr + base_d + o_t[:, None] * DATA_BYTES + g * GB + o_c[None, :])
    T: tl.constexpr = b_d.shape[0]
    lo, hi = _e2m1_split_e4m3(b_d, USE_ASM)
    b_k = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (T, 2 * GB))
    if Q_TERMS == 1:
        part = _dot_e4m3(b_k, qh0, None, INTERPRET)
    else:
        part = _dot_e4m3(b_k, qh0, _dot_e4m3(b_k, ql0, None, INTERPRET), INTERPRET)
        if Q_TERMS == 4:
            part2 = _dot_e4m3(b_k, qh1, _dot_e4m3(b_k, ql1, None, INTERPRET), INTERPRET)
            part = part + part2 * (2.0**-SHIFT)
    row_scale = _pow2((w_s >> (8 * g)) & 0xFF) * tile_scale
    return part * row_scale[:, None]


@triton.jit
def _mx_group_dot_f16_tile(k_ptr, base_d, o_t, w_s, qe, qo, tile_scale, g: tl.constexpr, DATA_BYTES: tl.constexpr,
                           GB: tl.constexpr, USE_ASM: tl.constexpr):
    """``_mx_group_dot_split`` with the scales of ``_mx_group_dot_e4m3``: byte ``g`` of the token's scale
    word times one power of two for the whole tile (``qe``/``qo``: fp16 Q in ``_split_dims`` order)."""
    o_c = tl.arange(0, GB)
    b_d = tl.load(k_ptr + base_d + o_t[:, None] * DATA_BYTES + g * GB + o_c[None, :])
    T: tl.constexpr = b_d.shape[0]
    b_d = tl.reshape(tl.permute(tl.reshape(b_d, (T, GB // 4, 2, 2)), (0, 2, 1, 3)), (T, GB))
    lo, hi = _e2m1_split_f16(b_d, USE_ASM)
    part = tl.dot(hi, qo, tl.dot(lo, qe, out_dtype=tl.float32), out_dtype=tl.float32)
    row_scale = _pow2((w_s >> (8 * g)) & 0xFF) * tile_scale
    return part * row_scale[:, None]


@triton.jit
def _page_loop_e4m3(k_ptr, s_ptr, bt_row, out_ptr, o_h, pos, pos_min, m_n, post, tile_scale, p_start, p_end,
                    cp_rank, cp_world, stride_k_page, stride_s_page,
                    h00, l00, h10, l10, h01, l01, h11, l11, h02, l02, h12, l12, h03, l03, h13, l13,
                    Q_TERMS: tl.constexpr, SHIFT: tl.constexpr, NUM_STAGES: tl.constexpr, T: tl.constexpr,
                    G: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
                    USE_ASM: tl.constexpr, INTERPRET: tl.constexpr):
    """Mode ``e4m3``: every page of ``[p_start, p_end)``: one 32-bit load of each token's 4 scale bytes,
    four ``_mx_group_dot_e4m3`` (``Q_TERMS`` 0: ``_mx_group_dot_f16_tile`` with ``h0g``/``l0g`` the
    group's fp16 even/odd Q), the position mask only on pages that reach past ``pos_min`` (the tile's
    first row), and the page max. ``hLg``/``lLg``: level L of group g's Q parts."""
    o_t = tl.arange(0, T)
    GB: tl.constexpr = G // 2
    s_words = s_ptr.to(tl.pointer_type(tl.int32))
    for p in tl.range(p_start, p_end, num_stages=NUM_STAGES):
        page = tl.load(bt_row + p).to(tl.int64)
        base_d = page * stride_k_page
        w_s = tl.load(s_words + page * (stride_s_page // 4) + o_t * (SCALE_BYTES // 4))
        if Q_TERMS == 0:
            acc = _mx_group_dot_f16_tile(k_ptr, base_d, o_t, w_s, h00, l00, tile_scale, 0, DATA_BYTES, GB, USE_ASM)
            acc += _mx_group_dot_f16_tile(k_ptr, base_d, o_t, w_s, h01, l01, tile_scale, 1, DATA_BYTES, GB, USE_ASM)
            acc += _mx_group_dot_f16_tile(k_ptr, base_d, o_t, w_s, h02, l02, tile_scale, 2, DATA_BYTES, GB, USE_ASM)
            acc += _mx_group_dot_f16_tile(k_ptr, base_d, o_t, w_s, h03, l03, tile_scale, 3, DATA_BYTES, GB, USE_ASM)
        else:
            acc = _mx_group_dot_e4m3(k_ptr, base_d, o_t, w_s, h00, l00, h10, l10, tile_scale, 0, Q_TERMS, SHIFT,
                                     DATA_BYTES, GB, USE_ASM, INTERPRET)
            acc += _mx_group_dot_e4m3(k_ptr, base_d, o_t, w_s, h01, l01, h11, l11, tile_scale, 1, Q_TERMS, SHIFT,
                                      DATA_BYTES, GB, USE_ASM, INTERPRET)
            acc += _mx_group_dot_e4m3(k_ptr, base_d, o_t, w_s, h02, l02, h12, l12, tile_scale, 2, Q_TERMS, SHIFT,
                                      DATA_BYTES, GB, USE_ASM, INTERPRET)
            acc += _mx_group_dot_e4m3(k_ptr, base_d, o_t, w_s, h03, l03, h13, l13, tile_scale, 3, Q_TERMS, SHIFT,
                                      DATA_BYTES, GB, USE_ASM, INTERPRET)
        t0 = (p * cp_world + cp_rank) * T
        if t0 + T - 1 > pos_min:
            acc = tl.where((t0 + o_t)[:, None] <= pos[None, :], acc, float("-inf"))
        tl.store(out_ptr + o_h + p, tl.max(acc, axis=0) * post, mask=m_n)


@triton.jit
def _page_loop_e4m3_stacked(k_ptr, s_ptr, bt_row, out_ptr, o_h, pos, pos_min, m_n, post, tile_scale, p_start,
                            p_end, cp_rank, cp_world, stride_k_page, stride_s_page, qs_h, qs_l,
                            Q_TERMS: tl.constexpr, NUM_STAGES: tl.constexpr, T: tl.constexpr, G: tl.constexpr,
                            NV: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
                            USE_ASM: tl.constexpr, INTERPRET: tl.constexpr):
    """Mode ``e4m3``, stacked: one K=128 dot per page against a block-diagonal Q ``[128, 4 NV]``
    (column ``g NV + n``: query n's group g, zero elsewhere), then each group's scale on its columns
    and the sum over groups: ``[T, NV]`` scores with no padding columns past the tile's queries.
    ``Q_TERMS`` 1: e4m3 Q ``qs_h``; 2: e4m3 ``qs_h + qs_l``; 0: fp16 Q ``qs_h`` and fp16 K."""
    GB: tl.constexpr = G // 2
    NG: tl.constexpr = DATA_BYTES // GB
    o_t = tl.arange(0, T)
    o_b = tl.arange(0, DATA_BYTES)
    grp = tl.arange(0, NG * NV) // NV
    s_words = s_ptr.to(tl.pointer_type(tl.int32))
    for p in tl.range(p_start, p_end, num_stages=NUM_STAGES):
        page = tl.load(bt_row + p).to(tl.int64)
        b_d = tl.load(k_ptr + page * stride_k_page + o_t[:, None] * DATA_BYTES + o_b[None, :])
        w_s = tl.load(s_words + page * (stride_s_page // 4) + o_t * (SCALE_BYTES // 4))
        if Q_TERMS == 0:
            # fp16: each group's bytes in ``_split_dims`` order (byte 4c + 2h + i to column 8h + 2c + i)
            b_d = tl.reshape(tl.permute(tl.reshape(b_d, (T, NG, GB // 4, 2, 2)), (0, 1, 3, 2, 4)), (T, NG, GB))
            lo3, hi3 = _e2m1_split_f16(b_d, USE_ASM)
            b_k = tl.reshape(tl.permute(tl.join(lo3, hi3), (0, 1, 3, 2)), (T, NG * G))
            part = tl.dot(b_k, qs_h, out_dtype=tl.float32)
        else:
            lo, hi = _e2m1_split_e4m3(b_d, USE_ASM)
            lo3 = tl.reshape(lo, (T, NG, GB))
            hi3 = tl.reshape(hi, (T, NG, GB))
            b_k = tl.reshape(tl.permute(tl.join(lo3, hi3), (0, 1, 3, 2)), (T, NG * G))
            if Q_TERMS == 1:
                part = _dot_e4m3(b_k, qs_h, None, INTERPRET)
            else:
                part = _dot_e4m3(b_k, qs_h, _dot_e4m3(b_k, qs_l, None, INTERPRET), INTERPRET)
        sc = _pow2((w_s[:, None] >> (8 * grp)[None, :]) & 0xFF) * tile_scale
        acc = tl.sum(tl.reshape(part * sc, (T, NG, NV)), axis=1)
        t0 = (p * cp_world + cp_rank) * T
        if t0 + T - 1 > pos_min:
            acc = tl.where((t0 + o_t)[:, None] <= pos[None, :], acc, float("-inf"))
        tl.store(out_ptr + o_h + p, tl.max(acc, axis=0) * post, mask=m_n)


@triton.jit
def _score_kernel(
    q_ptr, k_ptr, s_ptr, bt_ptr, seq_ptr, cu_ptr, tile_ptr, out_ptr,
    n_cols, S, cp_rank, cp_world, sm_scale,
    stride_q_r, stride_q_h, stride_k_page, stride_s_page, stride_bt, stride_o_h, stride_o_r,
    FMT: tl.constexpr,  # 0 bf16, 1 fp8, 2 mxfp4
    Q_FP8: tl.constexpr,
    H: tl.constexpr,
    ROWS: tl.constexpr,  # query rows per tile (decode: S)
    NQ: tl.constexpr,  # query vectors per tile, padded (>= 16, power of 2)
    PP: tl.constexpr,  # pages per program
    PREFILL: tl.constexpr,
    FILL_TAIL: tl.constexpr,  # write -inf in columns past the tile's last visible page
    NUM_STAGES: tl.constexpr,
    USE_ASM: tl.constexpr,
    MX_STACKED: tl.constexpr,  # MXFP4: one dot per page against a block-diagonal Q
    MX_SPLIT: tl.constexpr,  # MXFP4: two K=16 dots per group on unshuffled fragments (else one K=32 dot)
    MX_E4M3: tl.constexpr,  # MXFP4: e4m3 K and Q parts, one fp8 dot per group and Q part (else MX_SPLIT)
    Q8_TERMS: tl.constexpr,  # MX_E4M3, bf16 Q: e4m3 parts per element (2 or 4, _e4m3_levels); 0: none (fp16 only)
    INTERPRET: tl.constexpr,
    D: tl.constexpr,
    T: tl.constexpr,
    G: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    KFAC: tl.constexpr,  # 2^14: MXFP4 K is formed as 2^-14 * e2m1
    Q_TOP: tl.constexpr,
    K8FAC: tl.constexpr,  # 2^6: MX_E4M3 K is formed as 2^-6 * e2m1
    Q8_TOP: tl.constexpr,
    Q8_SHIFT: tl.constexpr,
    E4M3_STACK: tl.constexpr,  # MX_E4M3: one dot per page against a block-diagonal Q of NV vectors
    NV: tl.constexpr,  # query vectors per tile padded to a power of two >= 4 (E4M3_STACK)
):
    i_c, i_tile = tl.program_id(0), tl.program_id(1)
    if PREFILL:
        b = tl.load(tile_ptr + 2 * i_tile)
        row0 = tl.load(tile_ptr + 2 * i_tile + 1)
        cu0 = tl.load(cu_ptr + b)
        cu1 = tl.load(cu_ptr + b + 1)
        n_rows = tl.minimum(cu1 - row0, ROWS)
        pos0 = tl.load(seq_ptr + b) - (cu1 - cu0) + (row0 - cu0)
    else:
        b = i_tile
        row0 = b * S
        n_rows = S
        pos0 = tl.load(seq_ptr + b) - S
    # Local pages holding any token at or before the tile's last position.
    last_pos = pos0 + n_rows - 1
    n_global = tl.where(last_pos >= 0, last_pos // T + 1, 0)
    n_local = tl.minimum(tl.maximum((n_global - cp_rank + cp_world - 1) // cp_world, 0), n_cols)
    p_start = i_c * PP
    p_stop = tl.minimum(p_start + PP, n_cols)
    o_n = tl.arange(0, NQ)
    j = o_n // H
    m_n = j < n_rows
    rows = row0 + j
    heads = o_n % H
    pos = pos0 + j
    o_h = heads.to(tl.int64) * stride_o_h + rows.to(tl.int64) * stride_o_r
    if FILL_TAIL:
        for p in range(tl.maximum(p_start, n_local), p_stop):
            tl.store(out_ptr + o_h + p, tl.full([NQ], float("-inf"), tl.float32), mask=m_n)
    p_end = tl.minimum(p_stop, n_local)
    if p_start >= p_end:
        return

    # Query vectors, widened onto the tensor-core operand type (module docstring).
    post = tl.full([NQ], 1.0, tl.float32) * sm_scale
    if FMT == 2 and MX_E4M3:
        bt_row8 = bt_ptr + b.to(tl.int64) * stride_bt
        q0 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _e4m3_dims(0, G))
        q1 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _e4m3_dims(1, G))
        q2 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _e4m3_dims(2, G))
        q3 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _e4m3_dims(3, G))
        if E4M3_STACK:
            # Block-diagonal Q over NV query vectors (the tile's, padded to a power of two >= 4).
            o_v = tl.arange(0, 4 * NV)
            n_v = o_v % NV
            m_v = (n_v // H) < n_rows
            o_d8 = tl.arange(0, D)
            dims8 = (o_d8 // G) * G + 2 * (o_d8 % (G // 2)) + (o_d8 % G) // (G // 2)
            q_st = _load_q_dims(q_ptr, row0 + n_v // H, n_v % H, m_v, stride_q_r, stride_q_h, dims8)
            q_st = tl.where((o_d8 // G)[:, None] == (o_v // NV)[None, :], q_st, 0.0)
            o_n8 = tl.arange(0, NV)
            j8 = o_n8 // H
            m_n8 = j8 < n_rows
            o_h8 = (o_n8 % H).to(tl.int64) * stride_o_h + (row0 + j8).to(tl.int64) * stride_o_r
            post8 = tl.full([NV], 1.0, tl.float32) * sm_scale
            if Q8_TERMS > 0:  # e4m3 parts (fp8 tensor cores: reduced-precision accumulation on Hopper)
                if Q_FP8:
                    q_h = q_st.to(tl.float8e4nv)
                    _page_loop_e4m3_stacked(k_ptr, s_ptr, bt_row8, out_ptr, o_h8, pos0 + j8, pos0, m_n8, post8, K8FAC,
                                            p_start, p_end, cp_rank, cp_world, stride_k_page, stride_s_page, q_h, q_h,
                                            1, NUM_STAGES, T, G, NV, DATA_BYTES, SCALE_BYTES, USE_ASM, INTERPRET)
                    return
                else:
                    e8s = _q_exponent(tl.max(tl.max(tl.abs(q_st), axis=1), axis=0), Q8_TOP)
                    q_h, q_l, q_h1, q_l1, r_st = _e4m3_levels(q_st * _pow2(2 * 127 + Q8_TOP - e8s), Q8_SHIFT, 2)
                    if _n_nonzero(r_st) == 0:
                        _page_loop_e4m3_stacked(k_ptr, s_ptr, bt_row8, out_ptr, o_h8, pos0 + j8, pos0, m_n8, post8,
                                                _pow2(e8s - Q8_TOP) * K8FAC, p_start, p_end, cp_rank, cp_world,
                                                stride_k_page, stride_s_page, q_h, q_l, 2, NUM_STAGES, T, G, NV,
                                                DATA_BYTES, SCALE_BYTES, USE_ASM, INTERPRET)
                        return
            # fp16 with one power of two for the tile, stacked the same way (fp16 decode order).
            GB8: tl.constexpr = G // 2
            jj = o_d8 % GB8
            dims16 = ((o_d8 // G) * G + 2 * (4 * ((jj % 8) // 2) + 2 * (jj // 8) + (jj % 2))
                      + (o_d8 % G) // GB8)
            q16 = _load_q_dims(q_ptr, row0 + n_v // H, n_v % H, m_v, stride_q_r, stride_q_h, dims16)
            e16s = _q_exponent(tl.max(tl.max(tl.abs(q16), axis=1), axis=0), Q_TOP)
            q16 = tl.where((o_d8 // G)[:, None] == (o_v // NV)[None, :], q16, 0.0) * _pow2(2 * 127 + Q_TOP - e16s)
            q16h = q16.to(tl.float16)
            if _n_nonzero(q16h.to(tl.float32) - q16) == 0:
                _page_loop_e4m3_stacked(k_ptr, s_ptr, bt_row8, out_ptr, o_h8, pos0 + j8, pos0, m_n8, post8,
                                        _pow2(e16s - Q_TOP) * KFAC, p_start, p_end, cp_rank, cp_world,
                                        stride_k_page, stride_s_page, q16h, q16h, 0, NUM_STAGES, T, G, NV,
                                        DATA_BYTES, SCALE_BYTES, USE_ASM, INTERPRET)
                return
        if Q_FP8 and Q8_TERMS > 0:
            h0, h1, h2, h3 = q0.to(tl.float8e4nv), q1.to(tl.float8e4nv), q2.to(tl.float8e4nv), q3.to(tl.float8e4nv)
            _page_loop_e4m3(k_ptr, s_ptr, bt_row8, out_ptr, o_h, pos, pos0, m_n, post, K8FAC, p_start, p_end,
                            cp_rank, cp_world, stride_k_page, stride_s_page, h0, h0, h0, h0, h1, h1, h1, h1,
                            h2, h2, h2, h2, h3, h3, h3, h3, 1, Q8_SHIFT, NUM_STAGES, T, G, DATA_BYTES,
                            SCALE_BYTES, USE_ASM, INTERPRET)
            return
        else:  # bf16 Q, or no e4m3 parts
            # One power of two for the whole tile (its largest |q| to [2^8, 2^9) for e4m3 parts, to
            # [2^14, 2^15) for fp16): the scale products are then one per token, not per (token, query).
            amax = tl.maximum(tl.maximum(tl.max(tl.max(tl.abs(q0), axis=1), axis=0),
                                         tl.max(tl.max(tl.abs(q1), axis=1), axis=0)),
                              tl.maximum(tl.max(tl.max(tl.abs(q2), axis=1), axis=0),
                                         tl.max(tl.max(tl.abs(q3), axis=1), axis=0)))
            if Q8_TERMS > 0 and not E4M3_STACK:
                e8 = _q_exponent(amax, Q8_TOP)
                fac8 = _pow2(2 * 127 + Q8_TOP - e8)
                h00, l00, h10, l10, r0 = _e4m3_levels(q0 * fac8, Q8_SHIFT, Q8_TERMS)
                h01, l01, h11, l11, r1 = _e4m3_levels(q1 * fac8, Q8_SHIFT, Q8_TERMS)
                h02, l02, h12, l12, r2 = _e4m3_levels(q2 * fac8, Q8_SHIFT, Q8_TERMS)
                h03, l03, h13, l13, r3 = _e4m3_levels(q3 * fac8, Q8_SHIFT, Q8_TERMS)
                inexact = _n_nonzero(r0) + _n_nonzero(r1) + _n_nonzero(r2) + _n_nonzero(r3)
                if inexact == 0:
                    tile8 = _pow2(e8 - Q8_TOP) * K8FAC
                    _page_loop_e4m3(k_ptr, s_ptr, bt_row8, out_ptr, o_h, pos, pos0, m_n, post, tile8, p_start, p_end,
                                    cp_rank, cp_world, stride_k_page, stride_s_page, h00, l00, h10, l10, h01, l01,
                                    h11, l11, h02, l02, h12, l12, h03, l03, h13, l13, Q8_TERMS, Q8_SHIFT,
                                    NUM_STAGES, T, G, DATA_BYTES, SCALE_BYTES, USE_ASM, INTERPRET)
                    return
            if (Q8_TERMS == 0 or Q8_TERMS == 2) and not E4M3_STACK:
                # fp16 with one power of two for the tile, when that is exact for every element.
                e16 = _q_exponent(amax, Q_TOP)
                fac16 = _pow2(2 * 127 + Q_TOP - e16)
                f0 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(0, 0, G // 2)) * fac16
                g0 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(0, 1, G // 2)) * fac16
                f1 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(1, 0, G // 2)) * fac16
                g1 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(1, 1, G // 2)) * fac16
                f2 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(2, 0, G // 2)) * fac16
                g2 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(2, 1, G // 2)) * fac16
                f3 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(3, 0, G // 2)) * fac16
                g3 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(3, 1, G // 2)) * fac16
                hf0, hg0, hf1, hg1 = f0.to(tl.float16), g0.to(tl.float16), f1.to(tl.float16), g1.to(tl.float16)
                hf2, hg2, hf3, hg3 = f2.to(tl.float16), g2.to(tl.float16), f3.to(tl.float16), g3.to(tl.float16)
                off16 = (_n_nonzero(hf0.to(tl.float32) - f0) + _n_nonzero(hg0.to(tl.float32) - g0)
                         + _n_nonzero(hf1.to(tl.float32) - f1) + _n_nonzero(hg1.to(tl.float32) - g1)
                         + _n_nonzero(hf2.to(tl.float32) - f2) + _n_nonzero(hg2.to(tl.float32) - g2)
                         + _n_nonzero(hf3.to(tl.float32) - f3) + _n_nonzero(hg3.to(tl.float32) - g3))
                if off16 == 0:
                    tile16 = _pow2(e16 - Q_TOP) * KFAC
                    _page_loop_e4m3(k_ptr, s_ptr, bt_row8, out_ptr, o_h, pos, pos0, m_n, post, tile16, p_start,
                                    p_end, cp_rank, cp_world, stride_k_page, stride_s_page, hf0, hg0, hf0, hg0,
                                    hf1, hg1, hf1, hg1, hf2, hg2, hf2, hg2, hf3, hg3, hf3, hg3, 0, Q8_SHIFT,
                                    NUM_STAGES, T, G, DATA_BYTES, SCALE_BYTES, USE_ASM, INTERPRET)
                    return
        # else: a tile too wide for one power of two; it is scored by the split path below
    if FMT == 2 and MX_STACKED:
        # One dot per page against a block-diagonal Q: column g*NQ + n holds query n's group g
        # (zero elsewhere), so the product holds every group's partial dot for every query.
        o_c = tl.arange(0, 4 * NQ)
        n_c = o_c % NQ
        m_c = (n_c // H) < n_rows
        q_all = _load_q(q_ptr, row0 + n_c // H, n_c % H, m_c, stride_q_r, stride_q_h, 0, D)  # [D, 4NQ]
        q_own = _load_q(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, 0, D)  # [D, NQ]
        if Q_FP8:
            col_scale = tl.full([NQ], KFAC, tl.float32)
        else:
            e_all = _q_exponent(tl.max(tl.abs(q_all), axis=0), Q_TOP)
            q_all = q_all * _pow2(2 * 127 + Q_TOP - e_all)[None, :]
            e_own = _q_exponent(tl.max(tl.abs(q_own), axis=0), Q_TOP)
            col_scale = _pow2(e_own - Q_TOP) * KFAC
        o_dd = tl.arange(0, D)
        q_bd = tl.where((o_dd // G)[:, None] == (o_c // NQ)[None, :], q_all, 0.0).to(tl.float16)
    elif FMT == 2 and MX_SPLIT:
        GB: tl.constexpr = G // 2
        e0 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(0, 0, GB))
        o0 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(0, 1, GB))
        e1 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(1, 0, GB))
        o1 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(1, 1, GB))
        e2 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(2, 0, GB))
        o2 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(2, 1, GB))
        e3 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(3, 0, GB))
        o3 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(3, 1, GB))
        if Q_FP8:
            col_scale = tl.full([NQ], KFAC, tl.float32)
        else:
            amax = tl.maximum(tl.maximum(tl.maximum(tl.max(tl.abs(e0), axis=0), tl.max(tl.abs(o0), axis=0)),
                                         tl.maximum(tl.max(tl.abs(e1), axis=0), tl.max(tl.abs(o1), axis=0))),
                              tl.maximum(tl.maximum(tl.max(tl.abs(e2), axis=0), tl.max(tl.abs(o2), axis=0)),
                                         tl.maximum(tl.max(tl.abs(e3), axis=0), tl.max(tl.abs(o3), axis=0))))
            e_q = _q_exponent(amax, Q_TOP)
            fac = _pow2(2 * 127 + Q_TOP - e_q)[None, :]
            e0, o0, e1, o1 = e0 * fac, o0 * fac, e1 * fac, o1 * fac
            e2, o2, e3, o3 = e2 * fac, o2 * fac, e3 * fac, o3 * fac
            col_scale = _pow2(e_q - Q_TOP) * KFAC
        e0, o0, e1, o1 = e0.to(tl.float16), o0.to(tl.float16), e1.to(tl.float16), o1.to(tl.float16)
        e2, o2, e3, o3 = e2.to(tl.float16), o2.to(tl.float16), e3.to(tl.float16), o3.to(tl.float16)
    elif FMT == 2:
        q0 = _load_q(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, 0 * G, G)
        q1 = _load_q(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, 1 * G, G)
        q2 = _load_q(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, 2 * G, G)
        q3 = _load_q(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, 3 * G, G)
        # col_scale undoes the Q power of two and the 2^-14 of the fp16 e2m1 (module docstring).
        if Q_FP8:
            col_scale = tl.full([NQ], KFAC, tl.float32)
        else:
            amax = tl.maximum(tl.maximum(tl.max(tl.abs(q0), axis=0), tl.max(tl.abs(q1), axis=0)),
                              tl.maximum(tl.max(tl.abs(q2), axis=0), tl.max(tl.abs(q3), axis=0)))
            e_q = _q_exponent(amax, Q_TOP)
            fac = _pow2(2 * 127 + Q_TOP - e_q)[None, :]
            q0, q1, q2, q3 = q0 * fac, q1 * fac, q2 * fac, q3 * fac
            col_scale = _pow2(e_q - Q_TOP) * KFAC
        q0, q1, q2, q3 = q0.to(tl.float16), q1.to(tl.float16), q2.to(tl.float16), q3.to(tl.float16)
    else:
        b_q = _load_q(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, 0, D)
        if FMT == 0:
            if not INTERPRET:  # the CPU interpreter's bf16 dot is wrong: it scores in fp32 there
                b_q = b_q.to(tl.bfloat16)
        else:
            if not Q_FP8:
                amax = tl.max(tl.abs(b_q), axis=0)
                e_q = _q_exponent(amax, Q_TOP)
                b_q = b_q * _pow2(2 * 127 + Q_TOP - e_q)[None, :]
                post = post * _pow2(e_q - Q_TOP)
            b_q = b_q.to(tl.float16)

    o_t = tl.arange(0, T)
    o_d = tl.arange(0, D)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for p in tl.range(p_start, p_end, num_stages=NUM_STAGES):
        page = tl.load(bt_row + p).to(tl.int64)
        if FMT == 2 and MX_STACKED:
            o_b = tl.arange(0, DATA_BYTES)
            o_g = tl.arange(0, D // G)
            b_d = tl.load(k_ptr + page * stride_k_page + o_t[:, None] * DATA_BYTES + o_b[None, :])
            b_s = tl.load(s_ptr + page * stride_s_page + o_t[:, None] * SCALE_BYTES + o_g[None, :])
            b_k = _e2m1_to_f16(b_d, USE_ASM)  # [T, D]
            part = tl.reshape(tl.dot(b_k, q_bd, out_dtype=tl.float32), (T, D // G, NQ))
            acc = tl.sum(part * _pow2(b_s.to(tl.int32))[:, :, None], axis=1) * col_scale[None, :]
        elif FMT == 2 and MX_SPLIT:
            base_d = page * stride_k_page
            base_s = page * stride_s_page
            acc = _mx_group_dot_split(k_ptr, s_ptr, base_d, base_s, o_t, e0, o0, col_scale, 0, DATA_BYTES,
                                      SCALE_BYTES, G // 2, USE_ASM)
            acc += _mx_group_dot_split(k_ptr, s_ptr, base_d, base_s, o_t, e1, o1, col_scale, 1, DATA_BYTES,
                                       SCALE_BYTES, G // 2, USE_ASM)
            acc += _mx_group_dot_split(k_ptr, s_ptr, base_d, base_s, o_t, e2, o2, col_scale, 2, DATA_BYTES,
                                       SCALE_BYTES, G // 2, USE_ASM)
            acc += _mx_group_dot_split(k_ptr, s_ptr, base_d, base_s, o_t, e3, o3, col_scale, 3, DATA_BYTES,
                                       SCALE_BYTES, G // 2, USE_ASM)
        elif FMT == 2:
            base_d = page * stride_k_page
            base_s = page * stride_s_page
            acc = _mx_group_dot(k_ptr, s_ptr, base_d, base_s, o_t, q0, col_scale, 0, DATA_BYTES, SCALE_BYTES,
                      G // 2, USE_ASM)
            acc += _mx_group_dot(k_ptr, s_ptr, base_d, base_s, o_t, q1, col_scale, 1, DATA_BYTES, SCALE_BYTES,
                       G // 2, USE_ASM)
            acc += _mx_group_dot(k_ptr, s_ptr, base_d, base_s, o_t, q2, col_scale, 2, DATA_BYTES, SCALE_BYTES,
                       G // 2, USE_ASM)
            acc += _mx_group_dot(k_ptr, s_ptr, base_d, base_s, o_t, q3, col_scale, 3, DATA_BYTES, SCALE_BYTES,
                       G // 2, USE_ASM)
        else:
            b_k = tl.load(k_ptr + page * stride_k_page + o_t[:, None] * D + o_d[None, :])
            if FMT == 1:
                b_k = b_k.to(tl.float16)
            if INTERPRET and FMT == 0:
                acc = tl.dot(b_k.to(tl.float32), b_q, input_precision="ieee", out_dtype=tl.float32)
            else:
                acc = tl.dot(b_k, b_q, out_dtype=tl.float32)
        t_pos = (p * cp_world + cp_rank) * T + o_t
        acc = tl.where(t_pos[:, None] <= pos[None, :], acc, float("-inf"))
        tl.store(out_ptr + o_h + p, tl.max(acc, axis=0) * post, mask=m_n)


def _static_constexprs() -> dict:
    """The kernel's constexpr arguments that depend on nothing but the formats' constants."""
    return dict(INTERPRET=_interpret(), D=INDEX_DIM, T=PAGE_SIZE, G=MX_GROUP_SIZE, DATA_BYTES=MXFP4_DATA_BYTES,
                SCALE_BYTES=MXFP4_SCALE_BYTES, KFAC=float(2**_F16_K_EXP), Q_TOP=_Q_F16_TOP,
                K8FAC=float(2**_E4M3_K_EXP), Q8_TOP=_Q_E4M3_TOP, Q8_SHIFT=_Q_E4M3_SHIFT)


def _pages_per_program(work_pages: int) -> int:
    """Pages per program: about 2048 programs for the whole call, 1..16 pages each."""
    pp = 1
    while pp < 16 and work_pages // (2 * pp) >= 2048:
        pp *= 2
    return pp


def _cache_args(k_cache, k_scale, fmt):
    if fmt is IndexKFormat.MXFP4:
        return k_cache, k_scale, k_cache.stride(0), k_scale.stride(0)
    return k_cache, None, k_cache.stride(0), 0


def _launch(q, k_cache, k_scale, fmt, block_table, seq_lens, cu, tiles, out, n_tiles, S, rows, max_block,
            sm_scale, cp_rank, cp_world, prefill, fill_tail, pp=None, num_warps=4, num_stages=2):
    H = q.shape[1]
    nq = max(16, triton.next_power_of_2(rows * H))
    nv = max(4, triton.next_power_of_2(rows * H))
    if pp is None:
        pp = _pages_per_program(n_tiles * max_block)
    k_ptr, s_ptr, stride_k, stride_s = _cache_args(k_cache, k_scale, fmt)
    grid = (triton.cdiv(max_block, pp), n_tiles)
    if grid[0] == 0 or grid[1] == 0:
        return out
    _score_kernel[grid](
        q, k_ptr, s_ptr, block_table, seq_lens, cu, tiles, out,
        max_block, S, cp_rank, cp_world, sm_scale,
        q.stride(0), q.stride(1), stride_k, stride_s, block_table.stride(0), out.stride(0), out.stride(1),
        FMT=_FMT_CODE[fmt], Q_FP8=q.dtype == FP8_DTYPE, H=H, ROWS=rows, NQ=nq, PP=pp, PREFILL=prefill,
        E4M3_STACK=_stacked(_mx_mode(), nv),
        NV=nv,
        FILL_TAIL=fill_tail, NUM_STAGES=num_stages, USE_ASM=_use_asm(), **_mode_flags(_mx_mode()),
        **_static_constexprs(), num_warps=num_warps,
    )
    return out


def score_decode_triton(q, k_cache, k_scale, fmt, batch, max_block, block_table, seq_lens, S, sm_scale,
                        out=None, cp_rank=0, cp_world=1, pp=None, num_warps=4, num_stages=2):
    """Decode scores ``fp32 [H, batch*S, max_block]``; arguments validated by ``check_decode_args``.

    No host synchronisation and no data-dependent grid: safe to capture in a CUDA graph. With
    ``out=None`` the buffer is allocated here and every column past a row's last visible page
    reads -inf; a preallocated ``out`` is written up to each request's last page only.
    """
    H = q.shape[1]
    fill_tail = out is None
    if out is None:
        out = torch.empty((H, batch * S, max_block), dtype=torch.float32, device=q.device)
    return _launch(q, k_cache, k_scale, fmt, block_table, seq_lens, None, None, out, batch, S, S, max_block,
                   sm_scale, cp_rank, cp_world, False, fill_tail, pp, num_warps, num_stages)


def prefill_tiles(cu_seqlens_q, H: int, device=None):
    """Host work map for prefill: ``(int32 [n_tiles, 2] of (request, first row), rows per tile)``.

    ``cu_seqlens_q``: the int32 tensor (read back: one sync) or the same offsets as a list of ints
    (no sync); the map is put on ``device`` (default: the tensor's)."""
    rows = max(1, _PREFILL_ROWS_X_HEADS // H)
    if isinstance(cu_seqlens_q, torch.Tensor):
        cu, device = cu_seqlens_q.tolist(), device or cu_seqlens_q.device
    else:
        cu = list(cu_seqlens_q)
    tiles = [(b, r) for b in range(len(cu) - 1) for r in range(cu[b], cu[b + 1], rows)]
    t = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 2)
    return t.to(device), rows


def score_prefill_triton(q, k_cache, k_scale, fmt, max_block, block_table, seq_lens, cu_seqlens_q, sm_scale,
                         out=None, tiles=None, pp=None, num_warps=4, num_stages=2):
    """Prefill scores ``fp32 [H, total_new_tokens, max_block]``; validated by ``check_prefill_args``.

    ``tiles``: the ``prefill_tiles`` work map of this batch, made once by the caller; without it the
    map is built here from ``cu_seqlens_q`` (one sync). Every column is written (-inf past each row's
    last visible page) whether ``out`` is given or not, as ``naive.score_prefill_ref``.
    """
    H = q.shape[1]
    if out is None:
        out = torch.empty((H, q.shape[0], max_block), dtype=torch.float32, device=q.device)
    tiles, rows = tiles if tiles is not None else prefill_tiles(cu_seqlens_q, H)
    return _launch(q, k_cache, k_scale, fmt, block_table, seq_lens, cu_seqlens_q, tiles, out, tiles.shape[0], 0,
                   rows, max_block, sm_scale, 0, 1, True, True, pp, num_warps, num_stages)


__all__ = ["score_decode_triton", "score_prefill_triton", "prefill_tiles"]
