"""The plugin's attention entry points: on the CPU the kernels of ``m3_kernels.ops.attention`` (tested against
their float64 oracles in ``tests/kernels/ops/attention``) with SGLang's argument layout; the one-candidate hold
on SGLang's autotuned prefill and decode kernels; on CUDA (marked gpu) those kernels under each candidate against the
oracle."""

import importlib
import math
import os
import re

import pytest
import torch

from m3_kernels.ops.attention.naive import sparse_attention_ref
import sglang_m3.sparse_attention as sa
from sglang_m3.sparse_attention import (autotuner, pin_config, pin_from_env, sparse_attention_decode,
                                        sparse_attention_extend)

BLOCK = 4


def _selection(own_blocks: torch.Tensor, hkv: int, topk: int, gen) -> torch.Tensor:
    """``[hkv, rows, topk]`` int32: per row and KV head up to ``topk - 1`` distinct random blocks before the row's
    own (``own_blocks[row]``), then the own one, -1 after them."""
    sel = torch.full((hkv, len(own_blocks), topk), -1, dtype=torch.int32)
    for r, own in enumerate(own_blocks.tolist()):
        for h in range(hkv):
            earlier = torch.randperm(own, generator=gen)[: topk - 1].tolist() if own else []
            sel[h, r, : len(earlier) + 1] = torch.tensor([*earlier, own], dtype=torch.int32)
    return sel


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
    sel = _selection(positions // BLOCK, hkv, topk, gen)
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


# SGLang 0.5.16's candidates: prefill 2, 4 or 8 warps x 2, 3 or 4 stages; decode 4 or 8 warps x 2, 3, 4 or 5 stages
CANDIDATES = {"prefill": [(w, s) for w in (2, 4, 8) for s in (2, 3, 4)],
              "decode": [(w, s) for w in (4, 8) for s in (2, 3, 4, 5)]}
ENV = {"prefill": "M3_SPARSE_PREFILL_CONFIG", "decode": "M3_SPARSE_DECODE_CONFIG"}


def _held(tuner) -> list:
    return [(c.num_warps, c.num_stages) for c in tuner.configs]


@pytest.fixture
def tuners():
    """SGLang's sparse prefill and decode autotuners, given back all their candidates afterwards."""
    found = {which: autotuner(which) for which in CANDIDATES}
    yield found
    for which, tuner in found.items():
        pin_config(which, None, tuner)
    pin_from_env.cache_clear()


@pytest.fixture
def prefill_tuner(tuners):
    return tuners["prefill"]


@pytest.mark.parametrize("which", CANDIDATES)
def test_a_config_is_held_to_one_candidate_and_given_back(tuners, which):
    tuner = tuners[which]
    assert sorted(_held(tuner)) == CANDIDATES[which]
    before = _held(tuner)
    tuner.cache[("poisoned-key",)] = tuner.configs[0]  # a pick made before the pin
    assert pin_config(which, "8,2", tuner) == (8, 2)
    assert _held(tuner) == [(8, 2)] and not tuner.cache
    assert pin_config(which, " 4, 3 ", tuner) == (4, 3)  # held again: chosen among all, not among one
    assert _held(tuner) == [(4, 3)]
    tuner.cache[("poisoned-key",)] = tuner.configs[0]
    assert pin_config(which, "", tuner) is None
    assert _held(tuner) == before and not tuner.cache
    # without a tuner given, the module's own lookup finds the same autotuner
    assert pin_config(which, "4,4") == (4, 4) and _held(tuner) == [(4, 4)]


@pytest.mark.parametrize("which, spec", [("prefill", s) for s in ["3,3", "4", "4,3,1", "four,3", "4;3", "2,5"]]
                         + [("decode", s) for s in ["2,2", "8", "4,6", " , "]])
def test_a_config_that_is_no_candidate_is_refused_naming_the_variable(tuners, which, spec):
    tuner = tuners[which]
    pin_config(which, "8,4", tuner)
    listed = ", ".join(f"{w},{s}" for w, s in CANDIDATES[which])
    with pytest.raises(ValueError, match=rf"{ENV[which]}='{re.escape(spec)}'.*{re.escape(listed)}$"):
        pin_config(which, spec, tuner)
    assert _held(tuner) == [(8, 4)]  # the hold before stands


def _from_env(monkeypatch, prefill, decode):
    for env, value in ((ENV["prefill"], prefill), (ENV["decode"], decode)):
        if value is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, value)
    pin_from_env.cache_clear()
    pin_from_env()


