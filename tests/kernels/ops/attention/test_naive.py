"""The masked whole-context reference against a float64 brute force written token by token."""

import math

import pytest
import torch

from m3_kernels.ops.attention.naive import sparse_attention_ref

BLOCK = 4  # small blocks keep the brute force cheap; the code takes block_size as an argument


def brute_force(q, k_cache, v_cache, slots, pos, sel, sm_scale, block_size=BLOCK):
    """One row, all heads, float64 ``[Hq, D]``: softmax over tokens ``t <= pos`` whose block is in the head's
    list (zeros when there is none). ``slots``: the request's token slots; ``sel [Hkv, topk]``."""
    hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.zeros(hq, d, dtype=torch.float64)
    for h in range(hq):
        g = h // (hq // hkv)
        picked = {int(b) for b in sel[g] if b >= 0}
        keep = [t for t in range(min(pos + 1, slots.shape[0])) if t // block_size in picked]
        if not keep:
            continue
        k = k_cache[slots[keep], g].double()
        v = v_cache[slots[keep], g].double()
        out[h] = torch.softmax((k @ q[h].double()) * sm_scale, 0) @ v
    return out


def test_reference_matches_brute_force(gen):
    """Two requests (the first with a partial last block, rows of a cached prefix's extension), GQA, padding, a
    block past every row, a block listed twice, a head whose list is empty (zeros)."""
    hq, hkv, d, topk = 8, 2, 16, 3
    lens = [11, 5]
    k_cache = torch.randn(40, hkv, d, generator=gen)
    v_cache = torch.randn(40, hkv, d, generator=gen)
    req_to_token = torch.randperm(40, generator=gen)[:32].reshape(2, 16)
    req_pool_indices = torch.tensor([1, 0])
    positions = torch.tensor([8, 9, 10, 1, 2, 3])
    cu_rows = torch.tensor([0, 3, 6])
    q = torch.randn(6, hq, d, generator=gen)
    sel = torch.full((hkv, 6, topk), -1, dtype=torch.int32)
    sel[0, :3] = torch.tensor([0, 2, -1], dtype=torch.int32)
    sel[1, :3] = torch.tensor([1, 2, 1], dtype=torch.int32)  # block 1 twice
    sel[0, 3:, :2] = torch.tensor([1, 0], dtype=torch.int32)  # block 1 lies past every row of request 1
    # KV head 1 of request 1: nothing (all -1) -> zeros
    sm_scale = 1 / math.sqrt(d)
    out = sparse_attention_ref(q, k_cache, v_cache, req_to_token, req_pool_indices, torch.tensor(lens), cu_rows,
                               positions, sel, BLOCK, sm_scale)
    assert out.dtype == torch.float64
    for r in range(6):
        b = 0 if r < 3 else 1
        slots = req_to_token[req_pool_indices[b], : lens[b]]
        want = brute_force(q[r], k_cache, v_cache, slots, int(positions[r]), sel[:, r], sm_scale)
        torch.testing.assert_close(out[r], want, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[3:, 4:], torch.zeros(3, 4, d, dtype=torch.float64))


@pytest.mark.parametrize("length", [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 2])
def test_reference_every_row_of_one_prompt(gen, length):
    """Every row of a prompt of ``length`` tokens (one row, a block minus one, a block, a block plus one, a
    partial last block), random lists of earlier blocks plus the own block; the ``dtype`` argument."""
    hq, hkv, d, topk = 4, 2, 8, 2
    k_cache = torch.randn(64, hkv, d, generator=gen)
    v_cache = torch.randn(64, hkv, d, generator=gen)
    req_to_token = torch.randperm(64, generator=gen)[:length][None]
    positions = torch.arange(length)
    sel = torch.full((hkv, length, topk), -1, dtype=torch.int32)
    for h in range(hkv):
        for r in range(length):
            own = r // BLOCK
            sel[h, r, 0] = own
            if own:
                sel[h, r, 1] = int(torch.randint(0, own, (1,), generator=gen))
    q = torch.randn(length, hq, d, generator=gen)
    args = (q, k_cache, v_cache, req_to_token, torch.tensor([0]), torch.tensor([length]), torch.tensor([0, length]),
            positions, sel, BLOCK, 0.4)
    out = sparse_attention_ref(*args)
    for r in range(length):
        torch.testing.assert_close(out[r], brute_force(q[r], k_cache, v_cache, req_to_token[0], r, sel[:, r], 0.4),
                                   rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sparse_attention_ref(*args, dtype=torch.float32), out.float(), rtol=1e-5, atol=1e-5)
