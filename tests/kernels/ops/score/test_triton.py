"""Triton block scorers against the float64 torch reference (``naive.py``).

CPU: small cases under the Triton interpreter (``TRITON_INTERPRET=1``, set here when no GPU is
present). GPU (``-m gpu``): the full matrix of cache formats, views, Q dtypes, geometries, lengths,
context-parallel shards, buffers, scale ranges, CUDA-graph replay and every rejection.

Tolerance: ``|got - ref| <= 1e-5 * bound`` with ``bound`` the same score computed on ``|q|`` and
``|K|`` (fp32 accumulation of 128 exact products errs by at most ~128 ulp of that), the -inf
pattern equal, and no NaN.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from m3_kernels.formats import (  # noqa: E402
    FP8_DTYPE,
    PAGE_SIZE,
    alloc_index_k_cache,
    check_index_k_cache,
)
from m3_kernels.formats import IndexKCache  # noqa: E402
from m3_kernels.ops.score import (  # noqa: E402
    DecodeBatch,
    PrefillBatch,
    plan_decode,
    plan_prefill,
    score_decode,
    score_prefill,
)
from m3_kernels.ops.score.naive import score_decode_ref, score_prefill_ref  # noqa: E402
from m3_kernels.testing import (  # noqa: E402
    abs_index_k,
    assert_scores_close,
    capture_graph,
    make_q,
    q_abs,
    random_cache,
    score_decode_views,
    score_prefill_views,
    triton_module,
)

CPU = pytest.param("cpu", id="cpu")
GPU = pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)


def _on(device):
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("interpreter cases run on CPU-only machines (CI)")
    return device


def _kernels():
    return triton_module("m3_kernels.ops.score.backends.triton", "_score_kernel")


def check_decode(gen, device, fmt, q_dtype, S, H, seq_lens, max_block, cp=(0, 1), prealloc=False, single=True,
                 scale_range=(122, 127), q_scale=1.0, pages=None, q_octaves=0, q_subnormals=True):
    """``q_subnormals=False``: bf16 subnormals in Q become 0 (the interpreter widens them to fp32 wrongly)."""
    batch = len(seq_lens)
    pages = pages or batch * max_block + 1
    k_cache, k_scale = random_cache(gen, fmt, pages, device, single, *scale_range)
    block_table = torch.randperm(pages, generator=gen)[: batch * max_block].reshape(batch, max_block).int().to(device)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = make_q(gen, batch * S, H, q_dtype, device, q_scale, q_octaves)
    if not q_subnormals:
        q = torch.where(q.float().abs() < 2.0**-126, torch.zeros_like(q), q)
    sm_scale = 0.125
    out = None
    if prealloc:
        out = torch.full((H, batch * S, max_block), float("nan"), device=device)
    got = score_decode_views(q, k_cache, k_scale, block_table, seq, S, sm_scale, max_block, out, cp[0], cp[1],
                             backend="triton")
    if prealloc:
        assert got.data_ptr() == out.data_ptr()
    kc, ks = k_cache.cpu(), (k_scale.cpu() if k_scale is not None else None)
    args = (block_table.cpu(), seq.cpu(), S, sm_scale, max_block, cp[0], cp[1])
    ref = score_decode_ref(q.cpu(), kc, ks, *args)
    bound = score_decode_ref(q_abs(q.cpu()), *abs_index_k(kc, ks), *args)
    if prealloc:
        # Written up to each request's last visible page; the rest of the buffer is untouched.
        mask = torch.zeros_like(ref, dtype=torch.bool)
        for b, n in enumerate(seq_lens):
            last = n - 1
            n_global = last // PAGE_SIZE + 1 if last >= 0 else 0
            n_local = min(max_block, max(0, (n_global - cp[0] + cp[1] - 1) // cp[1]))
            mask[:, b * S : (b + 1) * S, :n_local] = True
        assert torch.isnan(got.cpu()[~mask]).all(), "preallocated buffer written past a request's last page"
        got = torch.where(mask.to(got.device), got, ref.to(got.device, torch.float32))
    assert_scores_close(got, ref, bound)
    return got


# ---------------------------------------------------------------- CPU interpreter (CI) cases


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8", "bf16"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8_DTYPE], ids=["q_bf16", "q_e4m3"])
def test_decode_small(gen, fmt, q_dtype):
    _on("cpu")
    _kernels()
    check_decode(gen, "cpu", fmt, q_dtype, S=2, H=3, seq_lens=[2, 129, 300], max_block=4)


# MXFP4 Q paths: a tile of <= 8 query vectors (S2 H2) takes the stacked page loop, a larger one (S3 H4)
# the per-group loop, each with one power of two per tile where that is exact; query vectors 60
# octaves apart (and most tiles with elements 40 octaves apart) cannot share one, and take the
# per-vector path. All must be right.
MX_Q_OCTAVES = pytest.mark.parametrize(
    "octaves", [0, 12, 40, -60], ids=["q_narrow", "q_12_octaves", "q_40_octaves", "q_vectors_60_octaves_apart"])


@MX_Q_OCTAVES
@pytest.mark.parametrize("S,H", [(2, 2), (3, 4)], ids=["stacked", "per_group"])
def test_decode_mxfp4_q_paths(gen, octaves, S, H):
    _on("cpu")
    _kernels()
    check_decode(gen, "cpu", "mxfp4", torch.bfloat16, S=S, H=H, seq_lens=[3, 200, 256], max_block=2,
                 scale_range=(110, 140), q_octaves=octaves)


@pytest.mark.parametrize("case", ["split_views", "cp", "prealloc", "cp_prealloc", "wide_scales"])
def test_decode_small_variants(gen, case):
    _on("cpu")
    _kernels()
    kw = dict(S=1, H=1, seq_lens=[1, 128, 257], max_block=3)
    if case == "split_views":
        kw["single"] = False
    if case in ("cp", "cp_prealloc"):
        kw.update(cp=(1, 2), seq_lens=[300, 600])
    if case in ("prealloc", "cp_prealloc"):
        kw["prealloc"] = True
    if case == "wide_scales":
        kw["scale_range"] = (107, 147)
    check_decode(gen, "cpu", "mxfp4", torch.bfloat16, **kw)


@pytest.mark.parametrize("fmt,S,H,octaves", [("mxfp4", 1, 1, 0), ("mxfp4", 3, 4, 0), ("mxfp4", 2, 2, -60),
                                              ("fp8", 1, 1, 0)],
                         ids=["mxfp4_stacked", "mxfp4_per_group", "mxfp4_per_vector", "fp8"])
def test_decode_context_parallel_rank_with_the_partial_last_page(gen, fmt, S, H, octaves):
    """Ranks 1 of 2 and 3 of 4 holding a request's partial last page (positions 199 and 1000: global blocks 1
    and 7), so the causal mask runs on a rank > 0 with that rank's global block ids, in each page loop."""
    _on("cpu")
    _kernels()
    for cp, lens in (((1, 2), [200, 140]), ((3, 4), [1001, 900])):
        check_decode(gen, "cpu", fmt, torch.bfloat16, S=S, H=H, seq_lens=[max(n, S) for n in lens], max_block=3,
                     cp=cp, q_octaves=octaves)


