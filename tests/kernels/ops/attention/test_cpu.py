"""The CPU serving attention (``cpu.py``) against the float64 brute force and the reference (``naive.py``), on
fresh random caches, with every path of the extend kernel forced in turn."""

import math

import pytest
import torch

import m3_kernels.ops.attention.cpu as cpu
from m3_kernels.ops.attention.cpu import (dense_attention_decode_cpu, dense_attention_extend_cpu,
                                         sparse_attention_decode_cpu, sparse_attention_extend_cpu)
from m3_kernels.ops.attention.naive import sparse_attention_ref

from .test_naive import BLOCK, brute_force

BF16_ROUNDINGS = 4  # bf16 roundings on the way (P before P @ V, each partial result, its merge weight, the output)


def tolerance(dtype, v_cache) -> dict:
    """fp32: the flash kernel's fp32 sums (well under 1e-5 at these sizes). bf16: each of ``BF16_ROUNDINGS``
    roundings moves a result by at most 2^-9 (bf16's unit roundoff) of the largest value it mixes, so the error is
    at most ``BF16_ROUNDINGS * 2^-9 * max|V|`` (logits are fp32 sums of exact products: no error worth counting)."""
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=0.0, atol=BF16_ROUNDINGS * 2.0**-9 * float(v_cache.abs().max()))


def msa_lists(gen, hkv, positions, topk, block_size, holes=False):
    """int32 ``[Hkv, rows, topk]`` as MSA picks them: every visible block while there are at most ``topk``, else
    the own block and ``topk - 1`` distinct earlier ones at random. ``holes``: also fewer earlier blocks (-1
    padding), a block twice, and ids past the row."""
    rows = positions.shape[0]
    sel = torch.full((hkv, rows, topk), -1, dtype=torch.int32)
    for r in range(rows):
        own = int(positions[r]) // block_size
        for h in range(hkv):
            if own + 1 <= topk:
                picked = list(range(own + 1))
            else:
                picked = [int(b) for b in torch.randperm(own, generator=gen)[: topk - 1]] + [own]
            if holes and own + 1 > topk and int(torch.randint(0, 3, (1,), generator=gen)) == 0:
                kind = int(torch.randint(0, 3, (1,), generator=gen))
                picked[0] = [-1, picked[1], own + 1 + int(torch.randint(0, 3, (1,), generator=gen))][kind]
            picked += [-1] * (topk - len(picked))
            sel[h, r] = torch.tensor(picked, dtype=torch.int32)[torch.randperm(topk, generator=gen)]
    return sel


class PathSpy:
    """Counts the rows each extend path attends (dense run, prefix tile, union tile, split)."""

    def __init__(self, monkeypatch):
        self.rows = {"dense": 0, "prefix": 0, "union": 0, "split": 0}
        for name in self.rows:
            fn = getattr(cpu, f"_attend_{name}")
            monkeypatch.setattr(cpu, f"_attend_{name}", self._wrap(name, fn))

    def _wrap(self, name, fn):
        def run(q, *args, **kwargs):
            self.rows[name] += q.shape[0]
            return fn(q, *args, **kwargs)
        return run


def batch(gen, dtype, lens, new, hq=8, hkv=2, d=16, topk=3, block_size=BLOCK, holes=False):
    """Random cache and rows: request ``b`` holds ``lens[b]`` tokens, the last ``new[b]`` of them new rows."""
    width = max(lens)
    slots = 4 * len(lens) * width
    k_cache = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    req_to_token = torch.randperm(slots, generator=gen)[: (len(lens) + 1) * width].view(len(lens) + 1, width)
    req_pool_indices = torch.randperm(len(lens) + 1, generator=gen)[: len(lens)]
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, new)])
    cu_rows = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()])
    sel = msa_lists(gen, hkv, positions, topk, block_size, holes)
    q = torch.randn(positions.shape[0], hq, d, generator=gen).to(dtype)
    return (q, k_cache, v_cache, req_to_token, req_pool_indices, torch.tensor(lens), cu_rows, positions, sel,
            block_size, 1 / math.sqrt(d))


