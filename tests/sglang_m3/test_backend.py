"""Backend checks that need no model runner: construction guards and the plan (metadata) half."""

from types import SimpleNamespace

import pytest
import torch

from m3_kernels.formats import PAGE_SIZE, IndexKFormat, ScaleRule
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang_m3.backend import MiniMaxM31SparseAttnBackend
from sglang_m3.config import IndexKSettings


@pytest.mark.parametrize("algorithm", ["EAGLE", "NGRAM"])
def test_speculative_decoding_is_refused_at_start_up(algorithm):
    runner = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm=algorithm))
    with pytest.raises(NotImplementedError, match=rf"speculative_algorithm='{algorithm}'.*--speculative-algorithm"):
        MiniMaxM31SparseAttnBackend(runner, IndexKSettings(IndexKFormat.MXFP4, ScaleRule.RCEIL, None))


def _plan_only_backend(req_to_token, in_graph_mode=False, num_idx_heads=2):
    """The backend's plan half (no runner): the attributes ``init_forward_metadata_*`` read."""
    backend = MiniMaxM31SparseAttnBackend.__new__(MiniMaxM31SparseAttnBackend)
    backend.device = req_to_token.device
    backend.req_to_token = req_to_token
    backend._block_starts = req_to_token[:, ::PAGE_SIZE]
    backend.max_blocks = backend._block_starts.shape[1]
    backend.num_idx_heads = num_idx_heads
    backend._graph_decode_meta = {}
    backend._in_graph_mode = in_graph_mode
    return backend


def _paged_req_to_token(num_reqs, blocks, gen):
    """Each request row holds whole pages in a random order: slot of token t = page * PAGE_SIZE + t % PAGE_SIZE."""
    pages = torch.randperm(num_reqs * blocks, generator=gen).reshape(num_reqs, blocks) + 1
    rows = pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)
    return rows.reshape(num_reqs, blocks * PAGE_SIZE).to(torch.int32), pages


def test_extend_plan_block_table_and_offsets(gen):
    req_to_token, pages = _paged_req_to_token(6, 4, gen)
    backend = _plan_only_backend(req_to_token)
    seq_lens = torch.tensor([1, 127, 128, 129, 300])
    prefix = torch.tensor([0, 0, 100, 128, 1])
    extend = seq_lens - prefix
    req = torch.tensor([5, 0, 3, 1, 2])
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, seq_lens=seq_lens, seq_lens_cpu=seq_lens,
                            extend_seq_lens=extend, extend_seq_lens_cpu=extend.tolist(), extend_prefix_lens=prefix,
                            req_pool_indices=req)
    backend.init_forward_metadata_out_graph(batch)
    meta = backend._extend_meta
    assert backend._decode_meta is None
    assert meta.max_block == 3 and meta.block_table.dtype == torch.int32
    assert meta.block_table.tolist() == pages[req, :3].tolist()
    assert meta.cu_seqlens_q.tolist() == [0, 1, 128, 156, 157, 456]
    assert meta.prefix_lens.tolist() == prefix.tolist() and meta.seq_lens.tolist() == seq_lens.tolist()
    assert (meta.max_seqlen_q, meta.num_tokens) == (299, 456)
    # The scorer's work map, made once per batch from host lengths: every new-token row of every
    # request covered by exactly one tile of that request.
    plan = meta.plan
    assert (plan.H, plan.batch, plan.num_tokens) == (2, 5, 456) and plan.tiles.device == req_to_token.device
    covered = [(b, r) for b, r0 in plan.tiles.tolist() for r in range(r0, min(r0 + plan.rows, 456))
               if r < meta.cu_seqlens_q[b + 1]]
    assert sorted(covered) == [(b, r) for b in range(5) for r in range(int(meta.cu_seqlens_q[b]),
                                                                        int(meta.cu_seqlens_q[b + 1]))]


def test_decode_plan_reuses_captured_buffers_and_refreshes_them_in_place(gen):
    req_to_token, pages = _paged_req_to_token(4, 3, gen)
    backend = _plan_only_backend(req_to_token, in_graph_mode=True)

    def batch(seq_lens, req):
        return SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor(seq_lens),
                               req_pool_indices=torch.tensor(req))

    backend.init_forward_metadata_out_graph(batch([1, 1], [0, 0]), in_capture=True)
    captured = backend._decode_meta
    replay = batch([128, 129], [3, 1])
    backend.init_forward_metadata_out_graph(replay)
    assert backend._decode_meta is captured and backend._extend_meta is None
    backend.init_forward_metadata_in_graph(replay)
    assert captured.block_table.tolist() == pages[[3, 1]].tolist()
    assert captured.seq_lens.tolist() == [128, 129] and captured.n_visible.tolist() == [1, 2]
    assert captured.scores.shape == (2, 2, 3)
    backend.init_forward_metadata_out_graph(batch([5, 6, 7], [0, 1, 2]))  # not captured: eager buffers
    assert backend._decode_meta is not captured and 3 not in backend._graph_decode_meta
