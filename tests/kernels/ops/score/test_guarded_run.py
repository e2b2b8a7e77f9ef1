"""``common.run_guarded``: a decode kernel that takes page ids as given and ignores NaN / Inf in q (the ROCm
FlyDSL and aiter kernels) keeps the two rules of every decode backend when run through it.

The real kernels cannot run on a CPU, so a stand-in kernel takes their place: it fails the test when it is
handed a page id outside the cache, and scores like a kernel that ignores NaN / Inf in q. The guarded result
must equal the torch backend's on the raw plan: its -inf and NaN pattern exactly, the rest to 1e-5.
"""

import math
import sys
import types

import pytest
import torch

from m3_kernels.formats import FP8_DTYPE, PAGE_SIZE, IndexKCache
from m3_kernels.ops.score import DecodeBatch, plan_decode, score_decode
from m3_kernels.ops.score.backends import aiter as aiter_backend
from m3_kernels.ops.score.backends import flydsl as flydsl_backend
from m3_kernels.ops.score.backends.torch import decode_scores
from m3_kernels.ops.score.common import ENV_DEBUG, new_out, run_guarded
from m3_kernels.testing import make_q, random_cache

from .test_bounds import BAD_PAGE_IDS, SCALE

LENS = (1, 127, 128, 129, 300, 600)  # 127, 129, 300, 600 end in a partial page
MAX_BLOCK = 4  # past every request's last visible page but 600's (5 pages: cut to 4)


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv(ENV_DEBUG, raising=False)  # outside ids are scored, not reported


def ids_inside(table, num_pages) -> bool:
    return bool(((table >= 0) & (table < num_pages)).all())


def stand_in_scores(q, cache, block_table, seq_lens, S, sm_scale, max_block, out, cp_rank, cp_world):
    """The stand-in kernel's scores (in place of FlyDSL / aiter, which cannot run here): fails the test on any
    page id outside the cache it is handed, then scores as the torch backend on q with NaN / Inf read as 0 (a
    kernel that ignores them) and the ids as given."""
    assert ids_inside(block_table[:, :max_block], cache.num_pages), "the kernel was handed a page id outside the cache"
    finite_q = torch.nan_to_num(q.float(), 0.0, 0.0, 0.0)
    return decode_scores(finite_q, cache, block_table, seq_lens, S, sm_scale, max_block, out, cp_rank, cp_world)


def stand_in_kernel(plan, q, cache, out):
    """The stand-in kernel as a plan's launch (``run_guarded``'s ``launch``)."""
    return stand_in_scores(q, cache, plan.block_table, plan.seq_lens, plan.S, plan.sm_scale, plan.max_block, out,
                           plan.cp_rank, plan.cp_world)


