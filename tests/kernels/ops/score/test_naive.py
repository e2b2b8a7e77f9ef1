"""Reference scorers against a brute force written token by token in float64."""

import math

import pytest
import torch

from m3_kernels.formats import FP8_DTYPE, PAGE_SIZE, alloc_index_k_cache, dequantize_index_k
from m3_kernels.ops.score.common import check_decode_args
from m3_kernels.ops.score.naive import score_decode_ref, score_prefill_ref
from m3_kernels.ops.write.naive import write_index_k_ref


def build_cache(gen, fmt, num_pages, single_region=True, ties=False):
    k = torch.randn(num_pages * PAGE_SIZE, 128, generator=gen)
    if ties:  # every page holds the same keys: block scores tie exactly
        k = k[:PAGE_SIZE].repeat(num_pages, 1)
    k_cache, k_scale = alloc_index_k_cache(num_pages, fmt, single_region=single_region)
    write_index_k_ref(k, torch.arange(k.shape[0]), k_cache, k_scale, fmt)
    return k_cache, k_scale


def brute_force(q, k_cache, k_scale, block_table, rows, sm_scale, max_block, cp_rank=0, cp_world=1):
    """rows: list of (request b, position) per q row. Returns float64 [H, len(rows), max_block]."""
    H = q.shape[1]
    out = torch.full((H, len(rows), max_block), -math.inf, dtype=torch.float64)
    qd = q.double()
    for r, (b, pos) in enumerate(rows):
        for p in range(max_block):
            g = p * cp_world + cp_rank
            visible = [t for t in range(PAGE_SIZE) if g * PAGE_SIZE + t <= pos]
            if not visible:
                continue
            page = int(block_table[b, p])
            scale = None if k_scale is None else k_scale[page]
            k = dequantize_index_k(k_cache[page], scale, torch.float64)
            for h in range(H):
                out[h, r, p] = max(float(k[t] @ qd[r, h]) for t in visible) * sm_scale
    return out


def assert_scores_equal(got, want):
    assert got.shape == want.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    assert torch.isfinite(got[finite]).all()
    assert torch.allclose(got[finite].double(), want[finite], rtol=1e-12, atol=1e-12)


def make_q(gen, rows, H, q_dtype):
    q = torch.randn(rows, H, 128, generator=gen) * 0.5
    return q.to(q_dtype)


