"""Backend checks that need no model runner: construction guards and the plan (metadata) half."""

import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from m3_kernels.formats import PAGE_SIZE, IndexKCache, IndexKFormat, ScaleRule
from sglang.srt.layers.attention.minimax_sparse_backend import MiniMaxSparseAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang_m3.backend import MiniMaxM31SparseAttnBackend
from sglang_m3.compat import RESOLUTION_PIPELINE, at_least
from sglang_m3.config import IndexKSettings
from sglang_m3.pool import IndexKPool, MiniMaxM31SparseKVPool


@pytest.mark.parametrize("algorithm", ["EAGLE", "NGRAM"])
def test_speculative_decoding_is_refused_at_start_up(algorithm):
    runner = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm=algorithm))
    with pytest.raises(NotImplementedError, match=rf"speculative_algorithm='{algorithm}'.*--speculative-algorithm"):
        MiniMaxM31SparseAttnBackend(runner, IndexKSettings(IndexKFormat.MXFP4, ScaleRule.RCEIL, None))


@pytest.mark.parametrize("topk,local,init", [(16, 17, 0), (16, 0, 1), (16, 12, 8), (16, 1, -1)])
def test_selection_parameters_that_break_the_rule_fail_at_start_up(monkeypatch, topk, local, init):
    def sglang_init(self, runner):  # what SGLang's backend reads from sparse_attention_config
        self.block_size_k, self.score_type = PAGE_SIZE, "max"
        self.topk_blocks, self.local_blocks, self.init_blocks = topk, local, init

    monkeypatch.setattr(MiniMaxSparseAttnBackend, "__init__", sglang_init)
    runner = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm=None))
    with pytest.raises(ValueError, match=rf"sparse_topk_blocks.*break the block selection's rule.*"
                                         rf"init_blocks={init}, local_blocks={local}, topk={topk}"):
        MiniMaxM31SparseAttnBackend(runner, IndexKSettings(IndexKFormat.MXFP4, ScaleRule.RCEIL, None))


@pytest.mark.parametrize("scorer,device_type,cuda_graph,refused", [
    ("torch", "cuda", True, True),
    ("torch", "cuda", False, False),  # eager decode: the reference scorer is allowed
    ("torch", "cpu", True, False),
    ("cuda", "cuda", True, False),
    ("triton", "cuda", True, False),
])
def test_a_decode_scorer_that_cannot_be_captured_fails_at_start_up(scorer, device_type, cuda_graph, refused):
    from sglang_m3.backend import check_decode_scorer

    if refused:
        with pytest.raises(ValueError, match=r"M3_SCORE_BACKEND=torch.*--disable-cuda-graph"):
            check_decode_scorer(scorer, device_type, cuda_graph)
    else:
        check_decode_scorer(scorer, device_type, cuda_graph)


def _plan_only_backend(req_to_token, max_bs=None, num_idx_heads=2, fmt="mxfp4"):
    """The backend's plan half (no runner): the attributes ``init_forward_metadata_*`` read (a pool of one
    ``IndexKCache``); with ``max_bs``, in CUDA-graph mode as the decode graph runner leaves it
    (``init_cuda_graph_state``)."""
    backend = MiniMaxM31SparseAttnBackend.__new__(MiniMaxM31SparseAttnBackend)
    backend.device = req_to_token.device
    backend.req_to_token = req_to_token
    backend._block_starts = req_to_token[:, ::PAGE_SIZE]
    backend.max_blocks = backend._block_starts.shape[1]
    backend.num_idx_heads = num_idx_heads
    backend.idx_sm_scale = 128**-0.5
    backend.topk_blocks, backend.local_blocks, backend.init_blocks, backend.recorder = 16, 1, 0, None
    pages = int(req_to_token.max()) // PAGE_SIZE + 1
    index_k_pool = SimpleNamespace(caches=[IndexKCache.new(pages, fmt, req_to_token.device)])
    index_k_pool.plan_write = partial(IndexKPool.plan_write, index_k_pool)
    backend.kv_pool = SimpleNamespace(index_k_pool=index_k_pool)
    backend.kv_pool.plan_index_k_write = partial(MiniMaxM31SparseKVPool.plan_index_k_write, backend.kv_pool)
    backend._graph_decode_buffers = None
    backend._graph_decode_plans = {}
    backend._in_graph_mode = False
    if max_bs is not None:
        backend.init_cuda_graph_state(max_bs, max_bs)
    return backend


def _paged_req_to_token(num_reqs, blocks, gen):
    """Each request row holds whole pages in a random order: slot of token t = page * PAGE_SIZE + t % PAGE_SIZE."""
    pages = torch.randperm(num_reqs * blocks, generator=gen).reshape(num_reqs, blocks) + 1
    rows = pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)
    return rows.reshape(num_reqs, blocks * PAGE_SIZE).to(torch.int32), pages


