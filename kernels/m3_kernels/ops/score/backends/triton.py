"""Triton block scorers (decode and prefill) over the paged index-K cache: bf16, fp8 and MXFP4.

Contract: ``naive.score_decode_ref`` / ``naive.score_prefill_ref`` (``docs/design.md``, "The block
scorer contract"). Validation happens in the plans (``plan_decode`` / ``plan_prefill``), the runs'
host check (``common.check_run``) and when the ``IndexKCache`` is made; nothing here re-checks them.
A page id outside the cache is read as page 0 and scores -inf; a query vector holding a NaN or Inf
scores NaN on every page it sees (the rules of ``naive.py``).

Work map: one program per (chunk of ``PP`` local pages, query tile). A decode query tile is one
request's ``S`` rows; a prefill tile is up to ``64 // H`` consecutive new tokens of one request.
Each program loads its tile's ``S*H`` query vectors once, then for every page: loads the page,
forms K on the tensor-core operand, takes one or a few ``tl.dot`` per page, masks tokens past each
row's position, takes the page max and stores ``sm_scale * max``. Splitting pages over programs
fills the GPU at small batch.

MXFP4 (the portable Triton path: fp16 tensor cores and integer ops only, so it runs wherever Triton
has an fp16 dot; ``docs/perf.md`` says why this one was kept). Each page's e2m1 codes are decoded to
fp16 with the bytes of a 32-element group in "split" order (even elements, then odd, with bytes
and Q permuted so that a thread's tensor-core fragment is 4 consecutive bytes). The tile's Q is
rounded to fp16 with ONE power of two for the whole tile, checked exact element by element, and
then, per page:
- tiles of at most 8 query vectors ("stacked"): one K=128 dot against a block-diagonal Q of
  ``4 NV`` columns (column ``g NV + n``: query n's group g, zero elsewhere; NV = the tile's vectors
  padded to a power of two >= 4), each group's scale on its columns, groups summed;
- larger tiles (prefill, decode with S*H > 8): per group two K=16 dots (even and odd elements);
- a tile that one power of two cannot hold exactly (query vectors of very different sizes) is
  scored with a power of two per query vector instead (the same per-group dots, per-(token,
  vector) scale products): exact too, slower.

Numerics:
- MXFP4: each e2m1 code becomes the fp16 bit pattern ``sign << 15 | code << 9``, i.e. exactly
  ``2^-14 * e2m1`` (code 1 is an fp16 subnormal); each group's fp32 partial dot product is
  multiplied by one power of two, the product of the group's e8m0 scale, ``2^14`` and the Q
  tile's (or vector's) power of two, so it leaves fp32's range only where the exact score does.
- fp8: e4m3 widens to fp16 exactly.
- Q: e4m3 widens to fp16 exactly. A bf16 Q vector (or tile) is multiplied by a power of two that
  puts its largest magnitude in [2^14, 2^15) and then rounded to fp16 (11 significant bits, so exact
  for every element within 2^28 of the largest; smaller ones round at 2^-39 of it), and the power
  of two is undone after the max. A bf16 cache is scored in bf16 directly.
- Products are exact in fp32 and accumulated in fp32 by the tensor cores.
"""

import os

import torch
import triton
import triton.language as tl

from ....formats import (
    FP8_DTYPE,
    INDEX_DIM,
    MX_GROUP_SIZE,
    MXFP4_DATA_BYTES,
    MXFP4_SCALE_BYTES,
    PAGE_SIZE,
    IndexKFormat,
)
from ...pdl import triton_launch_kwargs, use_pdl

FMT_CODE = {IndexKFormat.BF16: 0, IndexKFormat.FP8: 1, IndexKFormat.MXFP4: 2, IndexKFormat.MXFP4_ROT: 2}  # kernels' FMT
_F16_K_EXP = 14  # MXFP4 K is formed as 2^-14 * e2m1 in fp16
_Q_F16_TOP = 14  # a bf16 Q row's largest magnitude is moved to [2^14, 2^15)
_PREFILL_ROWS_X_HEADS = 64  # query vectors per prefill tile
_MX_STACK_MAX_NV = 8  # MXFP4: tiles of at most this many query vectors take the stacked page loop
ENV_NO_ASM = "M3_TRITON_NO_ASM"  # "1": decode e2m1 with plain Triton ops on the GPU too (no inline PTX)