@pytest.mark.parametrize("S,H", [(1, 1), (3, 4)], ids=["stacked", "per_group"])
def test_decode_mxfp4_tiny_q_and_large_scales(gen, S, H):
    """Q near 2^-118 against K scales 2^113-2^123: the tile's power of two is clamped so that it stays a
    normal number. bf16 subnormals in Q are zeroed here: the interpreter widens them to fp32 wrongly
    (-1.0928e-38 reads as -1.0102e-38); the GPU case, test_decode_mxfp4_q_paths_gpu, keeps them."""
    _on("cpu")
    _kernels()
    got = check_decode(gen, "cpu", "mxfp4", torch.bfloat16, S=S, H=H, seq_lens=[S, 200], max_block=2,
                       scale_range=(240, 250), q_scale=2.0**-118, q_subnormals=False)
    assert (got[torch.isfinite(got)] != 0).all()


def test_prefill_small(gen):
    _on("cpu")
    _kernels()
    check_prefill(gen, "cpu", "mxfp4", torch.bfloat16, H=2, new=[3, 130], prefix=[125, 0], max_block=3)


def test_prefill_small_empty_request_and_poisoned_out(gen):
    """A request with no new tokens, rows at positions 126-129 (page edges), a NaN-filled ``out``."""
    _on("cpu")
    _kernels()
    check_prefill(gen, "cpu", "mxfp4", torch.bfloat16, H=2, new=[2, 0, 2, 2], prefix=[126, 7, 128, 0], max_block=3,
                  prealloc=True)


