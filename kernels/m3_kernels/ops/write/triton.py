"""Triton index-cache writer: quantize index K (after norm + RoPE) and store it at token slots.

One program stores ``BT`` tokens. Every format is computed from fp32 with one rounding and is
bitwise equal to ``m3_kernels.formats`` (``quantize_index_k``), except ``mxfp4_rot``:

- ``bf16`` / ``fp8``: sanitize (NaN -> 0, +-inf -> +-fp32 max), clamp to the format's largest
  finite value, round to nearest even.
- ``mxfp4``: the e8m0 scale and every e2m1 code are computed on fp32 bit patterns with integer
  compares (no division, no scaled products), so subnormal inputs, ties and saturation follow
  ``formats.mxfp4`` exactly whatever the hardware's denormal mode.
- ``mxfp4_rot``: the key is rotated in the kernel (``_rotate``) before the same quantizer, most of it
  on tensor cores with exact integer sums. The reference rotates in float64, so a code or a scale
  may differ where the rotated value lies within the kernel's rotation error bound of a rounding
  boundary; ``tests/kernels/ops/write/test_triton.py`` checks exactly that, and the bound itself.

The rotation ``R x = H_128 diag(s) x / sqrt(128)`` (``formats.rotation``) uses the Sylvester structure
``H_128 = H_4 (x) H_32``: with ``x`` in four quarters ``x_a`` of 32 dims, output quarter ``a'`` (one MX
group) is ``(sum_a H_4[a', a] s_a x_a) H_32``. Per token, in fp32 (``_rotate``):

1. ``y = x 2^-E``, ``E = floor(log2 max|x|)`` clamped to [-126, 126]: one power-of-two product, exact
   except for elements below 2^-126 of the largest;
2. ``z = (H_4 (x) I_32) y``: two levels of fp32 adds (a butterfly across the quarters);
3. ``w = z 2^(10 - E_z)`` with the token's largest ``|z|`` in [2^E_z, 2^(E_z + 1)), so ``|w| < 2^11``;
   ``w = k1 + 2^-12 k2 + r``: ``k1``, ``k2`` integers of magnitude <= 2^11 (exact in fp16, rounded to
   nearest by adding and subtracting 1.5 * 2^23), ``|r| <= 2^-13``;
4. ``k1 H_32`` and ``k2 H_32``: fp16 tensor-core dots with fp32 accumulation; every product and
   partial sum is an integer of magnitude at most 2^16, so both are exact;
5. ``(2^-12 k2 H_32 + k1 H_32) * (fp32(1/sqrt(128)) 2^(E + E_z - 10))``: one fused multiply-add and one
   product by a normal factor. Only in programs holding a token near fp32's range edges (a
   branch): a further exact 2^-64 for a token whose factor would be subnormal, and the clamp to
   the MXFP4 input range (needed from ``max|x| >= 2^123`` on).

Error, with ``u = 2^-24`` and ``S = sum_i |x_i| / sqrt(128)``: step 2 errs by at most ``2.0001 u`` times
the sum of the four ``|y|`` it adds, so by ``2.0001 u S`` after ``H_32``; the dropped ``r`` by
``32 * 2^-13 * 2^(E_z - 10) <= 2^-18 max|z| <= 64.01 u S``; step 1 by under ``2^-100 u S``; step 5 and
the rounding of 1/sqrt(128) are three relative errors of ``u`` (the 2^-64 product may add ``2^-150``
when its result is subnormal). So ``|kernel - R x| <= 66.02 u S (1 + 3.1 u) + 3.0001 u |R x| + 2^-150
<= 67.1 u S + 2 u |R x| + 2^-150`` (as ``|R x| <= S``), assuming only that fp32 adds and products round
to nearest and keep subnormals (a fused multiply-add, where the compiler forms one, rounds once and
keeps the bound), and that the tensor cores add integers of magnitude below 2^24 exactly. The
test checks ``67.1 u S + 2 u |R x| + 2^-149`` on the rotated values themselves.
"""

import math

import torch
import triton
import triton.language as tl