def interpret() -> bool:
    """Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_asm() -> bool:
    """Inline PTX for the e2m1 decode: on NVIDIA GPUs only (not in the interpreter, not on ROCm; ``ENV_NO_ASM``)."""
    return not interpret() and torch.version.hip is None and os.environ.get(ENV_NO_ASM, "0") != "1"


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
def _load_q_split(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, GB: tl.constexpr):
    """fp32 ``[GB, NQ]`` x 8: each MX group's even then odd elements in ``_split_dims`` order."""
    e0 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(0, 0, GB))
    o0 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(0, 1, GB))
    e1 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(1, 0, GB))
    o1 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(1, 1, GB))
    e2 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(2, 0, GB))
    o2 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(2, 1, GB))
    e3 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(3, 0, GB))
    o3 = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, _split_dims(3, 1, GB))
    return e0, o0, e1, o1, e2, o2, e3, o3


@triton.jit
def _load_q(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, d0, DK: tl.constexpr):
    """fp32 ``[DK, NQ]`` slice ``d0 : d0 + DK`` of the query vectors (zero where masked)."""
    return _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, d0 + tl.arange(0, DK))


# e2m1 nibbles to fp16 (2^-14 * e2m1) by byte permutes: four bytes in, four f16x2 words out (see _e2m1_split_f16);
# the sm_90 prefill scorer (triton_sm90) builds on the same text
_E2M1_F16_ASM_TEXT = """
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
            """
_E2M1_F16_ASM = tl.constexpr(_E2M1_F16_ASM_TEXT)  # a jit function reads module globals only as constexpr


