"""The dense control's premise: with ``sparse_topk_blocks`` at least the blocks a row sees, the
serving path attends every visible block, i.e. exact causal attention.

Checked on the pieces the server runs: the block selector (torch reference; the Triton selector
under the interpreter on CPU and compiled on a GPU) and the attention over the selected blocks
(``m3_kernels.ops.attention``'s CPU serving kernel and its reference on CPU; SGLang's Triton sparse
prefill/decode kernels on a GPU),
against a float64 causal-attention oracle.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from accuracy.run import dense_max_tokens, dense_topk_blocks  # noqa: E402
from m3_kernels.formats import PAGE_SIZE  # noqa: E402
from m3_kernels.ops.select import select_blocks, visible_blocks  # noqa: E402
from m3_kernels.ops.select.naive import select_blocks_ref  # noqa: E402
from m3_kernels.testing import triton_module  # noqa: E402
from m3_kernels.ops.attention import sparse_attention_extend_cpu  # noqa: E402
from m3_kernels.ops.attention.naive import sparse_attention_ref  # noqa: E402

HEAD_DIM = 128


def _triton_select():
    return triton_module("m3_kernels.ops.select.triton", "_select_kernel").select_blocks_triton


def _dense_rows(n_visible, topk):
    slot = torch.arange(topk)
    return torch.where(slot[None] < n_visible[:, None].long(), slot[None], -1).to(torch.int32)


def _scores(gen, H, rows, nb):
    s = torch.randint(-4, 4, (H, rows, nb), generator=gen).float()
    s[torch.rand(s.shape, generator=gen) < 0.05] = float("nan")
    return s


@pytest.mark.parametrize("max_len", [2560, 32768])
def test_selector_returns_every_visible_block(gen, max_len):
    topk = dense_topk_blocks(dense_max_tokens([max_len]))
    nb = -(-max_len // PAGE_SIZE)
    positions = torch.tensor([0, 1, 127, 128, 129, PAGE_SIZE * 16, PAGE_SIZE * 17 + 5, max_len - 1])
    n_vis = visible_blocks(positions, PAGE_SIZE)
    scores = _scores(gen, 4, len(positions), nb)
    want = _dense_rows(n_vis, topk).expand(4, -1, -1)
    assert torch.equal(select_blocks_ref(scores, n_vis, topk), want)
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert torch.equal(_triton_select()(scores, n_vis.to(torch.int32), topk, 1, 0), want)


def test_triton_selector_wide_topk_sparse_rows_match_reference(gen):
    """Rows that see more blocks than a topk > 16 still follow the reference (interpreter)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter case (CPU-only machines); the GPU case is test_triton_selector_wide_topk_on_gpu")
    topk, nb = 24, 40
    n_vis = torch.tensor([0, 1, topk - 1, topk, topk + 1, nb - 1, nb], dtype=torch.int32)
    scores = _scores(gen, 2, len(n_vis), nb)
    assert torch.equal(_triton_select()(scores, n_vis, topk, 1, 0), select_blocks_ref(scores, n_vis, topk))


