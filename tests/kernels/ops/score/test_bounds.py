"""Bad input never reads or writes outside a buffer, and every backend gives the same answer.

The audit's cases as tests: a run checked against its plan on the host (q, ``out``, the cache), page ids
outside the cache (each such page scores -inf on every backend; ``M3_SCORE_DEBUG=1`` reports them), prefill
host lengths against the device ones, NaN / Inf in q (one rule on torch and Triton), and the smaller gaps.

Triton cases run in the interpreter on a CPU-only machine (``TRITON_INTERPRET=1``, set here); the
``gpu``-marked cases run the real kernels, the CUDA decode kernel included."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from m3_kernels.formats import PAGE_SIZE, IndexKCache  # noqa: E402
from m3_kernels.ops.score import (  # noqa: E402
    DecodeBatch,
    PrefillBatch,
    plan_decode,
    plan_prefill,
    score_and_select_decode,
    score_decode,
    score_prefill,
)
from m3_kernels.ops.score.common import ENV_DEBUG  # noqa: E402
from m3_kernels.ops.score.naive import score_decode_ref, score_prefill_ref  # noqa: E402
from m3_kernels.ops.select import select_blocks, visible_blocks  # noqa: E402
from m3_kernels.testing import make_q, random_cache, triton_module  # noqa: E402

CPU = pytest.param("cpu", id="cpu")
GPU = pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)
DEVICES = [CPU, GPU]
DECODE_BACKENDS = ["torch", "triton"]
PREFILL_BACKENDS = ["torch", "triton", "triton_sm90"]
SCALE = 0.125


def _on(device, backend="triton"):
    if device == "cpu" and torch.cuda.is_available() and backend != "torch":
        pytest.skip("interpreter cases run on CPU-only machines (CI)")
    if device == "cuda" and backend == "triton_sm90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm_90 prefill scorer needs a Hopper GPU")
    if backend != "torch":
        triton_module("m3_kernels.ops.score.backends.triton", "_score_kernel")
        triton_module("m3_kernels.ops.score.backends.triton_sm90", "_prefill_sm90_kernel")
    return device


def _cache(gen, fmt, pages, device):
    data, scale = random_cache(gen, fmt, pages, device)
    return IndexKCache.of(data, scale, fmt=fmt)


def _decode_case(gen, device, fmt="mxfp4", S=1, H=2, lens=(1, 129, 300), max_block=3, pages=None):
    batch = len(lens)
    pages = pages or batch * max_block + 1
    cache = _cache(gen, fmt, pages, device)
    bt = torch.randperm(pages, generator=gen)[: batch * max_block].reshape(batch, max_block).int().to(device)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    return cache, DecodeBatch(bt, seq, S, H, SCALE, max_block)


def _prefill_case(gen, device, fmt="mxfp4", H=2, new=(3, 130), prefix=(0, 127), max_block=3):
    batch = len(new)
    pages = batch * max_block + 1
    cache = _cache(gen, fmt, pages, device)
    bt = torch.randperm(pages, generator=gen)[: batch * max_block].reshape(batch, max_block).int().to(device)
    lens = [p + n for p, n in zip(prefix, new)]
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    return cache, PrefillBatch(bt, torch.tensor(lens, dtype=torch.int32, device=device),
                               torch.tensor(cu, dtype=torch.int32, device=device), H, SCALE, max_block,
                               cu_seqlens_host=cu, seq_lens_host=lens)


def _rows(batch) -> int:
    return batch.block_table.shape[0] * batch.S if isinstance(batch, DecodeBatch) else batch.cu_seqlens_host[-1]


# ---------------------------------------------------------------- the run against its plan


@pytest.mark.parametrize("op,backend", [("decode", b) for b in DECODE_BACKENDS]
                         + [("prefill", b) for b in PREFILL_BACKENDS])
@pytest.mark.parametrize("device", DEVICES)
def test_the_run_refuses_what_the_plan_was_not_made_for(gen, device, op, backend):
    _on(device, backend)
    cache, batch = (_decode_case if op == "decode" else _prefill_case)(gen, device)
    plan = (plan_decode if op == "decode" else plan_prefill)(cache, batch, backend=backend)
    run = score_decode if op == "decode" else score_prefill
    rows, H = _rows(batch), batch.H
    q = make_q(gen, rows, H, torch.bfloat16, device)
    run(plan, q, cache)  # as planned: fine
    bad_q = {
        "q must have H = 2 heads": make_q(gen, rows, H + 1, torch.bfloat16, device),
        f"q must have {rows} rows": make_q(gen, rows + 1, H, torch.bfloat16, device),
        "q must be contiguous in its last dim": make_q(gen, rows, H, torch.bfloat16, device)
        .repeat_interleave(2, dim=2)[..., ::2],
        "q must be bfloat16 or float8_e4m3fn": q.float(),
    }
    for match, bad in bad_q.items():
        with pytest.raises(ValueError, match=match):
            run(plan, bad, cache)
    cols = plan.max_block
    small = torch.full((H, rows, cols - 1), float("nan"), device=device)
    with pytest.raises(ValueError, match="out must be float32"):
        run(plan, q, cache, small)
    other = _cache(gen, "fp8", cache.num_pages, device)
    with pytest.raises(ValueError, match="cache must be .*mxfp4.* the plan's"):
        run(plan, q, other, None)
    smaller = _cache(gen, "mxfp4", cache.num_pages - 1, device)
    with pytest.raises(ValueError, match=f"cache must hold {cache.num_pages} pages"):
        run(plan, q, smaller, None)
    with pytest.raises(TypeError, match="cache must be an IndexKCache"):
        run(plan, q, cache.data, None)


def test_a_raw_tensor_in_place_of_the_cache_is_a_type_error_naming_it(gen):
    cache, batch = _decode_case(gen, "cpu")
    with pytest.raises(TypeError, match="cache must be an IndexKCache .*got a Tensor"):
        plan_decode(cache.data, batch)
    cache, pbatch = _prefill_case(gen, "cpu")
    with pytest.raises(TypeError, match="cache must be an IndexKCache .*got a Tensor"):
        plan_prefill(cache.data, pbatch)
    from m3_kernels.ops.write import write_index_k

    with pytest.raises(TypeError, match="cache must be an IndexKCache .*got a Tensor"):
        write_index_k(cache.data, torch.zeros(1, 128), torch.zeros(1, dtype=torch.int32))


# ---------------------------------------------------------------- page ids outside the cache


BAD_PAGE_IDS = {"num_pages": None, "minus_one": -1, "huge": 10**8}


def _poison(bt, pages, bad_id, cells):
    bt = bt.clone()
    for b, p in cells:
        bt[b, p] = pages if bad_id is None else bad_id
    return bt


def _expect(ref, cells, per_request_rows):
    """``ref`` with every row of the poisoned requests at the poisoned columns set to -inf."""
    ref = ref.clone()
    for b, p in cells:
        r0, r1 = per_request_rows(b)
        ref[:, r0:r1, p] = float("-inf")
    return ref


def _assert_scores_as(got, want):
    """The -inf pattern of ``want`` exactly, and its finite scores to 1e-5."""
    got = got.cpu().double()
    assert torch.equal(torch.isinf(got) & (got < 0), torch.isinf(want) & (want < 0))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", list(BAD_PAGE_IDS))
@pytest.mark.parametrize("backend", DECODE_BACKENDS + ["cuda", "oracle"])
@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_decode_page_ids_outside_the_cache_score_minus_inf(gen, device, fmt, backend, bad):
    """Every decode backend, the CUDA C++ kernel included (on an sm_90 GPU, MXFP4)."""
    if backend == "oracle" and device == "cuda":
        pytest.skip("the oracle runs on the CPU")
    if backend == "cuda":
        from m3_kernels.ops.score.backends import cuda as cuda_backend

        if device != "cuda" or fmt != "mxfp4" or not cuda_backend.ensure_built(torch.device("cuda")):
            pytest.skip("the CUDA kernel scores MXFP4 on an sm_90 GPU")
    _on(device, backend if backend not in ("oracle", "cuda") else "torch")
    S = 2
    cache, batch = _decode_case(gen, device, fmt, S=S)
    cells = [(1, 0), (2, 2)]  # request 1's first page, request 2's last (own) page
    bt = _poison(batch.block_table, cache.num_pages, BAD_PAGE_IDS[bad], cells)
    q = make_q(gen, _rows(batch), batch.H, torch.bfloat16, device)
    good = score_decode_ref(q.cpu(), *[v.cpu() if v is not None else None for v in cache.views()],
                            batch.block_table.cpu(), batch.seq_lens.cpu(), S, SCALE, batch.max_block)
    want = _expect(good, cells, lambda b: (b * S, (b + 1) * S))
    if backend == "oracle":
        got = score_decode_ref(q, *cache.views(), bt, batch.seq_lens, S, SCALE, batch.max_block)
    else:
        plan = plan_decode(cache, batch._replace(block_table=bt), backend=backend)
        got = score_decode(plan, q, cache)
    _assert_scores_as(got, want)


@pytest.mark.parametrize("bad", ["num_pages", "huge"])  # -1: the decode cases (the same guard)
@pytest.mark.parametrize("backend", PREFILL_BACKENDS + ["oracle"])
@pytest.mark.parametrize("device", DEVICES)
def test_prefill_page_ids_outside_the_cache_score_minus_inf(gen, device, backend, bad):
    if backend == "oracle" and device == "cuda":
        pytest.skip("the oracle runs on the CPU")
    _on(device, backend if backend != "oracle" else "torch")
    cache, batch = _prefill_case(gen, device)
    cells = [(0, 0), (1, 2)]
    bt = _poison(batch.block_table, cache.num_pages, BAD_PAGE_IDS[bad], cells)
    q = make_q(gen, _rows(batch), batch.H, torch.bfloat16, device)
    cu = batch.cu_seqlens_host
    good = score_prefill_ref(q.cpu(), *[v.cpu() if v is not None else None for v in cache.views()],
                             batch.block_table.cpu(), batch.seq_lens.cpu(), batch.cu_seqlens_q.cpu(), SCALE,
                             batch.max_block)
    want = _expect(good, cells, lambda b: (cu[b], cu[b + 1]))
    if backend == "oracle":
        got = score_prefill_ref(q, *cache.views(), bt, batch.seq_lens, batch.cu_seqlens_q, SCALE, batch.max_block)
    else:
        plan = plan_prefill(cache, batch._replace(block_table=bt), backend=backend)
        got = score_prefill(plan, q, cache)
    _assert_scores_as(got, want)


@pytest.mark.parametrize("bad", list(BAD_PAGE_IDS))
def test_the_debug_check_reports_page_ids_outside_the_cache(gen, monkeypatch, bad):
    cache, batch = _decode_case(gen, "cpu")
    bt = _poison(batch.block_table, cache.num_pages, BAD_PAGE_IDS[bad], [(2, 2)])
    plan_decode(cache, batch._replace(block_table=bt), backend="torch")  # masked, not reported
    monkeypatch.setenv(ENV_DEBUG, "1")
    with pytest.raises(ValueError, match=rf"block_table\[2\] holds page ids outside \[0, {cache.num_pages}\)"):
        plan_decode(cache, batch._replace(block_table=bt), backend="torch")
    _, pbatch = _prefill_case(gen, "cpu")
    pbt = _poison(pbatch.block_table, cache.num_pages, BAD_PAGE_IDS[bad], [(1, 2)])
    with pytest.raises(ValueError, match=r"block_table\[1\] holds page ids outside"):
        plan_prefill(cache, pbatch._replace(block_table=pbt), backend="torch")


def test_a_page_id_equal_to_num_pages_is_outside(gen, monkeypatch):
    """The boundary itself: ``num_pages`` is the first id outside (a ``>`` for ``>=`` is caught here)."""
    cache, batch = _decode_case(gen, "cpu", lens=(129,), max_block=2, pages=2)
    bt = torch.tensor([[1, 2]], dtype=torch.int32)
    q = make_q(gen, 1, 2, torch.bfloat16, "cpu")
    got = score_decode_ref(q, *cache.views(), bt, batch.seq_lens, 1, SCALE, 2)
    assert torch.isfinite(got[:, :, 0]).all() and (got[:, :, 1] == float("-inf")).all()
    plan = plan_decode(cache, batch._replace(block_table=bt), backend="torch")
    assert torch.equal(score_decode(plan, q, cache), got.float())
    monkeypatch.setenv(ENV_DEBUG, "1")
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        plan_decode(cache, batch._replace(block_table=bt), backend="torch")


# ---------------------------------------------------------------- prefill host lengths


def test_prefill_host_lengths_are_checked_against_the_device_ones(gen, monkeypatch):
    """On host tensors the check costs nothing and always runs; on a GPU it runs under ``M3_SCORE_DEBUG=1``."""
    cache, batch = _prefill_case(gen, "cpu")
    with pytest.raises(ValueError, match="cu_seqlens_host must equal cu_seqlens_q"):
        plan_prefill(cache, batch._replace(cu_seqlens_host=[0, 2, 133]))
    with pytest.raises(ValueError, match="seq_lens_host must equal seq_lens"):
        plan_prefill(cache, batch._replace(seq_lens_host=[3, 258]))


@pytest.mark.gpu
def test_prefill_host_lengths_checked_on_the_gpu_in_debug_mode(gen, monkeypatch):
    cache, batch = _prefill_case(gen, "cuda")
    bad = batch._replace(seq_lens_host=[3, 258])
    plan_prefill(cache, bad)  # no sync outside debug mode: not checked
    monkeypatch.setenv(ENV_DEBUG, "1")
    with pytest.raises(ValueError, match="seq_lens_host must equal seq_lens"):
        plan_prefill(cache, bad)


# ---------------------------------------------------------------- NaN and Inf in q


def _nonfinite_q(gen, rows, H, device):
    q = make_q(gen, rows, H, torch.bfloat16, device)
    q[0, 1, 5] = float("nan")
    q[rows - 1, 0, 7] = float("inf")
    q[rows - 1, 1, 9] = float("-inf")
    return q


def _check_nonfinite_rule(got, q, finite_ref):
    """A (row, head) whose q vector holds a NaN or Inf scores NaN on every page it sees, -inf on the others;
    every other vector scores as the oracle."""
    got = got.cpu().double()
    bad = ~torch.isfinite(q.cpu().float()).all(dim=2)  # [rows, H]
    bad = bad.t()[:, :, None].expand_as(got)
    seen = finite_ref != float("-inf")
    assert torch.isnan(got[bad & seen]).all()
    assert (got[bad & ~seen] == float("-inf")).all()
    assert torch.equal(got[~bad] == float("-inf"), finite_ref[~bad] == float("-inf"))
    fin = ~bad & seen
    torch.testing.assert_close(got[fin], finite_ref[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_q_one_rule_on_every_decode_backend(gen, device, fmt):
    _on(device)
    cache, batch = _decode_case(gen, device, fmt, S=2)
    rows = _rows(batch)
    q = _nonfinite_q(gen, rows, batch.H, device)
    views = [v.cpu() if v is not None else None for v in cache.views()]
    meta = (batch.block_table.cpu(), batch.seq_lens.cpu(), 2, SCALE, batch.max_block)
    finite_ref = score_decode_ref(torch.nan_to_num(q.cpu(), 0.0, 0.0, 0.0), *views, *meta)
    results = {"oracle": score_decode_ref(q.cpu(), *views, *meta)}
    for backend in DECODE_BACKENDS:
        results[backend] = score_decode(plan_decode(cache, batch, backend=backend), q, cache)
    n_visible = visible_blocks((batch.seq_lens.long()[:, None] - 2 + torch.arange(2, device=device)).flatten(),
                               PAGE_SIZE)
    picks = {}
    for name, got in results.items():
        _check_nonfinite_rule(got, q, finite_ref)
        picks[name] = select_blocks(got.to(device).float(), n_visible.to(device), 2, 1, 0).cpu()
    for name in picks:
        assert torch.equal(picks[name], picks["oracle"]), name


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_q_one_rule_on_every_prefill_backend(gen, device):
    _on(device)
    cache, batch = _prefill_case(gen, device)
    q = _nonfinite_q(gen, _rows(batch), batch.H, device)
    views = [v.cpu() if v is not None else None for v in cache.views()]
    meta = (batch.block_table.cpu(), batch.seq_lens.cpu(), batch.cu_seqlens_q.cpu(), SCALE, batch.max_block)
    finite_ref = score_prefill_ref(torch.nan_to_num(q.cpu(), 0.0, 0.0, 0.0), *views, *meta)
    _check_nonfinite_rule(score_prefill_ref(q.cpu(), *views, *meta), q, finite_ref)
    for backend in PREFILL_BACKENDS:
        if device == "cuda" and backend == "triton_sm90" and torch.cuda.get_device_capability()[0] != 9:
            continue
        _check_nonfinite_rule(score_prefill(plan_prefill(cache, batch, backend=backend), q, cache), q, finite_ref)


# ---------------------------------------------------------------- smaller gaps


def test_negative_decode_seq_lens_are_refused(gen):
    cache, batch = _decode_case(gen, "cpu")
    with pytest.raises(ValueError, match=r"seq_lens must be >= 0, got -1 at \[1\]"):
        plan_decode(cache, batch._replace(seq_lens=torch.tensor([1, -1, 300], dtype=torch.int32)))


def test_score_and_select_refuses_a_max_block_that_drops_the_own_block(gen):
    cache, batch = _decode_case(gen, "cpu", lens=(1, 129, 300), max_block=2)
    plan = plan_decode(cache, batch, backend="torch")
    q = make_q(gen, 3, 2, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="max_block = 2 .* request 2 sees 3 blocks"):
        score_and_select_decode(plan, q, cache)


def test_strided_seq_lens_are_refused(gen):
    """The int32 vectors must be contiguous (the kernels read them with unit stride)."""
    cache, batch = _decode_case(gen, "cpu")
    strided = torch.tensor([1, 0, 129, 0, 300, 0], dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="seq_lens must be a contiguous int32 vector"):
        plan_decode(cache, batch._replace(seq_lens=strided))


@pytest.mark.parametrize("S", [True, 1.0, 0])
def test_S_must_be_a_plain_int(gen, S):
    cache, batch = _decode_case(gen, "cpu")
    with pytest.raises(ValueError, match="S .query rows per request. must be an int >= 1"):
        plan_decode(cache, batch._replace(S=S))


@pytest.mark.parametrize("topk", [16.0, True, "16"])
def test_topk_must_be_an_int(topk):
    scores = torch.zeros(1, 1, 20)
    with pytest.raises(ValueError, match="topk must be an int"):
        select_blocks(scores, torch.tensor([20]), topk, 1, 0)


@pytest.mark.parametrize("seed", [1.5, True, "7", -1])
def test_a_bad_sign_seed_is_refused(seed):
    with pytest.raises(ValueError, match="sign_seed must be None or an int"):
        IndexKCache.new(1, "mxfp4_rot", sign_seed=seed)


def test_prepare_q_refuses_a_q_of_another_width():
    cache = IndexKCache.new(1, "mxfp4_rot", sign_seed=3)
    with pytest.raises(ValueError, match=r"q must be \[\.\.\., 128\]"):
        cache.prepare_q(torch.zeros(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"q must be \[\.\.\., 128\]"):
        IndexKCache.new(1, "mxfp4").prepare_q(torch.zeros(2, 64, dtype=torch.bfloat16))


def test_the_oracle_refuses_a_q_without_heads(gen):
    cache, batch = _decode_case(gen, "cpu")
    q = torch.zeros(3, 0, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"q must be \[rows, H >= 1, 128\]"):
        score_decode_ref(q, *cache.views(), batch.block_table, batch.seq_lens, 1, SCALE)


def test_a_cache_without_pages_is_refused_by_a_plan_that_reads_it():
    cache = IndexKCache.new(0, "mxfp4")
    batch = DecodeBatch(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1, 1, SCALE)
    with pytest.raises(ValueError, match="cache must hold at least one page"):
        plan_decode(cache, batch)
    assert math.isfinite(SCALE)
