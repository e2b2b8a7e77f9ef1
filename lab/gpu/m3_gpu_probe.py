"""Decode-input recorder for the H200 SGLang check (an SGLang ``sglang.srt.plugins`` entry point).

Loaded in every server process by ``lab/gpu/run_sglang_h200.sh`` (which writes its
entry-point metadata); does nothing unless ``M3_PROBE_DIR`` is set. Then, in an eager
(``--disable-cuda-graph``) server, the first ``M3_PROBE_CALLS`` (default 3) decode forwards of
the first sparse layer are saved to ``$M3_PROBE_DIR/decode_<n>.pt`` with everything needed to
recompute block selection with the torch references:

    q        index Q as the scorer took it ([bs, H, 128], after ``prepare_index_q``)
    k_cache, k_scale   the index-cache pages the batch reads (gathered, in the cache's format)
    block_table        int32 [bs, max_blocks], remapped to rows of the gathered pages
    seq_lens, n_visible, sm_scale, topk, local_blocks, init_blocks, fmt
    scores, selected   what the served path (Triton scorer + selector) produced

``sglang_h200.py`` compares them with ``score_decode_ref`` + ``select_blocks_ref``.
"""

import os

import torch

PROBE_DIR_ENV = "M3_PROBE_DIR"
PROBE_CALLS_ENV = "M3_PROBE_CALLS"


def _wrap_forward_decode(original):
    state = {"calls": 0}

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, idx_q, idx_k, idx_v, **kwargs):
        out_dir = os.environ[PROBE_DIR_ENV]
        limit = int(os.environ.get(PROBE_CALLS_ENV, "3"))
        if layer.layer_id != min(self.sparse_layer_ids) or state["calls"] >= limit:
            return original(self, q, k, v, layer, forward_batch, save_kv_cache, idx_q=idx_q, idx_k=idx_k,
                            idx_v=idx_v, **kwargs)
        captured = {}
        select = self._select

        def capturing_select(scores, n_visible):
            selected = select(scores, n_visible)
            captured["scores"], captured["selected"] = scores.clone(), selected.clone()
            return selected

        self._select = capturing_select
        try:
            result = original(self, q, k, v, layer, forward_batch, save_kv_cache, idx_q=idx_q, idx_k=idx_k,
                              idx_v=idx_v, **kwargs)
        finally:
            del self._select
        meta = self._decode_meta
        cache = self.kv_pool.get_index_k_buffer(layer.layer_id)
        idx_cache, idx_scale = cache.views()
        seq_lens = meta.seq_lens.long()
        n_pages = (seq_lens + 127) // 128
        used = torch.arange(meta.block_table.shape[1], device=seq_lens.device)[None] < n_pages[:, None]
        pages = torch.unique(meta.block_table[used].long())
        remap = torch.full((int(pages.max()) + 1,), -1, dtype=torch.int64, device=pages.device)
        remap[pages] = torch.arange(pages.numel(), device=pages.device)
        table = torch.where(used, remap[meta.block_table.long().clamp(min=0)], 0).to(torch.int32)
        record = {
            "q": self._index_q(idx_q, cache).cpu(),
            "k_cache": idx_cache[pages].cpu(),
            "k_scale": None if idx_scale is None else idx_scale[pages].cpu(),
            "block_table": table.cpu(),
            "seq_lens": meta.seq_lens.cpu(),
            "n_visible": meta.n_visible.cpu(),
            "sm_scale": self.idx_sm_scale,
            "topk": self.topk_blocks,
            "local_blocks": self.local_blocks,
            "init_blocks": self.init_blocks,
            "fmt": self.settings.fmt.value,
            "scores": captured["scores"].cpu(),
            "selected": captured["selected"].cpu(),
        }
        os.makedirs(out_dir, exist_ok=True)
        torch.save(record, os.path.join(out_dir, f"decode_{os.getpid()}_{state['calls']}.pt"))
        state["calls"] += 1
        return result

    return forward_decode


def register() -> None:
    """Patch ``MiniMaxM31SparseAttnBackend.forward_decode`` when ``M3_PROBE_DIR`` is set."""
    if not os.environ.get(PROBE_DIR_ENV):
        return
    try:
        from sglang_m3.backend import MiniMaxM31SparseAttnBackend
    except ImportError:  # processes that never build a backend may lack CUDA-side imports
        return
    if not getattr(MiniMaxM31SparseAttnBackend.forward_decode, "_m3_probe", False):
        wrapped = _wrap_forward_decode(MiniMaxM31SparseAttnBackend.forward_decode)
        wrapped._m3_probe = True
        MiniMaxM31SparseAttnBackend.forward_decode = wrapped
