"""FlyDSL decode block scorer for gfx950 (MI350/MI355X): MXFP4, fp8 or bf16 index-K cache.

Contract: ``ops/score/naive.py`` ``score_decode_ref`` (fp32 out, written for each request's
visible pages ``[0, n_local)``; the host wrapper pre-fills -inf when it allocates ``out``).

Geometry. A CTA of ``waves`` waves handles ``waves * pages_per_wave`` consecutive local pages of
one request (grid ``(batch, ceil(max_block / pages per CTA))``). Q is the MFMA B operand: column
``n`` of n-tile ``j`` is feature ``f = 16 j + n = tok * H + h``. K is the A operand: a 16-token
tile (rows) against 128 dims. The dot product does not care which dims share a K slot as long as
A and B agree, so lane ``l`` always takes the dims of MX group ``g = l // 16`` (dims ``32 g ..
32 g + 31``): its 16 B of e2m1 codes are contiguous and share one e8m0 byte.

- bf16 Q: four ``v_mfma_f32_16x16x32_bf16`` per tile; chunk ``c`` holds dims ``32 g + 8 c ..
  + 7``. MXFP4 K is widened with ``v_cvt_scalef32_pk_bf16_fp4`` (scale = the e8m0 byte as an fp32
  power of two, exact in bf16), fp8 K with ``v_cvt_scalef32_pk_bf16_fp8`` (scale 1, exact).
- e4m3 Q with an MXFP4 or fp8 K: one ``v_mfma_scale_f32_16x16x128_f8f6f4`` per tile (A = K as
  e2m1 with its e8m0 byte or as e4m3 with unit scale, B = Q as e4m3 with unit scale).
- bf16 K: bf16 MFMA; an e4m3 Q is widened to bf16 once (exact).

MXFP4 scales: each lane loads two dwords of the page's 512 B scale block at the start of the page;
tile ``t`` fetches its token's dword from the holding lane with one ``ds_bpermute`` and shifts
out byte ``g`` (one VMEM load per lane per tile would double the load instructions).

Output tile lane ``l`` holds column ``l % 16`` and rows ``4 (l // 16) + i``: each lane keeps a
running masked max over its rows of the page's 8 tiles, two xor-shuffles finish the page.
``nt_k`` is the number of K tiles whose loads are issued ahead of the tile being multiplied.

Hardware assumptions, not checked on a GPU (none was available): the 16x16xK MFMA operand layout
puts A[i][k] in lane ``i + 16 (k // (K/4))`` (8 bf16 per lane for K=32, 32 e2m1 or e4m3 for the
scaled K=128, whose per-lane scale covers those 32), D[i][j] in lane ``j + 16 (i // 4)``, element
``i % 4``; ``v_cvt_scalef32_pk_bf16_fp4`` turns byte ``sel`` into (low nibble, high nibble) in
(low, high) half. The seed PR (aiter#7060) describes the same per-lane scaled-MFMA operand (16 B of
e2m1 plus its e8m0 byte), widens the same format (element 2i in the low nibble) with the same
conversion instruction, and passed its tests on gfx950. ``tests/.../test_flydsl.py`` runs the
index functions below in a lane-level CPU model built on these assumptions.
"""

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl.expr import arith, gpu, range_constexpr, rocdl
from flydsl.expr.typing import T

from .....formats.constants import (
    E8M0_EXPONENT_BIAS,
    INDEX_DIM,
    MX_GROUP_SIZE,
    MXFP4_DATA_BYTES,
    MXFP4_SCALE_BYTES,
    PAGE_SIZE,
)

WAVE = 64  # lanes per wavefront on CDNA
TILE_TOKENS = 16  # MFMA M: tokens per K tile
TILE_FEATURES = 16  # MFMA N: q features (tok * H + h) per n-tile
TILES_PER_PAGE = PAGE_SIZE // TILE_TOKENS  # 8
LANE_GROUPS = WAVE // TILE_TOKENS  # 4 == MX groups per token (one per lane group)
FP32_MANTISSA_BITS = 23
UNIT_E8M0_X4 = E8M0_EXPONENT_BIAS * 0x01010101  # four e8m0 bytes of 2^0 (the scaled MFMA's unit scale)
NEG_INF = float("-inf")
OOB_OFFSET = 0x7FFFFFF0  # a buffer offset past num_records: the store is dropped

K_FORMATS = ("mxfp4", "fp8", "bf16")

assert LANE_GROUPS * MX_GROUP_SIZE == INDEX_DIM