def test_extend_plan_block_table_and_offsets(gen, monkeypatch):
    monkeypatch.setenv("M3_SCORE_BACKEND", "triton")  # the Triton work map, planned on the CPU
    req_to_token, pages = _paged_req_to_token(6, 4, gen)
    backend = _plan_only_backend(req_to_token)
    seq_lens = torch.tensor([1, 127, 128, 129, 300])
    prefix = torch.tensor([0, 0, 100, 128, 1])
    extend = seq_lens - prefix
    req = torch.tensor([5, 0, 3, 1, 2])
    batch = _extend_batch(req_to_token, req.tolist(), prefix.tolist(), extend.tolist())
    backend.init_forward_metadata_out_graph(batch)
    meta = backend._extend_meta
    # The selector's and the writer's plans, made once here for every layer: each new token's visible blocks
    # over [H, 456 rows, 3 blocks] of scores; the batch's slots.
    assert meta.select.n_visible.tolist() == (batch.positions // PAGE_SIZE + 1).tolist()
    assert (meta.select.H, meta.select.rows, meta.select.nb, meta.select.topk) == (2, 456, 3, 16)
    assert backend._write_plan.loc is batch.out_cache_loc
    assert backend._decode_meta is None
    assert meta.max_block == 3 and meta.block_table.dtype == torch.int32
    assert meta.block_table.tolist() == pages[req, :3].tolist()
    assert meta.cu_seqlens_q.tolist() == [0, 1, 128, 156, 157, 456]
    assert meta.prefix_lens.tolist() == prefix.tolist() and meta.seq_lens.tolist() == seq_lens.tolist()
    assert (meta.max_seqlen_q, meta.num_tokens) == (299, 456)
    # The scorer's work map, made once per batch from host lengths: every new-token row of every
    # request covered by exactly one tile of that request.
    plan = meta.plan
    assert plan.backend == "triton" and plan.block_table is meta.block_table and plan.max_block == 3
    tiles, rows_per_tile = plan.work
    assert (plan.H, plan.batch, plan.rows) == (2, 5, 456) and tiles.device == req_to_token.device
    covered = [(b, r) for b, r0 in tiles.tolist() for r in range(r0, min(r0 + rows_per_tile, 456))
               if r < meta.cu_seqlens_q[b + 1]]
    assert sorted(covered) == [(b, r) for b in range(5) for r in range(int(meta.cu_seqlens_q[b]),
                                                                        int(meta.cu_seqlens_q[b + 1]))]


def _decode_batch(seq_lens, req):
    return SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor(seq_lens),
                           req_pool_indices=torch.tensor(req), out_cache_loc=torch.zeros(len(req), dtype=torch.int64))


def test_decode_plan_reuses_captured_buffers_and_refreshes_them_in_place(gen):
    req_to_token, pages = _paged_req_to_token(4, 3, gen)
    backend = _plan_only_backend(req_to_token, max_bs=2)

    backend.init_forward_metadata_out_graph(_decode_batch([1, 1], [0, 0]), in_capture=True)
    captured = backend._decode_meta
    replay = _decode_batch([128, 129], [3, 1])
    backend.init_forward_metadata_out_graph(replay)
    meta = backend._decode_meta
    assert backend._extend_meta is None
    for name in ("block_table", "seq_lens", "n_visible", "scores"):  # the graph's addresses, same shapes
        a, b = getattr(meta, name), getattr(captured, name)
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
    assert meta.plan is captured.plan and meta.plan.out is captured.scores  # planned once, at capture
    assert meta.select is captured.select and meta.select.n_visible is captured.n_visible
    assert backend._write_plan.loc is replay.out_cache_loc  # the writer's plan: per batch, over its slots
    backend.init_forward_metadata_in_graph(replay)
    assert captured.block_table.tolist() == pages[[3, 1]].tolist()
    assert captured.seq_lens.tolist() == [128, 129] and captured.n_visible.tolist() == [1, 2]
    assert captured.scores.shape == (2, 2, 3)
    backend.init_forward_metadata_out_graph(_decode_batch([5, 6, 7], [0, 1, 2]))  # past max_bs: fresh buffers
    fresh = backend._decode_meta
    assert fresh.scores.shape == (2, 3, 3) and fresh.block_table.data_ptr() != captured.block_table.data_ptr()


def _meta_bytes(meta):
    return sum(getattr(meta, f).numel() * getattr(meta, f).element_size()
               for f in ("block_table", "seq_lens", "n_visible", "scores"))


