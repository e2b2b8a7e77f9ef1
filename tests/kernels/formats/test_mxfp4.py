"""MXFP4 format: exhaustive code tables, nibble order, scale rules and rounding against an
independent oracle written with Python scalars (math.frexp / exact comparisons)."""

import math

import pytest
import torch

from m3_kernels.formats import (
    MXFP4_INPUT_MAX,
    E8M0_MAX_WRITTEN,
    E8M0_MIN_WRITTEN,
    MX_GROUP_SIZE,
    ScaleRule,
    dequantize_mxfp4,
    e2m1_decode,
    e8m0_to_float,
    pack_e2m1,
    quantize_mxfp4,
    unpack_e2m1,
)

FP32_MAX = torch.finfo(torch.float32).max


# ---- independent oracle ---------------------------------------------------------------------

def e2m1_value(code: int) -> float:
    """e2m1 from its bit fields: 1 sign, 2 exponent (bias 1), 1 mantissa; exponent 0 is subnormal."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    mag = 0.5 * man if exp == 0 else 2.0 ** (exp - 1) * (1 + 0.5 * man)
    return sign * mag


GRID = sorted({abs(e2m1_value(c)) for c in range(8)})


def oracle_scale(amax: float, rule: str) -> int:
    """Biased exponent by exact search: rceil = smallest e with amax <= 6*2^e; floor = floor(log2 amax) - 2."""
    if amax == 0:
        return E8M0_MIN_WRITTEN
    if rule == "rceil":
        e = -200
        while 6.0 * math.ldexp(1.0, e) < amax:
            e += 1
    else:
        m, ex = math.frexp(amax)  # amax = m * 2^ex, m in [0.5, 1)
        e = (ex - 1) - 2
    return min(max(e + 127, E8M0_MIN_WRITTEN), E8M0_MAX_WRITTEN)


def oracle_code(x: float, e: int) -> int:
    """Nearest grid value of |x|/2^e, ties to the even code, saturating at 6; sign bit = x < 0."""
    a = abs(x) / math.ldexp(1.0, e)
    best = min(range(8), key=lambda c: (abs(GRID[c] - a), c & 1))
    return best | (8 if x < 0 else 0)


def oracle_quantize(k: torch.Tensor, rule: str):
    k = torch.nan_to_num(k.float(), nan=0.0).clamp(-MXFP4_INPUT_MAX, MXFP4_INPUT_MAX)
    codes, scales = [], []
    for row in k.tolist():
        crow, srow = [], []
        for g in range(0, len(row), MX_GROUP_SIZE):
            group = row[g : g + MX_GROUP_SIZE]
            s = oracle_scale(max(abs(v) for v in group), rule)
            srow.append(s)
            crow += [oracle_code(v, s - 127) for v in group]
        codes.append(crow)
        scales.append(srow)
    return torch.tensor(codes, dtype=torch.uint8), torch.tensor(scales, dtype=torch.uint8)


# ---- code tables ------------------------------------------------------------------------------

def test_every_data_byte_decodes():
    data = torch.arange(256, dtype=torch.uint8)
    codes = unpack_e2m1(data[:, None])  # [256, 2]
    values = e2m1_decode(codes, torch.float64)
    for b in range(256):
        assert values[b, 0].item() == e2m1_value(b & 0xF), b  # low nibble = even element
        assert values[b, 1].item() == e2m1_value(b >> 4), b


def test_every_scale_byte_decodes():
    scale = e8m0_to_float(torch.arange(256, dtype=torch.uint8), torch.float64)
    for b in range(255):
        assert scale[b].item() == math.ldexp(1.0, b - 127), b
    assert math.isnan(scale[255].item())


def test_nibble_order_pinned():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack_e2m1(codes).tolist() == [[0x21, 0x43]]
    assert unpack_e2m1(torch.tensor([[0x21, 0x43]], dtype=torch.uint8)).tolist() == [[1, 2, 3, 4]]
    # Through the quantizer: element 0 = 1.0 (code 2), element 1 = -6 (code 15), amax 6 -> scale 2^0.
    k = torch.zeros(1, 128)
    k[0, 0], k[0, 1] = 1.0, -6.0
    data, scale = quantize_mxfp4(k)
    assert data[0, 0].item() == 0xF2
    assert scale[0, 0].item() == 127


def test_pack_roundtrip_all_codes():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2, 8)  # every code in both nibbles
    assert torch.equal(unpack_e2m1(pack_e2m1(codes)), codes)


# ---- rounding: ties, saturation, scale rules ---------------------------------------------------

TIES = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)]


@pytest.mark.parametrize("value,code", TIES)
def test_ties_round_to_even(value, code):
    k = torch.zeros(1, 128)
    k[0, 0] = 6.0  # fixes the scale at 2^0 under rceil
    k[0, 1], k[0, 2] = value, -value
    data, scale = quantize_mxfp4(k, "rceil")
    assert scale[0, 0].item() == 127
    codes = unpack_e2m1(data)[0]
    assert codes[1].item() == code
    assert codes[2].item() == code | 8


def test_floor_saturates_and_rceil_does_not():
    k = torch.zeros(1, 128)
    k[0, 0] = 7.5  # floor: e = floor(log2 7.5) - 2 = 0 -> 7.5 saturates to 6; rceil: e = 1 -> 7.5/2 = 3.75 -> 4
    d_floor, s_floor = quantize_mxfp4(k, "floor")
    d_rceil, s_rceil = quantize_mxfp4(k, "rceil")
    assert (s_floor[0, 0].item(), unpack_e2m1(d_floor)[0, 0].item()) == (127, 7)
    assert (s_rceil[0, 0].item(), unpack_e2m1(d_rceil)[0, 0].item()) == (128, 6)


def _random_keys(gen, tokens=64):
    """Groups spanning 2^-20..2^20, with exact powers of two and 6*2^k boundaries mixed in."""
    k = torch.randn(tokens, 128, generator=gen)
    group_scale = torch.pow(2.0, torch.randint(-20, 21, (tokens, 4, 1), generator=gen).float())
    k = (k.view(tokens, 4, 32) * group_scale).view(tokens, 128)
    k[0, :32] = 6.0 * 2.0**3  # amax exactly 6*2^k
    k[1, :32] = torch.nextafter(torch.tensor(6.0 * 2.0**3), torch.tensor(1e9))  # one ulp above
    k[2, :32] = 2.0**-5  # exact power of two
    k[3] = 0.0
    return k


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_quantize_matches_oracle(rule, gen):
    k = _random_keys(gen)
    data, scale = quantize_mxfp4(k, rule)
    codes_ref, scale_ref = oracle_quantize(k, rule)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(unpack_e2m1(data), codes_ref)


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_bf16_input_is_quantized_from_its_exact_value(rule, gen):
    k = _random_keys(gen).bfloat16()
    assert torch.equal(torch.cat(quantize_mxfp4(k, rule), 1), torch.cat(quantize_mxfp4(k.float(), rule), 1))


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_roundtrip_error_per_group(rule, gen):
    """Each element is within half a grid step of its scaled value (plus the clip above 6 for floor)."""
    k = _random_keys(gen, 256)
    data, scale = quantize_mxfp4(k, rule)
    deq = dequantize_mxfp4(data, scale, torch.float64)
    step = torch.pow(2.0, scale.double() - 127).repeat_interleave(MX_GROUP_SIZE, 1)
    a = k.double().abs() / step
    half_step = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))
    clip = (a - 6).clamp(min=0)  # 0 for rceil by construction
    if rule == "rceil":
        assert a.max() <= 6
    assert ((deq - k.double()).abs() <= (half_step + clip) * step).all()
    # SQNR of the round trip on normal data: a regression guard for the whole pipeline.
    x = torch.randn(4096, 128, generator=gen)
    err = dequantize_mxfp4(*quantize_mxfp4(x, rule)) - x
    sqnr = 10 * torch.log10(x.pow(2).sum() / err.pow(2).sum())
    assert sqnr > (16.0 if rule == "rceil" else 15.0), sqnr


@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize(
    "fill",
    [0.0, 1e-45, 1e-40, 2.0**-126, 1e-30, 1.0, 1e30, 1e38, FP32_MAX, -FP32_MAX, float("inf"), float("nan")],
)
def test_scale_bytes_never_0_or_255(rule, fill):
    k = torch.full((2, 128), fill)
    k[1, ::3] = 0.0  # mixed groups
    _, scale = quantize_mxfp4(k, rule)
    assert scale.min() >= E8M0_MIN_WRITTEN and scale.max() <= E8M0_MAX_WRITTEN


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_largest_inputs_dequantize_finite_in_fp32(rule):
    k = torch.tensor([[FP32_MAX, 3e38, MXFP4_INPUT_MAX, -FP32_MAX] * 32])
    deq = dequantize_mxfp4(*quantize_mxfp4(k, rule))
    assert torch.isfinite(deq).all()
    assert deq[0, 2].item() == MXFP4_INPUT_MAX


def test_dequantize_is_exact_in_bf16(gen):
    data, scale = quantize_mxfp4(_random_keys(gen))
    assert torch.equal(dequantize_mxfp4(data, scale, torch.bfloat16).double(), dequantize_mxfp4(data, scale, torch.float64))


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_non_finite_input_is_documented_and_contained(rule, gen):
    """NaN -> +0, +-inf -> +-6*2^125; only the element's own group can change."""
    k = torch.randn(8, 128, generator=gen)
    bad = k.clone()
    bad[3, 5] = float("nan")
    bad[3, 40] = float("inf")
    bad[5, 100] = float("-inf")
    d_ok, s_ok = quantize_mxfp4(k, rule)
    d_bad, s_bad = quantize_mxfp4(bad, rule)
    touched = {(3, 0), (3, 1), (5, 3)}  # (token, group)
    for t in range(8):
        for g in range(4):
            same = torch.equal(d_ok[t, g * 16 : (g + 1) * 16], d_bad[t, g * 16 : (g + 1) * 16]) and s_ok[t, g] == s_bad[t, g]
            assert same or (t, g) in touched
    codes = unpack_e2m1(d_bad)
    assert codes[3, 5].item() == 0  # NaN stored as +0
    assert codes[3, 40].item() == 7 and codes[5, 100].item() == 15  # inf saturates to +-6 * 2^e
    assert torch.isfinite(dequantize_mxfp4(d_bad, s_bad, torch.float32)).all()
    # The NaN's group is quantized as if the NaN were 0.
    zeroed = k.clone()
    zeroed[3, 5] = 0.0
    assert torch.equal(quantize_mxfp4(zeroed, rule)[0][3, :16], d_bad[3, :16])


def test_rejects_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="last dim 128"):
        quantize_mxfp4(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quantize_mxfp4(torch.zeros(2, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"scale_rule must be one of \[rceil, floor\]"):
        quantize_mxfp4(torch.zeros(2, 128), "even")


def test_scale_rule_enum_values():
    assert [r.value for r in ScaleRule] == ["rceil", "floor"]
