"""The sm_90 prefill scorer (``ops.score.backends.triton_sm90``) against the float64 torch reference, and its
device work map against the host one.

CPU: small cases under the Triton interpreter (``TRITON_INTERPRET=1``, set here when no GPU is
present). GPU (``-m gpu``, an sm_90 card): the formats, Q dtypes, head counts, radix prefixes, page
edges, empty requests, poisoned buffers, extreme MXFP4 scales, the device map under CUDA-graph replay.

Tolerance as ``test_triton.py``: ``|got - ref| <= 1e-5 * bound`` (``bound``: the score of ``|q|`` and
``|K|``), the -inf pattern equal, no NaN.
"""

import dataclasses
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from m3_kernels.formats import FP8_DTYPE, PAGE_SIZE, alloc_index_k_cache, prepare_index_q, quantize_index_k  # noqa: E402
from m3_kernels.ops.score.naive import score_prefill_ref  # noqa: E402
from m3_kernels.testing import (  # noqa: E402
    abs_index_k,
    assert_scores_close,
    capture_graph,
    compile_sm90,
    make_q,
    q_abs,
    random_cache,
    triton_module,
)


def _sm90_ok():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _on(device):
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("interpreter cases run on CPU-only machines (CI)")
    if device == "cuda" and not _sm90_ok():
        pytest.skip("needs an sm_90 GPU")
    return device


def _mod():
    return triton_module("m3_kernels.ops.score.backends.triton_sm90", "_prefill_sm90_kernel")


def score_prefill_sm90(q, k_data, k_scale, fmt, block_table, seq_lens, cu_seqlens_q, sm_scale, max_block=None,
                       out=None, tiles=None, **launch):
    """The sm_90 scorer through its plan and run over loose views (``fmt``: the cache's format name), with the
    run's launch overrides (``DEFAULT_LAUNCH``'s keys) and, for the work-map tests, ``tiles`` in place of the
    plan's device map."""
    from m3_kernels.formats import IndexKCache
    from m3_kernels.ops.score import PrefillBatch, plan_prefill
    from m3_kernels.ops.score.common import check_run

    cache = IndexKCache(fmt, k_data, k_scale)
    H = q.shape[1] if q.dim() == 3 else 1
    plan = plan_prefill(cache, PrefillBatch(block_table, seq_lens, cu_seqlens_q, H, sm_scale, max_block, out),
                        backend="triton_sm90")
    if tiles is not None:
        plan = dataclasses.replace(plan, work=tiles)
    return plan.run(plan, q, cache, check_run(plan, q, cache, out), **launch)


def supported(**args):
    """``(ok, reason)`` of ``score_prefill_sm90(fmt="mxfp4", **args)``'s checks."""
    try:
        score_prefill_sm90(fmt="mxfp4", **args)
    except (ValueError, NotImplementedError) as e:
        return False, str(e)
    return True, ""


def _cache(gen, fmt, pages, device, single=True, scale_range=(122, 127)):
    """A random cache; ``mxfp4_rot``: keys rotated then quantized (``quantize_index_k``), the
    storage the scorer sees."""
    if fmt != "mxfp4_rot":
        return random_cache(gen, fmt, pages, device, single, *scale_range)
    k = torch.randn(pages * PAGE_SIZE, 128, generator=gen) * 3.0
    data, scale = quantize_index_k(k, "mxfp4_rot")
    kc, ks = alloc_index_k_cache(pages, "mxfp4", device, single_region=single)
    kc.copy_(data.view(pages, PAGE_SIZE, -1))
    ks.copy_(scale.view(pages, PAGE_SIZE, -1))
    return kc, ks