def test_captured_batch_sizes_share_one_set_of_decode_buffers(gen):
    """Decode buffer memory follows the largest captured batch size, not the sum over sizes; each
    size sees contiguous buffers of exactly its shape (scores a leading [H, bs, nb] block, not a slice)."""
    req_to_token, _ = _paged_req_to_token(8, 3, gen)
    H, nb, max_bs = 2, 3, 8
    backend = _plan_only_backend(req_to_token, max_bs=max_bs, num_idx_heads=H)
    shared = backend._graph_decode_buffers
    assert _meta_bytes(shared) == max_bs * nb * 4 + max_bs * 4 + max_bs * 8 + H * max_bs * nb * 4
    views = {}
    for bs in (1, 4, max_bs):  # capture order of SGLang: largest first, but any order shares
        backend.init_forward_metadata_out_graph(_decode_batch([1] * bs, [0] * bs), in_capture=True)
        views[bs] = meta = backend._decode_meta
        assert meta.block_table.shape == (bs, nb) and meta.seq_lens.shape == (bs,) and meta.n_visible.shape == (bs,)
        assert meta.scores.shape == (H, bs, nb) and meta.scores.dtype == torch.float32
        for name in ("block_table", "seq_lens", "n_visible", "scores"):
            view = getattr(meta, name)
            assert view.is_contiguous(), name
            assert view.data_ptr() == getattr(shared, name).data_ptr(), name
            assert view.untyped_storage().data_ptr() == getattr(shared, name).untyped_storage().data_ptr(), name
    assert views[4].block_table.dtype == torch.int32 and views[4].n_visible.dtype == torch.int64
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for meta in views.values()
                for t in (meta.block_table, meta.seq_lens, meta.n_visible, meta.scores)}
    assert sum(nbytes for _, nbytes in storages) == _meta_bytes(shared)  # one max_bs set for all sizes
    # The scorer writes a size's scores through its view: the leading H * bs * nb floats of the shared storage.
    views[4].scores.copy_(torch.arange(H * 4 * nb, dtype=torch.float32).view(H, 4, nb))
    assert shared.scores.view(-1)[: H * 4 * nb].tolist() == list(range(H * 4 * nb))
    backend.init_cuda_graph_state(4, 4)  # a smaller re-init keeps the set the captured graphs read
    assert backend._graph_decode_buffers is shared
    eager = _plan_only_backend(req_to_token)  # not in graph mode: fresh buffers per batch
    eager.init_forward_metadata_out_graph(_decode_batch([1, 1], [0, 0]))
    first = eager._decode_meta
    eager.init_forward_metadata_out_graph(_decode_batch([1, 1], [0, 0]))
    assert eager._decode_meta.scores.data_ptr() != first.scores.data_ptr() and eager._graph_decode_buffers is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int32])
def test_index_q_refuses_dtypes_the_scorers_do_not_take(dtype):
    backend = _plan_only_backend(torch.zeros(1, PAGE_SIZE, dtype=torch.int32))
    with pytest.raises(ValueError, match=f"idx_q must be bfloat16, float8_e4m3fn or float32.*got {dtype}"):
        backend._index_q(torch.zeros(2, 1, 128, dtype=dtype), backend._any_cache())


def test_index_q_keeps_bf16_and_e4m3_and_rounds_a_float32_models_q():
    from m3_kernels.formats import FP8_DTYPE

    backend = _plan_only_backend(torch.zeros(1, PAGE_SIZE, dtype=torch.int32))
    cache = backend._any_cache()
    q = torch.randn(2, 1, 128)
    assert torch.equal(backend._index_q(q, cache), q.bfloat16())  # a float32 model on the CPU
    for kept in (q.bfloat16(), q.to(FP8_DTYPE)):
        assert backend._index_q(kept, cache) is kept


def test_index_q_is_rotated_by_the_cache_of_mxfp4_rot(gen):
    """The Q-side transform is the cache's: ``mxfp4_rot`` rotates by the keys' rotation, the rest pass Q through."""
    from m3_kernels.formats import rotate

    backend = _plan_only_backend(torch.zeros(1, PAGE_SIZE, dtype=torch.int32), fmt="mxfp4_rot")
    q = torch.randn(2, 1, 128, generator=gen).bfloat16()
    assert torch.equal(backend._index_q(q, backend._any_cache()), rotate(q.float()).bfloat16())


def test_a_same_size_graph_state_keeps_its_decode_buffers(gen):
    """A second init_cuda_graph_state at the size already held keeps the set: graphs captured on it read it."""
    req_to_token, _ = _paged_req_to_token(4, 3, gen)
    backend = _plan_only_backend(req_to_token, max_bs=4)
    shared = backend._graph_decode_buffers
    backend.init_cuda_graph_state(4, 4)
    assert backend._graph_decode_buffers is shared
    backend.init_cuda_graph_state(2, 2)
    assert backend._graph_decode_buffers is shared


def test_extend_without_prefix_lens_takes_seq_minus_extend(gen):
    req_to_token, _ = _paged_req_to_token(2, 3, gen)
    backend = _plan_only_backend(req_to_token)
    seq, new = torch.tensor([300, 5]), torch.tensor([200, 5])
    batch = _extend_batch(req_to_token, [0, 1], [100, 0], new.tolist())
    batch.extend_prefix_lens = None
    backend.init_forward_metadata_out_graph(batch)
    assert backend._extend_meta.prefix_lens.tolist() == [100, 0]


# ---- the whole backend, built by its own __init__ (and SGLang's) on the CPU: forward passes against each other

