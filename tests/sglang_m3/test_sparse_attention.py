"""The plugin's attention entry points on the CPU: the kernels of ``m3_kernels.ops.attention`` (tested against
their float64 oracles in ``tests/kernels/ops/attention``) with SGLang's argument layout."""

import math

import torch

from m3_kernels.ops.attention.naive import sparse_attention_ref
from sglang_m3.sparse_attention import sparse_attention_decode, sparse_attention_extend

BLOCK = 4


def test_extend_entry_point_on_cpu(gen):
    """Two requests (one extending a cached prefix), bf16 cache; SGLang's extra arguments (prefix lengths, the
    longest extension) are accepted and the result equals the reference within bf16 rounding."""
    hq, hkv, d, topk = 8, 2, 16, 3
    lens, new = [23, 30], [23, 9]
    k_cache = torch.randn(80, hkv, d, generator=gen).bfloat16()
    v_cache = torch.randn(80, hkv, d, generator=gen).bfloat16()
    req_to_token = torch.randperm(80, generator=gen)[:64].view(2, 32)
    req_pool = torch.tensor([1, 0])
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, new)])
    cu = torch.tensor([0, 23, 32], dtype=torch.int32)
    sel = torch.full((hkv, 32, topk), -1, dtype=torch.int32)
    for r in range(32):
        own = int(positions[r]) // BLOCK
        for h in range(hkv):
            earlier = torch.randperm(own, generator=gen)[: topk - 1].tolist() if own else []
            sel[h, r, : len(earlier) + 1] = torch.tensor([*earlier, own], dtype=torch.int32)
    q = torch.randn(32, hq, d, generator=gen).bfloat16()
    seq = torch.tensor(lens, dtype=torch.int32)
    got = sparse_attention_extend(q, k_cache, v_cache, req_to_token, req_pool, seq, seq - torch.tensor(new), cu, 23,
                                  positions, sel, BLOCK, 1 / math.sqrt(d))
    want = sparse_attention_ref(q, k_cache, v_cache, req_to_token, req_pool, seq, cu, positions, sel, BLOCK,
                                1 / math.sqrt(d))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=0.0, atol=4 * 2.0**-9 * float(v_cache.abs().max()))


def test_decode_entry_point_on_cpu(gen):
    """One row per request at position seq_len - 1 (seq_len 1, BLOCK, BLOCK + 1, 3 * BLOCK + 2)."""
    hq, hkv, d = 4, 2, 8
    lens = [1, BLOCK, BLOCK + 1, 3 * BLOCK + 2]
    k_cache = torch.randn(64, hkv, d, generator=gen)
    v_cache = torch.randn(64, hkv, d, generator=gen)
    req_to_token = torch.randperm(64, generator=gen)[:56].view(4, 14)
    req_pool = torch.randperm(4, generator=gen)
    seq = torch.tensor(lens)
    sel = torch.full((hkv, 4, 2), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        sel[:, b, 0] = (n - 1) // BLOCK
        if n > BLOCK:
            sel[1, b, 1] = 0
    q = torch.randn(4, hq, d, generator=gen)
    got = sparse_attention_decode(q, k_cache, v_cache, req_to_token, req_pool, seq, sel, BLOCK, 0.5)
    want = sparse_attention_ref(q, k_cache, v_cache, req_to_token, req_pool, seq, torch.arange(5), seq - 1, sel, BLOCK,
                                0.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
