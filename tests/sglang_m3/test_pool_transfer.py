"""PD transfer of the index-K cache: the byte ranges SGLang's disaggregation sends for a request's pages, built
from ``MiniMaxM31SparseKVPool.get_index_k_state_buf_infos``, copied between two pools of one format.

SGLang (0.5.16, ``disaggregation/``) ships the index cache as state ``MINIMAX_INDEX_K``: per sparse layer one
buffer ``(base pointer, bytes, bytes per page)``, addressed by the request's page ids (the same ids as the main
K/V, ``_dsa_payload``), sent "flat" (``force_flat``): runs of consecutive page ids on both sides
(``group_concurrent_contiguous``) become one ``(src + first * item, dst + first * item, item * run)`` copy per
buffer. Here a ``memcpy`` through the pools' storages stands in for the transport (Mooncake or NIXL need RDMA or
their own engines; SGLang's ``fake`` backend moves no bytes).
"""

import numpy as np
import pytest
import torch

from m3_kernels.formats import PAGE_SIZE, IndexKFormat, ScaleRule
from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous
from sglang_m3.config import IndexKSettings
from sglang_m3.pool import MiniMaxM31SparseKVPool

SPARSE = [1, 2, 3]
POOL_PAGES = 16


def _pool(fmt, device):
    return MiniMaxM31SparseKVPool(
        size=POOL_PAGES * PAGE_SIZE - PAGE_SIZE, page_size=PAGE_SIZE, dtype=torch.bfloat16, head_num=4, head_dim=128,
        idx_head_dim=128, dense_layer_ids=[0], sparse_layer_ids=SPARSE, device=device,
        settings=IndexKSettings(IndexKFormat(fmt), ScaleRule.RCEIL, 7 if fmt == "mxfp4_rot" else None),
        disable_value_sparse_layer_ids=SPARSE, start_layer=0, end_layer=4)


def transfer_descriptors(src_infos, dst_infos, src_pages, dst_pages):
    """``(src_addr, dst_addr, length)`` per index buffer and run of consecutive pages, as SGLang's Mooncake
    sender forms them for ``MINIMAX_INDEX_K`` (``_send_kvcache_generic(..., force_flat=True)``)."""
    (src_ptrs, _, items), (dst_ptrs, _, dst_items) = src_infos, dst_infos
    assert items == dst_items, "both servers must hold the same format"
    src_runs, dst_runs = group_concurrent_contiguous(src_pages, dst_pages)
    return [(src + int(s[0]) * item, dst + int(d[0]) * item, item * len(s))
            for src, dst, item in zip(src_ptrs, dst_ptrs, items) for s, d in zip(src_runs, dst_runs)]