TINY_MODEL = Path(__file__).resolve().parents[2] / "configs" / "minimax-m3.1-tiny"
BLOCKS = 6  # blocks of each request row
# The runner stand-in fits SGLang 0.5.16's backend __init__; from 0.5.19 that __init__ reads the server's published
# runtime context (set up by a real server, which the server tests start).
RUNNER_STAND_IN = pytest.mark.skipif(at_least(RESOLUTION_PIPELINE),
                                     reason="SGLang >= 0.5.19's backend reads a real server's runtime context")
LAYER = SimpleNamespace(layer_id=1, scaling=128**-0.5)


class _Recorder:
    """Keeps what the backend records (a recorder also makes the CPU prefill score every row)."""

    def __init__(self):
        self.calls = []

    def record(self, mode, layer, positions, n_visible, selected, scores, **kw):
        self.calls.append((positions.clone(), n_visible.clone()))


def _real_backend(monkeypatch, topk=4, disable_cuda_graph=True, reqs=2):
    """The backend through MiniMaxM31SparseAttnBackend.__init__ (and SGLang's) on a CPU runner stand-in:
    the tiny config with topk blocks, an MXFP4 pool, request r on pages r*BLOCKS+1 .. (r+1)*BLOCKS."""
    import sglang_m3.backend as backend_module
    from sglang_m3.config import MiniMaxM31Config, index_k_settings
    from sglang_m3.pool import MiniMaxM31SparseKVPool

    monkeypatch.setattr(backend_module, "get_parallel", lambda: SimpleNamespace(attn_tp_size=1))
    config = json.loads((TINY_MODEL / "config.json").read_text())
    config["sparse_attention_config"]["sparse_topk_blocks"] = topk
    hf_config = MiniMaxM31Config(**config)
    pool = MiniMaxM31SparseKVPool(
        size=reqs * BLOCKS * PAGE_SIZE, page_size=PAGE_SIZE, dtype=torch.bfloat16, head_num=4, head_dim=128,
        idx_head_dim=128, dense_layer_ids=[0], sparse_layer_ids=[1, 2, 3], device="cpu",
        settings=IndexKSettings(IndexKFormat.MXFP4, ScaleRule.RCEIL, None), disable_value_sparse_layer_ids=[1, 2, 3],
        start_layer=0, end_layer=4)
    pages = torch.arange(reqs * BLOCKS).view(reqs, BLOCKS) + 1
    req_to_token = (pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(reqs, -1).to(torch.int32)
    runner = SimpleNamespace(
        token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), hisparse_coordinator=None,
        model_config=SimpleNamespace(context_len=BLOCKS * PAGE_SIZE, hf_config=hf_config, num_attention_heads=16),
        server_args=SimpleNamespace(speculative_algorithm=None, disable_cuda_graph=disable_cuda_graph), device="cpu")
    return MiniMaxM31SparseAttnBackend(runner, index_k_settings(hf_config)), req_to_token


def _inputs(n, gen):
    """q [n, 16, 128], k and v [n, 4, 128], index q [n, 4, 128], index k [n, 1, 128], bf16."""
    return tuple(torch.randn(n, h, 128, generator=gen).bfloat16() for h in (16, 4, 4, 4, 1))


def _extend(backend, req_to_token, req, prefix, new, inputs):
    seq = torch.tensor([prefix + new])
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, seq_lens=seq, seq_lens_cpu=seq,
                            extend_seq_lens=torch.tensor([new]), extend_seq_lens_cpu=[new],
                            extend_prefix_lens=torch.tensor([prefix]), req_pool_indices=torch.tensor([req]),
                            out_cache_loc=req_to_token[req, prefix:prefix + new].long(),
                            positions=torch.arange(prefix, prefix + new))
    backend.init_forward_metadata_out_graph(batch)
    q, k, v, idx_q, idx_k = inputs
    return backend.forward_extend(q, k, v, LAYER, batch, idx_q=idx_q, idx_k=idx_k, idx_v=None)[1]


def _decode(backend, req_to_token, req, seq_len, inputs):
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor([seq_len]),
                            req_pool_indices=torch.tensor([req]),
                            out_cache_loc=req_to_token[req, seq_len - 1:seq_len].long())
    backend.init_forward_metadata_out_graph(batch)
    backend.init_forward_metadata_in_graph(batch)
    q, k, v, idx_q, idx_k = inputs
    return backend.forward_decode(q, k, v, LAYER, batch, idx_q=idx_q, idx_k=idx_k, idx_v=None)[1]


