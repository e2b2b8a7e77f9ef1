"""Paged index-K pools for MiniMax-M3.1 (bf16, fp8, MXFP4), subclassing SGLang's M3 pools.

Index rows share the main K/V token slot ``loc`` (no allocator of their own), so radix-cache
prefix sharing, eviction, retraction and aborts cover the index cache with nothing extra: a slot
freed or reused by SGLang's allocator is freed or reused for both. Slot ``loc`` lives at page
``loc // PAGE_SIZE``, row ``loc % PAGE_SIZE``; this needs SGLang's ``--page-size`` to equal
``PAGE_SIZE`` (128, one MSA block), so that a request's block ``p`` is one cache page.

Each layer's index cache is one ``m3_kernels.formats.IndexKCache`` (format, views, scale rule, sign
seed), checked once when the pool makes it; ``get_index_k_buffer`` returns it and the writer and
scorers take it. Quantization is ``m3_kernels.ops.write``'s plan and run: ``plan_index_k_write`` checks a
batch's slots once (the backend calls it once per forward batch) and each layer's store runs that plan;
byte sizes come from ``IndexKFormat.token_bytes``.
"""

from contextlib import nullcontext
from typing import Optional

import torch

from m3_kernels.formats import INDEX_DIM, PAGE_SIZE, IndexKCache, alloc_index_k_cache
from m3_kernels.ops.write import WritePlan, plan_write, write_planned
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import KVCache, MHATokenToKOnlyPool, MiniMaxSparseKVPool

from .config import IndexKSettings


def check_page_size(page_size: int) -> None:
    """ValueError unless SGLang's page size equals the index cache's page (one MSA block)."""
    if page_size != PAGE_SIZE:
        raise ValueError(
            f"page_size must be {PAGE_SIZE} (one MSA block per cache page) for the MiniMax-M3.1 index-K cache, "
            f"got {page_size}; launch with --page-size {PAGE_SIZE}"
        )


def num_index_pages(size: int, page_size: int) -> int:
    """Pages covering SGLang's ``size + page_size`` token slots (slot 0's page is the padding page)."""
    return (size + page_size + PAGE_SIZE - 1) // PAGE_SIZE


class IndexKPool(MHATokenToKOnlyPool):
    """K-only index pool in one ``IndexKFormat``: per layer one ``IndexKCache`` (``caches``; MXFP4 in
    single-region 8704 B pages). ``k_buffer`` / ``k_scale_buffer`` hold the same views for SGLang's code."""

    def __init__(
        self,
        size: int,
        page_size: int,
        settings: IndexKSettings,
        layer_num: int,
        device: str,
        enable_memory_saver: bool,
    ):
        check_page_size(page_size)
        fmt = settings.fmt
        dtype = alloc_index_k_cache(0, fmt, "meta")[0].dtype
        # Skip MHATokenToKOnlyPool.__init__ (it allocates [size+page, 1, 128] rows of `dtype`).
        KVCache.__init__(self, size, page_size, dtype, layer_num, device, enable_memory_saver)
        self.settings = settings
        self.head_num = 1
        self.head_dim = INDEX_DIM
        self.num_pages = num_index_pages(size, page_size)
        # As SGLang's own pools allocate: inside the memory saver's region and, where KVCache.__init__ set one up
        # (transfer over NVLink for PD disaggregation), its custom memory pool, so the index cache is transferable too
        custom_pool = torch.cuda.use_mem_pool(self.custom_mem_pool) if self.enable_custom_mem_pool else nullcontext()
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE), custom_pool:
            self.caches = [IndexKCache.new(self.num_pages, fmt, device, settings.scale_rule, settings.sign_seed)
                           for _ in range(layer_num)]
        self.k_buffer = [c.data for c in self.caches]
        self.k_scale_buffer = [c.scale_e8m0 for c in self.caches]
        self._finalize_allocation_log(size)

    def get_key_buffer(self, layer_id: int) -> IndexKCache:
        """The ``IndexKCache`` of pool-local layer ``layer_id``."""
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id)
        return self.caches[layer_id]

    def plan_write(self, loc: torch.Tensor) -> WritePlan:
        """The index-K write of a batch's slots ``loc [tokens]`` into any layer's cache (all share format and
        capacity), checked once. Slots come from SGLang's allocator: on a GPU the writer's slot-range check
        (a device sync) is skipped, so the plan holds no host value of ``loc`` and a CUDA graph may capture it."""
        return plan_write(self.caches[0], loc, check_loc=False)

    def set_key_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor,
                       plan: Optional[WritePlan] = None) -> None:
        """Quantize index keys ``k [tokens, 1, 128]`` or ``[tokens, 128]`` into slots ``loc [tokens]`` (0 tokens:
        nothing written). ``plan``: ``plan_write(loc)``, made once for the batch's layers (``loc`` is then
        not read); None plans here."""
        write_planned(self.plan_write(loc) if plan is None else plan, self.caches[layer_id], k.flatten(1))

    def get_kv_size_bytes(self):
        storages = {k.untyped_storage().data_ptr(): k.untyped_storage().nbytes() for k in self.k_buffer}
        for s in self.k_scale_buffer:
            if s is not None:
                storages[s.untyped_storage().data_ptr()] = s.untyped_storage().nbytes()
        return sum(storages.values()), 0