def check_prefill(gen, device, fmt, q_dtype, H, new, prefix, max_block=None, single=True, prealloc=True,
                  tiles="device", scale_range=(122, 127), q_scale=1.0, extra_pages=1, **launch):
    """Score a batch (``new`` tokens after ``prefix`` cached ones per request) and compare with the
    reference. ``tiles``: "device" (``prefill_tiles_device``, padded), "host" (``prefill_tiles_host``
    as a tensor) or None (built inside, with the host length check)."""
    mod = _mod()
    batch = len(new)
    need = [(p + n + PAGE_SIZE - 1) // PAGE_SIZE for p, n in zip(prefix, new)]
    max_block = max_block or max(max(need), 1)
    pages = batch * max_block + extra_pages
    k_cache, k_scale = _cache(gen, fmt, pages, device, single, scale_range)
    bt = torch.randperm(pages, generator=gen)[: batch * max_block].reshape(batch, max_block).int().to(device)
    seq = torch.tensor([p + n for p, n in zip(prefix, new)], dtype=torch.int32, device=device)
    cu_list = [0] + torch.tensor(new).cumsum(0).tolist()
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    q = make_q(gen, sum(new), H, q_dtype, device, q_scale)
    if fmt == "mxfp4_rot":
        q = prepare_index_q(q, "mxfp4_rot")
    out = torch.full((H, sum(new), max_block), float("nan"), device=device) if prealloc else None
    if tiles == "device":
        t = mod.prefill_tiles_device(cu, H, mod.max_prefill_tiles(sum(new), batch, H) + 3)
    elif tiles == "host":
        t = torch.tensor(mod.prefill_tiles_host(cu_list, H), dtype=torch.int32).reshape(-1, 2).to(device)
    else:
        t = None
    got = score_prefill_sm90(q, k_cache, k_scale, fmt, bt, seq, cu, 0.25, max_block, out, tiles=t, **launch)
    if prealloc:
        assert got.data_ptr() == out.data_ptr()
    kc, ks = k_cache.cpu(), (k_scale.cpu() if k_scale is not None else None)
    args = (bt.cpu(), seq.cpu(), cu.cpu(), 0.25, max_block)
    ref = score_prefill_ref(q.cpu(), kc, ks, *args)
    bound = score_prefill_ref(q_abs(q.cpu()), *abs_index_k(kc, ks), *args)
    assert_scores_close(got, ref, bound)
    return got


# ---------------------------------------------------------------- work map (torch only: CPU and GPU)


def _random_batch(rng):
    batch = rng.randint(0, 9)
    new = [rng.choice([0, 0, 1, 63, 64, 65, 127, 128, 129, 255, 256, 257, rng.randint(0, 3000)]) for _ in range(batch)]
    return [0] + torch.tensor(new, dtype=torch.int64).cumsum(0).tolist() if batch else [0]


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def test_device_work_map_equals_the_host_plan(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    mod = _mod()
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    for _ in range(200):
        cu = _random_batch(rng)
        H = rng.choice([1, 2, 3, 4, 8, 64, 300])
        host = mod.prefill_tiles_host(cu, H)
        bound = mod.max_prefill_tiles(cu[-1], len(cu) - 1, H)
        assert len(host) <= bound, (seed, cu, H)
        pad = rng.randint(0, 5)
        dev = mod.prefill_tiles_device(torch.tensor(cu, dtype=torch.int32, device=device), H, bound + pad)
        assert dev.dtype == torch.int32 and tuple(dev.shape) == (bound + pad, 2)
        want = torch.tensor(host + [(mod.SENTINEL, 0)] * (bound + pad - len(host)), dtype=torch.int32)
        assert torch.equal(dev.cpu(), want.reshape(-1, 2)), (seed, cu, H)


def test_tile_rows_and_bound():
    mod = _mod()
    assert [mod.tile_rows(h) for h in (1, 3, 4, 8, 512)] == [256, 85, 64, 32, 1]
    # The bound is reached: every request one token past a tile.
    rows = mod.tile_rows(4)
    cu = [0, rows + 1, 2 * rows + 2]
    assert len(mod.prefill_tiles_host(cu, 4)) == mod.max_prefill_tiles(cu[-1], 2, 4) == 4


# ---------------------------------------------------------------- CPU interpreter (CI) cases


LAUNCHES = [dict(tn=64, pp=2), dict(tn=128, pp=16), dict(tn=64, pp=2, mx_join=True)]
LAUNCH_IDS = ["tn64", "tn128", "tn64_mx_join"]


@pytest.mark.parametrize("launch", LAUNCHES, ids=LAUNCH_IDS)
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8", "bf16", "mxfp4_rot"])
def test_prefill_small(gen, fmt, launch):
    """Radix prefixes (new tokens start mid-page: a tile whose first row sees all but the last token of
    its page), an empty request, the last partial page, a poisoned buffer."""
    _on("cpu")
    check_prefill(gen, "cpu", fmt, torch.bfloat16, H=2, new=[3, 0, 130, 1, 4], prefix=[125, 7, 0, 128, 126], **launch)


def check_causal_edges(gen, device, H):
    """Positive q and a bf16 cache whose keys grow along each page (positive, token t scaled by t + 1):
    every row's page max is its LAST visible token, so a mask off by one token changes every score."""
    _mod()
    new, prefix = [3, 2, 5, 130, 1], [126, 127, 0, 129, 255]
    batch, max_block = len(new), 3
    pages = batch * max_block + 1
    k_cache = (torch.rand(pages, PAGE_SIZE, 128, generator=gen) + 0.5) * torch.arange(1, PAGE_SIZE + 1)[None, :, None]
    k_cache = k_cache.to(torch.bfloat16).to(device)
    bt = torch.randperm(pages, generator=gen)[: batch * max_block].reshape(batch, max_block).int().to(device)
    seq = torch.tensor([p + n for p, n in zip(prefix, new)], dtype=torch.int32, device=device)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = (torch.rand(sum(new), H, 128, generator=gen) + 0.5).to(torch.bfloat16).to(device)
    got = score_prefill_sm90(q, k_cache, None, "bf16", bt, seq, cu, 1.0, max_block)
    args = (bt.cpu(), seq.cpu(), cu.cpu(), 1.0, max_block)
    ref = score_prefill_ref(q.cpu(), k_cache.cpu(), None, *args)
    assert_scores_close(got, ref, ref.abs())


@pytest.mark.parametrize("H", [1, 4])
def test_prefill_small_causal_edges(gen, H):
    _on("cpu")
    check_causal_edges(gen, "cpu", H)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8_DTYPE], ids=["q_bf16", "q_e4m3"])