@RUNNER_STAND_IN
def test_cpu_prefill_that_skips_rows_equals_scoring_every_row(monkeypatch, gen):
    """The CPU prefill does not score rows that see at most topk blocks (all selected anyway) unless a
    recorder asks; the output is the same either way, and the recorded n_visible is position // 128 + 1."""
    n = 5 * PAGE_SIZE + 3
    inputs = _inputs(n, gen)
    plain, req_to_token = _real_backend(monkeypatch)
    assert plain.recorder is None
    want = _extend(plain, req_to_token, 0, 0, n, inputs)
    recorded, req_to_token = _real_backend(monkeypatch)
    recorded.recorder = _Recorder()
    torch.testing.assert_close(_extend(recorded, req_to_token, 0, 0, n, inputs), want, rtol=0, atol=0)
    positions, n_visible = recorded.recorder.calls[0]
    assert torch.equal(n_visible, positions // PAGE_SIZE + 1)


@RUNNER_STAND_IN
@pytest.mark.parametrize("seq_len", [BLOCKS * PAGE_SIZE, 4 * PAGE_SIZE + 1])
def test_a_decode_step_equals_the_last_row_of_a_prefill(monkeypatch, gen, seq_len):
    """Decode at seq_len L after a prefill of L - 1 gives the last row of a prefill of L: at the end of the
    request's blocks and one token past a block edge, with n_visible = (L - 1) // 128 + 1."""
    inputs = _inputs(seq_len, gen)
    whole, req_to_token = _real_backend(monkeypatch)
    want = _extend(whole, req_to_token, 1, 0, seq_len, inputs)[-1]
    step, req_to_token = _real_backend(monkeypatch)
    step.recorder = _Recorder()
    _extend(step, req_to_token, 1, 0, seq_len - 1, [t[:-1] for t in inputs])
    got = _decode(step, req_to_token, 1, seq_len, [t[-1:] for t in inputs])[0]
    assert step.recorder.calls[-1][1].tolist() == [(seq_len - 1) // PAGE_SIZE + 1]
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2)


@RUNNER_STAND_IN
def test_the_decode_scorer_guard_is_told_whether_decode_graphs_are_on(monkeypatch):
    import sglang_m3.backend as backend_module

    seen = []
    monkeypatch.setattr(backend_module, "check_decode_scorer", lambda scorer, device_type, graph: seen.append(graph))
    _real_backend(monkeypatch, disable_cuda_graph=False)
    _real_backend(monkeypatch, disable_cuda_graph=True)
    assert seen == [True, False]


@RUNNER_STAND_IN
def test_a_decode_step_checks_its_metadata_once_for_all_layers(monkeypatch, gen):
    """Plan once per batch, run per layer: over a decode step of every sparse layer the batch metadata is
    checked once (at plan) and the caches not at all (they were checked when the pool made them)."""
    import m3_kernels.ops.score as score_module
    from m3_kernels.formats import cache as cache_module

    backend, req_to_token = _real_backend(monkeypatch)
    seq_len = 3 * PAGE_SIZE + 7
    inputs = _inputs(seq_len, gen)
    _extend(backend, req_to_token, 0, 0, seq_len - 1, [t[:-1] for t in inputs])
    counts = {"meta": 0, "cache": 0}
    check_meta, check_cache = score_module.check_batch, cache_module.check_index_k_cache
    monkeypatch.setattr(score_module, "check_batch",
                        lambda *a: counts.__setitem__("meta", counts["meta"] + 1) or check_meta(*a))
    monkeypatch.setattr(cache_module, "check_index_k_cache",  # the cache's own check
                        lambda *a: counts.__setitem__("cache", counts["cache"] + 1) or check_cache(*a))
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor([seq_len]),
                            req_pool_indices=torch.tensor([0]),
                            out_cache_loc=req_to_token[0, seq_len - 1:seq_len].long())
    backend.init_forward_metadata_out_graph(batch)
    backend.init_forward_metadata_in_graph(batch)
    q, k, v, idx_q, idx_k = [t[-1:] for t in inputs]
    layer_ids = sorted(backend.kv_pool.index_k_layer_id_mapping)
    assert len(layer_ids) == 3
    outs = [backend.forward_decode(q, k, v, SimpleNamespace(layer_id=i, scaling=LAYER.scaling), batch, idx_q=idx_q,
                                   idx_k=idx_k, idx_v=None)[1] for i in layer_ids]
    assert counts == {"meta": 1, "cache": 0}
    assert all(torch.isfinite(o.float()).all() for o in outs)


def _count_calls(monkeypatch, counts, name, *modules):
    """Count the calls of function ``name`` through every module of ``modules`` that has it."""
    for module in modules:
        original = getattr(module, name, None)
        if original is not None:
            def counted(*args, _original=original, **kwargs):
                counts[name] = counts.get(name, 0) + 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)


