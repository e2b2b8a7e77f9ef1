"""Plan and run: a plan checks a batch once; a run per layer checks q, out and the cache against the plan on the
host (no cache-view or metadata check) and scores as the oracle.

Triton cases run in the interpreter on a CPU-only machine (``TRITON_INTERPRET=1``, set here)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import m3_kernels.ops.score as score_module  # noqa: E402
from m3_kernels.formats import PAGE_SIZE, IndexKCache  # noqa: E402
from m3_kernels.formats import cache as cache_module  # noqa: E402
from m3_kernels.ops.score import (  # noqa: E402
    DecodeBatch,
    PrefillBatch,
    common,
    plan_decode,
    plan_prefill,
    score_decode,
    score_prefill,
)
from m3_kernels.ops.score.naive import score_decode_ref, score_prefill_ref  # noqa: E402
from m3_kernels.testing import (  # noqa: E402
    abs_index_k,
    assert_scores_close,
    make_q,
    q_abs,
    random_cache,
    triton_module,
)

LAYERS = 4


def _on_cpu_only():
    if torch.cuda.is_available():
        pytest.skip("interpreter cases run on CPU-only machines (CI)")


def _count_checks(monkeypatch):
    """Count every metadata check and every cache-view check, wherever it is called from."""
    counts = {"meta": 0, "views": 0, "loose": 0, "run": 0}

    def counted(key, fn):
        def wrapper(*a, **k):
            counts[key] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(score_module, "check_batch", counted("meta", score_module.check_batch))
    monkeypatch.setattr(score_module, "check_run", counted("run", score_module.check_run))
    monkeypatch.setattr(cache_module, "check_index_k_cache", counted("views", cache_module.check_index_k_cache))
    monkeypatch.setattr(common, "check_decode_args", counted("loose", common.check_decode_args))
    monkeypatch.setattr(common, "check_prefill_args", counted("loose", common.check_prefill_args))
    return counts


def _layers(gen, fmt, pages):
    """``LAYERS`` caches of one format, as a pool makes them (each checked once, here)."""
    caches = []
    for _ in range(LAYERS):
        data, scale = random_cache(gen, fmt, pages, "cpu")
        caches.append(IndexKCache.of(data, scale, fmt=fmt))
    return caches


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_a_multi_layer_decode_step_checks_once(gen, monkeypatch, backend, fmt):
    """One plan, then one run per layer into the planned buffer: the metadata is checked once, the caches
    never again after they were made, and every layer's scores match the float64 oracle."""
    if backend == "triton":
        _on_cpu_only()
        triton_module("m3_kernels.ops.score.backends.triton", "_score_kernel")
    S, H, lens, max_block = 1, 2, [1, 129, 300], 3
    batch = len(lens)
    pages = batch * max_block + 1
    caches = _layers(gen, fmt, pages)
    block_table = torch.randperm(pages, generator=gen)[: batch * max_block].reshape(batch, max_block).int()
    seq = torch.tensor(lens, dtype=torch.int32)
    out = torch.full((H, batch * S, max_block), float("nan"))
    counts = _count_checks(monkeypatch)
    plan = plan_decode(caches[0], DecodeBatch(block_table, seq, S, H, 0.125, max_block, out), backend=backend)
    assert counts == {"meta": 1, "views": 0, "loose": 0, "run": 0}
    qs, scores = [], []
    for cache in caches:  # the step: one run per layer
        qs.append(make_q(gen, batch * S, H, torch.bfloat16, "cpu"))
        got = score_decode(plan, cache.prepare_q(qs[-1]), cache, out)
        assert got is out
        scores.append(got.clone())
    assert counts == {"meta": 1, "views": 0, "loose": 0, "run": LAYERS}
    written = torch.arange(max_block)[None, None] < torch.tensor([(n - 1) // PAGE_SIZE + 1 for n in lens])[
        None, :, None]
    for cache, q, got in zip(caches, qs, scores):  # the oracle (which checks its own arguments)
        args = (block_table, seq, S, 0.125, max_block)
        ref = score_decode_ref(q, *cache.views(), *args)
        bound = score_decode_ref(q_abs(q), *abs_index_k(*cache.views()), *args)
        assert_scores_close(torch.where(written, got, ref.float()), ref, bound)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_multi_layer_prefill_checks_once(gen, monkeypatch, backend):
    if backend == "triton":
        _on_cpu_only()
        triton_module("m3_kernels.ops.score.backends.triton", "_score_kernel")
    H, new, prefix, max_block = 2, [3, 130], [0, 127], 3
    batch = len(new)
    pages = batch * max_block + 1
    caches = _layers(gen, "mxfp4", pages)
    block_table = torch.randperm(pages, generator=gen)[: batch * max_block].reshape(batch, max_block).int()
    seq = torch.tensor([p + n for p, n in zip(prefix, new)], dtype=torch.int32)
    cu = torch.tensor([0, 3, 133], dtype=torch.int32)
    counts = _count_checks(monkeypatch)
    plan = plan_prefill(caches[0], PrefillBatch(block_table, seq, cu, H, 0.25, max_block, cu_seqlens_host=cu.tolist(),
                                                seq_lens_host=seq.tolist()), backend=backend)
    assert plan.backend == backend and counts == {"meta": 1, "views": 0, "loose": 0, "run": 0}
    qs = [make_q(gen, sum(new), H, torch.bfloat16, "cpu") for _ in caches]
    scores = [score_prefill(plan, q, cache) for q, cache in zip(qs, caches)]
    assert counts == {"meta": 1, "views": 0, "loose": 0, "run": LAYERS}
    for cache, q, got in zip(caches, qs, scores):
        args = (block_table, seq, cu, 0.25, max_block)
        assert_scores_close(got, score_prefill_ref(q, *cache.views(), *args),
                            score_prefill_ref(q_abs(q), *abs_index_k(*cache.views()), *args))


def _meta(cache, **change):
    return DecodeBatch(torch.zeros(2, 2, dtype=torch.int32), torch.full((2,), 5, dtype=torch.int32), 1, 1,
                       0.5)._replace(**change)


PLAN_REJECTIONS = {  # today's messages, now raised by the plan
    "sm_scale_zero": (dict(sm_scale=0.0), "sm_scale"),
    "block_table_int64": (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), "block_table must be int32"),
    "seq_lens_length": (dict(seq_lens=torch.full((1,), 5, dtype=torch.int32)), "seq_lens must have 2 entries"),
    "S_zero": (dict(S=0), "S .query rows per request. must be an int >= 1"),
    "H_zero": (dict(H=0), r"H \(index heads\) must be an int >= 1"),
    "out_shape": (dict(out=torch.zeros(2, 2, 2)), "out must be float32"),
    "out_strided": (dict(out=torch.zeros(1, 2, 2, 2)[..., 0]), "out must be float32"),
    "out_other_device": (dict(out=torch.zeros(1, 2, 2, device="meta")), "one device"),
    "max_block_too_big": (dict(max_block=3), "max_block must be in"),
    "cp_rank": (dict(cp_rank=2, cp_world=2), "cp_rank"),
}


