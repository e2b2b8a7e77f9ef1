"""The plugin's attention entry points: on the CPU the kernels of ``m3_kernels.ops.attention`` (tested against
their float64 oracles in ``tests/kernels/ops/attention``) with SGLang's argument layout; the one-candidate hold
on SGLang's autotuned prefill kernel; on CUDA (marked gpu) that kernel under each candidate against the oracle."""

import math
import os
import re

import pytest
import torch

from m3_kernels.ops.attention.naive import sparse_attention_ref
from sglang_m3.sparse_attention import (pin_prefill_config, pin_prefill_from_env, prefill_autotuner,
                                        sparse_attention_decode, sparse_attention_extend)

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


@pytest.fixture
def prefill_tuner():
    """SGLang's sparse prefill autotuner, given back all its candidates afterwards."""
    tuner = prefill_autotuner()
    yield tuner
    pin_prefill_config(None, tuner)


def test_prefill_config_is_held_to_one_candidate_and_given_back(prefill_tuner):
    candidates = [(c.num_warps, c.num_stages) for c in prefill_tuner.configs]
    assert len(candidates) == 9 and (4, 3) in candidates  # SGLang 0.5.16: 2, 4 or 8 warps x 2, 3 or 4 stages
    prefill_tuner.cache[("poisoned-key",)] = prefill_tuner.configs[0]  # a pick made before the pin
    assert pin_prefill_config("8,2", prefill_tuner) == (8, 2)
    assert [(c.num_warps, c.num_stages) for c in prefill_tuner.configs] == [(8, 2)] and not prefill_tuner.cache
    assert pin_prefill_config(" 4, 3 ", prefill_tuner) == (4, 3)  # held again: chosen among all, not among one
    assert pin_prefill_config("", prefill_tuner) is None
    assert [(c.num_warps, c.num_stages) for c in prefill_tuner.configs] == candidates


@pytest.mark.parametrize("spec", ["3,3", "4", "4,3,1", "four,3", "4;3"])
def test_a_prefill_config_that_is_no_candidate_is_refused_naming_the_variable(prefill_tuner, spec):
    before = list(prefill_tuner.configs)
    with pytest.raises(ValueError, match=rf"M3_SPARSE_PREFILL_CONFIG='{re.escape(spec)}'.*2,2, 2,3, 2,4, 4,2"):
        pin_prefill_config(spec, prefill_tuner)
    assert prefill_tuner.configs == before


def test_the_environment_holds_a_candidate_and_unset_leaves_the_kernel_alone(prefill_tuner, monkeypatch):
    before = list(prefill_tuner.configs)
    for value, held in [(None, None), ("", None), ("2,4", (2, 4))]:
        pin_prefill_config(None, prefill_tuner)
        if value is None:
            monkeypatch.delenv("M3_SPARSE_PREFILL_CONFIG", raising=False)
        else:
            monkeypatch.setenv("M3_SPARSE_PREFILL_CONFIG", value)
        pin_prefill_from_env.cache_clear()
        pin_prefill_from_env()
        got = [(c.num_warps, c.num_stages) for c in prefill_tuner.configs]
        assert got == ([held] if held else [(c.num_warps, c.num_stages) for c in before])
    monkeypatch.setenv("M3_SPARSE_PREFILL_CONFIG", "16,2")
    pin_prefill_from_env.cache_clear()
    with pytest.raises(ValueError, match="M3_SPARSE_PREFILL_CONFIG='16,2'"):
        pin_prefill_from_env()
    # unset, the kernel is not even looked up (a later SGLang's kernel without an autotuner starts as before)
    import sglang_m3.sparse_attention as sa

    monkeypatch.delenv("M3_SPARSE_PREFILL_CONFIG")
    monkeypatch.setattr(sa, "prefill_autotuner", lambda: pytest.fail("looked up with the variable unset"))
    pin_prefill_from_env.cache_clear()
    pin_prefill_from_env()
    pin_prefill_from_env.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_prefill_candidate_equals_the_reference_on_cuda(prefill_tuner):
    """SGLang's sparse prefill kernel as the plugin calls it, held to each candidate in turn: two requests (one
    extending a cached prefix past a partial page), bf16 cache, M3's block of 128 and 16 picked blocks."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    block, hq, hkv, d, topk = 128, 8, 4, 128, 16
    lens, new = [129 + 128 * 20, 3000], [129 + 128 * 20, 1]
    slots = 8192
    k_cache = torch.randn(slots, hkv, d, generator=gen).bfloat16()
    v_cache = torch.randn(slots, hkv, d, generator=gen).bfloat16()
    req_to_token = torch.randperm(slots, generator=gen)[: 2 * 4096].view(2, 4096).int()
    req_pool = torch.tensor([1, 0])
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, new)])
    rows = len(positions)
    cu = torch.tensor([0, new[0], rows], dtype=torch.int32)
    sel = torch.full((hkv, rows, topk), -1, dtype=torch.int32)
    for r in range(rows):
        own = int(positions[r]) // block
        for h in range(hkv):
            earlier = torch.randperm(own, generator=gen)[: topk - 1].tolist() if own else []
            sel[h, r, : len(earlier) + 1] = torch.tensor([*earlier, own], dtype=torch.int32)
    q = torch.randn(rows, hq, d, generator=gen).bfloat16()
    seq = torch.tensor(lens, dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    want = sparse_attention_ref(q, k_cache, v_cache, req_to_token, req_pool, seq, cu, positions, sel, block, scale)
    cuda = [t.cuda() for t in (q, k_cache, v_cache, req_to_token, req_pool, seq, seq - torch.tensor(new), cu)]
    for c in list(prefill_tuner.configs):
        pin_prefill_config(f"{c.num_warps},{c.num_stages}", prefill_tuner)
        got = sparse_attention_extend(*cuda, max(new), positions.cuda(), sel.cuda(), block, scale)
        torch.testing.assert_close(got.double().cpu(), want, rtol=0.0, atol=4 * 2.0**-9 * float(v_cache.abs().max()),
                                   msg=lambda m, c=c: f"{c.num_warps} warps, {c.num_stages} stages: {m}")