@RUNNER_STAND_IN
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_a_forward_plans_its_index_k_write_and_selection_once_for_all_layers(monkeypatch, gen, mode):
    """The write of the batch's slots and the block selection are planned (and their rules checked: the slots'
    range, the selection parameters) once per forward batch, not once per sparse layer; each layer runs the
    plans and gives what the one-call writer and selector give (index cache bytes, selected blocks)."""
    import m3_kernels.ops.select as select_module
    import m3_kernels.ops.write as write_module
    import sglang_m3.backend as backend_module
    import sglang_m3.pool as pool_module
    from m3_kernels.ops.select import select_blocks
    from m3_kernels.ops.write import write_index_k

    backend, req_to_token = _real_backend(monkeypatch)
    backend.recorder = recorder = _Recorder()
    selections = []
    select = backend._select
    monkeypatch.setattr(backend, "_select", lambda scores, plan: selections.append((scores, plan)) or select(scores,
                                                                                                          plan))
    seq_len = 3 * PAGE_SIZE + 7
    inputs = _inputs(seq_len, gen)
    prior = 0 if mode == "extend" else seq_len - 1
    if prior:
        _extend(backend, req_to_token, 0, 0, prior, [t[:prior] for t in inputs])
    counts, selections[:], recorder.calls[:] = {}, [], []
    pool = backend.kv_pool.index_k_pool
    wants = []  # each layer's cache as the one-call writer leaves it: a copy of its bytes before, then written
    for cache in pool.caches:
        wants.append(type(cache).new(pool.num_pages, cache.fmt, "cpu", cache.scale_rule, cache.sign_seed))
        for dst, src in ((wants[-1].data, cache.data), (wants[-1].scale_e8m0, cache.scale_e8m0)):
            if dst is not None:
                dst.untyped_storage().copy_(src.untyped_storage())
    _count_calls(monkeypatch, counts, "plan_write", write_module, pool_module)
    _count_calls(monkeypatch, counts, "plan_select", select_module, backend_module)
    _count_calls(monkeypatch, counts, "check_loc_range", write_module)
    _count_calls(monkeypatch, counts, "check_select_params", select_module)
    locs = req_to_token[0, prior:seq_len].long()
    batch = SimpleNamespace(**{**vars(_extend_batch(req_to_token, [0], [0], [seq_len])), "out_cache_loc": locs,
                               "positions": torch.arange(prior, seq_len)})
    if mode == "decode":
        batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor([seq_len]),
                                req_pool_indices=torch.tensor([0]), out_cache_loc=locs)
    else:
        batch.extend_seq_lens_cpu, batch.extend_seq_lens = [seq_len], torch.tensor([seq_len])
    backend.init_forward_metadata(batch)
    q, k, v, idx_q, idx_k = [t[prior:] for t in inputs]
    forward = backend.forward_decode if mode == "decode" else backend.forward_extend
    layer_ids = sorted(backend.kv_pool.index_k_layer_id_mapping)
    assert len(layer_ids) == 3
    for i in layer_ids:
        forward(q, k, v, SimpleNamespace(layer_id=i, scaling=LAYER.scaling), batch, idx_q=idx_q, idx_k=idx_k,
                idx_v=None)
    assert counts == {"plan_write": 1, "plan_select": 1, "check_loc_range": 1, "check_select_params": 1}
    # The runs against the one-call forms: every layer's cache holds the one-call writer's bytes at the slots, and
    # every layer's selection is select_blocks' on its scores.
    for cache, want in zip(pool.caches, wants):
        write_index_k(want, idx_k.flatten(1), locs)
        assert torch.equal(cache.data.view(torch.uint8), want.data.view(torch.uint8))
    assert len(selections) == len(recorder.calls) == 3
    for (scores, plan), (positions, n_visible) in zip(selections, recorder.calls):
        assert positions.tolist() == list(range(prior, seq_len)) and torch.equal(n_visible, positions // PAGE_SIZE + 1)
        assert torch.equal(select(scores, plan), select_blocks(scores, n_visible, backend.topk_blocks,
                                                               backend.local_blocks, backend.init_blocks))


@RUNNER_STAND_IN
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_a_bad_slot_is_refused_once_per_batch_before_anything_is_stored(monkeypatch, gen, mode):
    """A slot outside the index cache is refused when the batch is planned, with the writer's message, and no
    layer's cache (main or index) changes."""
    backend, req_to_token = _real_backend(monkeypatch)
    capacity = backend.kv_pool.index_k_pool.caches[0].capacity
    n = 1 if mode == "decode" else PAGE_SIZE + 1
    locs = req_to_token[0, :n].long()
    locs[-1] = capacity  # one slot past the last page
    if mode == "decode":
        batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor([n]),
                                req_pool_indices=torch.tensor([0]), out_cache_loc=locs)
    else:
        batch = _extend_batch(req_to_token, [0], [0], [n], out_cache_loc=locs)
    before = _pool_bytes(backend)
    q, k, v, idx_q, idx_k = _inputs(n, gen)
    forward = backend.forward_decode if mode == "decode" else backend.forward_extend
    with pytest.raises(ValueError, match=rf"loc values must lie in \[0, {capacity}\), got min \d+, max {capacity}$"):
        backend.init_forward_metadata(batch)
        forward(q, k, v, LAYER, batch, idx_q=idx_q, idx_k=idx_k, idx_v=None)
    assert all(torch.equal(a, b) for a, b in zip(_pool_bytes(backend), before))


# ---- prefill in SGLang's breakable CUDA graph: capture and replay of the eager break, reproduced on the CPU

GRAPH_LAYER = SimpleNamespace(layer_id=1, scaling=128**-0.5, tp_q_head_num=16, v_head_dim=128)