# Index arithmetic of the kernel, written once: the kernel calls these with DSL values, the
# lane-level CPU model in the tests with Python ints (lane = 16 grp + n_col).


def local_page(chunk, jp, wave, waves, pages_per_wave):
    """Local page column scored by ``wave`` in its ``jp``-th step of CTA ``chunk``."""
    return chunk * (waves * pages_per_wave) + jp * waves + wave


def k_lane_offset(t, n_col, grp, k_token_bytes):
    """Byte offset in a K page of the 16 B pieces lane ``(n_col, grp)`` reads for tile ``t``."""
    return (t * TILE_TOKENS + n_col) * k_token_bytes + grp * (k_token_bytes // LANE_GROUPS)


def scale_word_offset(half, lane):
    """Byte offset in a scale page of the dword ``lane`` loads for page half ``half``."""
    return (half * WAVE + lane) * MXFP4_SCALE_BYTES


def scale_source(t, n_col):
    """(page half, source lane) holding the scale dword of token ``16 t + n_col``."""
    token = t * TILE_TOKENS
    return token // WAVE, token % WAVE + n_col


def q_lane_offset(b, tok, head, grp, S, q_row, q_head, q_bytes):
    """Byte offset in q of the MX group ``grp`` of row ``b S + tok``, head ``head``."""
    return (b * S + tok) * q_row + head * q_head + grp * (MX_GROUP_SIZE * q_bytes)


def acc_row(t, grp, i):
    """Token row in the page of accumulator element ``i`` in a lane of group ``grp`` (tile ``t``)."""
    return t * TILE_TOKENS + grp * 4 + i


def visible_limit(seq_len, S, tok, gp):
    """Last visible token row of global page ``gp`` for query token ``tok`` (may be < 0 or > 127)."""
    return seq_len - S + tok - gp * PAGE_SIZE


def out_offset(head, tok, b, p, S, out_head, out_row):
    """Element offset of ``out[head, b S + tok, p]``."""
    return head * out_head + (b * S + tok) * out_row + p


def _i32(v):
    return rocdl._to_ir(fx.Int32(v))


def _aux0():
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 0)


def _page_rsrc(tensor, byte_offset, num_bytes):
    """Buffer resource over ``num_bytes`` starting ``byte_offset`` (int64) bytes into ``tensor``."""
    base = fx.add_offset(fx.recast_iter(fx.Uint8, fx.get_iter(tensor)), fx.make_int_tuple(byte_offset))
    view = fx.make_view(base, fx.make_layout(num_bytes, 1))
    return rocdl.get_buffer_rsrc(fx.get_iter(rocdl.make_buffer_tensor(view, num_records_bytes=fx.Int64(num_bytes))))


def _load(rsrc, byte_offset, ty):
    return rocdl.raw_ptr_buffer_load(ty, rsrc, _i32(byte_offset), _i32(0), 0)


def _load_x4(rsrc, byte_offset):
    """16 B per lane (``buffer_load_dwordx4``) as ``vector<4xi32>``."""
    return fx.Vector(_load(rsrc, byte_offset, T.vec(4, T.i32)), dtype=fx.Int32)


def _bf16x8(words):
    """Four i32 words (eight packed bf16) as the ``vector<8xbf16>`` MFMA operand."""
    v = fx.Vector.from_elements([fx.Int32(w) for w in words], fx.Int32)
    return v.bitcast(fx.BFloat16)


def _widen_fp4(word, scale_f32):
    """Eight e2m1 codes (element 2i in the low nibble) times ``scale_f32`` -> ``vector<8xbf16>``."""
    pairs = [
        fx.Vector(rocdl.cvt_scalef32_pk_bf16_fp4(T.vec(2, T.bf16), word, scale_f32, sel), dtype=fx.BFloat16)
        for sel in range(4)
    ]
    return fx.Vector.from_elements([p[i] for p in pairs for i in range(2)], fx.BFloat16)


def _widen_fp8(word_lo, word_hi):
    """Eight e4m3 bytes (two i32 words) -> ``vector<8xbf16>``, exact."""
    one = rocdl._to_ir(fx.Float32(1.0))
    pairs = []
    for w in (word_lo, word_hi):
        for hi in (False, True):
            pairs.append(
                fx.Vector(rocdl.cvt_scalef32_pk_bf16_fp8(T.vec(2, T.bf16), rocdl._to_ir(w), one, hi), dtype=fx.BFloat16)
            )
    return fx.Vector.from_elements([p[i] for p in pairs for i in range(2)], fx.BFloat16)


