"""Triton index-cache writer against the formats module.

bf16, fp8, mxfp4: bitwise equal to ``quantize_index_k`` on every input, rounding corner cases
included (exact ties, every e2m1 threshold and scale boundary, saturation, zeros and -0,
subnormals, NaN and +-inf). mxfp4_rot: equal to ``quantize_mxfp4(rotate(k))`` except where the
exact rotated value lies within the kernel's fp32 rotation error bound of an e2m1 rounding
boundary (for a code) or of a scale boundary (for a group's scale); the test computes both from
float64 and fails on any other difference. CPU cases run under the Triton interpreter.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

from m3_kernels.formats import (  # noqa: E402
    F4_E2M1_TIES_DOWN,
    F4_E2M1_TIES_UP,
    PAGE_SIZE,
    alloc_index_k_cache,
    parse_format,
    quantize_index_k,
    quantize_mxfp4,
    rotation_matrix,
)
from m3_kernels.formats.mxfp4 import sanitize_fp32  # noqa: E402
from m3_kernels.ops.write import write_index_k  # noqa: E402
from m3_kernels.testing import triton_module  # noqa: E402

CPU = pytest.param("cpu", id="cpu")
GPU = pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)


def _on(device):
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("interpreter cases run on CPU-only machines (CI)")
    return device


def _writer():
    return triton_module("m3_kernels.ops.write.triton", "_write_index_k_kernel").write_index_k_triton


def write(k, loc, k_cache, k_scale, fmt, rule, seed=None):
    if k.device.type == "cpu":
        _writer()(k, loc, k_cache, k_scale, parse_format(fmt), rule, seed)
    else:
        write_index_k(k, loc, k_cache, k_scale, fmt, rule, seed)


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


def rotation_mismatches_explained(k, data, scales, rule, sign_seed):
    """Assert every difference from quantize_mxfp4(rotate(k)) sits within the fp32 rotation error
    bound of a boundary; return the number of differences."""
    x = sanitize_fp32(k).double()
    r = rotation_matrix(128, sign_seed, torch.float64)
    exact = x @ r.T  # float64, the reference's rotated value before its fp32 rounding
    # Kernel: fp32 sums of +-x_i (128 terms), then one product by fp32(1/sqrt(128)):
    # |kernel - exact| <= (128 + 2) * 2^-24 * sum|x_i| / sqrt(128) + one ulp.
    u = 2.0**-24
    tok_bound = (130 * u) * x.abs().sum(-1, keepdim=True) / math.sqrt(128) + 1e-45
    bound = tok_bound + exact.abs() * 2 * u
    ref_data, ref_scale = quantize_mxfp4(exact.float(), rule)
    diff_scale = ref_scale != scales
    exp = ref_scale.double() - 127
    # Scale boundaries: rceil at 6 * 2^e, floor at 2^e; a group may move when its amax is near one.
    amax = exact.abs().unflatten(-1, (4, 32)).amax(-1)
    group_bound = tok_bound + amax * 2 * u
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


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("sign_seed", [None, 7])
def test_rotated_writer_within_rotation_bound(gen, device, rule, sign_seed):
    device = _on(device)
    tokens = 33 if device == "cpu" else 8192
    pages = tokens // PAGE_SIZE + 1
    k = torch.randn(tokens, 128, generator=gen) * torch.exp2(torch.randint(-20, 20, (tokens, 1), generator=gen).float())
    k[:, :3] *= 50.0  # outlier channels
    k[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 0.0])
    k_cache, k_scale = alloc_index_k_cache(pages, "mxfp4", device)
    loc = torch.arange(tokens)
    write(k.to(device), loc.to(device), k_cache, k_scale, "mxfp4_rot", rule, sign_seed)
    data = k_cache.cpu().reshape(-1, 64)[:tokens]
    scales = k_scale.cpu().reshape(-1, 4)[:tokens]
    finite = torch.isfinite(k).all(-1)  # +-inf rows rotate fp32-max values: checked for no NaN only
    rotation_mismatches_explained(k[finite], data[finite], scales[finite], rule, sign_seed)
    ref_data, _ = quantize_index_k(k[finite], "mxfp4_rot", rule, sign_seed)
    assert (data[finite] == ref_data).float().mean() > 0.99  # the criterion above is not vacuous


@pytest.mark.parametrize("device", [CPU, GPU])
def test_rotation_check_can_fail(gen, device):
    """The bound check rejects a writer that rounds wrongly (codes off by one at random)."""
    device = _on(device)
    k = torch.randn(16, 128, generator=gen)
    data, scales = quantize_index_k(k, "mxfp4_rot")
    bad = data ^ 0x01
    with pytest.raises(AssertionError, match="code differs"):
        rotation_mismatches_explained(k, bad, scales, "rceil", None)


@pytest.mark.gpu
def test_bad_loc_raises_and_writes_nothing(gen):
    k_cache, k_scale = alloc_index_k_cache(1, "mxfp4", "cuda")
    before = (k_cache.clone(), k_scale.clone())
    k = torch.randn(2, 128, generator=gen, device="cpu").cuda()
    with pytest.raises(ValueError, match=r"loc values must lie in \[0, 128\)"):
        write_index_k(k, torch.tensor([3, 128], device="cuda"), k_cache, k_scale, "mxfp4")
    with pytest.raises(ValueError, match="does not match the cache"):
        write_index_k(k, torch.tensor([3, 4], device="cuda"), k_cache, k_scale, "fp8")
    write_index_k(k, torch.tensor([3, 128], device="cuda"), k_cache, k_scale, "mxfp4", check_loc=False)
    assert torch.equal(before[0][:, :3], k_cache[:, :3]) and not torch.equal(before[0][:, 3], k_cache[:, 3])


@pytest.mark.gpu
def test_writer_in_cuda_graph(gen):
    k = torch.zeros(300, 128, device="cuda")
    loc = torch.zeros(300, dtype=torch.int64, device="cuda")
    k_cache, k_scale = alloc_index_k_cache(8, "mxfp4", "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        write_index_k(k, loc, k_cache, k_scale, "mxfp4", check_loc=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_index_k(k, loc, k_cache, k_scale, "mxfp4")  # the slot check is skipped while capturing
    for _ in range(2):
        kk = corner_keys(gen, 300)
        ll = torch.randperm(8 * PAGE_SIZE, generator=gen)[:300]
        k.copy_(kk)
        loc.copy_(ll)
        graph.replay()
        rows, scales = quantize_index_k(kk, "mxfp4")
        assert torch.equal(k_cache.cpu()[ll // PAGE_SIZE, ll % PAGE_SIZE], rows)
        assert torch.equal(k_scale.cpu()[ll // PAGE_SIZE, ll % PAGE_SIZE], scales)