class _SegmentLog:
    """SGLang's ``BreakableCUDAGraphCapture`` as ``eager_on_graph`` sees it: ends and begins segments, keeps the
    eager functions a replay calls between them."""

    def __init__(self):
        self.events, self.cuda_graph = [], SimpleNamespace(_break_fns=[])

    def _end_current_segment(self):
        self.events.append("end")

    def _begin_new_segment(self):
        self.events.append("begin")


def _extend_batch(req_to_token, reqs, prefixes, news, positions=None, out_cache_loc=None):
    seq = torch.tensor([p + n for p, n in zip(prefixes, news)])
    locs = torch.cat([req_to_token[r, p:p + n] for r, p, n in zip(reqs, prefixes, news)]).long()
    pos = torch.cat([torch.arange(p, p + n) for p, n in zip(prefixes, news)])
    return SimpleNamespace(forward_mode=ForwardMode.EXTEND, seq_lens=seq, seq_lens_cpu=seq,
                           extend_seq_lens=torch.tensor(news), extend_seq_lens_cpu=list(news),
                           extend_prefix_lens=torch.tensor(prefixes), req_pool_indices=torch.tensor(reqs),
                           out_cache_loc=locs if out_cache_loc is None else out_cache_loc,
                           positions=pos if positions is None else positions)


def _pool_bytes(backend):
    pool = backend.kv_pool
    kv = [t.view(torch.uint8).clone() for i in range(4) for t in pool.get_kv_buffer(i)]
    idx = [c.data.view(torch.uint8).clone() for c in pool.index_k_pool.caches]
    return kv + idx


@RUNNER_STAND_IN
def test_breakable_prefill_graph_replays_equal_eager_prefills(monkeypatch, gen):
    """SGLang 0.5.16 records a prefill attention with index inputs inside its breakable graph. Captured
    once at a token bucket (SGLang's dummy batch: one request, no prefix), the attention must run eagerly
    between segments, and each replay (new batch shapes: one request, two with a prefix hit, fewer tokens
    than the bucket with garbage in the padded rows) must give the eager prefill's output bit for bit,
    zeros in the padded rows, and the same pool bytes (nothing stored for padded rows)."""
    import sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph as bcg
    import sglang_m3.backend as backend_module
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import context as bcg_context
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import context_manager as pcg

    monkeypatch.setattr(bcg, "_weak_ref_if_tensor", lambda x: x)  # CUDA-only in SGLang; identity keeps the address
    graph, req_to_token = _real_backend(monkeypatch)
    eager, _ = _real_backend(monkeypatch)
    bucket = 3 * PAGE_SIZE + 1
    static = [t.clone() for t in _inputs(bucket, gen)]  # the graph's input buffers: same storage across replays
    static_positions = torch.zeros(bucket, dtype=torch.int64)
    static_locs = torch.zeros(bucket, dtype=torch.int64)

    def run_static(backend, batch, record):
        n = sum(batch.extend_seq_lens_cpu)
        static_positions[:n], static_positions[n:] = batch.positions, 0
        static_locs[:n], static_locs[n:] = batch.out_cache_loc, 0  # SGLang's padding slot
        static_batch = SimpleNamespace(**{**vars(batch), "positions": static_positions, "out_cache_loc": static_locs})
        backend.init_forward_metadata_out_graph(batch)
        with pcg.set_tc_piecewise_forward_context(static_batch, [], None, [], []):
            if record is None:
                return backend.forward_extend(*static[:3], GRAPH_LAYER, static_batch, idx_q=static[3],
                                              idx_k=static[4], idx_v=None)[1]
            capture_token = bcg._current_capture_var.set(record)
            monkeypatch.setattr(backend_module, "_recorded_in_graph", lambda: True)
            try:
                with bcg_context.enable_breakable_cuda_graph():
                    return backend.forward_extend(*static[:3], GRAPH_LAYER, static_batch, idx_q=static[3],
                                                  idx_k=static[4], idx_v=None)[1]
            finally:
                monkeypatch.setattr(backend_module, "_recorded_in_graph", lambda: False)
                bcg._current_capture_var.reset(capture_token)

    # Capture on SGLang's dummy batch; the eager backend does the same forward so the pools share a history.
    capture = _SegmentLog()
    dummy = _extend_batch(req_to_token, [0], [0], [bucket])
    graph_out = run_static(graph, dummy, capture)
    assert capture.events == ["end", "begin"] and len(capture.cuda_graph._break_fns) == 1
    torch.testing.assert_close(graph_out, run_static(eager, dummy, None), rtol=0, atol=0)
    (replay_break,) = capture.cuda_graph._break_fns

    batches = [([1], [0], [2 * PAGE_SIZE + 7]),  # one request, fewer tokens than the bucket
               ([0, 1], [0, 2 * PAGE_SIZE + 7], [PAGE_SIZE - 1, PAGE_SIZE + 2]),  # two, the second a prefix hit
               ([0], [PAGE_SIZE - 1], [1])]  # one token
    for reqs, prefixes, news in batches:
        batch = _extend_batch(req_to_token, reqs, prefixes, news)
        n = sum(news)
        fresh = _inputs(n, gen)
        for buf, t in zip(static, fresh):
            buf[:n] = t
            buf[n:] = torch.randn(buf[n:].shape, generator=gen).bfloat16() * 1e3  # stale rows of earlier batches
        eager.init_forward_metadata_out_graph(batch)  # eager serving: no padded rows at all
        want = eager.forward_extend(*[t[:n] for t in static[:3]], GRAPH_LAYER, batch, idx_q=static[3][:n],
                                    idx_k=static[4][:n], idx_v=None)[1]
        # Replay: SGLang refreshes the metadata out of graph for the live batch, then calls the recorded break.
        static_positions[:n], static_locs[:n] = batch.positions, batch.out_cache_loc
        static_positions[n:], static_locs[n:] = 0, 0
        graph.init_forward_metadata_out_graph(batch)
        graph_out.fill_(float("nan"))  # poisoned: every row must be written
        live = SimpleNamespace(**{**vars(batch), "positions": static_positions, "out_cache_loc": static_locs})
        with pcg.set_tc_piecewise_forward_context(live, [], None, [], []):
            replay_break()
        torch.testing.assert_close(graph_out[:n], want, rtol=0, atol=0)
        assert torch.equal(graph_out[n:], torch.zeros_like(graph_out[n:]))
        for got, ref in zip(_pool_bytes(graph), _pool_bytes(eager)):
            assert torch.equal(got, ref)