from ...formats import (
    BF16_MAX,
    E8M0_MAX_WRITTEN,
    E8M0_MIN_WRITTEN,
    F4_E2M1_SIGN_BIT,
    FP8_E4M3_MAX,
    INDEX_DIM,
    MX_GROUP_SIZE,
    MXFP4_INPUT_MAX,
    PAGE_SIZE,
    IndexKFormat,
    ScaleRule,
    parse_scale_rule,
    rotation_matrix,
)

_FP32_MAX = torch.finfo(torch.float32).max
_BT = 16  # tokens per program


def _rot_launch(n_tokens: int):
    """(tokens per program, warps) of the mxfp4_rot writer for ``n_tokens``, chosen on sm_90 SASS
    counts and occupancy, not timed yet (docs/perf.md): 64 and 4 (whole warpgroup tensor-core
    tiles, the fewest instructions per token) once the programs fill an H200 (from 16384 tokens);
    16 and 4 below, where the latency of one program counts more."""
    return (64, 4) if n_tokens >= 16384 else (16, 4)

# Rounding thresholds of e2m1 as 4*t = 2^a * (1 + F / 2^23): (a, F) for t in
# F4_E2M1_TIES_DOWN (0.25, 1.25, 2.5, 5.0) and F4_E2M1_TIES_UP (0.75, 1.75, 3.5).
# A threshold t * 2^(s-127) = (4t) * 2^(s-129) has fp32 bits ((s - 2 + a) << 23) | F when
# normal, and (4t) << (s + 20) when subnormal (unit 2^-149).


@triton.jit
def _threshold_bits(s, FOUR_T: tl.constexpr, A: tl.constexpr, F: tl.constexpr):
    """fp32 bit pattern of (FOUR_T / 4) * 2^(s - 127), exactly (inf bits when it overflows)."""
    field = s - 2 + A
    normal = tl.where(field >= 255, 255 << 23, (field << 23) | F)
    return tl.where(field >= 1, normal, FOUR_T << (s + 20))


@triton.jit
def _e2m1_codes(mag, s):
    """e2m1 magnitude codes (0..7) of fp32 magnitudes ``mag`` (int32 bits) under scale byte ``s``
    (int32, broadcast): round to nearest, ties to the even code, saturating at 6."""
    code = (mag > _threshold_bits(s, 1, 0, 0)).to(tl.int32)  # 0.25, ties down
    code += (mag >= _threshold_bits(s, 3, 1, 0x400000)).to(tl.int32)  # 0.75, ties up
    code += (mag > _threshold_bits(s, 5, 2, 0x200000)).to(tl.int32)  # 1.25, ties down
    code += (mag >= _threshold_bits(s, 7, 2, 0x600000)).to(tl.int32)  # 1.75, ties up
    code += (mag > _threshold_bits(s, 10, 3, 0x200000)).to(tl.int32)  # 2.5, ties down
    code += (mag >= _threshold_bits(s, 14, 3, 0x600000)).to(tl.int32)  # 3.5, ties up
    code += (mag > _threshold_bits(s, 20, 4, 0x200000)).to(tl.int32)  # 5.0, ties down
    return code


@triton.jit
def _bf16_bits(x):
    """bfloat16 bit patterns (int16) of finite fp32 ``x``, round to nearest even (integer ops, so
    the CPU interpreter and the GPU agree)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).to(tl.int16)


@triton.jit
def _e4m3_bits(x):
    """float8_e4m3fn bit patterns (uint8) of fp32 ``x`` with |x| <= 448, round to nearest even,
    subnormals (steps of 2^-9) included; the sign of -0 and of negative values that round to 0 is
    kept, as torch's conversion does."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    sign = tl.where(bits < 0, 0x80, 0)
    # Normal e4m3 (|x| >= 2^-6): round the fp32 significand to 3 bits, rebias 127 -> 7.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Subnormal e4m3: round |x| * 2^9 to an integer; |x| = m * 2^(e - 150).
    e = tl.maximum(mag >> 23, 1)
    m = tl.where(mag >= 0x800000, (mag & 0x7FFFFF) | 0x800000, mag)
    shift = tl.minimum(141 - e, 31)
    q = m >> shift
    rem = m - (q << shift)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(mag >= (121 << 23), normal, q)  # 2^-6 has fp32 exponent field 121
    return (code | sign).to(tl.uint8)