def test_prefill_small_planned(gen):
    """A ``plan_prefill`` work map made once on the host gives the reference scores."""
    _on("cpu")
    _kernels()
    check_prefill(gen, "cpu", "mxfp4", torch.bfloat16, H=2, new=[3, 0, 130], prefix=[125, 9, 0], max_block=3,
                  prealloc=True, planned=True)


# ---------------------------------------------------------------- GPU matrix

GEOMETRIES = [(1, 1), (1, 4), (4, 1), (2, 3), (4, 4), (8, 4), (8, 1)]
LENGTHS = [[1, 127, 128, 129, 4000], [8, 3000, 256, 1000]]


@pytest.mark.gpu
@MX_Q_OCTAVES
@pytest.mark.parametrize("scale_range,q_scale", [((100, 150), 1.0), ((1, 20), 1.0), ((230, 252), 2.0**-100),
                                                 ((240, 250), 2.0**-118)],
                         ids=["e8m0_mid", "e8m0_low", "e8m0_high", "e8m0_high_q_tiny"])
def test_decode_mxfp4_q_paths_gpu(gen, octaves, scale_range, q_scale):
    """The MXFP4 Q paths (one power of two per tile, stacked or per group, and per vector) on the
    GPU, bf16 Q spread over up to 60 octaves, extreme scales."""
    for S, H in [(4, 1), (1, 4), (8, 4)]:
        check_decode(gen, "cuda", "mxfp4", torch.bfloat16, S, H, [S, 129, 3000, 700], max_block=24,
                     scale_range=scale_range, q_scale=q_scale, q_octaves=octaves)


@pytest.mark.gpu
@pytest.mark.parametrize("S,H", [(4, 1), (8, 4)], ids=["stacked", "per_group"])
def test_decode_mxfp4_without_inline_ptx(gen, S, H, monkeypatch):
    """The e2m1 decode in plain Triton ops (what ROCm and the interpreter run) on the GPU."""
    monkeypatch.setenv("M3_TRITON_NO_ASM", "1")
    for q_octaves in (0, -60):
        check_decode(gen, "cuda", "mxfp4", torch.bfloat16, S, H, [S, 129, 3000], max_block=24, q_octaves=q_octaves)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8", "bf16"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8_DTYPE], ids=["q_bf16", "q_e4m3"])
@pytest.mark.parametrize("S,H", GEOMETRIES)
@pytest.mark.parametrize("single", [True, False], ids=["single_region", "split_views"])
def test_decode_matrix(gen, fmt, q_dtype, S, H, single):
    if fmt != "mxfp4" and not single:
        pytest.skip("split views exist for MXFP4 only")
    for lens in LENGTHS:
        lens = [max(n, S) for n in lens]
        check_decode(gen, "cuda", fmt, q_dtype, S, H, lens, max_block=40)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("cp", [(0, 2), (1, 2), (3, 4)])
