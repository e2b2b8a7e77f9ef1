"""Test support (``m3_kernels.testing``): the suite's share of the cores per xdist worker, and the selection check
a benchmark's gate holds any top-k selector to (ours here; SGLang's own M3 prefill indexer in
``tests/benchmarks/bench_prefill.py`` on a GPU: under Triton's interpreter its scores come out wrong, ones
against ones giving 4.2e9 for 16, so it is not checked on a CPU)."""

import os

import pytest
import torch

from m3_kernels.formats import PAGE_SIZE
from m3_kernels.ops.score.naive import score_prefill_ref
from m3_kernels.ops.select.naive import select_blocks_ref, visible_blocks
from m3_kernels.testing import abs_index_k, make_q, q_abs, random_cache, selection_error, worker_threads


@pytest.mark.parametrize("cpus,workers,threads", [(2, 2, 1), (1, 2, 1), (8, 2, 4), (16, 3, 5), (4, 1, 4)])
def test_worker_threads_share_the_cores(cpus, workers, threads):
    assert worker_threads(cpus, workers) == threads


def test_this_worker_runs_torch_on_its_share():
    """In an xdist worker, torch's intra-op threads are this worker's share of the cores."""
    if "PYTEST_XDIST_WORKER_COUNT" not in os.environ or "OMP_NUM_THREADS" in os.environ:
        pytest.skip("only in an xdist worker without OMP_NUM_THREADS (the README's command)")
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    assert torch.get_num_threads() == worker_threads(os.cpu_count() or 1, workers)


# ---- selection_error: the check a benchmark's gate holds any selector to (ours, or a peer's) ---------------------

SM_SCALE = 0.125


def _prefill_case(gen, ctx, chunk, H):
    """One request's last ``chunk`` tokens over a random bf16 cache: (q, keys, block table, seq, cu, exact scores,
    their bound, visible blocks per row)."""
    pages = -(-ctx // PAGE_SIZE)
    k, _ = random_cache(gen, "bf16", pages + 2, "cpu")
    bt = torch.randperm(pages + 2, generator=gen)[:pages].int().reshape(1, pages)
    seq, cu = torch.tensor([ctx], dtype=torch.int32), torch.tensor([0, chunk], dtype=torch.int32)
    q = make_q(gen, chunk, H, torch.bfloat16, "cpu")
    ref = score_prefill_ref(q, k, None, bt, seq, cu, SM_SCALE, pages)
    bound = score_prefill_ref(q_abs(q), *abs_index_k(k, None), bt, seq, cu, SM_SCALE, pages)
    n_visible = visible_blocks(torch.arange(ctx - chunk, ctx), PAGE_SIZE)
    return q, k, bt, seq, cu, ref, bound, n_visible


def _gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


@pytest.mark.parametrize("topk, local, init", [(4, 1, 0), (5, 1, 1), (3, 2, 0)])
def test_the_reference_selection_passes_and_each_planted_fault_is_named(topk, local, init):
    *_, ref, _, n = _prefill_case(_gen(), ctx=1300, chunk=200, H=2)  # rows see 9-11 blocks
    picked = select_blocks_ref(ref, n, topk, local, init)
    check = lambda p: selection_error(p, ref, n, 0.0, topk, local, init)  # noqa: E731
    assert check(picked) == ""
    assert check(picked.flip(-1)) == ""  # any order

    h, r = 1, 7
    ranked_slot = init  # select_blocks_ref lays a row out as [init..., ranked..., local...]
    worst = init + int(ref[h, r, init : n[r] - local].argmin())  # the lowest-scoring block selection could rank
    bad = picked.clone()
    bad[h, r, ranked_slot] = worst
    assert "below the row's best" in check(bad)
    bad = picked.clone()
    bad[h, r, ranked_slot] = bad[h, r, ranked_slot + 1]
    assert "twice" in check(bad)
    bad = picked.clone()
    bad[h, r, -1] = -1
    assert "min(topk, visible)" in check(bad)
    bad = picked.clone()
    bad[h, r, ranked_slot] = int(n[r])
    assert "past the row's visible" in check(bad)
    bad = picked.clone()
    chosen = set(picked[h, r].tolist())
    other = next(b for b in range(int(n[r])) if b not in chosen)
    bad[h, r, -1] = other  # the local block swapped for another
    assert "forced block" in check(bad) or "below" in check(bad)
    assert "forced block" in selection_error(bad, ref.abs() + 1e9, n, 0.0, topk, local, init)  # all tie: only the rule


def test_rows_seeing_at_most_topk_blocks_must_take_them_all():
    *_, ref, _, n = _prefill_case(_gen(), ctx=300, chunk=300, H=1)  # 1-3 blocks per row
    picked = select_blocks_ref(ref, n, 4, 1, 0)
    assert selection_error(picked, ref, n, 0.0, 4, 1, 0) == ""
    bad = picked.clone()
    bad[0, 299, 0] = -1
    assert "min(topk, visible)" in selection_error(bad, ref, n, 0.0, 4, 1, 0)
