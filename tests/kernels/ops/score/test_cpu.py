"""The CPU serving scorers against the float64 reference (``naive.py``), on fresh random caches."""

import itertools
import math

import pytest
import torch

from m3_kernels.formats import FP8_DTYPE, PAGE_SIZE, alloc_index_k_cache, dequantize_index_k
from m3_kernels.formats import IndexKCache
from m3_kernels.ops.score import DecodeBatch, PrefillBatch, plan_decode, plan_prefill, score_decode, score_prefill
from m3_kernels.ops.score.backends.torch import dequantize_pages
from m3_kernels.ops.score.naive import score_decode_ref, score_prefill_ref

from .test_naive import build_cache, make_q


def score_decode_cpu(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block=None, out=None, cp_rank=0,
                     cp_world=1):
    """The torch backend's decode plan and run over loose views."""
    cache = IndexKCache.of(k_cache, k_scale)
    batch = DecodeBatch(block_table, seq_lens, S, q.shape[1], sm_scale, max_block, out, cp_rank, cp_world)
    return score_decode(plan_decode(cache, batch, backend="torch"), q, cache)


def score_prefill_cpu(q, k_cache, k_scale, block_table, seq_lens, cu_seqlens_q, sm_scale, max_block=None, out=None,
                      skip_rows_seeing=0):
    """The torch backend's prefill plan and run over loose views."""
    cache = IndexKCache.of(k_cache, k_scale)
    batch = PrefillBatch(block_table, seq_lens, cu_seqlens_q, q.shape[1], sm_scale, max_block, out,
                         skip_rows_seeing=skip_rows_seeing)
    return score_prefill(plan_prefill(cache, batch, backend="torch"), q, cache)

# fp32 dot products of 128 terms against the exactly rounded float64 score: |q|.|k| * 128 * 2^-24 bounds the
# error; with unit-scale inputs 1e-4 relative (plus 1e-4 absolute near zero) leaves a wide margin.
RTOL, ATOL = 1e-4, 1e-4