@pytest.mark.parametrize("tiles", ["device", "host", None], ids=["device_map", "host_map", "built_inside"])
def test_prefill_small_maps_and_q_dtypes(gen, q_dtype, tiles):
    """Lengths 1, 127, 128, 129 with H=4 (64 tokens a tile: tiles end mid-request), out allocated inside."""
    _on("cpu")
    check_prefill(gen, "cpu", "mxfp4", q_dtype, H=4, new=[1, 127, 128, 129], prefix=[0, 0, 0, 0], tiles=tiles,
                  prealloc=False)


@pytest.mark.parametrize("mx_join", [False, True], ids=["split", "joined"])
def test_prefill_small_split_views_and_wide_scales(gen, mx_join):
    _on("cpu")
    check_prefill(gen, "cpu", "mxfp4", torch.bfloat16, H=3, new=[90, 5], prefix=[40, 250], single=False,
                  scale_range=(100, 150), mx_join=mx_join)


def test_prefill_small_max_block_below_the_visible_pages(gen):
    """``max_block`` smaller than the pages a request sees: the scores stop at ``max_block``."""
    _on("cpu")
    check_prefill(gen, "cpu", "fp8", torch.bfloat16, H=1, new=[20, 300], prefix=[200, 100], max_block=2)


@pytest.mark.parametrize("fmt,mx_join,tn", [(0, False, 64), (1, False, 64), (2, False, 128), (2, True, 64)],
                         ids=["bf16", "fp8", "mxfp4_split", "mxfp4_joined"])