@pytest.mark.parametrize("name", list(PLAN_REJECTIONS))
def test_the_plan_rejects_bad_metadata_with_todays_messages(name):
    cache = IndexKCache.new(4, "mxfp4")
    change, match = PLAN_REJECTIONS[name]
    with pytest.raises(ValueError, match=match):
        plan_decode(cache, _meta(cache, **change), backend="torch")


def test_a_backend_that_cannot_take_the_cache_is_refused_at_plan_time():
    cache = IndexKCache.new(2, "fp8")
    meta = _meta(cache)
    with pytest.raises(ValueError, match="the CUDA scorer reads MXFP4 caches only, got a fp8 cache"):
        plan_decode(cache, meta, backend="cuda")
    with pytest.raises(ValueError, match="aiter's .* reads MXFP4 caches only"):
        plan_decode(cache, meta, backend="aiter")
    mx = IndexKCache.new(2, "mxfp4")
    with pytest.raises(ValueError, match=r"S \* H <= 32"):
        plan_decode(mx, _meta(mx, H=33), backend="cuda")


def test_the_plan_records_the_geometry_and_the_work_map():
    cache = IndexKCache.new(4, "mxfp4")
    out = torch.empty(3, 4, 2)
    plan = plan_decode(cache, DecodeBatch(torch.zeros(2, 5, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 2, 3,
                                          0.5, out=out), backend="triton")
    assert (plan.backend, plan.S, plan.H, plan.batch, plan.max_block, plan.sm_scale) == ("triton", 2, 3, 2, 2, 0.5)
    assert plan.out is out and plan.fmt.value == "mxfp4" and plan.work == 1 and plan.num_pages == 4
    auto = plan_decode(cache, DecodeBatch(torch.zeros(2, 5, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 2, 3,
                                          0.5))
    assert auto.backend == "torch" and auto.max_block == 5  # on the CPU; max_block from the block table