def _causal_oracle(q, k, v, positions, sm_scale):
    """float64 ``[rows, Hq, D]``: row ``r`` attends keys ``0..positions[r]`` of ``k, v [L, Hkv, D]``."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    logits = torch.einsum("rhd,lhd->hrl", q.double(), k) * sm_scale
    mask = torch.arange(k.shape[0])[None, :] <= positions[:, None]
    p = torch.softmax(logits.masked_fill(~mask[None], float("-inf")), dim=-1)
    return torch.einsum("hrl,lhd->rhd", p, v)


def _assert_close(name, want, got, ratio):
    err = (got.double() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
    assert err <= ratio, f"{name}: relative RMS error {err:.3g} > {ratio}"


def _paged_request(gen, seq_len, hkv, slots, dtype):
    """One request's K/V scattered over a shuffled slot range: ``(k, v, k_cache, v_cache, req_to_token)``."""
    k = torch.randn(seq_len, hkv, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(seq_len, hkv, HEAD_DIM, generator=gen).to(dtype)
    perm = torch.randperm(slots, generator=gen)[:seq_len]
    k_cache = torch.full((slots, hkv, HEAD_DIM), float("nan"), dtype=dtype)
    v_cache = torch.full((slots, hkv, HEAD_DIM), float("nan"), dtype=dtype)
    k_cache[perm], v_cache[perm] = k, v
    req_to_token = torch.zeros(2, slots, dtype=torch.int32)
    req_to_token[1, :seq_len] = perm.to(torch.int32)
    return k, v, k_cache, v_cache, req_to_token


@pytest.mark.parametrize("seq_len,prefix", [(129, 0), (2560 - 37, 1800)])
def test_torch_attention_over_every_block_is_causal_attention(gen, seq_len, prefix):
    hq, hkv = 8, 2
    topk = dense_topk_blocks(dense_max_tokens([seq_len]))
    k, v, k_cache, v_cache, req_to_token = _paged_request(gen, seq_len, hkv, seq_len + 50, torch.float32)
    positions = torch.arange(prefix, seq_len)
    q = torch.randn(len(positions), hq, HEAD_DIM, generator=gen)
    topk_idx = _dense_rows(visible_blocks(positions, PAGE_SIZE), topk).expand(hkv, -1, -1).contiguous()
    args = (q, k_cache, v_cache, req_to_token, torch.tensor([1]), torch.tensor([seq_len]),
            torch.tensor([0, len(positions)]), positions, topk_idx, PAGE_SIZE, HEAD_DIM**-0.5)
    want = _causal_oracle(q, k, v, positions, HEAD_DIM**-0.5)
    _assert_close("o", want, sparse_attention_extend_cpu(*args), 1e-5)  # the CPU serving kernel
    _assert_close("o", want, sparse_attention_ref(*args, dtype=torch.float32), 1e-5)


@pytest.mark.gpu
def test_triton_selector_wide_topk_on_gpu(gen):
    topk = dense_topk_blocks(dense_max_tokens([32768]))  # 257
    for nb in (topk, 300):  # all rows dense; then rows past topk take the ranked branch
        n_vis = torch.tensor([0, 1, 16, 17, topk - 1, topk, min(nb, topk + 1), nb], dtype=torch.int32)
        scores = _scores(gen, 4, len(n_vis), nb)
        got = select_blocks(scores.cuda(), n_vis.cuda(), topk, 1, 0).cpu()
        assert torch.equal(got, select_blocks_ref(scores, n_vis, topk))


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [2560 - 37, 32768 - 24])
def test_sglang_sparse_kernels_over_every_block_are_causal_attention(gen, seq_len):
    from sglang.kernels.ops.attention.minimax_sparse.decode.topk_sparse import flash_decode_with_gqa_share_sparse
    from sglang.kernels.ops.attention.minimax_sparse.prefill.topk_sparse import flash_prefill_with_gqa_share_sparse

    hq, hkv, dev = 16, 4, "cuda"
    sm_scale = HEAD_DIM**-0.5
    topk = dense_topk_blocks(dense_max_tokens([32768]))
    k, v, k_cache, v_cache, req_to_token = _paged_request(gen, seq_len, hkv, seq_len + 300, torch.bfloat16)
    k_cache, v_cache, req_to_token = k_cache.to(dev), v_cache.to(dev), req_to_token.to(dev)
    slot_ids = torch.tensor([1], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=dev)

    # Prefill of the last 700 tokens after a cached prefix (rows see 1..all blocks of the request).
    prefix = seq_len - 700
    positions = torch.arange(prefix, seq_len)
    q = torch.randn(len(positions), hq, HEAD_DIM, generator=gen).to(torch.bfloat16)
    topk_idx = _dense_rows(visible_blocks(positions, PAGE_SIZE), topk).expand(hkv, -1, -1).contiguous()
    got = flash_prefill_with_gqa_share_sparse(
        q=q.to(dev), k_cache=k_cache, v_cache=v_cache, sink=None, req_to_token=req_to_token, slot_ids=slot_ids,
        topk_idx=topk_idx.to(dev), block_size_q=1, block_size_k=PAGE_SIZE,
        cu_seqlens=torch.tensor([0, len(positions)], dtype=torch.int32, device=dev), seq_lens=seq_lens,
        prefix_lens=torch.tensor([prefix], dtype=torch.int32, device=dev), max_seqlen_q=len(positions),
        sm_scale=sm_scale)
    _assert_close("prefill o", _causal_oracle(q, k, v, positions, sm_scale), got.cpu(), 2e-2)

    # Decode: the last token's row.
    qd = torch.randn(1, hq, HEAD_DIM, generator=gen).to(torch.bfloat16)
    last = torch.tensor([seq_len - 1])
    idx = _dense_rows(visible_blocks(last, PAGE_SIZE), topk).expand(hkv, -1, -1).contiguous()
    got = flash_decode_with_gqa_share_sparse(
        q=qd.to(dev), sink=None, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, seq_lens=seq_lens,
        slot_ids=slot_ids, block_size=PAGE_SIZE, topk_idx=idx.to(dev), sm_scale=sm_scale)
    _assert_close("decode o", _causal_oracle(qd, k, v, last, sm_scale), got.cpu(), 2e-2)