@RUNNER_STAND_IN
def test_a_prefill_recorded_outside_the_breakable_graph_is_refused(monkeypatch, gen):
    """A graph that records prefill attention without SGLang's eager breaks (``full``) would replay a stale
    host plan: refused at capture, naming the prefill-graph flag."""
    import sglang_m3.backend as backend_module

    backend, req_to_token = _real_backend(monkeypatch)
    q, k, v, idx_q, idx_k = _inputs(PAGE_SIZE, gen)
    batch = _extend_batch(req_to_token, [0], [0], [PAGE_SIZE])
    backend.init_forward_metadata_out_graph(batch)
    monkeypatch.setattr(backend_module, "_recorded_in_graph", lambda: True)
    with pytest.raises(RuntimeError, match=r"outside SGLang's breakable prefill graph.*--cuda-graph-backend-prefill"):
        backend.forward_extend(q, k, v, GRAPH_LAYER, batch, idx_q=idx_q, idx_k=idx_k, idx_v=None)


# ---- the prefill CUDA graph on a GPU: greedy tokens with the graph against without

MEDIUM_MODEL = Path(__file__).resolve().parents[2] / "configs" / "msa-medium"


def _generate_batch(url, prompts, max_new_tokens):
    import urllib.request

    body = json.dumps({"input_ids": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                                 "ignore_eos": True}}).encode()
    request = urllib.request.Request(f"{url}/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return [r["output_ids"] for r in json.loads(response.read())]


@pytest.mark.gpu
def test_prefill_graph_gives_the_greedy_tokens_of_eager_prefill(tmp_path):
    """A server keeping SGLang's breakable prefill graph (``SGLANG_M3_PREFILL_GRAPH=1``) and one without it
    (the default) give the same greedy tokens for batches the graph replays (one request; three of mixed
    lengths; the same three again, a radix-cache prefix hit), and the graph server's log shows replays. One
    format (MXFP4, the default): the eager break around prefill attention does not depend on it."""
    import os
    import re

    from sglang_m3.server import Server

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    weights = MEDIUM_MODEL / "model-00001-of-00001.safetensors"
    load = [] if weights.exists() and weights.stat().st_size > 1 << 20 else ["--load-format", "dummy"]
    vocab = json.loads((MEDIUM_MODEL / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(56)
    prompts = [torch.randint(100, vocab - 100, (n,), generator=g).tolist() for n in (1, 300, 1500, 4000)]
    batches = [prompts[2:3], prompts[:3], prompts[1:4], prompts[1:4]]
    args = ["--index-k-format", "mxfp4", "--attention-backend", "triton", "--mem-fraction-static", "0.35",
            "--context-length", "8192", *load]
    outputs, logs = {}, {}
    graph = ["--cuda-graph-backend-prefill", "breakable"]
    for name, extra, env in (("eager", [], {}), ("graph", graph, {"SGLANG_M3_PREFILL_GRAPH": "1"})):
        log = tmp_path / f"{name}.log"
        with Server(MEDIUM_MODEL, [*args, *extra], log, env={**os.environ, **env}, timeout_s=900) as server:
            outputs[name] = [_generate_batch(server.url, b, 24) for b in batches]
        logs[name] = log.read_text()
    replays = re.findall(r"Prefill batch.*cuda graph: True", logs["graph"])
    assert replays, "the graph server never replayed a prefill graph: " + logs["graph"][-3000:]
    assert not re.findall(r"Prefill batch.*cuda graph: True", logs["eager"])
    assert outputs["graph"] == outputs["eager"]