def assert_close_scores(got, want):
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "masked pages differ"
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite].double(), want[finite], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_dequantize_pages_is_exact(gen, fmt):
    k_cache, k_scale = build_cache(gen, fmt, 5)
    pages = torch.tensor([[4, 0], [2, 2]])
    got = dequantize_pages(k_cache, k_scale, pages)
    want = dequantize_index_k(k_cache[pages], None if k_scale is None else k_scale[pages], torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_dequantize_pages_every_byte_and_scale_extremes():
    """Every packed byte under scales 1 (2^-126), 127 (1) and 254 (2^127: 6 x 2^127 overflows fp32, as in the
    reference)."""
    k_data, k_scale = alloc_index_k_cache(3, "mxfp4", single_region=False)
    k_data.copy_(torch.arange(256, dtype=torch.uint8).repeat(3 * 128 * 64 // 256).view_as(k_data))
    for p, e in enumerate((1, 127, 254)):
        k_scale[p].fill_(e)
    pages = torch.arange(3)
    got = dequantize_pages(k_data, k_scale, pages)
    want = dequantize_index_k(k_data[pages], k_scale[pages], torch.float32)
    assert torch.equal(got, want)
    assert torch.isinf(got[2]).any()


CASES = [  # (seq_lens, S, H)
    ([1, 127, 128, 129], 1, 1),
    ([0, 300, 2, 256], 2, 4),
    ([129, 5, 384, 511], 4, 2),
]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("seq_lens,S,H", CASES)
def test_decode_matches_reference(gen, fmt, q_dtype, seq_lens, S, H):
    batch, max_block, num_pages = len(seq_lens), 5, 24
    k_cache, k_scale = build_cache(gen, fmt, num_pages)
    block_table = torch.randperm(num_pages, generator=gen)[: batch * max_block].view(batch, max_block).int()
    for b, n in enumerate(seq_lens):  # columns past the visible pages hold garbage that must never be read
        block_table[b, (n + PAGE_SIZE - 1) // PAGE_SIZE :] = -7
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    q = make_q(gen, batch * S, H, q_dtype)
    want = score_decode_ref(q, k_cache, k_scale, block_table, seq, S, 0.0883883)
    assert_close_scores(score_decode_cpu(q, k_cache, k_scale, block_table, seq, S, 0.0883883), want)


@pytest.mark.parametrize("cp_rank", [0, 2])
def test_decode_context_parallel_shard(gen, cp_rank):
    cp_world, seq_lens, S = 3, [129, 1000, 257], 2
    k_cache, k_scale = build_cache(gen, "mxfp4", 9)
    block_table = torch.randint(0, 9, (3, 3), generator=gen, dtype=torch.int32)
    q = make_q(gen, 3 * S, 2, torch.bfloat16)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    want = score_decode_ref(q, k_cache, k_scale, block_table, seq, S, 1.0, cp_rank=cp_rank, cp_world=cp_world)
    got = score_decode_cpu(q, k_cache, k_scale, block_table, seq, S, 1.0, cp_rank=cp_rank, cp_world=cp_world)
    assert_close_scores(got, want)


def test_decode_writes_every_column_of_out(gen):
    k_cache, k_scale = build_cache(gen, "mxfp4", 4)
    block_table = torch.arange(8, dtype=torch.int32).view(2, 4) % 4
    seq = torch.tensor([130, 3], dtype=torch.int32)
    q = make_q(gen, 2, 4, torch.bfloat16)
    out = torch.full((4, 2, 4), float("nan"))  # poisoned
    got = score_decode_cpu(q, k_cache, k_scale, block_table, seq, 1, 0.5, out=out)
    assert got is out
    assert_close_scores(out, score_decode_ref(q, k_cache, k_scale, block_table, seq, 1, 0.5))


def test_decode_scores_a_visible_page_outside_the_cache_minus_inf(gen):
    k_cache, k_scale = build_cache(gen, "fp8", 2)
    block_table = torch.tensor([[0, 1], [1, 5]], dtype=torch.int32)
    q = make_q(gen, 2, 1, torch.bfloat16)
    seq = torch.tensor([200, 129], dtype=torch.int32)
    got = score_decode_cpu(q, k_cache, k_scale, block_table, seq, 1, 1.0)
    assert torch.isfinite(got[:, :, :2].flatten()[:3]).all() and got[0, 1, 1] == float("-inf")
    assert_close_scores(got, score_decode_ref(q, k_cache, k_scale, block_table, seq, 1, 1.0))
    with pytest.raises(ValueError, match="sm_scale"):
        score_decode_cpu(q, k_cache, k_scale, block_table, torch.tensor([1, 1], dtype=torch.int32), 1, math.nan)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_prefill_matches_reference(gen, fmt, monkeypatch):
    """A cached prefix (its first tile starts inside a page), an empty request and a long one whose tiles see up to
    5 pages in key chunks of 2 (shrunk from the default so that the last chunk is partial and the own page is the
    first or the second page of a chunk)."""
    import m3_kernels.ops.score.backends.torch as cpu

    monkeypatch.setattr(cpu, "_KEY_PAGES", 2)
    seq_lens, new = [270, 40, 601], [70, 0, 601]
    k_cache, k_scale = build_cache(gen, fmt, 16)
    block_table = torch.randperm(16, generator=gen)[:15].view(3, 5).int()
    cu = torch.tensor([0, *itertools.accumulate(new)], dtype=torch.int32)
    q = make_q(gen, 671, 2, torch.bfloat16)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    want = score_prefill_ref(q, k_cache, k_scale, block_table, seq, cu, 0.5)
    out = torch.full_like(want, float("nan"), dtype=torch.float32)
    got = score_prefill_cpu(q, k_cache, k_scale, block_table, seq, cu, 0.5, out=out)
    assert got is out
    assert_close_scores(got, want)


def test_prefill_rejects_inconsistent_lengths(gen):
    k_cache, k_scale = build_cache(gen, "bf16", 2)
    q = make_q(gen, 5, 1, torch.bfloat16)
    with pytest.raises(ValueError):
        score_prefill_cpu(q, k_cache, k_scale, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                          torch.tensor([0, 5], dtype=torch.int32), 1.0)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("ties", [False, True], ids=["random", "tied-pages"])
def test_prefill_selection_matches_float64_selection_up_to_near_ties(gen, fmt, ties):
    """The top-16 blocks picked from the fp32 serving scores equal those picked from the float64 oracle's scores,
    row by row and index head by head, except where the oracle itself puts a dropped and a kept block within the
    fp32 error bound of the scores (a genuine near-tie); exactly tied pages pick the same (lower) ids in both."""
    from m3_kernels.ops.select import select_blocks, visible_blocks

    n_pages, new, H, sm_scale = 22, 300, 4, 128**-0.5
    k_cache, k_scale = build_cache(gen, fmt, n_pages, ties=ties)
    seq = torch.tensor([n_pages * PAGE_SIZE - 5], dtype=torch.int32)  # last page partial
    block_table = torch.randperm(n_pages, generator=gen).int()[None]
    cu = torch.tensor([0, new], dtype=torch.int32)
    q = make_q(gen, new, H, torch.bfloat16)
    got = score_prefill_cpu(q, k_cache, k_scale, block_table, seq, cu, sm_scale)
    want = score_prefill_ref(q, k_cache, k_scale, block_table, seq, cu, sm_scale)
    n_vis = visible_blocks(seq.long() - new + torch.arange(new), PAGE_SIZE)
    assert bool((n_vis > 16).all())  # every row ranks
    sel_got, sel_want = select_blocks(got, n_vis), select_blocks(want.float(), n_vis)
    k = dequantize_index_k(k_cache, k_scale, torch.float64).view(-1, 128)
    # |fp32 score - exact| <= sm_scale * 128 * 2^-24 * sum_i |q_i k_i| (<= |q| |k| by Cauchy-Schwarz), doubled.
    bound = 2 * sm_scale * 128 * 2.0**-24 * q.double().norm(dim=-1).t() * float(k.norm(dim=-1).max())  # [H, rows]
    differ = 0
    for h in range(H):
        for r in range(new):
            a, b = set(sel_got[h, r].tolist()), set(sel_want[h, r].tolist())
            if a == b:
                continue
            differ += 1
            kept = min(float(want[h, r, j]) for j in b)  # the oracle's weakest pick
            for j in a ^ b:
                assert abs(float(want[h, r, j]) - kept) <= float(bound[h, r]), (h, r, j)
    if ties:
        assert differ == 0


def test_prefill_skips_rows_that_see_few_pages(gen):
    """``skip_rows_seeing=3``: rows seeing at most 3 pages read -inf everywhere, the others equal the reference; the
    selection of every row is that of the full scores."""
    from m3_kernels.ops.select import select_blocks, visible_blocks

    k_cache, k_scale = build_cache(gen, "mxfp4", 6)
    seq = torch.tensor([700, 300], dtype=torch.int32)
    new = [700, 50]  # request 0 from position 0; request 1's rows at positions 250..299 (pages 1 and 2)
    cu = torch.tensor([0, *itertools.accumulate(new)], dtype=torch.int32)
    block_table = torch.stack([torch.randperm(6, generator=gen), torch.randperm(6, generator=gen)]).int()
    q = make_q(gen, 750, 2, torch.bfloat16)
    got = score_prefill_cpu(q, k_cache, k_scale, block_table, seq, cu, 0.5, skip_rows_seeing=3)
    want = score_prefill_ref(q, k_cache, k_scale, block_table, seq, cu, 0.5)
    positions = torch.cat([torch.arange(700), torch.arange(250, 300)])
    few = visible_blocks(positions, PAGE_SIZE) <= 3
    assert int(few.sum()) == 3 * PAGE_SIZE + 50
    assert torch.isneginf(got[:, few]).all()
    assert_close_scores(got[:, ~few], want[:, ~few])
    n_vis = visible_blocks(positions, PAGE_SIZE)
    assert torch.equal(select_blocks(got, n_vis, 3, 1, 0), select_blocks(want.float(), n_vis, 3, 1, 0))