# A prompt from position 0 (its first rows pick every block: the dense run), a cached prefix whose new rows start
# inside a block, one row, an empty request, an extension whose rows still pick every block (dense run through a
# mask), and a long prompt whose last block is partial.
LENS, NEW = [61, 37, 9, 5, 10, 45], [61, 14, 1, 0, 3, 45]
MODES = {  # monkeypatched limits -> the paths the sparse rows take
    "prefix": dict(_PREFIX_MAX_BLOCKS=10**6, _PREFIX_MIN_FRACTION=0.0),
    "union": dict(_UNION_MAX_BLOCKS=10**6, _PREFIX_MAX_BLOCKS=0),
    "split": dict(_UNION_MAX_BLOCKS=0, _PREFIX_MAX_BLOCKS=0),
    "mixed": dict(_UNION_MAX_BLOCKS=8, _PREFIX_MAX_BLOCKS=6, _PREFIX_MIN_FRACTION=0.0),
    "split-chunks": dict(_UNION_MAX_BLOCKS=0, _PREFIX_MAX_BLOCKS=0, _PAIR_ELEMS=7 * 3 * 4 * 16),  # 7-row chunks
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("holes", [False, True], ids=["msa-lists", "holes"])
def test_extend_matches_oracle(gen, dtype, mode, holes, monkeypatch):
    for name, value in MODES[mode].items():
        monkeypatch.setattr(cpu, name, value)
    spy = PathSpy(monkeypatch)
    args = batch(gen, dtype, LENS, NEW, holes=holes)
    q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, cu_rows, positions, sel, block_size, sm_scale = args
    got = sparse_attention_extend_cpu(*args)
    assert got.dtype == dtype and got.shape == q.shape
    want = sparse_attention_ref(*args)
    torch.testing.assert_close(got.double(), want, **tolerance(dtype, v_cache))
    r = int(cu_rows[5]) + 40  # one row of the long prompt against the brute force as well
    slots = req_to_token[req_pool_indices[5], : LENS[5]]
    torch.testing.assert_close(want[r], brute_force(q[r], k_cache, v_cache, slots, int(positions[r]), sel[:, r],
                                                    sm_scale), rtol=1e-12, atol=1e-12)
    sparse_rows = q.shape[0] - spy.rows["dense"]
    assert spy.rows["dense"] >= 3 * BLOCK + 3  # request 0's first three blocks and request 4's rows
    if mode in ("prefix", "union"):
        assert spy.rows == {"dense": spy.rows["dense"], "prefix": 0, "union": 0, "split": 0, mode: sparse_rows}
    elif mode.startswith("split"):
        assert spy.rows == {"dense": spy.rows["dense"], "prefix": 0, "union": 0, "split": sparse_rows}
    else:
        assert spy.rows["prefix"] > 0 and spy.rows["union"] > 0 and spy.rows["split"] > 0
        assert spy.rows["prefix"] + spy.rows["union"] + spy.rows["split"] == sparse_rows


@pytest.mark.parametrize("mode", ["prefix", "union", "split"])
def test_extend_at_block_128_edges(gen, mode, monkeypatch):
    """M3's block and head geometry (block 128, 16 query heads over 4 KV heads x 128, bf16), prompts of 1, 127, 128,
    129 and 300 tokens and an extension of a 128-token prefix to 300 (its last page partial)."""
    for name, value in MODES[mode].items():
        monkeypatch.setattr(cpu, name, value)
    args = batch(gen, torch.bfloat16, [1, 127, 128, 129, 300, 300], [1, 127, 128, 129, 300, 172], hq=16, hkv=4,
                 d=128, topk=2, block_size=128)
    got = sparse_attention_extend_cpu(*args)
    torch.testing.assert_close(got.double(), sparse_attention_ref(*args), **tolerance(torch.bfloat16, args[2]))


def test_extend_without_rows_and_without_visible_tokens(gen, monkeypatch):
    """No rows at all; rows whose lists hold nothing visible get zeros, on the prefix, union and split paths."""
    args = list(batch(gen, torch.float32, [9], [0]))
    assert sparse_attention_extend_cpu(*args).shape == (0, 8, 16)
    args = list(batch(gen, torch.float32, [30], [6]))
    args[8] = torch.full_like(args[8], -1)
    args[8][0, :3, 0] = 7  # KV head 0 of the first three rows: their own block; the rest: nothing
    for mode in ("split", "union", "prefix"):
        for name, value in MODES[mode].items():
            monkeypatch.setattr(cpu, name, value)
        got = sparse_attention_extend_cpu(*args)
        want = sparse_attention_ref(*args)
        assert torch.equal(want[3:], torch.zeros_like(want[3:]))
        assert torch.equal(want[:3, 4:], torch.zeros_like(want[:3, 4:]))
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_call_and_its_log_sum_exp(gen, dtype, causal):
    """The private torch op the extend kernel merges by: output and natural-log log-sum-exp of the scaled logits."""
    q = torch.randn(2, 3, 37, 16, generator=gen).to(dtype)
    k = torch.randn(2, 3, 37, 16, generator=gen).to(dtype)
    v = torch.randn(2, 3, 37, 16, generator=gen).to(dtype)
    out, lse = cpu._attend(q, k, v, 0.3, causal)
    logits = (q.double() @ k.double().transpose(-1, -2)) * 0.3
    if causal:
        logits = logits.masked_fill(~torch.ones(37, 37, dtype=torch.bool).tril(), float("-inf"))
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, 3, 37)
    # bf16: the kernel's vectorised exp and log (seen: 6e-5); an lse error e scales a partial result's merge weight
    # by exp(e), far below the 2^-9 rounding of that weight already counted in BF16_ROUNDINGS.
    lse_tol = 1e-5 if dtype == torch.float32 else 2.0**-12
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits, -1), rtol=0.0, atol=lse_tol)
    torch.testing.assert_close(out.double(), torch.softmax(logits, -1) @ v.double(), **tolerance(dtype, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_at_block_edges(gen, dtype):
    """One row per request at position seq_len - 1, for seq_len 1, BLOCK - 1, BLOCK, BLOCK + 1 and longer ones whose
    lists skip blocks."""
    hq, hkv, d, topk = 4, 2, 8, 2
    lens = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 2, 5 * BLOCK]
    width = max(lens)
    k_cache = torch.randn(160, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(160, hkv, d, generator=gen).to(dtype)
    req_to_token = torch.randperm(160, generator=gen)[: len(lens) * width].reshape(len(lens), width)
    req_pool_indices = torch.randperm(len(lens), generator=gen)
    seq_lens = torch.tensor(lens)
    sel = msa_lists(gen, hkv, seq_lens - 1, topk, BLOCK, holes=True)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    out = sparse_attention_decode_cpu(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, sel, BLOCK, 0.35)
    for b, length in enumerate(lens):
        slots = req_to_token[req_pool_indices[b], :length]
        want = brute_force(q[b], k_cache, v_cache, slots, length - 1, sel[:, b], 0.35)
        torch.testing.assert_close(out[b].double(), want, **tolerance(dtype, v_cache))


# (cached prefix, new rows) per request: fresh prompts (causal call), one row after a prefix, a prefix ending at
# a block edge, rows folded (<= 64) and not (> 64) after a prefix, and a request with no new rows.
EXTENDS = [(0, 1), (0, BLOCK + 1), (BLOCK - 1, 1), (BLOCK, BLOCK - 1), (BLOCK + 1, 65), (3 * BLOCK + 5, 64), (7, 0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4), (16, 1)])
def test_dense_extend_over_whole_contexts(gen, dtype, hq, hkv):
    """The dense layers' extend: each new row over every token up to its position, the requests' rows packed in
    turn, against the float64 brute force with every block listed; rows folded or not, an empty batch."""
    d = 16
    width = max(p + n for p, n in EXTENDS)
    slots = 2 * len(EXTENDS) * width
    k_cache = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    req_to_token = torch.randperm(slots, generator=gen)[: (len(EXTENDS) + 1) * width].view(-1, width).int()
    req_pool_indices = torch.randperm(len(EXTENDS) + 1, generator=gen)[: len(EXTENDS)]
    prefix_lens = torch.tensor([p for p, _ in EXTENDS])
    extend_lens = torch.tensor([n for _, n in EXTENDS])
    q = torch.randn(int(extend_lens.sum()), hq, d, generator=gen).to(dtype)
    out = dense_attention_extend_cpu(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                                     0.3)
    assert out.shape == q.shape and out.dtype == dtype
    every_block = torch.arange(width // BLOCK + 1)[None].expand(hkv, -1)
    r = 0
    for b, (prefix, n) in enumerate(EXTENDS):
        token_slots = req_to_token[req_pool_indices[b], : prefix + n].long()
        for i in range(n):
            want = brute_force(q[r + i], k_cache, v_cache, token_slots, prefix + i, every_block, 0.3)
            torch.testing.assert_close(out[r + i].double(), want, **tolerance(dtype, v_cache))
        r += n
    empty = dense_attention_extend_cpu(q[:0], k_cache, v_cache, req_to_token, req_pool_indices[:0], prefix_lens[:0],
                                       extend_lens[:0], 0.3)
    assert empty.shape == (0, hq, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4), (16, 1)])