@pytest.mark.parametrize("prealloc", [False, True])
@pytest.mark.parametrize("S,H", [(4, 1), (8, 4)], ids=["stacked", "per_group"])
def test_decode_cp_and_buffers(gen, fmt, cp, prealloc, S, H):
    """Lengths 2000 and 5000 end in a partial page (blocks 15 and 39) held by rank 1 of 2 and by rank 3 of 4."""
    check_decode(gen, "cuda", fmt, torch.bfloat16, S, H, [1, 129, 2000, 5000], max_block=48, cp=cp,
                 prealloc=prealloc)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8_DTYPE], ids=["q_bf16", "q_e4m3"])
@pytest.mark.parametrize("scale_range,q_scale", [((107, 147), 1.0), ((1, 20), 1.0), ((230, 252), 2.0**-100),
                                                  ((1, 240), 1.0)], ids=["2^-20..2^20", "e8m0_low", "e8m0_high",
                                                                         "e8m0_all"])
def test_decode_mxfp4_scale_ranges(gen, q_dtype, scale_range, q_scale):
    if q_dtype == FP8_DTYPE and q_scale != 1.0:
        pytest.skip("e4m3 Q cannot hold 2^-100")
    got = check_decode(gen, "cuda", "mxfp4", q_dtype, 2, 2, [700, 3000], max_block=24, scale_range=scale_range,
                       q_scale=q_scale)
    assert got.isfinite().any()


@pytest.mark.gpu
def test_mxfp4_default_buffer_reads_minus_inf_past_the_end(gen):
    got = check_decode(gen, "cuda", "mxfp4", torch.bfloat16, 1, 1, [1, 300], max_block=8)
    assert torch.isneginf(got[:, 0, 1:]).all() and torch.isneginf(got[:, 1, 3:]).all()
    assert torch.isfinite(got[:, 1, :3]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8_DTYPE], ids=["q_bf16", "q_e4m3"])
