"""Torch sparse attention over selected blocks (the clear version and the CPU serving gather path)
against a float64 per-row oracle."""

import math

import pytest
import torch

import sglang_m3.sparse_attention as sa
from sglang_m3.sparse_attention import (_ROW_CHUNK, sparse_attention_by_block, sparse_attention_decode,
                                        sparse_attention_gather, sparse_attention_torch)

BOTH = pytest.mark.parametrize("attend", [sparse_attention_torch, sparse_attention_gather, sparse_attention_by_block],
                               ids=["torch", "gather", "by_block"])

BLOCK = 4  # small blocks keep the oracle cheap; the code takes block_size as an argument


def _oracle(q, k_cache, v_cache, slots, pos, sel, sm_scale):
    """One row, all heads: softmax over tokens t <= pos whose block is in the head's list."""
    hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.empty(hq, d, dtype=torch.float64)
    for h in range(hq):
        g = h // (hq // hkv)
        keep = [t for t in range(pos + 1) if t // BLOCK in set(int(b) for b in sel[g] if b >= 0)]
        k = k_cache[slots[keep], g].double()
        v = v_cache[slots[keep], g].double()
        w = torch.softmax((k @ q[h].double()) * sm_scale, 0)
        out[h] = w @ v
    return out


@BOTH
def test_matches_oracle_with_padding_gqa_and_two_requests(gen, attend):
    hq, hkv, d, topk = 8, 2, 16, 3
    lens = [11, 5]  # request 0 has 3 blocks (last partial); request 1 two
    slots_total = 40
    k_cache = torch.randn(slots_total, hkv, d, generator=gen)
    v_cache = torch.randn(slots_total, hkv, d, generator=gen)
    req_to_token = torch.randperm(slots_total, generator=gen)[:32].reshape(2, 16)
    req_pool_indices = torch.tensor([1, 0])  # request b lives in req_to_token row 1 - b
    seq_lens = torch.tensor(lens)
    # Rows: request 0 positions 8..10 (block 2), request 1 positions 1..3 (block 0).
    positions = torch.tensor([8, 9, 10, 1, 2, 3])
    cu_rows = torch.tensor([0, 3, 6])
    q = torch.randn(6, hq, d, generator=gen)
    sel = torch.full((hkv, 6, topk), -1, dtype=torch.int32)
    sel[0, :3] = torch.tensor([0, 2, -1], dtype=torch.int32)
    sel[1, :3] = torch.tensor([1, 2, -1], dtype=torch.int32)
    sel[0, 3:, :2] = torch.tensor([1, 0], dtype=torch.int32)  # block 1 lies past every row: masked
    sel[1, 3:, 0] = 0  # KV head 1 of request 1: its own block only
    sm_scale = 1 / math.sqrt(d)
    out = attend(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, cu_rows, positions, sel, BLOCK,
                 sm_scale)
    for r in range(6):
        b = 0 if r < 3 else 1
        slots = req_to_token[req_pool_indices[b], : lens[b]]
        ref = _oracle(q[r], k_cache, v_cache, slots, int(positions[r]), sel[:, r], sm_scale)
        torch.testing.assert_close(out[r].double(), ref, rtol=1e-5, atol=1e-5)


def test_decode_rows_at_block_edges(gen):
    """The CPU decode entry: one row per request at position seq_len - 1, for seq_len 1, BLOCK - 1,
    BLOCK, BLOCK + 1 and a longer one that drops a block."""
    hq, hkv, d, topk = 4, 2, 8, 2
    lens = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 2]
    width = max(lens)
    k_cache = torch.randn(80, hkv, d, generator=gen)
    v_cache = torch.randn(80, hkv, d, generator=gen)
    req_to_token = torch.randperm(80, generator=gen)[: len(lens) * width].reshape(len(lens), width)
    req_pool_indices = torch.randperm(len(lens), generator=gen)
    seq_lens = torch.tensor(lens)
    sel = torch.full((hkv, len(lens), topk), -1, dtype=torch.int32)
    for b, length in enumerate(lens):
        last = (length - 1) // BLOCK
        sel[:, b, 0] = last  # own block
        if last > 0:
            sel[1, b, 1] = last - 1  # KV head 1 also reads the previous block
    q = torch.randn(len(lens), hq, d, generator=gen)
    sm_scale = 1 / math.sqrt(d)
    out = sparse_attention_decode(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, sel, BLOCK, sm_scale)
    for b, length in enumerate(lens):
        slots = req_to_token[req_pool_indices[b], :length]
        ref = _oracle(q[b], k_cache, v_cache, slots, length - 1, sel[:, b], sm_scale)
        torch.testing.assert_close(out[b].double(), ref, rtol=1e-5, atol=1e-5)