@triton.jit
def _e2m1_split_f16(b_d, USE_ASM: tl.constexpr):
    """uint8 ``[..., C]`` packed e2m1 -> (low-nibble fp16, high-nibble fp16), each ``[..., C]`` and
    ``2^-14 * e2m1``, without interleaving.

    fp16 of nibble n is ``(n & 8) << 12 | (n & 7) << 9``: its low byte is zero and its high byte
    is ``(n & 8) << 4 | (n & 7) << 1``, so the GPU path builds four high bytes per 32-bit word
    with two masks and shifts and places them with byte permutes (about 1.6 instructions per
    element).
    """
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm=_E2M1_F16_ASM,
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
def _group_f16_split(k_ptr, base_d, o_t, g: tl.constexpr, DATA_BYTES: tl.constexpr, GB: tl.constexpr,
                     USE_ASM: tl.constexpr):
    """fp16 ``[T, GB]`` x 2: MX group ``g`` of every token, even and odd elements in ``_split_dims``
    order (physical byte 4c + 2h + i to logical column 8h + 2c + i)."""
    o_c = tl.arange(0, GB)
    b_d = tl.load(k_ptr + base_d + o_t[:, None] * DATA_BYTES + g * GB + o_c[None, :])
    T: tl.constexpr = b_d.shape[0]
    b_d = tl.reshape(tl.permute(tl.reshape(b_d, (T, GB // 4, 2, 2)), (0, 2, 1, 3)), (T, GB))
    return _e2m1_split_f16(b_d, USE_ASM)


@triton.jit
def _mx_group_dot_split(k_ptr, s_ptr, base_d, base_s, o_t, b_qe, b_qo, col_scale, g: tl.constexpr,
                        DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, GB: tl.constexpr,
                        USE_ASM: tl.constexpr):
    """fp32 ``[T, NQ]``: MX group ``g`` of every token dotted with Q (``b_qe``/``b_qo``: the group's
    even/odd elements in ``_split_dims`` order, fp16), as two K=16 dots, times the group's e8m0
    scale and the column's power of two ``col_scale`` (one product of powers of two: it leaves
    fp32's range only where the exact score does)."""
    b_s = tl.load(s_ptr + base_s + o_t * SCALE_BYTES + g)
    lo, hi = _group_f16_split(k_ptr, base_d, o_t, g, DATA_BYTES, GB, USE_ASM)
    part = tl.dot(hi, b_qo, tl.dot(lo, b_qe, out_dtype=tl.float32), out_dtype=tl.float32)
    return part * (_pow2(b_s.to(tl.int32))[:, None] * col_scale[None, :])


@triton.jit
def _tile_vectors(row0, pos0, n_rows, stride_o_h, stride_o_r, H: tl.constexpr, N: tl.constexpr):
    """A query tile's ``N`` vectors (``n_rows`` tokens from row ``row0`` at position ``pos0``, ``H`` heads each,
    token-major): ``(mask, rows, heads, positions, output offsets without the page)``."""
    o_n = tl.arange(0, N)
    j = o_n // H
    rows = row0 + j
    heads = o_n % H
    return j < n_rows, rows, heads, pos0 + j, heads.to(tl.int64) * stride_o_h + rows.to(tl.int64) * stride_o_r


@triton.jit
def _page_id(bt_row, p, n_pages):
    """Page ``p`` of the request (int64) and whether it lies in the cache; an id outside ``[0, n_pages)`` is
    replaced by page 0, so nothing is read outside the cache, and its score is -inf (``_page_score``)."""
    page = tl.load(bt_row + p)
    ok = (page >= 0) & (page < n_pages)
    return tl.where(ok, page, 0).to(tl.int64), ok


@triton.jit
def _page_score(m, post, ok, bad, first_token, pos):
    """What a page stores: its max times ``post``; NaN for a query vector holding a NaN or Inf (``bad``) that
    sees the page (``first_token <= pos``); -inf for a page id outside the cache (``ok`` false)."""
    v = tl.where(bad & (first_token <= pos), float("nan"), m * post)
    return tl.where(ok, v, float("-inf"))


@triton.jit
def _nonfinite(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, D: tl.constexpr):
    """int1 ``[NQ]``: the query vector holds a NaN or an Inf (``x - x`` is then NaN, else 0)."""
    x = _load_q_dims(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, tl.arange(0, D))
    return tl.sum(((x - x) != 0.0).to(tl.int32), axis=0) > 0


@triton.jit
def _n_nonzero(x):
    """How many elements of a 2-D fp32 tile are not zero (NaN counts), int32 scalar."""
    return tl.sum(tl.sum((x != 0.0).to(tl.int32), axis=1), axis=0)


@triton.jit
def _mx_group_dot_tile(k_ptr, base_d, o_t, w_s, qe, qo, tile_scale, g: tl.constexpr, DATA_BYTES: tl.constexpr,
                       GB: tl.constexpr, USE_ASM: tl.constexpr):
    """``_mx_group_dot_split`` with one power of two for the whole tile: the group's scale is byte
    ``g`` of the token's scale word ``w_s``, times ``tile_scale``, one product per token."""
    lo, hi = _group_f16_split(k_ptr, base_d, o_t, g, DATA_BYTES, GB, USE_ASM)
    part = tl.dot(hi, qo, tl.dot(lo, qe, out_dtype=tl.float32), out_dtype=tl.float32)
    row_scale = _pow2((w_s >> (8 * g)) & 0xFF) * tile_scale
    return part * row_scale[:, None]


@triton.jit
def _page_loop_tile(k_ptr, s_ptr, bt_row, out_ptr, o_h, pos, pos_min, m_n, post, tile_scale, p_start, p_end,
                    cp_rank, cp_world, n_pages, bad, stride_k_page, stride_s_page, qe0, qo0, qe1, qo1, qe2, qo2, qe3,
                    qo3, NUM_STAGES: tl.constexpr, T: tl.constexpr, G: tl.constexpr, DATA_BYTES: tl.constexpr,
                    SCALE_BYTES: tl.constexpr, USE_ASM: tl.constexpr):
    """MXFP4, one power of two per tile, tiles of more than 8 query vectors: every page of
    ``[p_start, p_end)``: one 32-bit load of each token's 4 scale bytes, four ``_mx_group_dot_tile``
    (``qeg``/``qog``: group g's fp16 even/odd Q), the position mask only on pages that reach past
    ``pos_min`` (the tile's first row), and the page max."""
    o_t = tl.arange(0, T)
    GB: tl.constexpr = G // 2
    s_words = s_ptr.to(tl.pointer_type(tl.int32))
    for p in tl.range(p_start, p_end, num_stages=NUM_STAGES):
        page, ok = _page_id(bt_row, p, n_pages)
        base_d = page * stride_k_page
        w_s = tl.load(s_words + page * (stride_s_page // 4) + o_t * (SCALE_BYTES // 4))
        acc = _mx_group_dot_tile(k_ptr, base_d, o_t, w_s, qe0, qo0, tile_scale, 0, DATA_BYTES, GB, USE_ASM)
        acc += _mx_group_dot_tile(k_ptr, base_d, o_t, w_s, qe1, qo1, tile_scale, 1, DATA_BYTES, GB, USE_ASM)
        acc += _mx_group_dot_tile(k_ptr, base_d, o_t, w_s, qe2, qo2, tile_scale, 2, DATA_BYTES, GB, USE_ASM)
        acc += _mx_group_dot_tile(k_ptr, base_d, o_t, w_s, qe3, qo3, tile_scale, 3, DATA_BYTES, GB, USE_ASM)
        t0 = (p * cp_world + cp_rank) * T
        if t0 + T - 1 > pos_min:
            acc = tl.where((t0 + o_t)[:, None] <= pos[None, :], acc, float("-inf"))
        tl.store(out_ptr + o_h + p, _page_score(tl.max(acc, axis=0), post, ok, bad, t0, pos), mask=m_n)


@triton.jit
def _page_loop_stacked(k_ptr, s_ptr, bt_row, out_ptr, o_h, pos, pos_min, m_n, post, tile_scale, p_start, p_end,
                       cp_rank, cp_world, n_pages, bad, stride_k_page, stride_s_page, q_bd, NUM_STAGES: tl.constexpr,
                       T: tl.constexpr, G: tl.constexpr, NV: tl.constexpr, DATA_BYTES: tl.constexpr,
                       SCALE_BYTES: tl.constexpr, USE_ASM: tl.constexpr):
    """MXFP4, one power of two per tile, tiles of at most 8 query vectors: one K=128 dot per page
    against the block-diagonal fp16 Q ``q_bd [128, 4 NV]`` (rows in each group's ``_split_dims``
    order, even elements first), then each group's scale on its columns and the sum over groups:
    ``[T, NV]`` scores with no padding columns past the tile's queries."""
    GB: tl.constexpr = G // 2
    NG: tl.constexpr = DATA_BYTES // GB
    o_t = tl.arange(0, T)
    o_b = tl.arange(0, DATA_BYTES)
    grp = tl.arange(0, NG * NV) // NV
    s_words = s_ptr.to(tl.pointer_type(tl.int32))
    for p in tl.range(p_start, p_end, num_stages=NUM_STAGES):
        page, ok = _page_id(bt_row, p, n_pages)
        b_d = tl.load(k_ptr + page * stride_k_page + o_t[:, None] * DATA_BYTES + o_b[None, :])
        w_s = tl.load(s_words + page * (stride_s_page // 4) + o_t * (SCALE_BYTES // 4))
        # each group's bytes in _split_dims order (byte 4c + 2h + i to column 8h + 2c + i)
        b_d = tl.reshape(tl.permute(tl.reshape(b_d, (T, NG, GB // 4, 2, 2)), (0, 1, 3, 2, 4)), (T, NG, GB))
        lo3, hi3 = _e2m1_split_f16(b_d, USE_ASM)
        b_k = tl.reshape(tl.permute(tl.join(lo3, hi3), (0, 1, 3, 2)), (T, NG * G))
        part = tl.dot(b_k, q_bd, out_dtype=tl.float32)
        sc = _pow2((w_s[:, None] >> (8 * grp)[None, :]) & 0xFF) * tile_scale
        acc = tl.sum(tl.reshape(part * sc, (T, NG, NV)), axis=1)
        t0 = (p * cp_world + cp_rank) * T
        if t0 + T - 1 > pos_min:
            acc = tl.where((t0 + o_t)[:, None] <= pos[None, :], acc, float("-inf"))
        tl.store(out_ptr + o_h + p, _page_score(tl.max(acc, axis=0), post, ok, bad, t0, pos), mask=m_n)


@triton.jit
def _score_kernel(
    q_ptr, k_ptr, s_ptr, bt_ptr, seq_ptr, cu_ptr, tile_ptr, out_ptr,
    n_cols, n_pages, S, cp_rank, cp_world, sm_scale,
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
    INTERPRET: tl.constexpr,
    D: tl.constexpr,
    T: tl.constexpr,
    G: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    KFAC: tl.constexpr,  # 2^14: MXFP4 K is formed as 2^-14 * e2m1
    Q_TOP: tl.constexpr,
    MX_STACK: tl.constexpr,  # MXFP4: the tile's NV vectors fit the stacked page loop
    NV: tl.constexpr,  # query vectors per tile padded to a power of two >= 4 (MX_STACK)
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (ops.pdl)
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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
    m_n, rows, heads, pos, o_h = _tile_vectors(row0, pos0, n_rows, stride_o_h, stride_o_r, H, NQ)
    if FILL_TAIL:
        for p in range(tl.maximum(p_start, n_local), p_stop):
            tl.store(out_ptr + o_h + p, tl.full([NQ], float("-inf"), tl.float32), mask=m_n)
    p_end = tl.minimum(p_stop, n_local)
    if p_start >= p_end:
        return

    # Query vectors, widened onto the tensor-core operand type (module docstring).
    post = tl.full([NQ], 1.0, tl.float32) * sm_scale
    GB: tl.constexpr = G // 2
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    if FMT == 2:
        # One power of two for the whole tile (its largest |q| to [2^14, 2^15)), where the tile's fp16
        # form is exact for every element: the scale products are then one per token.
        if MX_STACK:
            NG: tl.constexpr = D // G
            o_v = tl.arange(0, NG * NV)  # column g * NV + n: query vector n, group g
            n_v = o_v % NV
            m_v = (n_v // H) < n_rows
            o_dd = tl.arange(0, D)  # row: group o_dd // G, then its even (first GB) or odd elements
            jj = o_dd % GB
            dims = ((o_dd // G) * G + 2 * (4 * ((jj % 8) // 2) + 2 * (jj // 8) + (jj % 2)) + (o_dd % G) // GB)
            q_st = _load_q_dims(q_ptr, row0 + n_v // H, n_v % H, m_v, stride_q_r, stride_q_h, dims)
            e_t = _q_exponent(tl.max(tl.max(tl.abs(q_st), axis=1), axis=0), Q_TOP)
            q_st = tl.where((o_dd // G)[:, None] == (o_v // NV)[None, :], q_st, 0.0) * _pow2(2 * 127 + Q_TOP - e_t)
            q_bd = q_st.to(tl.float16)
            if _n_nonzero(q_bd.to(tl.float32) - q_st) == 0:
                o_nv = tl.arange(0, NV)
                j_v = o_nv // H
                o_h_v = (o_nv % H).to(tl.int64) * stride_o_h + (row0 + j_v).to(tl.int64) * stride_o_r
                post_v = tl.full([NV], 1.0, tl.float32) * sm_scale
                bad_v = _nonfinite(q_ptr, row0 + j_v, o_nv % H, j_v < n_rows, stride_q_r, stride_q_h, D)
                _page_loop_stacked(k_ptr, s_ptr, bt_row, out_ptr, o_h_v, pos0 + j_v, pos0, j_v < n_rows, post_v,
                                   _pow2(e_t - Q_TOP) * KFAC, p_start, p_end, cp_rank, cp_world, n_pages, bad_v,
                                   stride_k_page, stride_s_page, q_bd, NUM_STAGES, T, G, NV, DATA_BYTES, SCALE_BYTES,
                                   USE_ASM)
                return
            bad = _nonfinite(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, D)  # for the per-vector loop below
        else:
            bad = _nonfinite(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, D)
            f0, g0, f1, g1, f2, g2, f3, g3 = _load_q_split(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, GB)
            amax = tl.maximum(tl.maximum(tl.maximum(tl.max(tl.max(tl.abs(f0), axis=1), axis=0),
                                                    tl.max(tl.max(tl.abs(g0), axis=1), axis=0)),
                                         tl.maximum(tl.max(tl.max(tl.abs(f1), axis=1), axis=0),
                                                    tl.max(tl.max(tl.abs(g1), axis=1), axis=0))),
                              tl.maximum(tl.maximum(tl.max(tl.max(tl.abs(f2), axis=1), axis=0),
                                                    tl.max(tl.max(tl.abs(g2), axis=1), axis=0)),
                                         tl.maximum(tl.max(tl.max(tl.abs(f3), axis=1), axis=0),
                                                    tl.max(tl.max(tl.abs(g3), axis=1), axis=0))))
            e_t = _q_exponent(amax, Q_TOP)
            fac = _pow2(2 * 127 + Q_TOP - e_t)
            f0, g0, f1, g1 = f0 * fac, g0 * fac, f1 * fac, g1 * fac
            f2, g2, f3, g3 = f2 * fac, g2 * fac, f3 * fac, g3 * fac
            hf0, hg0, hf1, hg1 = f0.to(tl.float16), g0.to(tl.float16), f1.to(tl.float16), g1.to(tl.float16)
            hf2, hg2, hf3, hg3 = f2.to(tl.float16), g2.to(tl.float16), f3.to(tl.float16), g3.to(tl.float16)
            inexact = (_n_nonzero(hf0.to(tl.float32) - f0) + _n_nonzero(hg0.to(tl.float32) - g0)
                       + _n_nonzero(hf1.to(tl.float32) - f1) + _n_nonzero(hg1.to(tl.float32) - g1)
                       + _n_nonzero(hf2.to(tl.float32) - f2) + _n_nonzero(hg2.to(tl.float32) - g2)
                       + _n_nonzero(hf3.to(tl.float32) - f3) + _n_nonzero(hg3.to(tl.float32) - g3))
            if inexact == 0:
                _page_loop_tile(k_ptr, s_ptr, bt_row, out_ptr, o_h, pos, pos0, m_n, post, _pow2(e_t - Q_TOP) * KFAC,
                                p_start, p_end, cp_rank, cp_world, n_pages, bad, stride_k_page, stride_s_page,
                                hf0, hg0, hf1, hg1, hf2, hg2, hf3, hg3, NUM_STAGES, T, G, DATA_BYTES, SCALE_BYTES,
                                USE_ASM)
                return
        # Else a tile too wide for one power of two: a power of two per query vector, in the page loop below.
        e0, o0, e1, o1, e2, o2, e3, o3 = _load_q_split(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, GB)
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
    else:
        b_q = _load_q(q_ptr, rows, heads, m_n, stride_q_r, stride_q_h, 0, D)
        bad = tl.sum(((b_q - b_q) != 0.0).to(tl.int32), axis=0) > 0  # a NaN or Inf in the vector, as _nonfinite
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
    for p in tl.range(p_start, p_end, num_stages=NUM_STAGES):
        page, ok = _page_id(bt_row, p, n_pages)
        if FMT == 2:
            base_d = page * stride_k_page
            base_s = page * stride_s_page
            acc = _mx_group_dot_split(k_ptr, s_ptr, base_d, base_s, o_t, e0, o0, col_scale, 0, DATA_BYTES,
                                      SCALE_BYTES, GB, USE_ASM)
            acc += _mx_group_dot_split(k_ptr, s_ptr, base_d, base_s, o_t, e1, o1, col_scale, 1, DATA_BYTES,
                                       SCALE_BYTES, GB, USE_ASM)
            acc += _mx_group_dot_split(k_ptr, s_ptr, base_d, base_s, o_t, e2, o2, col_scale, 2, DATA_BYTES,
                                       SCALE_BYTES, GB, USE_ASM)
            acc += _mx_group_dot_split(k_ptr, s_ptr, base_d, base_s, o_t, e3, o3, col_scale, 3, DATA_BYTES,
                                       SCALE_BYTES, GB, USE_ASM)
        else:
            b_k = tl.load(k_ptr + page * stride_k_page + o_t[:, None] * D + o_d[None, :])
            if FMT == 1:
                b_k = b_k.to(tl.float16)
            if INTERPRET and FMT == 0:
                acc = tl.dot(b_k.to(tl.float32), b_q, input_precision="ieee", out_dtype=tl.float32)
            else:
                acc = tl.dot(b_k, b_q, out_dtype=tl.float32)
        t0 = (p * cp_world + cp_rank) * T
        acc = tl.where((t0 + o_t)[:, None] <= pos[None, :], acc, float("-inf"))
        tl.store(out_ptr + o_h + p, _page_score(tl.max(acc, axis=0), post, ok, bad, t0, pos), mask=m_n)


def _static_constexprs() -> dict:
    """The kernel's constexpr arguments that depend on nothing but the formats' constants."""
    return dict(INTERPRET=interpret(), D=INDEX_DIM, T=PAGE_SIZE, G=MX_GROUP_SIZE, DATA_BYTES=MXFP4_DATA_BYTES,
                SCALE_BYTES=MXFP4_SCALE_BYTES, KFAC=float(2**_F16_K_EXP), Q_TOP=_Q_F16_TOP)


def _pages_per_program(work_pages: int) -> int:
    """Pages per program: about 2048 programs for the whole call, 1..16 pages each."""
    pp = 1
    while pp < 16 and work_pages // (2 * pp) >= 2048:
        pp *= 2
    return pp


def prefill_tiles(cu: list[int], H: int, device):
    """Host work map for prefill: ``(int32 [n_tiles, 2] of (request, first row), rows per tile)`` from the host
    offsets ``cu`` (``cu_seqlens_q``), put on ``device``."""
    rows = max(1, _PREFILL_ROWS_X_HEADS // H)
    tiles = [(b, r) for b in range(len(cu) - 1) for r in range(cu[b], cu[b + 1], rows)]
    return torch.tensor(tiles, dtype=torch.int32).reshape(-1, 2).to(device), rows


def check_plan(plan, batch):
    """The Triton work map of a batch: decode, pages per program; prefill, the host tile list (``(tiles,
    rows)``, from the batch's host offsets). Returns it (the plan's ``work``)."""
    if plan.op == "decode":
        return _pages_per_program(plan.batch * plan.max_block)
    cu = batch.cu_seqlens_q.tolist() if batch.cu_seqlens_host is None else [int(x) for x in batch.cu_seqlens_host]
    return prefill_tiles(cu, plan.H, plan.device)


def run(plan, q, cache, out, pp=None, num_warps=4, num_stages=2, pdl=None):
    """Scores of ``plan`` (``ops.score.plan_decode`` / ``plan_prefill``) for ``q`` over ``cache`` into ``out``
    (``ops.score.score_decode`` / ``score_prefill`` checked all three). Decode writes each request's columns up
    to its last visible page; prefill every column (-inf past each row's last visible page). No host sync and no
    data-dependent grid: safe to capture in a CUDA graph. ``pp``, ``num_warps``, ``num_stages``: launch
    parameters for benchmarks (default: the plan's work map); ``pdl``: programmatic dependent launch (default
    ``ops.pdl.use_pdl``)."""
    prefill = plan.op == "prefill"
    if prefill:
        tiles, rows = plan.work
        n_tiles, S, cu, cp_rank, cp_world = tiles.shape[0], 0, plan.cu_seqlens_q, 0, 1
    else:
        tiles, rows, n_tiles, S, cu, cp_rank, cp_world = None, plan.S, plan.batch, plan.S, None, plan.cp_rank, \
            plan.cp_world
    pp = pp or (_pages_per_program(n_tiles * plan.max_block) if prefill else plan.work)
    grid = (triton.cdiv(plan.max_block, pp), n_tiles)
    if grid[0] == 0 or grid[1] == 0:
        return out
    H = plan.H
    nq = max(16, triton.next_power_of_2(rows * H))
    nv = max(4, triton.next_power_of_2(rows * H))
    scale = cache.scale_e8m0
    _score_kernel[grid](
        q, cache.data, scale, plan.block_table, plan.seq_lens, cu, tiles, out,
        plan.max_block, cache.num_pages, S, cp_rank, cp_world, plan.sm_scale,
        q.stride(0), q.stride(1), cache.data.stride(0), 0 if scale is None else scale.stride(0),
        plan.block_table.stride(0), out.stride(0), out.stride(1),
        FMT=FMT_CODE[cache.storage], Q_FP8=q.dtype == FP8_DTYPE, H=H, ROWS=rows, NQ=nq, PP=pp, PREFILL=prefill,
        MX_STACK=nv <= _MX_STACK_MAX_NV, NV=nv, FILL_TAIL=prefill, NUM_STAGES=num_stages, USE_ASM=use_asm(),
        **_static_constexprs(), num_warps=num_warps,
        **triton_launch_kwargs(use_pdl(q.device) if pdl is None else pdl),
    )
    return out


__all__ = ["FMT_CODE", "check_plan", "interpret", "prefill_tiles", "run", "use_asm"]