def _byte_views(pool):
    """Each index buffer's whole storage as uint8, keyed by base address (what the descriptors point into)."""
    views = {}
    for cache in pool.index_k_pool.caches:
        storage = cache.data.untyped_storage()
        views[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(
            storage, 0, (storage.nbytes(),), (1,))
    return views


def _memcpy(descriptors, src_pool, dst_pool):
    """Copy each descriptor's bytes; every range must lie inside one buffer of its pool."""
    src_views, dst_views = _byte_views(src_pool), _byte_views(dst_pool)

    def locate(views, addr, length):
        for base, view in views.items():
            if base <= addr and addr + length <= base + view.numel():
                return view[addr - base:addr - base + length]
        raise AssertionError(f"range [{addr}, {addr + length}) is outside every index buffer")

    for src, dst, length in descriptors:
        locate(dst_views, dst, length).copy_(locate(src_views, src, length))


def _page_views(cache, page):
    """The page as the scorers read it (data, and scales where the format has them), as bytes (poison holds NaNs)."""
    views = [cache.data[page]] + ([] if cache.scale_e8m0 is None else [cache.scale_e8m0[page]])
    return [v.view(torch.uint8) for v in views]


def _check_transfer(fmt, device, gen):
    src, dst = _pool(fmt, device), _pool(fmt, device)
    # A request of 5 full pages and a last partial one, on scattered pages; different pages on the decode side.
    tokens = 5 * PAGE_SIZE + 37
    src_pages = torch.tensor([3, 4, 9, 10, 11, 2])
    dst_pages = torch.tensor([12, 13, 14, 1, 7, 8])
    loc = (src_pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).flatten()[:tokens].to(device)
    for layer_id in SPARSE:
        k = (torch.randn(tokens, 1, 128, generator=gen) * torch.rand(1, 1, 128, generator=gen) * 8).bfloat16()
        src.set_index_k_buffer(type("L", (), {"layer_id": layer_id}), loc, k.to(device))
    for view in _byte_views(dst).values():  # poison: every byte of the decode side, kept to check untouched pages
        view.copy_(torch.randint(0, 256, view.shape, generator=gen, dtype=torch.uint8).to(device))
    before = [[v.clone() for p in range(POOL_PAGES) for v in _page_views(c, p)] for c in dst.index_k_pool.caches]

    infos = src.get_index_k_state_buf_infos()
    assert len(infos[0]) == len(SPARSE)
    assert infos[2] == [fmt_bytes * PAGE_SIZE for fmt_bytes in [IndexKFormat(fmt).token_bytes] * len(SPARSE)]
    descriptors = transfer_descriptors(infos, dst.get_index_k_state_buf_infos(), src_pages.numpy().astype("int32"),
                                       dst_pages.numpy().astype("int32"))
    _memcpy(descriptors, src, dst)

    moved = dict(zip(dst_pages.tolist(), src_pages.tolist()))
    for s_cache, d_cache, old in zip(src.index_k_pool.caches, dst.index_k_pool.caches, before):
        for page in range(POOL_PAGES):
            got = _page_views(d_cache, page)
            want = _page_views(s_cache, moved[page]) if page in moved else old[page * len(got):(page + 1) * len(got)]
            for g, w in zip(got, want):
                assert torch.equal(g, w), f"{fmt}: page {page} of the decode pool"
    # The request's keys read back from the decode pool's slots equal the prefill pool's (data and scales).
    dst_loc = (dst_pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).flatten()[:tokens]
    for s_cache, d_cache in zip(src.index_k_pool.caches, dst.index_k_pool.caches):
        for s_view, d_view in zip(s_cache.views(), d_cache.views()):
            if s_view is not None:  # [slots, ...] bytes
                d_slots, s_slots = (b.reshape(-1, *b.shape[2:]) for b in (d_view.view(torch.uint8),
                                                                          s_view.view(torch.uint8)))
                assert torch.equal(d_slots[dst_loc.to(device)], s_slots[loc])


@pytest.mark.parametrize("fmt", [f.value for f in IndexKFormat])
def test_pd_transfer_descriptors_move_a_requests_index_pages_byte_for_byte(fmt, gen):
    """For each format: the descriptors SGLang's transfer builds from our buffer infos copy a request's index-K
    pages (data and, for MXFP4, the per-page e8m0 scales) into the decode pool's pages, byte for byte; every
    other page of the decode pool keeps its (poisoned) bytes; one buffer per sparse layer, one page per item."""
    _check_transfer(fmt, "cpu", gen)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [f.value for f in IndexKFormat])
def test_pd_transfer_descriptors_on_gpu(fmt, gen):
    """The same on CUDA pools (device copies by the descriptors' addresses)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check_transfer(fmt, "cuda", gen)


def test_descriptors_merge_runs_of_consecutive_pages():
    """Consecutive page ids on both sides travel as one range per buffer; a break on either side splits it."""
    infos = ([1000, 50000], [0, 0], [100, 100])
    got = transfer_descriptors(infos, ([7000, 90000], [0, 0], [100, 100]), np.array([3, 4, 5, 9], dtype=np.int32),
                               np.array([1, 2, 6, 7], dtype=np.int32))
    assert got == [(1300, 7100, 200), (1500, 7600, 100), (1900, 7700, 100),
                   (50300, 90100, 200), (50500, 90600, 100), (50900, 90700, 100)]