def test_mxfp4_split_and_single_region_agree_bitwise(gen, q_dtype):
    pages, batch, mb = 40, 3, 12
    single = alloc_index_k_cache(pages, "mxfp4", "cuda", single_region=True)
    single[0].copy_(torch.randint(0, 256, single[0].shape, generator=gen, dtype=torch.uint8))
    single[1].copy_(torch.randint(100, 150, single[1].shape, generator=gen, dtype=torch.uint8))
    split = (single[0].contiguous(), single[1].contiguous())
    bt = torch.randperm(pages, generator=gen)[: batch * mb].reshape(batch, mb).int().cuda()
    seq = torch.tensor([5, 700, 1536], dtype=torch.int32, device="cuda")
    q = make_q(gen, batch * 2, 2, q_dtype, "cuda")
    a = score_decode_views(q, *single, bt, seq, 2, 0.3, backend="triton")
    b = score_decode_views(q, *split, bt, seq, 2, 0.3, backend="triton")
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_cuda_graph_capture_and_replay(gen, fmt):
    """Captured once with preallocated buffers, replayed with other lengths and block tables."""
    pages, batch, mb, S, H = 64, 4, 16, 4, 1
    k_cache, k_scale = random_cache(gen, fmt, pages, "cuda")
    bt = torch.zeros(batch, mb, dtype=torch.int32, device="cuda")
    seq = torch.full((batch,), S, dtype=torch.int32, device="cuda")
    q = torch.zeros(batch * S, H, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(H, batch * S, mb, device="cuda")
    cache = IndexKCache.of(k_cache, k_scale)
    plan = plan_decode(cache, DecodeBatch(bt, seq, S, H, 0.5, mb, out), backend="triton")  # once, at capture

    def run():
        score_decode(plan, q, cache, out)

    graph = capture_graph(run)
    for lens in ([4, 129, 1000, 2048], [2048, 5, 300, 128], [17, 17, 17, 1900]):
        bt.copy_(torch.randperm(pages, generator=gen)[: batch * mb].reshape(batch, mb))
        seq.copy_(torch.tensor(lens))
        q.copy_(make_q(gen, batch * S, H, torch.bfloat16, "cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        kc, ks = k_cache.cpu(), (k_scale.cpu() if k_scale is not None else None)
        args = (bt.cpu(), seq.cpu(), S, 0.5, mb)
        ref = score_decode_ref(q.cpu(), kc, ks, *args)
        bound = score_decode_ref(q_abs(q.cpu()), *abs_index_k(kc, ks), *args)
        written = torch.isfinite(ref) | torch.isneginf(ref)
        n_pages = [(n - 1) // PAGE_SIZE + 1 for n in lens]
        for b, n in enumerate(n_pages):
            written[:, b * S : (b + 1) * S, n:] = False
        got = torch.where(written, out.cpu().double(), ref)
        assert_scores_close(got, ref, bound)


def check_prefill(gen, device, fmt, q_dtype, H, new, prefix, max_block, single=True, prealloc=False, planned=False):
    batch = len(new)
    pages = batch * max_block + 1
    k_cache, k_scale = random_cache(gen, fmt, pages, device, single)
    bt = torch.randperm(pages, generator=gen)[: batch * max_block].reshape(batch, max_block).int().to(device)
    seq = torch.tensor([p + n for p, n in zip(prefix, new)], dtype=torch.int32, device=device)
    cu = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32, device=device)
    q = make_q(gen, sum(new), H, q_dtype, device)
    out = torch.full((H, sum(new), max_block), float("nan"), device=device) if prealloc else None
    if planned:  # the plan made from host lists, as the SGLang backend does per batch, then one run
        cache = IndexKCache.of(k_cache, k_scale)
        plan = plan_prefill(cache, PrefillBatch(bt, seq, cu, H, 0.25, max_block, out, cu_seqlens_host=cu.tolist(),
                                                seq_lens_host=seq.tolist()), backend="triton")
        got = score_prefill(plan, q, cache)
    else:  # lengths read back from the device by the plan
        got = score_prefill_views(q, k_cache, k_scale, bt, seq, cu, 0.25, max_block, out, backend="triton")
    if prealloc:  # every column is written, -inf past each row's last page
        assert got.data_ptr() == out.data_ptr()
    kc, ks = k_cache.cpu(), (k_scale.cpu() if k_scale is not None else None)
    args = (bt.cpu(), seq.cpu(), cu.cpu(), 0.25, max_block)
    ref = score_prefill_ref(q.cpu(), kc, ks, *args)
    bound = score_prefill_ref(q_abs(q.cpu()), *abs_index_k(kc, ks), *args)
    assert_scores_close(got, ref, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8", "bf16"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8_DTYPE], ids=["q_bf16", "q_e4m3"])
@pytest.mark.parametrize("H", [1, 3, 4])
@pytest.mark.parametrize("planned", [False, True], ids=["unplanned", "planned"])
def test_prefill_matrix(gen, fmt, q_dtype, H, planned):
    # Radix prefixes of 0, 1, 127, 128, 129 and 1000 tokens before chunks of new tokens.
    check_prefill(gen, "cuda", fmt, q_dtype, H, new=[1, 200, 129, 64, 1, 300], prefix=[0, 1, 127, 128, 129, 1000],
                  max_block=12, planned=planned)


# ---------------------------------------------------------------- rejections (both devices)


def _valid(device):
    k_cache, k_scale = alloc_index_k_cache(4, "mxfp4", device)
    q = torch.zeros(2, 1, 128, dtype=torch.bfloat16, device=device)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=device)
    seq = torch.full((2,), 5, dtype=torch.int32, device=device)
    return dict(q=q, k_cache=k_cache, k_scale=k_scale, block_table=bt, seq_lens=seq, S=1, sm_scale=0.5)


REJECTIONS = {
    "sm_scale_zero": (dict(sm_scale=0.0), "sm_scale"),
    "sm_scale_negative": (dict(sm_scale=-1.0), "sm_scale"),
    "sm_scale_nan": (dict(sm_scale=float("nan")), "sm_scale"),
    "sm_scale_inf": (dict(sm_scale=float("inf")), "sm_scale"),
    "q_fp32": (dict(q="fp32"), "q must be"),
    "q_rows": (dict(q="rows"), "q must have"),
    "block_table_int64": (dict(block_table="int64"), "block_table"),
    "seq_lens_length": (dict(seq_lens="short"), "seq_lens"),
    "S_zero": (dict(S=0), "S "),
    "k_scale_misaligned": (dict(k_scale="misaligned"), "aligned"),
    "views_overlap": (dict(k_scale="overlap"), "overlap"),
    "k_cache_bad_stride": (dict(k_cache="strided"), "k_data"),
    "out_shape": (dict(out="shape"), "out must be"),
    "out_strided": (dict(out="strided"), "out must be"),  # right shape, last dim not contiguous
    "out_other_device": (dict(out="meta"), "one device"),
    "q_strided": (dict(q="strided"), "q must be contiguous"),
    "max_block_too_big": (dict(max_block=3), "max_block"),
    "cp_rank": (dict(cp_rank=2, cp_world=2), "cp_rank"),
}


def _apply(args, change, device):
    args = dict(args)
    for key, val in change.items():
        if val == "fp32":
            args["q"] = args["q"].float()
        elif val == "rows":
            args["q"] = args["q"][:1]
        elif val == "int64":
            args["block_table"] = args["block_table"].long()
        elif val == "short":
            args["seq_lens"] = args["seq_lens"][:1]
        elif val == "misaligned":
            buf = torch.zeros(4 * 128 * 4 + 1, dtype=torch.uint8, device=device)
            args["k_scale"] = buf[1:].view(4, 128, 4)
        elif val == "overlap":
            args["k_scale"] = args["k_cache"].as_strided((4, 128, 4), (args["k_cache"].stride(0), 4, 1))
        elif key == "k_cache" and val == "strided":
            args["k_cache"] = torch.zeros(4, 128, 128, dtype=torch.uint8, device=device)[:, :, :64]
        elif val == "shape":
            args["out"] = torch.zeros(2, 2, 2, device=device)
        elif key == "out" and val == "strided":
            args["out"] = torch.zeros(1, 2, 2, 2, device=device)[..., 0]
        elif val == "meta":
            args["out"] = torch.zeros(1, 2, 2, device="meta")
        elif key == "q" and val == "strided":
            args["q"] = torch.zeros(2, 1, 256, dtype=torch.bfloat16, device=device)[..., ::2]
        else:
            args[key] = val
    return args


def decode_supported(**args):
    """``(ok, reason)`` of the shared rules on a decode call given as loose tensors."""
    from m3_kernels.ops.score.common import check_decode_args

    try:
        check_decode_args(**args)
    except ValueError as e:
        return False, str(e)
    return True, ""


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("name", list(REJECTIONS))
def test_rejections_raise_and_supported_says_no(device, name):
    device = _on(device)
    change, match = REJECTIONS[name]
    args = _apply(_valid(device), change, device)
    ok, reason = decode_supported(**args)
    assert not ok and match in reason
    with pytest.raises(ValueError, match=match):
        score_decode_views(**args, backend="triton")


@pytest.mark.parametrize("device", [CPU, GPU])
def test_supported_accepts_valid_inputs(device):
    device = _on(device)
    args = _valid(device)
    assert decode_supported(**args) == (True, "")
    assert check_index_k_cache(args["k_cache"], args["k_scale"]).value == "mxfp4"


@pytest.mark.parametrize("device", [CPU, GPU])
def test_score_and_select_decode_matches_the_two_references(gen, device, monkeypatch):
    device = _on(device)
    _kernels()
    from m3_kernels.ops.score import score_and_select_decode
    from m3_kernels.ops.select.naive import select_blocks_ref, visible_blocks

    S, H, batch, mb = 2, 2, 3, 24
    pages = batch * mb + 1
    k_cache, k_scale = random_cache(gen, "mxfp4", pages, device)
    bt = torch.randperm(pages, generator=gen)[: batch * mb].reshape(batch, mb).int().to(device)
    seq = torch.tensor([3, 2100, 3000], dtype=torch.int32, device=device)
    q = make_q(gen, batch * S, H, torch.bfloat16, device)
    cache = IndexKCache.of(k_cache, k_scale)
    scores, blocks = score_and_select_decode(plan_decode(cache, DecodeBatch(bt, seq, S, H, 0.5), backend="triton"), q,
                                             cache)
    pos = (seq.cpu().long()[:, None] - S + torch.arange(S)).flatten()
    want = select_blocks_ref(scores.cpu(), visible_blocks(pos, PAGE_SIZE))
    assert torch.equal(blocks.cpu(), want)
    # max_block below the blocks a row sees (17 and 24 here) would drop the row's own block: refused (on a GPU,
    # where the lengths stay on the device, under M3_SCORE_DEBUG=1)
    monkeypatch.setenv("M3_SCORE_DEBUG", "1")
    plan = plan_decode(cache, DecodeBatch(bt, seq, S, H, 0.5, max_block=10), backend="triton")
    with pytest.raises(ValueError, match="max_block = 10 must hold every visible block: request 1 sees 17"):
        score_and_select_decode(plan, q, cache)
    with pytest.raises(ValueError, match="cp_world"):
        score_and_select_decode(plan_decode(cache, DecodeBatch(bt, seq, S, H, 0.5, cp_rank=0, cp_world=2),
                                            backend="triton"), q, cache)


def _prefill_args(device):
    """A valid prefill call of ``_valid``'s two requests with one new token each."""
    a = _valid(device)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    return a["q"], a["k_cache"], a["k_scale"], a["block_table"], a["seq_lens"], cu, 0.5


@pytest.mark.parametrize("device", [CPU, GPU])
def test_prefill_rejects_out_the_kernel_cannot_write(device):
    """The kernel stores ``out[h, r, p]`` at ``o_h + p``: a strided last dim or another device must raise."""
    device = _on(device)
    args = _prefill_args(device)
    strided = torch.zeros(1, 2, 2, 2, device=device)[..., 0]  # [H=1, rows=2, max_block=2], last stride 2
    with pytest.raises(ValueError, match="out must be float32"):
        score_prefill_views(*args, out=strided, backend="triton")
    with pytest.raises(ValueError, match="out must be float32"):
        score_prefill_views(*args, out=torch.zeros(1, 2, 2, dtype=torch.float64, device=device), backend="triton")
    with pytest.raises(ValueError, match="one device"):
        score_prefill_views(*args, out=torch.zeros(1, 2, 2, device="meta"), backend="triton")


@pytest.mark.parametrize("device", [CPU, GPU])
def test_prefill_plan_rejections(device):
    """A plan checks the host offsets and lengths it is given (the server's) when made."""
    device = _on(device)
    q, k_cache, k_scale, bt, seq, cu, sm = _prefill_args(device)
    cache = IndexKCache.of(k_cache, k_scale)

    def plan(cu_host, lens_host):
        return plan_prefill(cache, PrefillBatch(bt, seq, cu, 1, sm, cu_seqlens_host=cu_host, seq_lens_host=lens_host),
                            backend="triton")

    with pytest.raises(ValueError, match="cu_seqlens_q must rise"):
        plan([0, 2, 1], [5, 5])
    with pytest.raises(ValueError, match="request 1 has 3 new tokens but seq_lens"):
        plan([0, 1, 4], [5, 2])
    with pytest.raises(ValueError, match="len.seq_lens. . 1 = 3 entries"):
        plan([0, 1], [5, 5])
    made = plan([0, 1, 2], [5, 5])
    assert (made.backend, made.H, made.batch, made.rows, made.max_block) == ("triton", 1, 2, 2, 2)
    assert made.work[0].tolist() == [[0, 0], [1, 1]] and made.work[0].device == bt.device
