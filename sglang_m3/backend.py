"""MSA attention backend for MiniMax-M3.1 over the quantized index-K cache.

Subclasses SGLang's ``MiniMaxSparseAttnBackend`` (which ``MiniMaxHybridAttnBackend`` pairs with
the dense backend for layers 0-2) and replaces its index path. Per sparse layer and forward:

1. store main K/V and the index key at ``out_cache_loc`` (the batch's write plan, run inside the pool);
2. score every visible 128-token block from the layer's ``IndexKCache`` (``score_prefill`` /
   ``score_decode`` on the batch's plan; radix-cached prefixes are read from the cache like any other page);
3. pick the top blocks (the batch's ``select_planned``);
4. attend over the picked blocks (``sparse_attention``: SGLang's Triton kernels on CUDA, torch
   elsewhere).

Plan, then run: host work (block tables for prefill, decode buffer views, and the plans: the scorer's
``plan_decode`` / ``plan_prefill``, the selector's ``plan_select`` and the index-K writer's plan of
``out_cache_loc``: backend choice and every metadata check, once per batch) happens in
``init_forward_metadata_out_graph``; decode metadata is refreshed by device ops in
``init_forward_metadata_in_graph`` into buffers that CUDA-graph capture and replay share. A captured
batch size's decode score and select plans are made at capture and reused by its replays (they hold the
same buffers); the write plan holds the batch's ``out_cache_loc`` tensor and no host value of it (its slot
check is the allocator's), so the one made at capture reads the graph's static slots at every replay.
Each layer's run checks only that its tensors match the plans, on the host (on a CPU the reference selector
also checks each row's visible-block count: decode fills those in-graph, after the plan).

Decode buffers in CUDA-graph mode: ``init_cuda_graph_state(max_bs)`` allocates one set for
``max_bs`` rows and every batch size up to it gets leading views of that set (``scores`` as the first
``H_idx * bs * max_blocks`` elements, so each view is contiguous), so memory follows the largest
captured size, not their sum. Sharing is safe because graphs replay one at a time on one stream and
each replay rewrites its rows in-graph (``block_table``, ``seq_lens``, ``n_visible`` copied in
``init_forward_metadata_in_graph``; ``scores`` written by the scorer up to each row's last visible
block, the columns past it left stale and masked by ``n_visible``). Larger batches, and eager mode,
get fresh buffers.

Prefill in SGLang's ``breakable`` prefill CUDA graph: the prefill metadata (block table cut to the widest
request, offsets, the scorer's plan and work map) is made on the host per batch, so prefill attention must
never be replayed from a recording. SGLang 0.5.23 already runs it eagerly between graph segments. SGLang 0.5.16
calls it inside the segment being captured; ``forward_extend`` then ends the segment and runs the attention
eagerly (SGLang's ``eager_on_graph``), at capture and at every replay, reading the live batch from SGLang's
prefill context and the plan ``init_forward_metadata`` made for it just before the replay. Any other graph
recording a prefill attention (``full``) is refused with a message naming the prefill-graph flag.
"""

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch

from m3_kernels.formats import FP8_DTYPE, PAGE_SIZE
from m3_kernels.ops.score import (
    ENV_BACKEND,
    DecodeBatch,
    DecodePlan,
    PrefillBatch,
    PrefillPlan,
    plan_decode,
    plan_prefill,
    resolve_backend,
    score_decode,
    score_prefill,
)
from m3_kernels.ops.select import SelectPlan, check_select_params, plan_select, select_planned, visible_blocks
from m3_kernels.ops.write import WritePlan
from sglang.srt.configs.model_config import get_minimax_sparse_attention_config
from sglang.srt.layers.attention.minimax_sparse_backend import MiniMaxSparseAttnBackend
from sglang.srt.runtime_context import get_parallel

from .compat import setting
from .config import IndexKSettings
from .debug import SelectionRecorder
from .sparse_attention import pin_from_env, sparse_attention_decode, sparse_attention_extend

logger = logging.getLogger(__name__)


@dataclass
class _DecodeMeta:
    """Decode buffers of one batch of ``bs`` rows: fresh, or views of the CUDA-graph set (module docstring)."""

    block_table: torch.Tensor  # int32 [bs, max_blocks]: page id of each request block
    seq_lens: torch.Tensor  # int32 [bs]
    n_visible: torch.Tensor  # int64 [bs]: blocks the decode row sees
    scores: torch.Tensor  # fp32 [H_idx, bs, max_blocks]
    plan: Optional[DecodePlan] = None  # the scorer's plan over these buffers, made once (per captured size)
    select: Optional[SelectPlan] = None  # the selector's plan over ``scores`` and ``n_visible``, made with ``plan``