class MiniMaxM31SparseKVPool(MiniMaxSparseKVPool):
    """SGLang's M3 pool (main K/V of every layer) with an ``IndexKPool`` for the sparse layers.

    Every sparse layer must be K-only (``sparse_disable_index_value``), as in MiniMax-M3.
    ``get_index_k_buffer`` returns the layer's ``IndexKCache`` instead of one tensor.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        idx_head_dim: int,
        dense_layer_ids: list[int],
        sparse_layer_ids: list[int],
        device: str,
        settings: IndexKSettings,
        disable_value_sparse_layer_ids: Optional[list[int]] = None,
        enable_memory_saver: bool = False,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
    ):
        check_page_size(page_size)
        if idx_head_dim != INDEX_DIM:
            raise ValueError(f"sparse_index_dim must be {INDEX_DIM} for the index-K formats, got {idx_head_dim}")
        with_value = sorted(set(sparse_layer_ids) - set(disable_value_sparse_layer_ids or []))
        if with_value:
            raise NotImplementedError(
                f"sparse layers {with_value} keep an index value (sparse_disable_index_value = 0); "
                "the index-K formats cover K-only sparse layers (MiniMax-M3) only"
            )
        start = 0 if start_layer is None else start_layer
        end = len(dense_layer_ids) + len(sparse_layer_ids) if end_layer is None else end_layer
        # The parent builds the main pool over all local layers; given no sparse layers it builds
        # no index pool of its own.
        super().__init__(
            size=size, page_size=page_size, dtype=dtype, head_num=head_num, head_dim=head_dim,
            idx_head_dim=idx_head_dim, dense_layer_ids=sorted(dense_layer_ids + sparse_layer_ids),
            sparse_layer_ids=[], device=device, enable_memory_saver=enable_memory_saver,
            start_layer=start, end_layer=end,
        )
        local_sparse = [lid for lid in sparse_layer_ids if start <= lid < end]
        self.settings = settings
        self.sparse_layer_id_mapping = {lid: i for i, lid in enumerate(local_sparse)}
        self.index_k_layer_id_mapping = dict(self.sparse_layer_id_mapping)
        self.index_kv_layer_id_mapping = {}
        self.index_k_pool = IndexKPool(size, page_size, settings, len(local_sparse), device, enable_memory_saver)
        self.mem_usage += self.index_k_pool.mem_usage

    def _index_layer(self, layer_id: int) -> int:
        mapped = self.index_k_layer_id_mapping.get(layer_id)
        if mapped is None:
            raise ValueError(f"layer_id={layer_id} is not a sparse layer; sparse layers: "
                             f"{list(self.index_k_layer_id_mapping)}")
        return mapped

    def get_index_k_buffer(self, layer_id: int) -> IndexKCache:
        """The ``IndexKCache`` of sparse layer ``layer_id`` (``m3_kernels.formats.pages`` layout)."""
        self._wait_for_layer(layer_id)
        return self.index_k_pool.get_key_buffer(self._index_layer(layer_id))

    def get_index_kv_buffer(self, layer_id: int):
        raise NotImplementedError("MiniMax-M3.1 sparse layers keep no index value")

    def plan_index_k_write(self, loc: torch.Tensor) -> Optional[WritePlan]:
        """``IndexKPool.plan_write`` of a batch's slots ``loc``, once for all sparse layers; None where this
        rank holds no sparse layer."""
        return self.index_k_pool.plan_write(loc) if self.index_k_pool.caches else None

    def set_index_k_buffer(self, layer, loc: torch.Tensor, cache_idx_k: torch.Tensor,
                           plan: Optional[WritePlan] = None) -> None:
        self.index_k_pool.set_key_buffer(self._index_layer(layer.layer_id), loc, cache_idx_k, plan)

    def set_fused_kv_index_buffer(self, layer, loc, cache_k, cache_v, cache_idx_k, cache_idx_v,
                                  index_k_plan: Optional[WritePlan] = None) -> None:
        """Store main K/V and the index key of a sparse layer at ``loc`` (the index key through
        ``index_k_plan``, the batch's ``plan_index_k_write(loc)``, when given).

        K and V may be column views of a fused projection output (row stride larger than the
        row); they are made contiguous first, which SGLang's fused K/index store does not do.
        """
        if cache_idx_v is not None:
            raise NotImplementedError("MiniMax-M3.1 sparse layers keep no index value")
        self.set_kv_buffer(layer, loc, cache_k.contiguous(), cache_v.contiguous())
        self.set_index_k_buffer(layer, loc, cache_idx_k, index_k_plan)

    def get_index_k_state_buf_infos(self):
        """Per layer (base pointer, bytes, bytes per page) of the index cache (PD transfer by page id)."""
        pool = self.index_k_pool
        ptrs, lens, items = [], [], []
        for k, s in zip(pool.k_buffer, pool.k_scale_buffer):
            storage = k.untyped_storage()
            if s is not None and s.untyped_storage().data_ptr() != storage.data_ptr():
                raise NotImplementedError("PD transfer needs the single-region MXFP4 page layout")
            ptrs.append(storage.data_ptr())
            lens.append(storage.nbytes())
            items.append(storage.nbytes() // pool.num_pages)
        return ptrs, lens, items


def cell_bytes(num_dense: int, num_sparse: int, kv_heads: int, head_dim: int, kv_element_bytes: int,
               settings: IndexKSettings) -> int:
    """Bytes one token slot costs in ``MiniMaxM31SparseKVPool`` (local layers): main K and V of
    every layer plus one index key per sparse layer in the settings' format."""
    return (num_dense + num_sparse) * 2 * kv_heads * head_dim * kv_element_bytes + num_sparse * settings.fmt.token_bytes