def n_local(seq_len, cp_rank, cp_world) -> int:
    """Local pages the last row of a request of ``seq_len`` tokens sees."""
    n_global = (seq_len - 1) // PAGE_SIZE + 1 if seq_len >= 1 else 0
    return min(MAX_BLOCK, max(0, (n_global - cp_rank + cp_world - 1) // cp_world))


def case(gen, fmt, S, cp_rank, cp_world, bad, q_dtype=torch.bfloat16, H=2):
    """``(cache, batch, q, poisoned cells)``: fresh random keys, table and q; random block-table cells, a
    request's last visible page and a column past every visible page among them, hold the bad id; a few query
    vectors hold a NaN (and, in bf16, +-Inf)."""
    batch_size = len(LENS)
    pages = batch_size * MAX_BLOCK + 1
    data, scale = random_cache(gen, fmt, pages, "cpu")
    cache = IndexKCache.of(data, scale, fmt=fmt)
    bt = torch.randperm(pages, generator=gen)[: batch_size * MAX_BLOCK].reshape(batch_size, MAX_BLOCK).int()
    bad_id = pages if bad is None else bad
    poison = torch.rand(bt.shape, generator=gen) < 0.3
    poison[5, n_local(LENS[5], cp_rank, cp_world) - 1] = True  # a request's last visible page
    poison[1, 0] = True  # 127 tokens: a partial page (visible unless the shard holds none of it)
    poison[0, MAX_BLOCK - 1] = True  # a page no row sees
    poison[5, 0] = False  # inside the cache, seen by the last row (a NaN in one head, the other finite)
    poison[3, max(0, n_local(LENS[3], cp_rank, cp_world) - 1)] = False  # 129: the page starting at its last row
    bt[poison] = bad_id
    seq = torch.tensor(LENS, dtype=torch.int32)
    rows = batch_size * S
    q = make_q(gen, rows, H, q_dtype, "cpu")
    last_head = int(torch.randint(0, H, (1,), generator=gen))
    cells = [(rows - 1, last_head, float("nan")),  # the last row of request 3 is at position 128: a page's first token
             (4 * S - 1, int(torch.randint(0, H, (1,), generator=gen)), float("nan"))]
    if q_dtype != FP8_DTYPE:  # e4m3 has no Inf
        cells += [(rows - 1, last_head, float("inf")), (4 * S - 1, cells[1][1], float("-inf")),
                  (int(torch.randint(0, rows - 1, (1,), generator=gen)), int(torch.randint(0, H, (1,), generator=gen)),
                   float("nan"))]
    for r, h, value in cells:
        q[r, h, int(torch.randint(0, 128, (1,), generator=gen))] = value
    return cache, DecodeBatch(bt, seq, S, H, SCALE, MAX_BLOCK, cp_rank=cp_rank, cp_world=cp_world), q, poison


def torch_oracle(cache, batch, q):
    """The torch backend on the raw plan (it keeps both rules in its own code)."""
    return score_decode(plan_decode(cache, batch, backend="torch"), q, cache)


def assert_same_pattern(got, want):
    """The -inf and NaN pattern of ``want`` exactly, and its other scores to 1e-5."""
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    rest = ~torch.isnan(want) & ~torch.isneginf(want)
    torch.testing.assert_close(got[rest], want[rest], rtol=1e-5, atol=1e-5)


def assert_case_bites(want, batch, poison):
    """The case is not vacuous: some scores are NaN, some finite, and a poisoned page is one a row sees."""
    assert torch.isnan(want).any() and torch.isfinite(want).any()
    seen = [b for b, p in poison.nonzero().tolist() if p < n_local(LENS[b], batch.cp_rank, batch.cp_world)]
    assert seen


@pytest.mark.parametrize("bad", list(BAD_PAGE_IDS))
@pytest.mark.parametrize("cp_rank,cp_world", [(0, 1), (0, 2), (1, 2)])
@pytest.mark.parametrize("S", [1, 2])
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8", "bf16"])
def test_guarded_run_keeps_both_rules(gen, fmt, S, cp_rank, cp_world, bad):
    cache, batch, q, poison = case(gen, fmt, S, cp_rank, cp_world, BAD_PAGE_IDS[bad])
    want = torch_oracle(cache, batch, q)
    assert_case_bites(want, batch, poison)
    plan = plan_decode(cache, batch, backend="torch")  # the plan's fields; the stand-in is the kernel
    got = run_guarded(plan, q, cache, new_out(plan), stand_in_kernel)
    assert_same_pattern(got, want)
    assert torch.equal(plan.block_table, batch.block_table)  # the plan's own table is left as it was


def test_guarded_run_with_an_e4m3_q(gen):
    cache, batch, q, poison = case(gen, "mxfp4", 2, 0, 1, -1, q_dtype=FP8_DTYPE)
    want = torch_oracle(cache, batch, q)
    assert_case_bites(want, batch, poison)
    plan = plan_decode(cache, batch, backend="torch")
    assert_same_pattern(run_guarded(plan, q, cache, new_out(plan), stand_in_kernel), want)


def test_the_stand_in_alone_breaks_both_rules(gen):
    """Without ``run_guarded`` the checks above fail: the stand-in refuses outside ids, and on in-range ids it
    scores a non-finite query vector finite where the rule says NaN."""
    cache, batch, q, _ = case(gen, "mxfp4", 2, 0, 1, -1)
    plan = plan_decode(cache, batch, backend="torch")
    with pytest.raises(AssertionError, match="handed a page id outside the cache"):
        stand_in_kernel(plan, q, cache, new_out(plan))
    safe = batch._replace(block_table=batch.block_table.clamp(0, cache.num_pages - 1))
    plan = plan_decode(cache, safe, backend="torch")
    with pytest.raises(AssertionError):
        assert_same_pattern(stand_in_kernel(plan, q, cache, new_out(plan)), torch_oracle(cache, safe, q))


# ---------------------------------------------------------------- the ROCm runs go through it


def test_the_flydsl_run_goes_through_the_guard(gen, monkeypatch):
    """A plan for backend "flydsl" and its run on the CPU, the FlyDSL launch (``host.run``) replaced by the
    stand-in kernel (FlyDSL itself is never imported)."""
    calls = []

    def launch(plan, q, cache, out, nt_k=None):
        calls.append(nt_k)
        return stand_in_kernel(plan, q, cache, out)

    host = types.ModuleType(f"{flydsl_backend.__name__}.host")
    host.run = launch
    monkeypatch.setitem(sys.modules, host.__name__, host)
    monkeypatch.setattr(flydsl_backend, "availability", lambda device=None: (True, ""))  # as on ROCm gfx950
    for fmt, cp_rank, cp_world in (("mxfp4", 1, 2), ("bf16", 0, 1)):
        cache, batch, q, poison = case(gen, fmt, 2, cp_rank, cp_world, 10**8)
        plan = plan_decode(cache, batch, backend="flydsl")
        assert plan.backend == "flydsl"
        got = score_decode(plan, q, cache)
        assert_same_pattern(got, torch_oracle(cache, batch, q))
        flydsl_backend.run(plan, q, cache, new_out(plan), nt_k=3)
    assert calls == [None, 3, None, 3]


def test_the_aiter_run_goes_through_the_guard(gen, monkeypatch):
    """A plan for backend "aiter" and its run on the CPU, aiter's scorer replaced by the stand-in kernel behind
    aiter's documented signature (it stores ``max * sm_scale * log2(e)``)."""
    calls = []

    def score_flydsl_fp4(idx_q, k_data, k_scale, block_table, seq_lens, S, H, sm_scale, max_block, out=None,
                         cfg=None, work_map=None, **cfg_kwargs):
        calls.append(block_table)
        cache = IndexKCache.of(k_data, k_scale)
        return stand_in_scores(idx_q, cache, block_table, seq_lens, S, sm_scale * math.log2(math.e), max_block,
                               out, 0, 1)

    monkeypatch.setattr(aiter_backend, "find_scorer", lambda: score_flydsl_fp4)
    monkeypatch.setattr(aiter_backend, "availability", lambda device=None: (True, ""))  # as on ROCm with aiter
    for S in (1, 2):
        cache, batch, q, poison = case(gen, "mxfp4", S, 0, 1, -1)
        plan = plan_decode(cache, batch, backend="aiter")
        assert plan.backend == "aiter"
        assert_same_pattern(score_decode(plan, q, cache), torch_oracle(cache, batch, q))
    assert len(calls) == 2 and all(ids_inside(t, cache.num_pages) for t in calls)