def _mfma_bf16(a, b, acc):
    return fx.Vector(rocdl.mfma_f32_16x16x32_bf16(T.vec(4, T.f32), [a, b, acc]), dtype=fx.Float32)


def _mfma_scaled(a, a_fmt, a_scale, b, acc):
    """``v_mfma_scale_f32_16x16x128_f8f6f4``: A in ``a_fmt`` (4 = e2m1, 0 = e4m3), B e4m3 unit scale."""
    res = rocdl.mfma_scale_f32_16x16x128_f8f6f4(
        T.vec(4, T.f32), [a, b, acc, a_fmt, 0, 0, a_scale, 0, _i32(UNIT_E8M0_X4)]
    )
    return fx.Vector(res, dtype=fx.Float32)


def build_decode_scorer(k_format: str, q_fp8: bool, S: int, H: int, waves: int = 4, pages_per_wave: int = 2,
                        nt_k: int = 6):
    """Return the ``@flyc.jit`` launcher of one specialisation.

    Launcher arguments: ``q`` (bf16 | e4m3 ``[batch*S, H, 128]``), ``k_data`` (the cache, or MXFP4
    data view), ``k_scale`` (MXFP4 scale view; any tensor otherwise), ``block_table``,
    ``seq_lens``, ``out`` (fp32), then int32 strides in bytes (``q_row``, ``q_head``,
    ``k_page``, ``s_page``) and in elements (``bt_row``, ``out_head``, ``out_row``),
    ``max_block``, ``cp_rank``, ``cp_world``, fp32 ``sm_scale``, ``grid_y``, ``stream``.
    """
    if k_format not in K_FORMATS:
        raise ValueError(f"k_format must be one of {K_FORMATS}, got {k_format!r}")
    if S < 1 or H < 1 or waves < 1 or pages_per_wave < 1 or not 1 <= nt_k <= TILES_PER_PAGE:
        raise ValueError(f"need S, H, waves, pages_per_wave >= 1 and 1 <= nt_k <= {TILES_PER_PAGE}")
    F = S * H
    NF = (F + TILE_FEATURES - 1) // TILE_FEATURES
    scaled = q_fp8 and k_format != "bf16"  # one scaled MFMA per tile
    q_bytes = 1 if q_fp8 else 2
    k_token_bytes = {"mxfp4": MXFP4_DATA_BYTES, "fp8": INDEX_DIM, "bf16": 2 * INDEX_DIM}[k_format]
    k_lane_bytes = k_token_bytes // LANE_GROUPS  # 16 / 32 / 64 B: this lane's MX group of one token
    k_page_bytes = PAGE_SIZE * k_token_bytes
    s_page_bytes = PAGE_SIZE * MXFP4_SCALE_BYTES
    pages_per_cta = waves * pages_per_wave

    def load_tile(t, k_rsrc, n_col, grp):
        """This lane's K words of tile ``t`` (16 B loads)."""
        kb = k_lane_offset(t, n_col, grp, k_token_bytes)
        words = []
        for i in range(k_lane_bytes // 16):
            x4 = _load_x4(k_rsrc, kb + 16 * i)
            words += [x4[e] for e in range(4)]
        return words

    def load_page_scales(s_rsrc, lane):
        """The page's 512 B of e8m0 bytes, one dword per lane per half page (token ``64 h + lane``)."""
        return [fx.Int32(_load(s_rsrc, scale_word_offset(h, lane), T.i32)) for h in range(PAGE_SIZE // WAVE)]

    def tile_scale(page_scales, t, n_col, grp):
        """e8m0 byte (as i32) of this lane's token ``16 t + n_col`` and MX group ``grp``."""
        half, src_lane = scale_source(t, n_col)
        word = rocdl.ds_bpermute(T.i32, rocdl._to_ir(src_lane * 4), rocdl._to_ir(page_scales[half]))
        return (fx.Int32(word) >> (grp * 8)) & 0xFF

    def tile_scores(words, scale, q_frags):
        """MFMA accumulators (``vector<4xf32>`` per n-tile) of one K tile against Q."""
        zero_acc = fx.Vector.from_elements([fx.Float32(0.0)] * 4, fx.Float32)
        if scaled:
            a = fx.Vector.from_elements(words, fx.Int32)
            if k_format == "mxfp4":
                a_fmt, a_scale = 4, scale
            else:
                a_fmt, a_scale = 0, fx.Int32(UNIT_E8M0_X4)
            return [_mfma_scaled(a, a_fmt, a_scale, q_frags[j][0], zero_acc) for j in range(NF)]
        if k_format == "mxfp4":
            scale_f32 = fx.Float32(arith.bitcast(T.f32, rocdl._to_ir(scale << FP32_MANTISSA_BITS)))
            a_chunks = [_widen_fp4(words[c], scale_f32) for c in range(4)]
        elif k_format == "fp8":
            a_chunks = [_widen_fp8(words[2 * c], words[2 * c + 1]) for c in range(4)]
        else:
            a_chunks = [_bf16x8(words[4 * c : 4 * c + 4]) for c in range(4)]
        accs = []
        for j in range(NF):
            acc = zero_acc
            for c in range(4):
                acc = _mfma_bf16(a_chunks[c], q_frags[j][c], acc)
            accs.append(acc)
        return accs

    def score_page(p, k_data, k_scale, out, block_table, b, bt_row, k_page, s_page, seq_len, cp_rank, cp_world,
                   out_head, out_row, sm_scale, n_col, grp, q_frags, tok_of, head_of):
        """Masked max over local page ``p`` for every feature; lanes of group 0 store the scores."""
        gp = p * cp_world + cp_rank
        page_id = fx.Int32(rocdl.s_buffer_load(fx.get_iter(rocdl.make_buffer_tensor(block_table)), b * bt_row + p))
        k_rsrc = _page_rsrc(k_data, fx.Int64(page_id) * fx.Int64(k_page), k_page_bytes)
        page_scales = None
        if k_format == "mxfp4":  # issued first: tile 0 waits for the scales, not for later K tiles
            s_rsrc = _page_rsrc(k_scale, fx.Int64(page_id) * fx.Int64(s_page), s_page_bytes)
            page_scales = load_page_scales(s_rsrc, grp * TILE_FEATURES + n_col)
        # Per n-tile, per lane: the last visible token row of this page for the lane's column.
        limits = [visible_limit(seq_len, S, tok_of[j], gp) for j in range(NF)]
        best = [fx.Float32(NEG_INF) for _ in range(NF)]
        # Issue order is pinned with scheduling barriers, so exactly nt_k tiles are in flight while
        # tile t is multiplied (LLVM would otherwise hoist or sink loads at will).
        inflight = [load_tile(t, k_rsrc, n_col, grp) for t in range(min(nt_k, TILES_PER_PAGE))]
        for t in range(TILES_PER_PAGE):
            rocdl.sched_barrier(0)
            if t + nt_k < TILES_PER_PAGE:
                inflight.append(load_tile(t + nt_k, k_rsrc, n_col, grp))
            scale = tile_scale(page_scales, t, n_col, grp) if k_format == "mxfp4" else None
            accs = tile_scores(inflight[t], scale, q_frags)
            for j in range(NF):
                for i in range(4):
                    row = acc_row(t, grp, i)
                    val = (row <= limits[j]).select(accs[j][i], fx.Float32(NEG_INF))
                    best[j] = fx.Float32(arith.maximumf(rocdl._to_ir(best[j]), rocdl._to_ir(val)))
        # Bounded by the size of out, so a store at OOB_OFFSET is dropped by the buffer unit.
        o_rsrc = rocdl.get_buffer_rsrc(fx.get_iter(rocdl.make_buffer_tensor(out, max_size=False)))
        for j in range(NF):
            m = best[j]
            m = fx.Float32(arith.maximumf(rocdl._to_ir(m), rocdl._to_ir(gpu.shuffle_xor(m, 16, WAVE))))
            m = fx.Float32(arith.maximumf(rocdl._to_ir(m), rocdl._to_ir(gpu.shuffle_xor(m, 32, WAVE))))
            col = n_col + j * TILE_FEATURES
            off = out_offset(head_of[j], tok_of[j], b, p, S, out_head, out_row)
            # Lanes of group 0 hold the page max of their column; the rest (and padding columns) store nothing.
            off = ((grp == 0) & (col < F)).select(off * 4, fx.Int32(OOB_OFFSET))
            rocdl.raw_ptr_buffer_store(rocdl._to_ir(m * sm_scale), o_rsrc, _i32(off), _i32(0), aux=_aux0())

    def load_q(q, b, n_col, grp, q_row, q_head):
        """Q fragments (B operand) of request ``b``, one list per n-tile: one ``vector<8xi32>`` of e4m3
        (scaled MFMA) or four ``vector<8xbf16>``; and each lane's (tok, head) per n-tile."""
        q_rsrc = rocdl.get_buffer_rsrc(fx.get_iter(rocdl.make_buffer_tensor(q)))
        q_frags, tok_of, head_of = [], [], []
        for j in range(NF):
            feat = fx.min(n_col + j * TILE_FEATURES, fx.Int32(F - 1))  # padding columns repeat the last feature
            tok = feat // H
            head = feat % H
            tok_of.append(tok)
            head_of.append(head)
            base = q_lane_offset(b, tok, head, grp, S, q_row, q_head, q_bytes)
            if q_fp8:
                w = [_load_x4(q_rsrc, base + 16 * i) for i in range(2)]
                words = [w[i // 4][i % 4] for i in range(8)]
                if scaled:
                    q_frags.append([fx.Vector.from_elements(words, fx.Int32)])
                else:
                    q_frags.append([_widen_fp8(words[2 * c], words[2 * c + 1]) for c in range(4)])
            else:
                w = [_load_x4(q_rsrc, base + 16 * i) for i in range(4)]
                q_frags.append([_bf16x8([w[c][i] for i in range(4)]) for c in range(4)])
        return q_frags, tok_of, head_of

    @flyc.kernel
    def m3_score_decode(
        q: fx.Tensor, k_data: fx.Tensor, k_scale: fx.Tensor, block_table: fx.Tensor, seq_lens: fx.Tensor,
        out: fx.Tensor, q_row: fx.Int32, q_head: fx.Int32, k_page: fx.Int32, s_page: fx.Int32, bt_row: fx.Int32,
        out_head: fx.Int32, out_row: fx.Int32, max_block: fx.Int32, cp_rank: fx.Int32, cp_world: fx.Int32,
        sm_scale: fx.Float32,
    ):
        tid = fx.Int32(gpu.thread_idx.x)
        b = fx.Int32(gpu.block_idx.x)
        chunk = fx.Int32(gpu.block_idx.y)
        lane = tid % WAVE
        wave = fx.Int32(rocdl.readfirstlane(T.i32, rocdl._to_ir(tid // WAVE)))
        n_col = lane % TILE_FEATURES  # output column / A row within a tile
        grp = lane // TILE_FEATURES  # MX group (dims 32 grp .. 32 grp + 31) / output row block

        seq_len = fx.Int32(rocdl.s_buffer_load(fx.get_iter(rocdl.make_buffer_tensor(seq_lens)), b))
        # Local pages holding a visible token: global blocks p * cp_world + cp_rank < ceil(seq_len / 128).
        n_global = (seq_len + (PAGE_SIZE - 1)) // PAGE_SIZE
        n_local = fx.max(fx.min((n_global - cp_rank + cp_world - 1) // cp_world, max_block), fx.Int32(0))

        if local_page(chunk, 0, 0, waves, pages_per_wave) < n_local:  # a CTA past the request's end does nothing
            q_frags, tok_of, head_of = load_q(q, b, n_col, grp, q_row, q_head)
            for jp in range_constexpr(pages_per_wave):
                p = local_page(chunk, jp, wave, waves, pages_per_wave)  # adjacent waves take adjacent pages
                if p < n_local:
                    score_page(p, k_data, k_scale, out, block_table, b, bt_row, k_page, s_page, seq_len, cp_rank,
                               cp_world, out_head, out_row, sm_scale, n_col, grp, q_frags, tok_of, head_of)

    @flyc.jit
    def launch(
        q: fx.Tensor, k_data: fx.Tensor, k_scale: fx.Tensor, block_table: fx.Tensor, seq_lens: fx.Tensor,
        out: fx.Tensor, q_row: fx.Int32, q_head: fx.Int32, k_page: fx.Int32, s_page: fx.Int32, bt_row: fx.Int32,
        out_head: fx.Int32, out_row: fx.Int32, max_block: fx.Int32, cp_rank: fx.Int32, cp_world: fx.Int32,
        sm_scale: fx.Float32, batch: fx.Int32, grid_y: fx.Int32, stream: fx.Stream = fx.Stream(None),
    ):
        m3_score_decode(
            q, k_data, k_scale, block_table, seq_lens, out, q_row, q_head, k_page, s_page, bt_row, out_head,
            out_row, max_block, cp_rank, cp_world, sm_scale,
        ).launch(grid=(batch, grid_y, 1), block=(waves * WAVE, 1, 1), stream=stream)

    launch.pages_per_cta = pages_per_cta
    launch.pages_per_wave = pages_per_wave
    launch.features = F
    return launch
