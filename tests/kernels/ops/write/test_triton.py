"""Triton index-cache writer against the formats module.

bf16, fp8, mxfp4: bitwise equal to ``quantize_index_k`` on every input, rounding corner cases
included (exact ties, every e2m1 threshold and scale boundary, saturation, zeros and -0,
subnormals, NaN and +-inf). mxfp4_rot: equal to ``quantize_mxfp4(rotate(k))`` except where the
exact rotated value lies within the kernel's fp32 rotation error bound of an e2m1 rounding
boundary (for a code) or of a scale boundary (for a group's scale); the test computes both from
float64 and fails on any other difference. The kernel's rotated fp32 values themselves are checked
against the error bound derived in ``m3_kernels/ops/write/triton.py``. CPU cases run under the
Triton interpreter.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from m3_kernels.formats import (  # noqa: E402
    F4_E2M1_TIES_DOWN,
    F4_E2M1_TIES_UP,
    MXFP4_INPUT_MAX,
    PAGE_SIZE,
    IndexKCache,
    alloc_index_k_cache,
    quantize_index_k,
    quantize_mxfp4,
    rotation_matrix,
)
from m3_kernels.formats.mxfp4 import sanitize_fp32  # noqa: E402
from m3_kernels.ops.write import write_index_k  # noqa: E402
from m3_kernels.testing import capture_graph, triton_module  # noqa: E402

CPU = pytest.param("cpu", id="cpu")
GPU = pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)


def _on(device):
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("interpreter cases run on CPU-only machines (CI)")
    return device


def _writer_module():
    return triton_module("m3_kernels.ops.write.triton", "_write_index_k_kernel")


def _writer():
    return _writer_module().write_index_k_triton


def write(k, loc, k_cache, k_scale, fmt, rule, seed=None, tokens_per_program=None):
    cache = IndexKCache(fmt, k_cache, k_scale, rule, seed)
    if k.device.type == "cpu" or tokens_per_program:
        _writer()(cache, k, loc, tokens_per_program)
    else:
        write_index_k(cache, k, loc)


def corner_keys(gen, tokens):
    """Keys full of corner cases: exact e2m1 ties and thresholds times the group scale, values one
    ulp either side, saturation, zeros, -0, subnormals, NaN, +-inf, huge values."""
    k = torch.randn(tokens, 128, generator=gen) * torch.exp2(torch.randint(-40, 40, (tokens, 1), generator=gen).float())
    thresholds = torch.tensor(F4_E2M1_TIES_DOWN + F4_E2M1_TIES_UP + (0.5, 1.0, 6.0, 7.0, 12.0))
    for t in range(0, tokens, 3):
        e = torch.randint(-130, 120, (1,), generator=gen).float()
        amax = 6.0 * torch.exp2(e)  # scale boundary: amax exactly 6 * 2^e
        vals = thresholds[torch.randint(0, len(thresholds), (128,), generator=gen)] * torch.exp2(e)
        sign = torch.where(torch.rand(128, generator=gen) < 0.5, -1.0, 1.0)
        ulp = torch.randint(-1, 2, (128,), generator=gen)
        v = (vals * sign).float()
        v = torch.where(ulp > 0, torch.nextafter(v, torch.tensor(float("inf"))), v)
        v = torch.where(ulp < 0, torch.nextafter(v, torch.tensor(float("-inf"))), v)
        v[::32] = amax.float()
        k[t] = v
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-45, -1e-45, 1e-39, 3.4e38,
                            -3.4e38, 448.0, 449.0, 464.0, -465.0, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 0.0])
    k[min(1, tokens - 1), : len(special)] = special
    if tokens > 2:
        k[2] = 0.0
        k[2, 40:72] = torch.full((32,), 5e-40)  # an all-subnormal group
    return k


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("single", [True, False], ids=["single_region", "split_views"])
def test_writer_bitwise(gen, device, fmt, rule, in_dtype, single):
    device = _on(device)
    if fmt != "mxfp4" and (rule == "floor" or not single):
        pytest.skip("scale rule and views apply to MXFP4 only")
    tokens = 37 if device == "cpu" else 4099
    pages = tokens // PAGE_SIZE + 2
    k = corner_keys(gen, tokens).to(in_dtype)
    k_cache, k_scale = alloc_index_k_cache(pages, fmt, device, single_region=single)
    k_cache.view(torch.uint8).fill_(0xA5)  # poison
    if k_scale is not None:
        k_scale.fill_(0xA5)
    loc = torch.randperm(pages * PAGE_SIZE, generator=gen)[:tokens]
    write(k.to(device), loc.to(device), k_cache, k_scale, fmt, rule)
    rows, scales = quantize_index_k(k, fmt, rule)
    page, row = loc // PAGE_SIZE, loc % PAGE_SIZE
    assert torch.equal(k_cache.cpu()[page, row].view(torch.uint8), rows.view(torch.uint8))
    if k_scale is not None:
        assert torch.equal(k_scale.cpu()[page, row], scales)
    untouched = torch.ones(pages * PAGE_SIZE, dtype=torch.bool)
    untouched[loc] = False
    assert (k_cache.cpu().reshape(pages * PAGE_SIZE, -1).view(torch.uint8)[untouched] == 0xA5).all()
    if k_scale is not None:
        assert (k_scale.cpu().reshape(pages * PAGE_SIZE, -1)[untouched] == 0xA5).all()


U = 2.0**-24


def rotation_mismatches_explained(k, data, scales, rule, sign_seed):
    """Assert every difference from quantize_mxfp4(rotate(k)) sits within the fp32 rotation error
    bound of a boundary; return the number of differences."""
    x = sanitize_fp32(k).double()
    r = rotation_matrix(128, sign_seed, torch.float64)
    exact = x @ r.T  # float64, the reference's rotated value before its fp32 rounding
    # The kernel's rotation (m3_kernels/ops/write/triton.py) errs by at most 67.1 u S + 2 u |exact|
    # + 2^-150, S = sum|x_i| / sqrt(128); this allows 130 u S + 2 u |exact| + 1e-45 (the bound of
    # fp32 sums of 128 terms, which an exact rotation of any fp32 design should meet).
    tok_bound = (130 * U) * x.abs().sum(-1, keepdim=True) / math.sqrt(128) + 1e-45
    bound = tok_bound + exact.abs() * 2 * U
    ref_data, ref_scale = quantize_mxfp4(exact.float(), rule)
    diff_scale = ref_scale != scales
    exp = ref_scale.double() - 127
    # Scale boundaries: rceil at 6 * 2^e, floor at 2^e; a group may move when its amax is near one.
    amax = exact.abs().unflatten(-1, (4, 32)).amax(-1)
    group_bound = tok_bound + amax * 2 * U
    lo = (amax - group_bound).clamp_min(0)
    hi = amax + group_bound
    if rule == "rceil":
        near = torch.ceil(torch.log2(lo.clamp_min(1e-300) / 6)) != torch.ceil(torch.log2(hi / 6))
    else:
        near = torch.floor(torch.log2(lo.clamp_min(1e-300))) != torch.floor(torch.log2(hi))
    assert not (diff_scale & ~near).any(), "scale differs away from any scale boundary"
    # Codes, in groups whose scale agrees: thresholds t * 2^e within the bound of |exact|.
    codes_k = torch.stack([data & 0xF, data >> 4], -1).flatten(-2)
    codes_r = torch.stack([ref_data & 0xF, ref_data >> 4], -1).flatten(-2)
    same_scale = (~diff_scale).repeat_interleave(32, -1)
    diff = (codes_k != codes_r) & same_scale
    ts = torch.tensor(F4_E2M1_TIES_DOWN + F4_E2M1_TIES_UP, dtype=torch.float64)
    step = torch.exp2(exp).repeat_interleave(32, -1)
    dist = (exact.abs()[..., None] - ts * step[..., None]).abs().amin(-1)
    # A value near 0 may flip the sign bit of a zero code.
    near_code = (dist <= bound) | (exact.abs() <= bound)
    assert not (diff & ~near_code).any(), "code differs away from any rounding boundary"
    return int(diff.sum() + diff_scale.sum())


def rotation_keys(gen, tokens):
    """Keys for the rotated writer: Gaussian rows across 2^-20..2^20 with outlier channels; row 0
    with NaN, +inf (sanitized to the fp32 maximum) and signed zeros; then rows at the edges of fp32
    (all subnormal, mixed normal and subnormal, near 2^120, one whose rotation overflows fp32), a
    zero row, a constant row (all output in one element), one dominant element over small ones and
    two rows at the rotation's worst case. Returns ``(k, first row of the Gaussian rest)``."""
    k = torch.randn(tokens, 128, generator=gen) * torch.exp2(torch.randint(-20, 20, (tokens, 1), generator=gen).float())
    k[:, :3] *= 50.0  # outlier channels
    edge = [torch.randn(128, generator=gen) * 2.0**-140,  # every element subnormal
            torch.randn(128, generator=gen) * 2.0**-128,
            torch.randn(128, generator=gen) * 2.0**120,
            torch.full((128,), 2.0**126),  # |R x| = 2^129.5 in one element: saturates at the MXFP4 maximum
            torch.zeros(128),
            torch.full((128,), 3.0),
            torch.cat([torch.tensor([2.0**20]), torch.randn(127, generator=gen) * 2.0**-3]),
            # one 1.0 and 31 x 2^-23 in one quarter: the kernel drops the 31 small ones whole, an
            # error of about 62 u S, 0.9 of its bound; with 2^-21 they must be kept (an exponent of z
            # taken too coarse would drop them too, above the bound)
            torch.cat([torch.tensor([1.0]), torch.full((31,), 2.0**-23), torch.zeros(96)]),
            torch.cat([torch.tensor([1.0]), torch.full((31,), 2.0**-21), torch.zeros(96)])]
    k[2 : 2 + len(edge)] = torch.stack(edge)
    k[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 0.0])
    return k, 2 + len(edge)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("sign_seed", [None, 7])