def test_compiles_for_sm90(fmt, mx_join, tn):
    """The kernel compiles for sm_90 on a machine without a GPU (Triton's own ptxas): inline PTX, globals read
    from jit code and layouts are checked here, which the interpreter does not do."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only check; a GPU run compiles it for real")
    k_ty = {0: "*bf16", 1: "*fp8e4nv", 2: "*u8"}[fmt]
    sig = {"q_ptr": "*bf16", "k_ptr": k_ty, "s_ptr": "*u8", "bt_ptr": "*i32", "seq_ptr": "*i32", "cu_ptr": "*i32",
           "tile_ptr": "*i32", "out_ptr": "*fp32", "n_cols": "i32", "n_pages": "i32", "post_scale": "fp32", "stride_q_r": "i32",
           "stride_q_h": "i32", "stride_k_page": "i32", "stride_s_page": "i32", "stride_bt": "i32",
           "stride_o_h": "i32", "stride_o_r": "i32"}
    const = dict(FMT=fmt, H=4, ROWS=64, BM=256, PP=32, TN=tn, MX_JOIN=mx_join, NUM_STAGES=3, USE_ASM=True,
                 INTERPRET=False, D=128, T=PAGE_SIZE, DATA_BYTES=64, SCALE_BYTES=4)
    facts = compile_sm90("m3_kernels.ops.score.backends.triton_sm90", "_prefill_sm90_kernel", sig, const, num_warps=8)
    assert facts["sass_bytes"] > 0


# ---------------------------------------------------------------- GPU (sm_90)

FORMATS = ["mxfp4", "mxfp4_rot", "fp8", "bf16"]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_dtype,H", [(torch.bfloat16, 1), (torch.bfloat16, 3), (torch.bfloat16, 4),
                                       (torch.bfloat16, 8), (FP8_DTYPE, 1), (FP8_DTYPE, 4)],
                         ids=["q_bf16-H1", "q_bf16-H3", "q_bf16-H4", "q_bf16-H8", "q_e4m3-H1", "q_e4m3-H4"])
@pytest.mark.parametrize("tiles", ["device", None], ids=["device_map", "built_inside"])
def test_prefill_matrix_gpu(gen, fmt, q_dtype, H, tiles):
    if fmt == "mxfp4_rot" and q_dtype == FP8_DTYPE:
        pytest.skip("a rotated format takes a bf16 Q")
    _on("cuda")
    # Radix prefixes of 0, 1, 127, 128, 129 and 1000 tokens before chunks of 1, 127, 128, 129, 700 and 0 new tokens.
    check_prefill(gen, "cuda", fmt, q_dtype, H, new=[1, 127, 128, 129, 700, 0, 300],
                  prefix=[0, 1, 127, 128, 129, 1000, 1000], prealloc=tiles == "device", tiles=tiles)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp4_rot"])
@pytest.mark.parametrize("H", [1, 3, 4, 8])
@pytest.mark.parametrize("tn", [64, 128])
def test_prefill_mxfp4_joined_gpu(gen, fmt, H, tn):
    """The ``mx_join`` MXFP4 path (one K=128 product on the page in natural dim order) over the matrix's batch."""
    _on("cuda")
    check_prefill(gen, "cuda", fmt, torch.bfloat16, H, new=[1, 127, 128, 129, 700, 0, 300],
                  prefix=[0, 1, 127, 128, 129, 1000, 1000], mx_join=True, tn=tn, maxnreg=128)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [1, 3, 4, 8])
def test_prefill_causal_edges_gpu(gen, H):
    _on("cuda")
    check_causal_edges(gen, "cuda", H)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("launch", [dict(tn=128, maxnreg=None), dict(tn=64, pp=16, maxnreg=128),
                                    dict(tn=64, num_stages=4, pp=128), dict(tn=64, maxnreg=128, mx_join=True)],
                         ids=["tn128_uncapped", "tn64_pp16_capped", "tn64_stages4", "tn64_capped_mx_join"])
def test_prefill_long_gpu(gen, fmt, launch):
    """One 4000-token chunk after a 3000-token prefix (55 pages, many tiles and page chunks) and a batch beside
    it, under the launch settings the benchmark may pick."""
    _on("cuda")
    check_prefill(gen, "cuda", fmt, torch.bfloat16, 4, new=[4000, 33], prefix=[3000, 5000], **launch)


@pytest.mark.gpu
@pytest.mark.parametrize("scale_range,q_scale", [((100, 150), 1.0), ((0, 20), 2.0**100), ((230, 254), 2.0**-100),
                                                 ((0, 240), 1.0)], ids=["e8m0_mid", "e8m0_low", "e8m0_high",
                                                                        "e8m0_all"])