def test_dense_decode_over_whole_contexts(gen, dtype, hq, hkv):
    """The dense layers' decode: every token up to the row's position, query head h on KV head h // (Hq / Hkv),
    requests of lengths 1, 127, 128, 129 and longer in one call (padding masked), against the float64 brute force
    with every block listed; an empty batch returns an empty result."""
    d, block = 16, 128
    lens = [1, block - 1, block, block + 1, 3 * block + 5]
    width = max(lens)
    slots = 2 * len(lens) * width
    k_cache = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    req_to_token = torch.randperm(slots, generator=gen)[: (len(lens) + 1) * width].view(len(lens) + 1, width).int()
    req_pool_indices = torch.randperm(len(lens) + 1, generator=gen)[: len(lens)]
    seq_lens = torch.tensor(lens)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    out = dense_attention_decode_cpu(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, 0.3)
    assert out.shape == q.shape and out.dtype == dtype
    every_block = torch.arange(width // block + 1)[None].expand(hkv, -1)
    for b, length in enumerate(lens):
        want = brute_force(q[b], k_cache, v_cache, req_to_token[req_pool_indices[b], :length].long(), length - 1,
                           every_block, 0.3, block_size=block)
        torch.testing.assert_close(out[b].double(), want, **tolerance(dtype, v_cache))
    empty = dense_attention_decode_cpu(q[:0], k_cache, v_cache, req_to_token, req_pool_indices[:0], seq_lens[:0], 0.3)
    assert empty.shape == (0, hq, d)