@triton.jit
def _token_slots(loc_ptr, o_t, n_tokens, capacity, PAGE: tl.constexpr):
    """Tokens ``o_t``'s cache slots: (mask, page, row); out-of-range slots are masked, never written."""
    m_t = o_t < n_tokens
    loc = tl.load(loc_ptr + o_t, mask=m_t, other=-1).to(tl.int64)
    m_t = m_t & (loc >= 0) & (loc < capacity)
    return m_t, loc // PAGE, loc % PAGE


@triton.jit
def _load_keys(p_k, m_k, IN_BF16: tl.constexpr, PRE_CLAMP: tl.constexpr):
    """fp32 keys at ``p_k`` (zero where ``m_k`` is false), NaN -> 0, clamped to +-``PRE_CLAMP``."""
    b_k = tl.load(p_k, mask=m_k, other=0.0)
    if IN_BF16:  # bf16 bits -> fp32 bits: exact for subnormals whatever the conversion path does
        b_k = ((b_k.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        b_k = b_k.to(tl.float32)
    b_k = tl.where(b_k != b_k, 0.0, b_k)  # NaN -> 0
    return tl.minimum(tl.maximum(b_k, -PRE_CLAMP), PRE_CLAMP)  # +-inf -> +-max (and format saturation)


@triton.jit
def _e8m0_bytes(amax, RCEIL: tl.constexpr, S_MIN: tl.constexpr, S_MAX: tl.constexpr):
    """e8m0 scale bytes (int32) of groups whose largest magnitude has fp32 bits ``amax``."""
    field = amax >> 23
    if RCEIL:
        # ceil(log2(amax / 6)): exponent - 2, plus one when the significand exceeds 1.5.
        s = field - 2 + ((amax & 0x7FFFFF) > 0x400000).to(tl.int32)
    else:
        s = field - 2
    return tl.minimum(tl.maximum(s, S_MIN), S_MAX)


@triton.jit
def _pow2f(e):
    """fp32 2^e for int32 ``e`` in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _row_max_abs(a, b, c, d):
    """Largest ``|.|`` of each row over four fp32 ``[BT, G]`` tiles (no NaN): fp32 ``[BT]``."""
    return tl.max(tl.maximum(tl.maximum(tl.abs(a), tl.abs(b)), tl.maximum(tl.abs(c), tl.abs(d))), axis=1)


@triton.jit
def _hadamard_exact(z, fw, h):
    """``z [BT, G] * fw`` (|.| < 2^11) times ``h``, as ``k1 h + 2^-12 k2 h`` (module docstring, steps 3-4)."""
    w = z * fw
    k1 = (w + 12582912.0) - 12582912.0  # round to the nearest integer (1.5 * 2^23 has unit ulp)
    r = (w - k1) * 4096.0
    k2 = (r + 12582912.0) - 12582912.0
    a1 = tl.dot(k1.to(tl.float16), h, out_dtype=tl.float32)
    a2 = tl.dot(k2.to(tl.float16), h, out_dtype=tl.float32)
    return a2 * (1.0 / 4096.0) + a1


@triton.jit
def _rotate(x0, x1, x2, x3, rot_scale, h_ptr, G: tl.constexpr, CLAMP: tl.constexpr):
    """``R x`` of fp32 keys given as four quarters ``[BT, G]`` (signs applied, finite) -> four fp32
    ``[BT, G]`` output quarters (the MX groups), clamped to +-``CLAMP``, within the bound of the
    module docstring. ``h_ptr``: the fp16 ``[G, G]`` Sylvester Hadamard matrix."""
    e = (_row_max_abs(x0, x1, x2, x3).to(tl.int32, bitcast=True) >> 23) - 127
    e = tl.minimum(tl.maximum(e, -126), 126)  # floor(log2 max|x|), clamped so 2^-e is normal
    f = _pow2f(-e)[:, None]
    y0, y1, y2, y3 = x0 * f, x1 * f, x2 * f, x3 * f
    t0, t1, t2, t3 = y0 + y1, y0 - y1, y2 + y3, y2 - y3
    z0, z1, z2, z3 = t0 + t2, t1 + t3, t0 - t2, t1 - t3  # (H_4 (x) I) y
    mz = _row_max_abs(z0, z1, z2, z3).to(tl.int32, bitcast=True)
    ez = tl.where(mz > 0, (mz >> 23) - 127, 0)  # in [-24, 3] for a nonzero row
    fw = _pow2f(10 - ez)[:, None]
    # Output factor rot_scale * 2^eo, exact and normal; a row near fp32's underflow takes 2^-64 after
    # it, one near overflow a clamp, in a branch only programs holding such a row take.
    eo = tl.where(mz > 0, e + ez - 10, 0)  # a zero row (or a masked one) stays off the branch
    low = eo < -122
    fo = (rot_scale * _pow2f(tl.where(low, eo + 64, eo)))[:, None]
    h = tl.load(h_ptr + tl.arange(0, G)[:, None] * G + tl.arange(0, G)[None, :])
    o0 = _hadamard_exact(z0, fw, h) * fo
    o1 = _hadamard_exact(z1, fw, h) * fo
    o2 = _hadamard_exact(z2, fw, h) * fo
    o3 = _hadamard_exact(z3, fw, h) * fo
    if tl.max((low | (e > 122)).to(tl.int32), axis=0) > 0:  # below 2^123 |R x| < CLAMP
        fl = tl.where(low, 2.0**-64, 1.0)[:, None]
        o0 = tl.minimum(tl.maximum(o0 * fl, -CLAMP), CLAMP)
        o1 = tl.minimum(tl.maximum(o1 * fl, -CLAMP), CLAMP)
        o2 = tl.minimum(tl.maximum(o2 * fl, -CLAMP), CLAMP)
        o3 = tl.minimum(tl.maximum(o3 * fl, -CLAMP), CLAMP)
    return o0, o1, o2, o3


@triton.jit
def _store_mxfp4(b_k, page, row, m_t, cache_ptr, scale_ptr, stride_cache_page, stride_scale_page,
                 RCEIL: tl.constexpr, S_MIN: tl.constexpr, S_MAX: tl.constexpr, SIGN: tl.constexpr, G: tl.constexpr):
    """Quantize fp32 keys ``b_k [BT, D]`` (no NaN, within the MXFP4 input range) to MXFP4 and store
    each row's 64 data bytes and 4 scale bytes at its slot (``m_t``: rows to store)."""
    BT: tl.constexpr = b_k.shape[0]
    D: tl.constexpr = b_k.shape[1]
    bits = b_k.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    negative = (bits < 0) & (mag != 0)
    mag3 = tl.reshape(mag, (BT, D // G, G))
    amax = tl.max(mag3, axis=2)  # [BT, 4]; int order == float order for magnitudes
    s = _e8m0_bytes(amax, RCEIL, S_MIN, S_MAX)
    code = _e2m1_codes(mag3, s[:, :, None])
    code = tl.reshape(code, (BT, D)) + tl.where(negative, SIGN, 0)
    lo, hi = tl.split(tl.reshape(code, (BT, D // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    o_b = tl.arange(0, D // 2)
    p_out = cache_ptr + page[:, None] * stride_cache_page + row[:, None] * (D // 2) + o_b[None, :]
    tl.store(p_out, packed, mask=m_t[:, None])
    o_g = tl.arange(0, D // G)
    p_scale = scale_ptr + page[:, None] * stride_scale_page + row[:, None] * (D // G) + o_g[None, :]
    tl.store(p_scale, s.to(tl.uint8), mask=m_t[:, None])


@triton.jit
def _write_index_k_kernel(
    k_ptr, loc_ptr, cache_ptr, scale_ptr,
    n_tokens, capacity, stride_k_t, stride_cache_page, stride_scale_page,
    FMT: tl.constexpr,  # 0 bf16, 1 fp8, 2 mxfp4
    IN_BF16: tl.constexpr,
    RCEIL: tl.constexpr,
    BT: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    PAGE: tl.constexpr,
    CLAMP: tl.constexpr,
    S_MIN: tl.constexpr,
    S_MAX: tl.constexpr,
    SIGN: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, D)
    m_t, page, row = _token_slots(loc_ptr, o_t, n_tokens, capacity, PAGE)
    b_k = _load_keys(k_ptr + o_t[:, None].to(tl.int64) * stride_k_t + o_d[None, :], m_t[:, None], IN_BF16, CLAMP)
    if FMT == 0:
        p_out = cache_ptr + page[:, None] * stride_cache_page + row[:, None] * D + o_d[None, :]
        tl.store(p_out, _bf16_bits(b_k), mask=m_t[:, None])
    elif FMT == 1:
        p_out = cache_ptr + page[:, None] * stride_cache_page + row[:, None] * D + o_d[None, :]
        tl.store(p_out, _e4m3_bits(b_k), mask=m_t[:, None])
    else:
        _store_mxfp4(b_k, page, row, m_t, cache_ptr, scale_ptr, stride_cache_page, stride_scale_page, RCEIL, S_MIN,
                     S_MAX, SIGN, G)


@triton.jit
def _write_mxfp4_rot_kernel(
    k_ptr, loc_ptr, sign_ptr, h_ptr, cache_ptr, scale_ptr,
    n_tokens, capacity, stride_k_t, stride_cache_page, stride_scale_page, rot_scale,
    SIGNS: tl.constexpr,  # sign_ptr holds the +-1 diagonal of R (else none: plain Hadamard)
    IN_BF16: tl.constexpr,
    RCEIL: tl.constexpr,
    BT: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    PAGE: tl.constexpr,
    CLAMP: tl.constexpr,
    PRE_CLAMP: tl.constexpr,
    S_MIN: tl.constexpr,
    S_MAX: tl.constexpr,
    SIGN: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_t = i_t * BT + tl.arange(0, BT)
    o_g = tl.arange(0, G)
    m_t, page, row = _token_slots(loc_ptr, o_t, n_tokens, capacity, PAGE)
    p_k = k_ptr + o_t[:, None].to(tl.int64) * stride_k_t + o_g[None, :]
    x0 = _load_keys(p_k, m_t[:, None], IN_BF16, PRE_CLAMP)
    x1 = _load_keys(p_k + G, m_t[:, None], IN_BF16, PRE_CLAMP)
    x2 = _load_keys(p_k + 2 * G, m_t[:, None], IN_BF16, PRE_CLAMP)
    x3 = _load_keys(p_k + 3 * G, m_t[:, None], IN_BF16, PRE_CLAMP)
    if SIGNS:
        x0 = x0 * tl.load(sign_ptr + o_g)[None, :]
        x1 = x1 * tl.load(sign_ptr + G + o_g)[None, :]
        x2 = x2 * tl.load(sign_ptr + 2 * G + o_g)[None, :]
        x3 = x3 * tl.load(sign_ptr + 3 * G + o_g)[None, :]
    o0, o1, o2, o3 = _rotate(x0, x1, x2, x3, rot_scale, h_ptr, G, CLAMP)
    # [BT, D] in dim order: element (t, b, p, q) of the joins is group 2q + p, dim b of it
    b_k = tl.reshape(tl.permute(tl.join(tl.join(o0, o1), tl.join(o2, o3)), (0, 3, 2, 1)), (BT, D))
    _store_mxfp4(b_k, page, row, m_t, cache_ptr, scale_ptr, stride_cache_page, stride_scale_page, RCEIL, S_MIN,
                 S_MAX, SIGN, G)


_ROT_CACHE = {}


def _rotation_signs(sign_seed, device):
    """fp32 ``[128]``: the +-1 diagonal ``s`` of ``R = H diag(s) / sqrt(128)`` (None: all +1, no tensor).
    Cached per device, so calls after the first are safe inside a CUDA graph capture."""
    if sign_seed is None:
        return None
    key = ("signs", sign_seed, str(device))
    if key not in _ROT_CACHE:
        r = rotation_matrix(INDEX_DIM, sign_seed, torch.float64) * math.sqrt(INDEX_DIM)
        _ROT_CACHE[key] = r[0].round().to(device=device, dtype=torch.float32)  # row 0 of H is all ones
    return _ROT_CACHE[key]


def _hadamard_32(device):
    """fp16 ``[32, 32]``: the Sylvester Hadamard matrix ``H_32`` (+-1 entries), cached per device."""
    key = ("h32", str(device))
    if key not in _ROT_CACHE:
        h = rotation_matrix(MX_GROUP_SIZE, None, torch.float64) * math.sqrt(MX_GROUP_SIZE)
        _ROT_CACHE[key] = h.round().to(device=device, dtype=torch.float16)
    return _ROT_CACHE[key]


_ROT_SCALE = float(torch.tensor(1.0 / math.sqrt(INDEX_DIM), dtype=torch.float32))  # fp32(1/sqrt(128))


def write_index_k_triton(cache, k, loc, tokens_per_program=None, num_warps=None):
    """Launch the writer into ``cache`` (an ``IndexKCache``: format, scale rule and sign seed are its own);
    ``k`` and ``loc`` already validated by ``naive.check_write_rows``.

    ``k [tokens, 128]`` fp32/bf16 (last dim contiguous), ``loc [tokens]`` int32/int64; slots outside
    the cache are skipped (never written). ``tokens_per_program`` (a power of two >= 16) and
    ``num_warps`` are launch parameters for benchmarks (default 16 and 4; ``_rot_launch`` for
    ``mxfp4_rot``).
    """
    n = k.shape[0]
    if n == 0:
        return
    fmt, k_cache, k_scale = cache.fmt, cache.data, cache.scale_e8m0
    scale_rule, sign_seed = cache.scale_rule, cache.sign_seed
    if k.stride(1) != 1:
        k = k.contiguous()
    loc = loc.contiguous()
    capacity = cache.capacity
    rule = parse_scale_rule(scale_rule)
    default_bt, default_warps = _rot_launch(n) if fmt.is_rotated else (_BT, 4)
    bt = tokens_per_program or default_bt
    num_warps = num_warps or default_warps
    grid = (triton.cdiv(n, bt),)
    k_in = k.view(torch.int16) if k.dtype == torch.bfloat16 else k
    common = dict(IN_BF16=k.dtype == torch.bfloat16, RCEIL=rule is ScaleRule.RCEIL, BT=bt, D=INDEX_DIM,
                  G=MX_GROUP_SIZE, PAGE=PAGE_SIZE, S_MIN=E8M0_MIN_WRITTEN, S_MAX=E8M0_MAX_WRITTEN,
                  SIGN=F4_E2M1_SIGN_BIT, num_warps=num_warps)
    if fmt.is_rotated:
        signs = _rotation_signs(sign_seed, k.device)
        _write_mxfp4_rot_kernel[grid](
            k_in, loc, signs, _hadamard_32(k.device), k_cache, k_scale, n, capacity, k.stride(0), k_cache.stride(0),
            k_scale.stride(0), _ROT_SCALE, SIGNS=signs is not None, CLAMP=MXFP4_INPUT_MAX, PRE_CLAMP=_FP32_MAX,
            **common)
        return
    if fmt is IndexKFormat.BF16:
        code, cache, clamp = 0, k_cache.view(torch.int16), BF16_MAX
    elif fmt is IndexKFormat.FP8:
        code, cache, clamp = 1, k_cache.view(torch.uint8), FP8_E4M3_MAX
    else:
        code, cache, clamp = 2, k_cache, MXFP4_INPUT_MAX
    _write_index_k_kernel[grid](
        k_in, loc, cache, k_scale, n, capacity, k.stride(0), cache.stride(0),
        k_scale.stride(0) if k_scale is not None else 0, FMT=code, CLAMP=clamp, **common)


__all__ = ["write_index_k_triton"]