CASES = [  # (seq_lens, S, H)
    ([1, 127, 128, 129], 1, 1),
    ([0, 300, 2, 256], 2, 4),
    ([129, 5, 384], 4, 2),
]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("seq_lens,S,H", CASES)
def test_decode_matches_brute_force(gen, fmt, q_dtype, seq_lens, S, H):
    batch, max_block = len(seq_lens), 4
    num_pages = 16
    k_cache, k_scale = build_cache(gen, fmt, num_pages)
    # Shuffled page ids; unused columns hold garbage that must never be read.
    block_table = torch.randperm(num_pages, generator=gen)[: batch * max_block].view(batch, max_block).int()
    for b, n in enumerate(seq_lens):
        block_table[b, (n + PAGE_SIZE - 1) // PAGE_SIZE :] = -7
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    q = make_q(gen, batch * S, H, q_dtype)
    sm_scale = 0.0883883
    got = score_decode_ref(q, k_cache, k_scale, block_table, seq, S, sm_scale)
    rows = [(b, n - S + tok) for b, n in enumerate(seq_lens) for tok in range(S)]
    assert_scores_equal(got, brute_force(q, k_cache, k_scale, block_table, rows, sm_scale, max_block))


@pytest.mark.parametrize("cp_rank", [0, 1, 2])
def test_decode_context_parallel_shard(gen, cp_rank):
    cp_world, seq_lens, S = 3, [129, 1000, 257], 2
    k_cache, k_scale = build_cache(gen, "mxfp4", 9)
    block_table = torch.randint(0, 9, (3, 3), generator=gen, dtype=torch.int32)
    q = make_q(gen, 3 * S, 2, torch.bfloat16)
    got = score_decode_ref(q, k_cache, k_scale, block_table, torch.tensor(seq_lens, dtype=torch.int32), S, 1.0,
                           cp_rank=cp_rank, cp_world=cp_world)
    rows = [(b, n - S + tok) for b, n in enumerate(seq_lens) for tok in range(S)]
    assert_scores_equal(got, brute_force(q, k_cache, k_scale, block_table, rows, 1.0, 3, cp_rank, cp_world))


def test_ties_and_split_views_agree(gen):
    single = build_cache(gen, "mxfp4", 4, ties=True)
    split = tuple(t.clone() for t in alloc_index_k_cache(4, "mxfp4", single_region=False))
    split[0].copy_(single[0])
    split[1].copy_(single[1])
    block_table = torch.arange(4, dtype=torch.int32)[None]
    q = make_q(gen, 1, 1, torch.bfloat16)
    a = score_decode_ref(q, *single, block_table, torch.tensor([512], dtype=torch.int32), 1, 1.0)
    b = score_decode_ref(q, *split, block_table, torch.tensor([512], dtype=torch.int32), 1, 1.0)
    assert torch.equal(a, b)
    assert (a[0, 0] == a[0, 0, 0]).all()  # identical pages tie exactly


def test_prefill_matches_brute_force_and_decode(gen):
    # Request 0: 200 cached prefix tokens + 70 new; request 1: nothing new; request 2: 129 new, no prefix.
    seq_lens, new = [270, 40, 129], [70, 0, 129]
    k_cache, k_scale = build_cache(gen, "fp8", 8)
    block_table = torch.randperm(8, generator=gen)[:6].view(3, 2).int()
    cu = torch.tensor([0, 70, 70, 199], dtype=torch.int32)
    q = make_q(gen, 199, 2, torch.bfloat16)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    got = score_prefill_ref(q, k_cache, k_scale, block_table, seq, cu, 0.5)
    rows = [(b, seq_lens[b] - new[b] + i) for b in range(3) for i in range(new[b])]
    assert_scores_equal(got, brute_force(q, k_cache, k_scale, block_table, rows, 0.5, 2))
    # The last 4 rows of request 2 are decode with S = 4.
    dec = score_decode_ref(q[195:199], k_cache, k_scale, block_table[2:3], seq[2:3], 4, 0.5)
    assert torch.equal(dec, got[:, 195:199])


def test_prefill_of_more_rows_than_one_chunk_matches_brute_force(gen):
    """One request of 300 new rows after a 40-token prefix: the reference scores rows in chunks
    (``naive._ROW_CHUNK``), and every chunk must mask by its own rows' positions."""
    from m3_kernels.ops.score import naive

    new = naive._ROW_CHUNK + 44
    seq_len = 40 + new
    k_cache, k_scale = build_cache(gen, "mxfp4", 4)
    block_table = torch.randperm(4, generator=gen)[:3].view(1, 3).int()
    q = make_q(gen, new, 1, torch.bfloat16)
    got = score_prefill_ref(q, k_cache, k_scale, block_table, torch.tensor([seq_len], dtype=torch.int32),
                            torch.tensor([0, new], dtype=torch.int32), 0.25)
    rows = [(0, seq_len - new + i) for i in range(new)]
    assert_scores_equal(got, brute_force(q, k_cache, k_scale, block_table, rows, 0.25, 3))


def _supported(*args, **kwargs):
    """``(ok, reason)`` of the oracles' check of a decode call."""
    try:
        check_decode_args(*args, **kwargs)
    except ValueError as e:
        return False, str(e)
    return True, ""


@pytest.mark.parametrize("sm_scale", [0.0, -1.0, float("nan"), float("inf"), -float("inf"), "x"])
def test_rejects_bad_sm_scale(gen, sm_scale):
    k_cache, k_scale = build_cache(gen, "mxfp4", 1)
    args = (make_q(gen, 1, 1, torch.bfloat16), k_cache, k_scale, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1, sm_scale)
    with pytest.raises(ValueError, match="sm_scale"):
        score_decode_ref(*args)
    ok, reason = _supported(*args)
    assert not ok and "sm_scale" in reason


def test_rejections(gen):
    k_cache, k_scale = build_cache(gen, "mxfp4", 2)
    q = make_q(gen, 2, 1, torch.bfloat16)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    seq = torch.ones(2, dtype=torch.int32)
    bad = {
        "q must be bfloat16 or float8_e4m3fn": dict(q=q.float()),
        "q must have 4 rows": dict(S=2),
        "block_table must be int32": dict(block_table=bt.long()),
        "seq_lens must be a contiguous int32 vector": dict(seq_lens=seq.long()),
        "seq_lens must have 2 entries": dict(seq_lens=torch.ones(3, dtype=torch.int32)),
        "S \\(query rows per request\\) must be an int >= 1": dict(S=0),
        "cp_world": dict(cp_rank=2, cp_world=2),
        "max_block must be in": dict(max_block=3),
    }
    for msg, change in bad.items():
        kwargs = dict(q=q, k_cache=k_cache, k_scale=k_scale, block_table=bt, seq_lens=seq, S=1, sm_scale=1.0)
        kwargs.update(change)
        with pytest.raises(ValueError, match=msg):
            score_decode_ref(**kwargs)


@pytest.mark.parametrize("cp", [dict(cp_rank=0.0, cp_world=1.0), dict(cp_rank=0, cp_world=1.0),
                                dict(cp_rank=0.0, cp_world=2), dict(cp_rank=False, cp_world=1),
                                dict(cp_rank=0, cp_world=True), dict(cp_rank=torch.tensor(0), cp_world=1)])
def test_rejects_non_integer_context_parallel_arguments(gen, cp):
    """The shared check and the call agree: a float, bool or tensor cp_rank / cp_world is refused by name."""
    from m3_kernels.testing import score_decode_views

    k_cache, k_scale = build_cache(gen, "mxfp4", 1)
    args = (make_q(gen, 1, 1, torch.bfloat16), k_cache, k_scale, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1, 1.0)
    name = "cp_rank" if type(cp["cp_rank"]) is not int else "cp_world"
    ok, reason = _supported(*args, **cp)
    assert not ok and reason.startswith(f"{name} must be an int")
    with pytest.raises(ValueError, match=f"{name} must be an int"):
        score_decode_views(*args, **cp, backend="torch")
    with pytest.raises(ValueError, match=f"{name} must be an int"):
        score_decode_ref(*args, **cp)


def test_prefill_rejects_inconsistent_lengths(gen):
    k_cache, k_scale = build_cache(gen, "bf16", 1)
    q = make_q(gen, 5, 1, torch.bfloat16)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="5 new tokens but seq_lens"):
        score_prefill_ref(q, k_cache, k_scale, bt, torch.tensor([3], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q must rise"):
        score_prefill_ref(q, k_cache, k_scale, bt, torch.tensor([9], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32), 1.0)


def test_torch_dispatch_validates_out_like_the_kernels(gen):
    """Plans for the torch backend take ``max_block`` from ``out`` and reject an ``out`` the Triton path
    rejects (no silent broadcast into a wider buffer)."""
    from m3_kernels.testing import score_decode_views, score_prefill_views

    k_cache, k_scale = build_cache(gen, "mxfp4", 2)
    q = make_q(gen, 2, 1, torch.bfloat16)
    bt = torch.zeros(2, 1, dtype=torch.int32)
    seq = torch.tensor([5, 100], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    for bad, msg in [(torch.zeros(1, 2, 3), "max_block must be in"), (torch.zeros(1, 2, 1, dtype=torch.float64), "out must be")]:
        with pytest.raises(ValueError, match=msg):
            score_decode_views(q, k_cache, k_scale, bt, seq, 1, 1.0, out=bad, backend="torch")
        with pytest.raises(ValueError, match=msg):
            score_prefill_views(q, k_cache, k_scale, bt, seq, cu, 1.0, out=bad, backend="torch")
    out = torch.full((1, 2, 1), float("nan"))
    assert score_decode_views(q, k_cache, k_scale, bt, seq, 1, 1.0, out=out, backend="torch") is out
    # The torch backend is the fast torch scorer (backends/torch.py, checked against this reference in test_cpu.py): bit for
    # bit that, and within float32 rounding of the float64 reference.
    assert torch.equal(out, score_decode_views(q, k_cache, k_scale, bt, seq, 1, 1.0, backend="torch"))
    ref64 = score_decode_ref(q, k_cache, k_scale, bt, seq, 1, 1.0)
    assert torch.allclose(out.double(), ref64, rtol=1e-5, atol=0)


def test_rejects_a_non_integer_max_block(gen):
    k_cache, k_scale = build_cache(gen, "bf16", 1)
    args = (make_q(gen, 1, 1, torch.bfloat16), k_cache, k_scale, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32))
    ok, reason = _supported(*args, 1, 1.0, 1.0)
    assert not ok and "(an int)" in reason
    with pytest.raises(ValueError, match=r"max_block must be in .*\(an int\)"):
        score_prefill_ref(*args, torch.tensor([0, 1], dtype=torch.int32), 1.0, 1.0)