@pytest.mark.parametrize("mx_join", [False, True], ids=["split", "joined"])
def test_prefill_mxfp4_scale_ranges_gpu(gen, scale_range, q_scale, mx_join):
    """Every e8m0 byte 0..254 is folded into bf16 K exactly (subnormal K at the low end, 2^127 at the top); Q is
    scaled so that the scores stay far above the tolerance's absolute floor and inside fp32."""
    _on("cuda")
    got = check_prefill(gen, "cuda", "mxfp4", torch.bfloat16, 4, new=[129, 300], prefix=[5, 700],
                        scale_range=scale_range, q_scale=q_scale, mx_join=mx_join)
    assert got.isfinite().any()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_prefill_device_map_under_graph_replay_gpu(gen, fmt):
    """Map and scorer captured once in a CUDA graph with padded buffers, replayed with other lengths."""
    _on("cuda")
    mod = _mod()
    H, mb, batch, total = 4, 16, 3, 600
    pages = batch * mb + 1
    k_cache, k_scale = random_cache(gen, fmt, pages, "cuda")
    bt = torch.zeros(batch, mb, dtype=torch.int32, device="cuda")
    seq = torch.ones(batch, dtype=torch.int32, device="cuda")
    cu = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    q = torch.zeros(total, H, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(H, total, mb, device="cuda")
    max_tiles = mod.max_prefill_tiles(total, batch, H)

    def run():
        tiles = mod.prefill_tiles_device(cu, H, max_tiles)
        score_prefill_sm90(q, k_cache, k_scale, fmt, bt, seq, cu, 0.5, mb, out, tiles=tiles)

    graph = capture_graph(run)
    for new, prefix in (([200, 0, 400], [10, 5, 1000]), ([1, 599, 0], [2000, 0, 0]), ([64, 65, 471], [0, 63, 129])):
        bt.copy_(torch.randperm(pages, generator=gen)[: batch * mb].reshape(batch, mb))
        seq.copy_(torch.tensor([p + n for p, n in zip(prefix, new)]))
        cu.copy_(torch.tensor([0] + torch.tensor(new).cumsum(0).tolist()))
        q.copy_(make_q(gen, total, H, torch.bfloat16, "cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        kc, ks = k_cache.cpu(), (k_scale.cpu() if k_scale is not None else None)
        args = (bt.cpu(), seq.cpu(), cu.cpu(), 0.5, mb)
        ref = score_prefill_ref(q.cpu(), kc, ks, *args)
        bound = score_prefill_ref(q_abs(q.cpu()), *abs_index_k(kc, ks), *args)
        assert_scores_close(out, ref, bound)


# ---------------------------------------------------------------- rejections (as today's scorer)


def _args(device):
    k_data, k_scale = alloc_index_k_cache(4, "mxfp4", device)
    q = torch.zeros(2, 1, 128, dtype=torch.bfloat16, device=device)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=device)
    seq = torch.full((2,), 5, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    return dict(q=q, k_data=k_data, k_scale=k_scale, block_table=bt, seq_lens=seq, cu_seqlens_q=cu, sm_scale=0.5)


REJECTIONS = {
    "sm_scale_zero": (dict(sm_scale=0.0), "sm_scale"),
    "sm_scale_nan": (dict(sm_scale=float("nan")), "sm_scale"),
    "q_fp32": (dict(q="fp32"), "q must be"),
    "q_strided": (dict(q="strided"), "q must be contiguous"),
    "block_table_int64": (dict(block_table="int64"), "block_table"),
    "seq_lens_length": (dict(seq_lens="short"), "seq_lens"),
    "cu_seqlens_length": (dict(cu_seqlens_q="short"), "cu_seqlens_q"),
    "k_scale_misaligned": (dict(k_scale="misaligned"), "aligned"),
    "out_shape": (dict(out="shape"), "out must be"),
    "out_strided": (dict(out="strided"), "out must be"),
    "out_fp64": (dict(out="fp64"), "out must be"),
    "out_other_device": (dict(out="meta"), "one device"),
    "max_block_too_big": (dict(max_block=3), "max_block"),
}


def _apply(args, change, device):
    args = dict(args)
    for key, val in change.items():
        if val == "fp32":
            args["q"] = args["q"].float()
        elif key == "q" and val == "strided":
            args["q"] = torch.zeros(2, 1, 256, dtype=torch.bfloat16, device=device)[..., ::2]
        elif val == "int64":
            args["block_table"] = args["block_table"].long()
        elif val == "short":
            args[key] = args[key][:-1]
        elif val == "misaligned":
            buf = torch.zeros(4 * 128 * 4 + 1, dtype=torch.uint8, device=device)
            args["k_scale"] = buf[1:].view(4, 128, 4)
        elif val == "shape":
            args["out"] = torch.zeros(2, 2, 2, device=device)
        elif key == "out" and val == "strided":
            args["out"] = torch.zeros(1, 2, 2, 2, device=device)[..., 0]
        elif val == "fp64":
            args["out"] = torch.zeros(1, 2, 2, dtype=torch.float64, device=device)
        elif val == "meta":
            args["out"] = torch.zeros(1, 2, 2, device="meta")
        else:
            args[key] = val
    return args


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", list(REJECTIONS))
def test_rejections_raise_and_supported_says_no(device, name):
    device = _on(device)
    _mod()
    change, match = REJECTIONS[name]
    args = _apply(_args(device), change, device)
    ok, reason = supported(**args)
    assert not ok and match in reason
    with pytest.raises(ValueError, match=match):
        score_prefill_sm90(fmt="mxfp4", **args)


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def test_supported_accepts_valid_inputs_and_other_rejections(device):
    device = _on(device)
    _mod()
    args = _args(device)
    assert supported(**args) == (True, "")
    with pytest.raises(ValueError, match="does not match the cache"):
        score_prefill_sm90(fmt="fp8", **args)
    with pytest.raises(ValueError, match="request 1 has 3 new tokens but seq_lens"):
        bad = dict(args, q=torch.zeros(4, 1, 128, dtype=torch.bfloat16, device=device),
                   seq_lens=torch.tensor([5, 2], dtype=torch.int32, device=device),
                   cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32, device=device))
        score_prefill_sm90(fmt="mxfp4", **bad)
    with pytest.raises(TypeError, match="unknown launch settings"):
        score_prefill_sm90(fmt="mxfp4", warps=4, **args)
    with pytest.raises(ValueError, match="need tn in"):
        score_prefill_sm90(fmt="mxfp4", tn=32, **args)


def test_supported_refuses_the_cpu_without_the_interpreter(monkeypatch):
    _mod()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, reason = supported(**_args("cpu"))
    assert not ok and "NVIDIA CUDA" in reason


# ---------------------------------------------------------------- through the dispatcher (plan, then run)


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_plan_then_run_equals_the_checked_entry_and_the_oracle(gen, device, fmt):
    """``plan_prefill(backend="triton_sm90")`` builds the device work map once; ``score_prefill`` then runs the
    kernel with nothing checked: bit for bit the checked entry's scores, within the oracle's bound, every
    column of a poisoned ``out`` written."""
    from m3_kernels.formats import IndexKCache
    from m3_kernels.ops.score import PrefillBatch, plan_prefill, score_prefill

    device = _on(device)
    H, new, prefix = 4, [129, 1, 0, 300], [127, 0, 5, 128]
    batch, max_block = len(new), max(-(-(p + n) // PAGE_SIZE) for p, n in zip(prefix, new))
    pages = batch * max_block + 1
    k_cache, k_scale = _cache(gen, fmt, pages, device)
    cache = IndexKCache(fmt, k_cache, k_scale)
    bt = torch.randperm(pages, generator=gen)[: batch * max_block].reshape(batch, max_block).int().to(device)
    seq = torch.tensor([p + n for p, n in zip(prefix, new)], dtype=torch.int32, device=device)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = make_q(gen, sum(new), H, torch.bfloat16, device, 1.0)
    out = torch.full((H, sum(new), max_block), float("nan"), device=device)
    plan = plan_prefill(cache, PrefillBatch(bt, seq, cu, H, 0.25, max_block, out), backend="triton_sm90")
    assert plan.backend == "triton_sm90" and plan.work.dtype == torch.int32
    got = score_prefill(plan, q, cache)
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
    want = score_prefill_sm90(q, k_cache, k_scale, fmt, bt, seq, cu, 0.25, max_block)
    assert torch.equal(got, want)
    kc, ks = k_cache.cpu(), (k_scale.cpu() if k_scale is not None else None)
    args = (bt.cpu(), seq.cpu(), cu.cpu(), 0.25, max_block)
    assert_scores_close(got, score_prefill_ref(q.cpu(), kc, ks, *args),
                        score_prefill_ref(q_abs(q.cpu()), *abs_index_k(kc, ks), *args))