def test_the_environment_holds_each_kernel_and_unset_leaves_it_alone(tuners, monkeypatch, caplog):
    every = {which: _held(t) for which, t in tuners.items()}
    for prefill, decode in [(None, None), ("", ""), ("2,4", None), (None, "8,5"), ("8,3", "4,2")]:
        for which, tuner in tuners.items():
            pin_config(which, None, tuner)
        with caplog.at_level("INFO", logger="sglang_m3.sparse_attention"):
            caplog.clear()
            _from_env(monkeypatch, prefill, decode)
        for which, value in (("prefill", prefill), ("decode", decode)):
            want = [tuple(int(x) for x in value.split(","))] if value else every[which]
            assert _held(tuners[which]) == want, (which, value)
        logged = [r.getMessage() for r in caplog.records if "held to" in r.getMessage()]
        assert len(logged) == bool(prefill) + bool(decode)
        fixed_on_hopper = hasattr(importlib.import_module(sa.KERNELS["decode"][1]), "_gqa_share_sparse_decode_pinned")
        warned = [r for r in caplog.records if r.levelname == "WARNING" and "fixed config" in r.getMessage()]
        assert len(warned) == (bool(decode) and fixed_on_hopper)  # SGLang 0.5.23 on Hopper: the variable is told
        if prefill:  # the line lab/gpu/call_timings.py reads
            assert f"sparse prefill attention held to {prefill.replace(',', ' warps, ')} stages" in logged[0]


def test_a_bad_variable_fails_before_either_kernel_is_held(tuners, monkeypatch):
    for prefill, decode, bad in [("16,2", "4,3", "M3_SPARSE_PREFILL_CONFIG='16,2'"),
                                 ("4,3", "4,1", "M3_SPARSE_DECODE_CONFIG='4,1'")]:
        for which, tuner in tuners.items():
            pin_config(which, None, tuner)
        before = {which: _held(t) for which, t in tuners.items()}
        with pytest.raises(ValueError, match=re.escape(bad)):
            _from_env(monkeypatch, prefill, decode)
        assert {which: _held(t) for which, t in tuners.items()} == before


def test_unset_the_kernels_are_not_looked_up(monkeypatch):
    """A later SGLang whose kernels are not autotuned starts as before while neither variable is set."""
    monkeypatch.setattr(sa, "autotuner", lambda which: pytest.fail(f"{which} looked up with its variable unset"))
    _from_env(monkeypatch, None, "")
    pin_from_env.cache_clear()


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
    sel = _selection(positions // block, hkv, topk, gen)
    q = torch.randn(rows, hq, d, generator=gen).bfloat16()
    seq = torch.tensor(lens, dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    want = sparse_attention_ref(q, k_cache, v_cache, req_to_token, req_pool, seq, cu, positions, sel, block, scale)
    cuda = [t.cuda() for t in (q, k_cache, v_cache, req_to_token, req_pool, seq, seq - torch.tensor(new), cu)]
    for c in list(prefill_tuner.configs):
        pin_config("prefill", f"{c.num_warps},{c.num_stages}", prefill_tuner)
        got = sparse_attention_extend(*cuda, max(new), positions.cuda(), sel.cuda(), block, scale)
        torch.testing.assert_close(got.double().cpu(), want, rtol=0.0, atol=4 * 2.0**-9 * float(v_cache.abs().max()),
                                   msg=lambda m, c=c: f"{c.num_warps} warps, {c.num_stages} stages: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_decode_candidate_equals_the_reference_on_cuda(tuners):
    """SGLang's sparse decode kernel as the plugin calls it, held to each candidate in turn: requests of 1, 127, 128,
    129 and 3,000 tokens (one row each, at seq_len - 1), bf16 cache, block 128, up to 16 picked blocks; each
    candidate against the float64 oracle, and whether it gives the first candidate's bits (printed, not asserted:
    rounding may differ between candidates)."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    block, hq, hkv, d, topk = 128, 8, 4, 128, 16
    lens = [1, 127, 128, 129, 3000]
    batch, slots, width = len(lens), 16384, 3072
    k_cache = torch.randn(slots, hkv, d, generator=gen).bfloat16()
    v_cache = torch.randn(slots, hkv, d, generator=gen).bfloat16()
    req_to_token = torch.randperm(slots, generator=gen)[: batch * width].view(batch, width).int()
    req_pool = torch.randperm(batch, generator=gen)
    sel = _selection((torch.tensor(lens) - 1) // block, hkv, topk, gen)
    q = torch.randn(batch, hq, d, generator=gen).bfloat16()
    seq = torch.tensor(lens, dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    want = sparse_attention_ref(q, k_cache, v_cache, req_to_token, req_pool, seq, torch.arange(batch + 1), seq - 1,
                                sel, block, scale)
    cuda = [t.cuda() for t in (q, k_cache, v_cache, req_to_token, req_pool, seq, sel)]
    first, same = None, []
    for c in list(tuners["decode"].configs):
        pin_config("decode", f"{c.num_warps},{c.num_stages}", tuners["decode"])
        got = sparse_attention_decode(*cuda, block, scale)
        torch.testing.assert_close(got.double().cpu(), want, rtol=0.0, atol=4 * 2.0**-9 * float(v_cache.abs().max()),
                                   msg=lambda m, c=c: f"{c.num_warps} warps, {c.num_stages} stages: {m}")
        first = got if first is None else first
        same.append(f"{c.num_warps},{c.num_stages}: {'equal' if torch.equal(got, first) else 'differs'}")
    print("decode candidates against the first:", "; ".join(same))
