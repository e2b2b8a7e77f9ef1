"""Triton index-cache writer: quantize index K (after norm + RoPE) and store it at token slots.

One program stores ``BT`` tokens. Every format is computed from fp32 with one rounding and is
bitwise equal to ``m3_kernels.formats`` (``quantize_index_k``), except ``mxfp4_rot``:

- ``bf16`` / ``fp8``: sanitize (NaN -> 0, +-inf -> +-fp32 max), clamp to the format's largest
  finite value, round to nearest even.
- ``mxfp4``: the e8m0 scale and every e2m1 code are computed on fp32 bit patterns with integer
  compares (no division, no scaled products), so subnormal inputs, ties and saturation follow
  ``formats.mxfp4`` exactly whatever the hardware's denormal mode.
- ``mxfp4_rot``: the key is rotated in the kernel (fp32 sums of +-k_i, then one multiply by
  fp32(1/sqrt(128))) before the same quantizer. The reference rotates in float64, so a code or a
  scale may differ where the rotated value lies within the fp32 summation error bound of a
  rounding boundary; ``tests/kernels/ops/write/test_triton.py`` checks exactly that.
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
def _write_index_k_kernel(
    k_ptr, loc_ptr, rot_ptr, cache_ptr, scale_ptr,
    n_tokens, capacity, stride_k_t, stride_cache_page, stride_scale_page, rot_scale,
    FMT: tl.constexpr,  # 0 bf16, 1 fp8, 2 mxfp4
    ROTATE: tl.constexpr,
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
    o_d = tl.arange(0, D)
    m_t = o_t < n_tokens
    loc = tl.load(loc_ptr + o_t, mask=m_t, other=-1).to(tl.int64)
    m_t = m_t & (loc >= 0) & (loc < capacity)  # out-of-range slots are never written
    page = loc // PAGE
    row = loc % PAGE
    b_k = tl.load(k_ptr + o_t[:, None].to(tl.int64) * stride_k_t + o_d[None, :], mask=m_t[:, None], other=0.0)
    if IN_BF16:  # bf16 bits -> fp32 bits: exact for subnormals whatever the conversion path does
        b_k = ((b_k.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        b_k = b_k.to(tl.float32)
    b_k = tl.where(b_k != b_k, 0.0, b_k)  # NaN -> 0
    b_k = tl.minimum(tl.maximum(b_k, -PRE_CLAMP), PRE_CLAMP)  # +-inf -> +-max (and format saturation)
    if FMT == 0:
        p_out = cache_ptr + page[:, None] * stride_cache_page + row[:, None] * D + o_d[None, :]
        tl.store(p_out, _bf16_bits(b_k), mask=m_t[:, None])
    elif FMT == 1:
        p_out = cache_ptr + page[:, None] * stride_cache_page + row[:, None] * D + o_d[None, :]
        tl.store(p_out, _e4m3_bits(b_k), mask=m_t[:, None])
    else:
        if ROTATE:
            # rot_ptr holds H * diag(signs) (+-1 entries, transposed): exact products, fp32 sums.
            b_r = tl.load(rot_ptr + o_d[:, None] * D + o_d[None, :])
            b_k = tl.dot(b_k, b_r, input_precision="ieee") * rot_scale
            b_k = tl.where(b_k != b_k, 0.0, b_k)
            b_k = tl.minimum(tl.maximum(b_k, -CLAMP), CLAMP)
        bits = b_k.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        negative = (bits < 0) & (mag != 0)
        mag3 = tl.reshape(mag, (BT, D // G, G))
        amax = tl.max(mag3, axis=2)  # [BT, 4]; int order == float order for magnitudes
        field = amax >> 23
        if RCEIL:
            # ceil(log2(amax / 6)): exponent - 2, plus one when the significand exceeds 1.5.
            s = field - 2 + ((amax & 0x7FFFFF) > 0x400000).to(tl.int32)
        else:
            s = field - 2
        s = tl.minimum(tl.maximum(s, S_MIN), S_MAX)
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


_ROT_CACHE = {}


def _rotation_pm1(sign_seed, device):
    """``(H diag(s))^T`` with +-1 entries (fp32) and the fp32 factor 1/sqrt(128)."""
    key = (sign_seed, str(device))
    if key not in _ROT_CACHE:
        r = rotation_matrix(INDEX_DIM, sign_seed, torch.float64) * math.sqrt(INDEX_DIM)
        _ROT_CACHE[key] = r.T.contiguous().round().to(device=device, dtype=torch.float32)
    return _ROT_CACHE[key], float(torch.tensor(1.0 / math.sqrt(INDEX_DIM), dtype=torch.float32))


def write_index_k_triton(k, loc, k_cache, k_scale, fmt: IndexKFormat, scale_rule=ScaleRule.RCEIL, sign_seed=None):
    """Launch the writer; arguments already validated by ``naive.check_write_args``.

    ``k [tokens, 128]`` fp32/bf16 (last dim contiguous), ``loc [tokens]`` int32/int64; slots outside
    the cache are skipped (never written).
    """
    n = k.shape[0]
    if n == 0:
        return
    if k.stride(1) != 1:
        k = k.contiguous()
    loc = loc.contiguous()
    capacity = k_cache.shape[0] * PAGE_SIZE
    rule = parse_scale_rule(scale_rule)
    grid = (triton.cdiv(n, _BT),)
    rot, rot_scale = (None, 1.0)
    if fmt is IndexKFormat.BF16:
        code, cache, clamp = 0, k_cache.view(torch.int16), BF16_MAX
    elif fmt is IndexKFormat.FP8:
        code, cache, clamp = 1, k_cache.view(torch.uint8), FP8_E4M3_MAX
    else:
        code, cache, clamp = 2, k_cache, MXFP4_INPUT_MAX
        if fmt.is_rotated:
            rot, rot_scale = _rotation_pm1(sign_seed, k.device)
    _write_index_k_kernel[grid](
        k.view(torch.int16) if k.dtype == torch.bfloat16 else k, loc, rot, cache, k_scale,
        n, capacity, k.stride(0), cache.stride(0), k_scale.stride(0) if k_scale is not None else 0, rot_scale,
        FMT=code, ROTATE=rot is not None, IN_BF16=k.dtype == torch.bfloat16, RCEIL=rule is ScaleRule.RCEIL,
        BT=_BT, D=INDEX_DIM,
        G=MX_GROUP_SIZE, PAGE=PAGE_SIZE, CLAMP=clamp,
        PRE_CLAMP=_FP32_MAX if rot is not None else clamp, S_MIN=E8M0_MIN_WRITTEN, S_MAX=E8M0_MAX_WRITTEN,
        SIGN=F4_E2M1_SIGN_BIT,
    )


__all__ = ["write_index_k_triton"]