@pytest.mark.parametrize("bt", [None, 64], ids=["bt_default", "bt64"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotated_writer_within_rotation_bound(gen, device, rule, sign_seed, bt, in_dtype):
    device = _on(device)
    tokens = 33 if device == "cpu" else 8192
    pages = tokens // PAGE_SIZE + 1
    k, plain = rotation_keys(gen, tokens)
    k = k.to(in_dtype)
    k_cache, k_scale = alloc_index_k_cache(pages, "mxfp4", device)
    loc = torch.arange(tokens)
    write(k.to(device), loc.to(device), k_cache, k_scale, "mxfp4_rot", rule, sign_seed, bt)
    data = k_cache.cpu().reshape(-1, 64)[:tokens]
    scales = k_scale.cpu().reshape(-1, 4)[:tokens]
    rotation_mismatches_explained(k, data, scales, rule, sign_seed)  # +-inf rotate as +-fp32 max
    ref_data, _ = quantize_index_k(k, "mxfp4_rot", rule, sign_seed)
    # the criterion above is not vacuous (edge rows aside: where the kernel's rotation is exact,
    # float64's rounding noise gives the reference tiny nonzero codes)
    assert (data[plain:] == ref_data[plain:]).float().mean() > 0.99


@triton.jit
def _rotate_kernel(k_ptr, sign_ptr, h_ptr, out_ptr, rot_scale, SIGNS: tl.constexpr, BT: tl.constexpr,
                   G: tl.constexpr, CLAMP: tl.constexpr):
    """The writer's ``_rotate`` alone: sanitized fp32 keys ``[n, 4G]`` -> rotated fp32 ``[n, 4G]``."""
    o = (tl.program_id(0) * BT + tl.arange(0, BT))[:, None] * (4 * G) + tl.arange(0, G)[None, :]
    x0, x1, x2, x3 = tl.load(k_ptr + o), tl.load(k_ptr + o + G), tl.load(k_ptr + o + 2 * G), tl.load(k_ptr + o + 3 * G)
    if SIGNS:
        o_g = tl.arange(0, G)[None, :]
        x0, x1 = x0 * tl.load(sign_ptr + o_g), x1 * tl.load(sign_ptr + G + o_g)
        x2, x3 = x2 * tl.load(sign_ptr + 2 * G + o_g), x3 * tl.load(sign_ptr + 3 * G + o_g)
    o0, o1, o2, o3 = _WRITER._rotate(x0, x1, x2, x3, rot_scale, h_ptr, G, CLAMP)
    tl.store(out_ptr + o, o0)
    tl.store(out_ptr + o + G, o1)
    tl.store(out_ptr + o + 2 * G, o2)
    tl.store(out_ptr + o + 3 * G, o3)


_WRITER = None  # the writer module as _rotate_kernel calls it (set by kernel_rotation)


def kernel_rotation(x, sign_seed, bt):
    """The writer kernel's fp32 rotation of sanitized fp32 keys ``x [n, 128]`` (n a multiple of ``bt``),
    ``bt`` tokens per program."""
    global _WRITER
    _WRITER = _writer_module()
    out = torch.full_like(x, float("nan"))
    signs = _WRITER._rotation_signs(sign_seed, x.device)
    _rotate_kernel[(x.shape[0] // bt,)](x, signs, _WRITER._hadamard_32(x.device), out, _WRITER._ROT_SCALE,
                                        SIGNS=signs is not None, BT=bt, G=32, CLAMP=MXFP4_INPUT_MAX)
    return out


def assert_rotation_within_bound(x, got, sign_seed, terms=67.1):
    """``|got - clamp(R x)| <= terms u S + 2 u |R x| + 2^-149`` elementwise, S = sum|x_i| / sqrt(128),
    clamp to the MXFP4 input range (as the kernel clamps; clamping never widens a difference)."""
    exact = x.double() @ rotation_matrix(128, sign_seed, torch.float64).T
    bound = terms * U * x.double().abs().sum(-1, keepdim=True) / math.sqrt(128) + 2 * U * exact.abs() + 2.0**-149
    err = (got.double() - exact.clamp(-MXFP4_INPUT_MAX, MXFP4_INPUT_MAX)).abs()
    assert not torch.isnan(got).any(), "NaN in the rotation"
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"rotation error {worst:.3g} x its bound"
    return worst


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("sign_seed", [None, 7])
@pytest.mark.parametrize("bt", [16, 64])
def test_rotation_values_within_the_derived_bound(gen, device, sign_seed, bt):
    """The fp32 rotation itself against float64, with the kernel's own (tighter) bound."""
    device = _on(device)
    x = sanitize_fp32(rotation_keys(gen, 64 if device == "cpu" else 8192)[0])
    got = kernel_rotation(x.to(device), sign_seed, bt).cpu()
    print(f"worst rotation error: {assert_rotation_within_bound(x, got, sign_seed):.3f} of the bound")


def test_rotation_bound_check_can_fail(gen):
    """The check rejects a rotation off by 200 u S, three times the bound's main term."""
    x = rotation_keys(gen, 32)[0][2:]
    exact = (x.double() @ rotation_matrix(128, None, torch.float64).T).clamp(-MXFP4_INPUT_MAX, MXFP4_INPUT_MAX)
    assert_rotation_within_bound(x, exact.float(), None)
    s = x.double().abs().sum(-1, keepdim=True) / math.sqrt(128)
    with pytest.raises(AssertionError, match="rotation error"):
        assert_rotation_within_bound(x, exact + 200 * U * s, None)


@pytest.mark.parametrize("device", [CPU, GPU])
def test_rotation_check_can_fail(gen, device):
    """The bound check rejects a writer that rounds wrongly (codes off by one at random)."""
    device = _on(device)
    k = torch.randn(16, 128, generator=gen)
    data, scales = quantize_index_k(k, "mxfp4_rot")
    bad = data ^ 0x01
    with pytest.raises(AssertionError, match="code differs"):
        rotation_mismatches_explained(k, bad, scales, "rceil", None)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_kernel_skips_slots_outside_the_cache(gen, device, fmt):
    """The kernel's own skip of loc < 0 and loc >= capacity (the path a server takes, check_loc=False): the
    cache is pages 1-2 of a 4-page pool, so a slot written out of range would land in page 0 or 3."""
    device = _on(device)
    pool, pool_scale = alloc_index_k_cache(4, fmt, device, single_region=False)
    pool.view(torch.uint8).fill_(0xA5)
    if pool_scale is not None:
        pool_scale.fill_(0xA5)
    k_cache, k_scale = pool[1:3], None if pool_scale is None else pool_scale[1:3]
    capacity = 2 * PAGE_SIZE
    k = torch.randn(20, 128, generator=gen)
    loc = torch.tensor([3, -1, capacity, 5, -PAGE_SIZE, capacity + 7] + list(range(100, 114)))
    _writer()(IndexKCache(fmt, k_cache, k_scale), k.to(device), loc.to(device))
    for t in (pool.view(torch.uint8), pool_scale):
        if t is not None:
            assert (t[0] == 0xA5).all() and (t[3] == 0xA5).all(), "a slot outside the cache was written"
    inside = (loc >= 0) & (loc < capacity)
    rows, _ = quantize_index_k(k[inside], fmt)
    got = k_cache.cpu()[loc[inside] // PAGE_SIZE, loc[inside] % PAGE_SIZE]
    assert torch.equal(got.view(torch.uint8), rows.view(torch.uint8))


@pytest.mark.parametrize("device", [CPU, GPU])
def test_rotated_writer_clamps_a_huge_row_on_its_own(gen, device):
    """A row at 2^126 whose program holds no subnormal row: the clamp before the rotation is its own
    branch (a huge row beside a tiny one is clamped by the tiny row's branch too, rotation_keys)."""
    device = _on(device)
    k = torch.randn(32, 128, generator=gen)
    k[5] = 2.0**126
    k[20, :64] = -(2.0**125)
    k_cache, k_scale = alloc_index_k_cache(1, "mxfp4", device)
    write(k.to(device), torch.arange(32).to(device), k_cache, k_scale, "mxfp4_rot", "rceil", None, 16)
    rotation_mismatches_explained(k, k_cache.cpu().reshape(-1, 64)[:32], k_scale.cpu().reshape(-1, 4)[:32], "rceil",
                                  None)
    assert_rotation_within_bound(k, kernel_rotation(k.to(device), None, 16).cpu(), None)


@pytest.mark.gpu
def test_bad_loc_raises_and_writes_nothing(gen):
    k_cache, k_scale = alloc_index_k_cache(1, "mxfp4", "cuda")
    before = (k_cache.clone(), k_scale.clone())
    k = torch.randn(2, 128, generator=gen, device="cpu").cuda()
    cache = IndexKCache("mxfp4", k_cache, k_scale)
    with pytest.raises(ValueError, match=r"loc values must lie in \[0, 128\)"):
        write_index_k(cache, k, torch.tensor([3, 128], device="cuda"))
    with pytest.raises(ValueError, match="does not match the cache"):  # a cache of the wrong format is never made
        IndexKCache("fp8", k_cache, k_scale)
    write_index_k(cache, k, torch.tensor([3, 128], device="cuda"), check_loc=False)
    assert torch.equal(before[0][:, :3], k_cache[:, :3]) and not torch.equal(before[0][:, 3], k_cache[:, 3])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,seed", [("mxfp4", None), ("mxfp4_rot", None), ("mxfp4_rot", 7)])
def test_writer_in_cuda_graph(gen, fmt, seed):
    """Captured once after a warm-up call, replayed with other keys and slots."""
    k = torch.zeros(300, 128, device="cuda")
    loc = torch.zeros(300, dtype=torch.int64, device="cuda")
    cache = IndexKCache.new(8, fmt, "cuda", sign_seed=seed)
    k_cache, k_scale = cache.views()
    # The slot check is skipped while capturing; the warm-up call skips it explicitly.
    graph = capture_graph(lambda: write_index_k(cache, k, loc),
                          warmup=lambda: write_index_k(cache, k, loc, check_loc=False))
    for _ in range(2):
        kk = corner_keys(gen, 300) if fmt == "mxfp4" else rotation_keys(gen, 300)[0]
        ll = torch.randperm(8 * PAGE_SIZE, generator=gen)[:300]
        k.copy_(kk)
        loc.copy_(ll)
        graph.replay()
        data, scale = k_cache.cpu()[ll // PAGE_SIZE, ll % PAGE_SIZE], k_scale.cpu()[ll // PAGE_SIZE, ll % PAGE_SIZE]
        if fmt == "mxfp4":
            rows, scales = quantize_index_k(kk, fmt)
            assert torch.equal(data, rows) and torch.equal(scale, scales)
        else:
            rotation_mismatches_explained(kk, data, scale, "rceil", seed)