@dataclass
class _ExtendMeta:
    block_table: torch.Tensor  # int32 [bs, max_block]
    seq_lens: torch.Tensor  # int32 [bs]
    prefix_lens: torch.Tensor  # int32 [bs]
    cu_seqlens_q: torch.Tensor  # int32 [bs + 1]
    max_seqlen_q: int
    max_block: int
    num_tokens: int
    plan: Optional[PrefillPlan]  # the scorer's plan, made once here for every sparse layer
    select: Optional[SelectPlan] = None  # the selector's plan: each new token's visible blocks, [num_tokens]


def check_decode_scorer(scorer: str, device_type: str, cuda_graph: bool) -> None:
    """ValueError if decode scorer ``scorer`` (``resolve_backend``'s name) cannot be captured in the CUDA graphs
    a server on ``device_type`` will capture: the torch reference reads sizes back to the host."""
    if scorer == "torch" and device_type == "cuda" and cuda_graph:
        raise ValueError(
            f"{ENV_BACKEND}=torch: the torch reference decode scorer reads values back to the host, which CUDA-graph "
            f"capture forbids; launch with --disable-cuda-graph, or unset {ENV_BACKEND} (auto)"
        )


class MiniMaxM31SparseAttnBackend(MiniMaxSparseAttnBackend):
    """Sparse-layer backend reading the ``MiniMaxM31SparseKVPool`` index cache (see module docstring)."""

    def __init__(self, runner, settings: IndexKSettings):
        spec = setting(runner.server_args, "speculative_algorithm", None) if hasattr(runner, "server_args") else None
        if spec is not None:  # fail at start-up, not at the first verify batch inside the scheduler
            raise NotImplementedError(
                f"speculative_algorithm={spec!r}: speculative decoding is not supported with the MiniMax-M3.1 "
                "index-K cache (its decode plan scores one query row per request; verify batches, several rows "
                "a request, are not planned); launch without --speculative-algorithm"
            )
        super().__init__(runner)
        # Our index path feeds SGLang's Triton sparse kernels; MSA (SM100) decode is not wired in.
        self.use_msa = self._use_msa_decode = self._msa_owns_decode = False
        self.use_dense_sparse_decode = False
        self.settings = settings
        if self.block_size_k != PAGE_SIZE:
            raise ValueError(f"sparse_block_size must be {PAGE_SIZE}, got {self.block_size_k}")
        if self.score_type != "max":
            raise NotImplementedError(f"sparse_score_type {self.score_type!r}: the index-K scorers compute 'max'")
        try:  # at start-up, not at the first batch inside the scheduler
            check_select_params(self.topk_blocks, self.local_blocks, self.init_blocks)
        except ValueError as e:
            raise ValueError("sparse_attention_config: sparse_topk_blocks, sparse_local_block (or "
                             "sparse_local_tokens) and sparse_init_block (or sparse_init_tokens) break the block "
                             f"selection's rule: {e}") from None
        sparse_cfg = get_minimax_sparse_attention_config(runner.model_config.hf_config)
        total_idx_heads = sparse_cfg["sparse_num_index_heads"]
        self.num_idx_heads = total_idx_heads // min(get_parallel().attn_tp_size, total_idx_heads)
        num_kv_heads = self.kv_pool.main_pool.head_num
        if self.num_idx_heads != num_kv_heads:
            raise NotImplementedError(
                f"{self.num_idx_heads} index heads per rank against {num_kv_heads} KV heads: "
                "only one index head per KV head (MiniMax-M3) is supported"
            )
        self.idx_sm_scale = self.idx_head_dim**-0.5
        self.device = self.req_to_token.device
        # First token slot of every block of every request row: [max_reqs, max_blocks] (a view).
        self._block_starts = self.req_to_token[:, ::PAGE_SIZE]
        self.max_blocks = self._block_starts.shape[1]
        self._graph_decode_buffers: Optional[_DecodeMeta] = None  # for max_bs rows, in CUDA-graph mode
        self._graph_decode_plans: dict[int, _DecodeMeta] = {}  # per batch size: views of those buffers, planned
        self._in_graph_mode = False
        self._decode_meta: Optional[_DecodeMeta] = None
        self._extend_meta: Optional[_ExtendMeta] = None
        self._write_plan: Optional[WritePlan] = None  # the index-K write of this batch's out_cache_loc
        self.recorder = SelectionRecorder.from_config(runner.model_config.hf_config, self.sparse_layer_ids)
        # Resolved now (the CUDA kernel's JIT build happens here, not mid-capture); each plan resolves the same way.
        self.decode_scorer = resolve_backend(self.device, settings.fmt, "decode", query_vectors=self.num_idx_heads)
        check_decode_scorer(self.decode_scorer, self.device.type,
                            not setting(runner.server_args, "disable_cuda_graph", False))
        if self.device.type == "cuda":
            pin_from_env()  # a bad M3_SPARSE_{PREFILL,DECODE}_CONFIG fails the start, not the first call
        logger.info("sglang-m3: %s index-K cache, decode scorer %s", settings.fmt.value, self.decode_scorer)

    # ---- plan --------------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """One set of decode buffers for ``max_bs`` rows, viewed by every captured batch size (kept if a
        set at least that large exists: graphs captured on it still read it)."""
        self._in_graph_mode = True
        shared = self._graph_decode_buffers
        if shared is None or shared.seq_lens.shape[0] < max_bs:
            self._graph_decode_buffers = self._new_decode_meta(max_bs)
            self._graph_decode_plans = {}

    def _new_decode_meta(self, bs: int) -> _DecodeMeta:
        dev = self.device
        return _DecodeMeta(
            block_table=torch.zeros(bs, self.max_blocks, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(bs, dtype=torch.int32, device=dev),
            n_visible=torch.ones(bs, dtype=torch.int64, device=dev),
            scores=torch.empty(self.num_idx_heads, bs, self.max_blocks, dtype=torch.float32, device=dev),
        )

    def _graph_decode_views(self, bs: int) -> _DecodeMeta:
        """The first ``bs`` rows of the CUDA-graph buffers, each contiguous: ``scores`` is the leading
        ``[H_idx, bs, max_blocks]`` block of the shared storage, not a strided slice of its rows."""
        shared, H, nb = self._graph_decode_buffers, self.num_idx_heads, self.max_blocks
        return _DecodeMeta(
            block_table=shared.block_table[:bs],
            seq_lens=shared.seq_lens[:bs],
            n_visible=shared.n_visible[:bs],
            scores=shared.scores.view(-1)[: H * bs * nb].view(H, bs, nb),
        )

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        mode = forward_batch.forward_mode
        self._decode_meta = self._extend_meta = self._write_plan = None
        if mode.is_idle():
            return
        if mode.is_target_verify() or mode.is_draft_extend_v2():
            raise NotImplementedError("speculative decoding is not supported with the MiniMax-M3.1 index-K cache")
        self._write_plan = self.kv_pool.plan_index_k_write(forward_batch.out_cache_loc)
        if mode.is_decode():
            bs = forward_batch.seq_lens.shape[0]
            shared = self._graph_decode_buffers if self._in_graph_mode else None
            if shared is not None and bs <= shared.seq_lens.shape[0]:  # capture, replay, or eager up to max_bs
                meta = self._graph_decode_plans.get(bs)
                if meta is None:  # first use of this size (its capture): views and plan made once
                    meta = self._graph_decode_plans[bs] = self._plan_decode(self._graph_decode_views(bs))
                self._decode_meta = meta
            else:
                self._decode_meta = self._plan_decode(self._new_decode_meta(bs))
            return
        # Extend (prefill, chunked prefill, mixed): eager, host metadata allowed.
        seq_lens_cpu = forward_batch.seq_lens_cpu
        extend_lens_cpu = forward_batch.extend_seq_lens_cpu
        max_block = max(1, math.ceil(int(seq_lens_cpu.max()) / PAGE_SIZE))
        extend_lens = forward_batch.extend_seq_lens.to(torch.int32)
        # New-token offsets, summed once on the host: the plan reads them there, the kernels on the device.
        cu_host = list(itertools.accumulate((int(n) for n in extend_lens_cpu), initial=0))
        cu = torch.tensor(cu_host, dtype=torch.int32, device=extend_lens.device)
        prefix = forward_batch.extend_prefix_lens
        seq_lens = forward_batch.seq_lens.to(torch.int32)
        self._extend_meta = _ExtendMeta(
            block_table=self._block_table(forward_batch.req_pool_indices)[:, :max_block].contiguous(),
            seq_lens=seq_lens,
            prefix_lens=prefix.to(torch.int32) if prefix is not None else seq_lens - extend_lens,
            cu_seqlens_q=cu,
            max_seqlen_q=int(max(extend_lens_cpu)),
            max_block=max_block,
            num_tokens=cu_host[-1],
            plan=None,
        )
        meta, cache = self._extend_meta, self._any_cache()
        meta.select = self._plan_select(visible_blocks(forward_batch.positions[: meta.num_tokens], PAGE_SIZE),
                                        max_block)
        if cache is not None:
            # Rows seeing at most topk blocks take them all (no scores needed) unless the recorder keeps scores.
            meta.plan = plan_prefill(cache, PrefillBatch(
                meta.block_table, seq_lens, cu, self.num_idx_heads, self.idx_sm_scale, max_block,
                cu_seqlens_host=cu_host, seq_lens_host=seq_lens_cpu.tolist(),
                skip_rows_seeing=self.topk_blocks if self.recorder is None else 0))

    def _any_cache(self):
        """A sparse layer's ``IndexKCache`` (every layer shares format, geometry and device, so plans take any);
        None where this rank holds no sparse layer."""
        caches = self.kv_pool.index_k_pool.caches
        return caches[0] if caches else None

    def _plan_decode(self, meta: _DecodeMeta) -> _DecodeMeta:
        cache = self._any_cache()
        if cache is not None:
            meta.plan = plan_decode(cache, DecodeBatch(meta.block_table, meta.seq_lens, 1, self.num_idx_heads,
                                                       self.idx_sm_scale, self.max_blocks, meta.scores))
        meta.select = self._plan_select(meta.n_visible, self.max_blocks)
        return meta

    def _plan_select(self, n_visible: torch.Tensor, nb: int) -> SelectPlan:
        """The selection over this batch's ``[H_idx, rows, nb]`` scores (no host value of ``n_visible`` read)."""
        return plan_select(n_visible, self.num_idx_heads, nb, self.topk_blocks, self.local_blocks, self.init_blocks)

    def init_forward_metadata_in_graph(self, forward_batch):
        meta = self._decode_meta
        if meta is None:
            return
        # Device ops only: recorded at capture, replayed with the runner's refreshed inputs.
        meta.block_table.copy_(self._block_table(forward_batch.req_pool_indices))
        meta.seq_lens.copy_(forward_batch.seq_lens)
        meta.n_visible.copy_(visible_blocks(forward_batch.seq_lens - 1, PAGE_SIZE))

    def _block_table(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """int32 ``[bs, max_blocks]``: cache page of each block of each request (one page per block)."""
        return torch.div(self._block_starts[req_pool_indices.long()], PAGE_SIZE, rounding_mode="floor").to(torch.int32)

    # ---- run ---------------------------------------------------------------------------------

    def _index_q(self, idx_q: torch.Tensor, cache) -> torch.Tensor:
        """Index Q as the scorers take it: bf16 (or e4m3), then ``cache.prepare_q`` (rotated for ``mxfp4_rot``).
        A float32 model's (CPU) Q is rounded to bf16; any other dtype raises (float16 models are refused at
        start-up)."""
        if idx_q.dtype == torch.float32:
            idx_q = idx_q.to(torch.bfloat16)
        elif idx_q.dtype not in (torch.bfloat16, FP8_DTYPE):
            raise ValueError(f"idx_q must be bfloat16, float8_e4m3fn or float32 (rounded to bfloat16), "
                             f"got {idx_q.dtype}")
        return cache.prepare_q(idx_q)

    def _select(self, scores: torch.Tensor, plan: SelectPlan) -> torch.Tensor:
        return select_planned(plan, scores)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, idx_q, idx_k, idx_v, **kwargs):
        if _recorded_in_graph():  # SGLang 0.5.16's breakable prefill graph records this call (module docstring)
            return self._extend_between_segments(q, k, v, layer, idx_q, idx_k, idx_v)
        return self._extend(q, k, v, layer, forward_batch, forward_batch.out_cache_loc, self._write_plan, idx_q,
                            idx_k, idx_v)

    def _extend_between_segments(self, q, k, v, layer, idx_q, idx_k, idx_v):
        """Capture of a breakable prefill graph: end the segment here and run this attention eagerly, now
        and at every replay (``_breakable_extend``), into an output the next segment reads."""
        from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
            eager_on_graph,
            is_in_breakable_cuda_graph,
        )

        if not is_in_breakable_cuda_graph():
            raise RuntimeError(
                "MiniMax-M3.1 index-K cache: a CUDA graph is recording prefill attention outside SGLang's "
                "breakable prefill graph; its metadata is planned on the host per batch, so only the breakable "
                "graph (which runs attention eagerly between segments) can hold it: use "
                "--cuda-graph-backend-prefill breakable or disabled"
            )
        out = q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        eager_on_graph(True)(_breakable_extend)(self, q, k, v, out, layer, idx_q, idx_k, idx_v)
        return None, out

    def _extend(self, q, k, v, layer, forward_batch, out_cache_loc, write_plan, idx_q, idx_k, idx_v):
        meta = self._extend_meta
        self.kv_pool.set_fused_kv_index_buffer(layer, out_cache_loc, k, v, idx_k, idx_v, write_plan)
        k_cache, v_cache = self.kv_pool.get_kv_buffer(layer.layer_id)
        cache = self.kv_pool.get_index_k_buffer(layer.layer_id)

        padded_tokens, n = q.shape[0], meta.num_tokens  # DP attention may pad q past the real tokens
        q, idx_q, positions = q[:n], idx_q[:n], forward_batch.positions[:n]
        scores = score_prefill(meta.plan, self._index_q(idx_q, cache), cache)
        n_visible = meta.select.n_visible
        selected = self._select(scores, meta.select)
        o = sparse_attention_extend(q, k_cache, v_cache, self.req_to_token, forward_batch.req_pool_indices,
                                    meta.seq_lens, meta.prefix_lens, meta.cu_seqlens_q, meta.max_seqlen_q, positions,
                                    selected, self.block_size_k, layer.scaling)
        if self.recorder is not None:
            self.recorder.record("extend", layer.layer_id, positions, n_visible, selected, scores,
                                 seq_lens=meta.seq_lens, cu_rows=meta.cu_seqlens_q)
        o = o.reshape(n, -1)
        if padded_tokens > n:
            o = torch.cat([o, o.new_zeros(padded_tokens - n, o.shape[1])])
        return None, o

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, idx_q, idx_k, idx_v, **kwargs):
        meta = self._decode_meta
        self.kv_pool.set_fused_kv_index_buffer(layer, forward_batch.out_cache_loc, k, v, idx_k, idx_v,
                                               self._write_plan)
        k_cache, v_cache = self.kv_pool.get_kv_buffer(layer.layer_id)
        cache = self.kv_pool.get_index_k_buffer(layer.layer_id)

        scores = score_decode(meta.plan, self._index_q(idx_q, cache), cache, meta.scores)
        selected = self._select(scores, meta.select)
        o = sparse_attention_decode(q, k_cache, v_cache, self.req_to_token, forward_batch.req_pool_indices,
                                    meta.seq_lens, selected, self.block_size_k, layer.scaling)
        if self.recorder is not None:
            self.recorder.record("decode", layer.layer_id, meta.seq_lens - 1, meta.n_visible, selected, scores)
        return None, o.reshape(q.shape[0], -1)


def _recorded_in_graph() -> bool:
    """Whether a CUDA graph is recording on the current stream (a prefill attention call being captured)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _breakable_extend(backend, q, k, v, out, layer, idx_q, idx_k, idx_v) -> None:
    """One prefill attention between two segments of SGLang's breakable prefill graph, run at capture and
    at every replay with the same tensors (static addresses the segment before refills). It reads the live
    batch from SGLang's prefill context and the plan ``init_forward_metadata`` made for it before the
    replay, runs the real tokens only (K/V and index K stored for them alone), and zeroes the padded rows."""
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager import (
        get_tc_piecewise_forward_context,
    )

    forward_batch = get_tc_piecewise_forward_context().forward_batch
    n = backend._extend_meta.num_tokens
    # The write plan is over the live batch's out_cache_loc (made before the replay), whose first n slots are the
    # static ones the segment reads; a DP-padded live batch plans more rows than the n stored here.
    _, o = backend._extend(q[:n], k[:n], v[:n], layer, forward_batch, forward_batch.out_cache_loc[:n],
                           backend._write_plan.first(n), idx_q[:n], idx_k[:n], None if idx_v is None else idx_v[:n])
    out[:n].copy_(o)
    out[n:].zero_()