@BOTH
def test_rows_past_one_chunk(gen, attend, monkeypatch):
    """More query rows than one ``_ROW_CHUNK``: every chunk (the last one partial) is attended; the gather
    path's tile chunks are shrunk to a few tiles so that it also runs several."""
    monkeypatch.setattr(sa, "_GATHER_ELEMS", 3 * 2 * BLOCK * 2 * BLOCK)
    monkeypatch.setattr(sa, "_BY_BLOCK_ELEMS", 100 * 2 * 1 * BLOCK)  # by-block path: row chunks of 100
    hq, hkv, d = 2, 1, 8
    rows = _ROW_CHUNK + 3
    k_cache = torch.randn(rows, hkv, d, generator=gen)
    v_cache = torch.randn(rows, hkv, d, generator=gen)
    req_to_token = torch.randperm(rows, generator=gen).reshape(1, rows)
    positions = torch.arange(rows)
    sel = torch.stack([positions // BLOCK, torch.zeros(rows, dtype=torch.int64)], dim=-1).to(torch.int32)[None]
    q = torch.randn(rows, hq, d, generator=gen)
    out = attend(q, k_cache, v_cache, req_to_token, torch.tensor([0]), torch.tensor([rows]), torch.tensor([0, rows]),
                 positions, sel, BLOCK, 0.5)
    for r in range(rows):
        ref = _oracle(q[r], k_cache, v_cache, req_to_token[0], r, sel[:, r], 0.5)
        torch.testing.assert_close(out[r].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [None, 12000], ids=["one-run", "runs-of-few-tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_matches_the_clear_version_on_random_selections(gen, dtype, budget, monkeypatch):
    """Three requests (a cached prefix, a single row, a long one), random distinct block lists per KV head and
    row (own block last, -1 padding), tiles whose union is wider than one row's list; all tiles in one run, or
    runs of a few tiles of different widths."""
    if budget is not None:
        monkeypatch.setattr(sa, "_GATHER_ELEMS", budget)
        monkeypatch.setattr(sa, "_BY_BLOCK_ELEMS", 10 * 4 * 4 * BLOCK)  # row chunks of 10 that split requests
    hq, hkv, d, topk, width = 8, 2, 16, 4, 64
    lens, new = [37, 9, 61], [13, 1, 61]
    k_cache = torch.randn(300, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(300, hkv, d, generator=gen).to(dtype)
    req_to_token = torch.randperm(300, generator=gen)[: 4 * width].view(4, width)
    req_pool_indices = torch.tensor([2, 0, 3])
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, new)])
    cu_rows = torch.tensor([0, 13, 14, 75])
    rows = positions.shape[0]
    sel = torch.full((hkv, rows, topk), -1, dtype=torch.int32)
    for h in range(hkv):
        for r in range(rows):
            own = int(positions[r]) // BLOCK
            others = torch.randperm(own, generator=gen)[: int(torch.randint(0, topk, (1,), generator=gen))] if own else []
            picked = [int(b) for b in others] + [own]
            sel[h, r, : len(picked)] = torch.tensor(picked, dtype=torch.int32)
    q = torch.randn(rows, hq, d, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, req_to_token, req_pool_indices, torch.tensor(lens), cu_rows, positions, sel, BLOCK,
            0.3)
    want = sparse_attention_torch(*args)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(sparse_attention_by_block(*args).float(), want.float(), rtol=tol, atol=tol)
    got = sparse_attention_gather(*args)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    r = 20  # one row (request 2, req_to_token row 3) against the float64 oracle as well
    slots = req_to_token[3, : lens[2]]
    ref = _oracle(q[r].float(), k_cache.float(), v_cache.float(), slots, int(positions[r]), sel[:, r], 0.3)
    torch.testing.assert_close(got[r].double(), ref, rtol=tol, atol=tol)


@BOTH
def test_a_block_listed_twice_counts_once(gen, attend):
    hq, hkv, d = 4, 2, 8
    k_cache = torch.randn(16, hkv, d, generator=gen)
    v_cache = torch.randn(16, hkv, d, generator=gen)
    req_to_token = torch.randperm(16, generator=gen)[None]
    positions = torch.tensor([9, 10])
    sel = torch.tensor([[[0, 0, 2], [2, 1, 2]], [[1, 2, -1], [0, 2, 0]]], dtype=torch.int32)
    q = torch.randn(2, hq, d, generator=gen)
    out = attend(q, k_cache, v_cache, req_to_token, torch.tensor([0]), torch.tensor([11]), torch.tensor([0, 2]),
                 positions, sel, BLOCK, 0.5)
    for r in range(2):
        ref = _oracle(q[r], k_cache, v_cache, req_to_token[0], int(positions[r]), sel[:, r], 0.5)
        torch.testing.assert_close(out[r].double(), ref, rtol=1e-5, atol=1e-5)
