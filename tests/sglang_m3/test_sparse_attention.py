"""Torch sparse attention over selected blocks against a float64 per-row oracle."""

import math

import torch

from sglang_m3.sparse_attention import sparse_attention_torch

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


def test_matches_oracle_with_padding_gqa_and_two_requests(gen):
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
    out = sparse_attention_torch(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, cu_rows, positions,
                                 sel, BLOCK, sm_scale)
    for r in range(6):
        b = 0 if r < 3 else 1
        slots = req_to_token[req_pool_indices[b], : lens[b]]
        ref = _oracle(q[r], k_cache, v_cache, slots, int(positions[r]), sel[:, r], sm_scale)
        torch.testing.assert_close(out[r].double(), ref, rtol=1e-5, atol=1e-5)
