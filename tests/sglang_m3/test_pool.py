"""Index-K pools: one ``IndexKCache`` per sparse layer (checked when made), writes through ``write_index_k``,
sizes from ``IndexKFormat.token_bytes``."""

import pytest
import torch

from m3_kernels.formats import (
    MXFP4_PAGE_BYTES,
    PAGE_SIZE,
    IndexKCache,
    IndexKFormat,
    ScaleRule,
    quantize_index_k,
)
from sglang_m3.config import IndexKSettings
from sglang_m3.pool import MiniMaxM31SparseKVPool, cell_bytes, num_index_pages

FORMATS = list(IndexKFormat)
SIZE = 3 * PAGE_SIZE  # token slots; the pool adds one padding page


def _pool(fmt, page_size=PAGE_SIZE, sparse=(1, 2, 3), k_only=(1, 2, 3), sign_seed=None, scale_rule=ScaleRule.RCEIL,
          idx_head_dim=128, end_layer=4):
    return MiniMaxM31SparseKVPool(
        size=SIZE, page_size=page_size, dtype=torch.bfloat16, head_num=4, head_dim=128, idx_head_dim=idx_head_dim,
        dense_layer_ids=[0], sparse_layer_ids=list(sparse), device="cpu",
        settings=IndexKSettings(IndexKFormat(fmt), scale_rule, sign_seed),
        disable_value_sparse_layer_ids=list(k_only), start_layer=0, end_layer=end_layer,
    )


class _Layer:
    def __init__(self, layer_id):
        self.layer_id = layer_id


def _poison(t):
    if t is None:
        return
    if t.dtype == torch.uint8:
        t.fill_(0xA5)
    else:
        t.view(torch.uint8).fill_(0x5A)


@pytest.mark.parametrize("fmt,scale_rule", [(f, ScaleRule.RCEIL) for f in FORMATS]
                         + [("mxfp4", ScaleRule.FLOOR), ("mxfp4_rot", ScaleRule.FLOOR)])
def test_set_index_k_stores_the_format_rows_at_loc_only(fmt, scale_rule, gen):
    pool = _pool(fmt, sign_seed=7 if fmt == "mxfp4_rot" else None, scale_rule=scale_rule)
    for layer in (1, 2, 3):
        for t in pool.get_index_k_buffer(layer).views():
            _poison(t)
    before = [[None if t is None else t.clone() for t in pool.get_index_k_buffer(layer).views()]
              for layer in (1, 2, 3)]
    # Slots around page edges and in the last partial page, in a shuffled order.
    loc = torch.tensor([1, 127, 128, 129, 255, 256, 3 * PAGE_SIZE + 5, 300, 2 * PAGE_SIZE + 1])
    loc = loc[torch.randperm(loc.numel(), generator=gen)]
    k = torch.randn(loc.numel(), 1, 128, generator=gen).to(torch.bfloat16) * 3
    pool.set_fused_kv_index_buffer(_Layer(2), loc, torch.randn(loc.numel(), 4, 128).to(torch.bfloat16),
                                   torch.randn(loc.numel(), 4, 128).to(torch.bfloat16), k, None)
    rows, scale_rows = quantize_index_k(k.reshape(-1, 128), fmt, scale_rule, pool.settings.sign_seed)
    k_cache, k_scale = pool.get_index_k_buffer(2).views()
    page, row = loc // PAGE_SIZE, loc % PAGE_SIZE
    assert torch.equal(k_cache[page, row].view(torch.uint8), rows.view(torch.uint8))
    if scale_rows is not None:
        assert torch.equal(k_scale[page, row], scale_rows)
    # Nothing else moved: other slots of layer 2, and layers 1 and 3 entirely.
    written = torch.zeros(k_cache.shape[0] * PAGE_SIZE, dtype=torch.bool)
    written[loc] = True
    flat = k_cache.reshape(-1, *k_cache.shape[2:]).view(torch.uint8)
    assert torch.equal(flat[~written], before[1][0].reshape(flat.shape[0], -1).view(torch.uint8)[~written])
    if k_scale is not None:  # MXFP4: the scale bytes of the other slots too
        flat_scale = k_scale.reshape(flat.shape[0], -1)
        assert torch.equal(flat_scale[~written], before[1][1].reshape(flat.shape[0], -1)[~written])
    for i in (0, 2):
        for now, was in zip(pool.get_index_k_buffer((1, 2, 3)[i]).views(), before[i]):
            assert now is None or torch.equal(now.view(torch.uint8), was.view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(0, 1, 128), (0, 128)])
def test_an_empty_write_changes_nothing(fmt, shape):
    """0 tokens (a batch whose requests brought no new token to this layer) is a no-op, as SGLang's own store is."""
    pool = _pool(fmt, sign_seed=7 if fmt == "mxfp4_rot" else None)
    for t in pool.get_index_k_buffer(2).views():
        _poison(t)
    before = [None if t is None else t.clone() for t in pool.get_index_k_buffer(2).views()]
    empty = torch.zeros(0, 4, 128, dtype=torch.bfloat16)
    pool.set_fused_kv_index_buffer(_Layer(2), torch.zeros(0, dtype=torch.long), empty, empty,
                                   torch.zeros(shape, dtype=torch.bfloat16), None)
    for now, was in zip(pool.get_index_k_buffer(2).views(), before):
        assert now is None or torch.equal(now.view(torch.uint8), was.view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_index_bytes_follow_token_bytes(fmt):
    pool = _pool(fmt)
    pages = num_index_pages(SIZE, PAGE_SIZE)
    k_bytes, v_bytes = pool.index_k_pool.get_kv_size_bytes()
    assert v_bytes == 0 and k_bytes == 3 * pages * PAGE_SIZE * IndexKFormat(fmt).token_bytes
    if IndexKFormat(fmt).is_mxfp4:
        assert pool.get_index_k_state_buf_infos()[2] == [MXFP4_PAGE_BYTES] * 3


def test_cell_bytes_raise_capacity_by_the_byte_ratio():
    """Full-size M3.1 (60 layers, 3 dense, 4 KV heads x 128, bf16 K/V): slots per GiB per format."""
    per_format = {f: cell_bytes(3, 57, 4, 128, 2, IndexKSettings(f, ScaleRule.RCEIL, None)) for f in FORMATS}
    assert per_format[IndexKFormat.BF16] - per_format[IndexKFormat.MXFP4] == 57 * (256 - 68)
    assert per_format[IndexKFormat.FP8] - per_format[IndexKFormat.MXFP4] == 57 * (128 - 68)
    budget = 1 << 30
    tokens = {f: budget // c for f, c in per_format.items()}
    assert tokens[IndexKFormat.MXFP4] > tokens[IndexKFormat.FP8] > tokens[IndexKFormat.BF16]


@pytest.mark.parametrize("page_size", [1, 64, 256])
def test_page_size_must_be_one_block(page_size):
    with pytest.raises(ValueError, match=f"page_size must be 128 .*got {page_size}; launch with --page-size 128"):
        _pool("mxfp4", page_size=page_size)


@pytest.mark.parametrize("size", [1, 127, 128, 129, 300, 384])
def test_index_pages_cover_every_slot(size):
    """Slots 0 .. size + page_size - 1 (slot 0's page pads), for any size, page-aligned or not."""
    assert num_index_pages(size, PAGE_SIZE) == -(-(size + PAGE_SIZE) // PAGE_SIZE)


def test_index_dim_must_be_128():
    with pytest.raises(ValueError, match="sparse_index_dim must be 128 for the index-K formats, got 64"):
        _pool("mxfp4", idx_head_dim=64)


def test_a_pipeline_stage_holds_only_its_own_sparse_layers():
    pool = _pool("mxfp4", end_layer=3)  # this stage runs layers 0-2: sparse layers 1 and 2, not 3
    assert pool.index_k_layer_id_mapping == {1: 0, 2: 1}
    assert len(pool.index_k_pool.k_buffer) == 2


def test_index_value_layers_are_rejected():
    with pytest.raises(NotImplementedError, match="index value"):
        _pool("fp8", k_only=(1, 2))


def test_dense_layer_has_no_index_cache():
    with pytest.raises(ValueError, match="not a sparse layer"):
        _pool("bf16").get_index_k_buffer(0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_layer_gets_one_cache_of_the_settings(fmt):
    """``get_index_k_buffer`` returns the layer's ``IndexKCache``: the settings' format, scale rule and sign
    seed travel with its views (the same tensors SGLang's code sees in k_buffer / k_scale_buffer)."""
    pool = _pool(fmt, sign_seed=7 if fmt == "mxfp4_rot" else None, scale_rule=ScaleRule.FLOOR)
    caches = [pool.get_index_k_buffer(layer) for layer in (1, 2, 3)]
    assert len({id(c) for c in caches}) == 3 and all(isinstance(c, IndexKCache) for c in caches)
    for i, cache in enumerate(caches):
        assert (cache.fmt, cache.scale_rule, cache.sign_seed) == (IndexKFormat(fmt), ScaleRule.FLOOR,
                                                                  pool.settings.sign_seed)
        assert cache.data is pool.index_k_pool.k_buffer[i] and cache.scale_e8m0 is pool.index_k_pool.k_scale_buffer[i]
        assert cache.num_pages == num_index_pages(SIZE, PAGE_SIZE) and cache.page_size == PAGE_SIZE
    assert pool.get_index_k_buffer(2) is caches[1]  # made once, not per call


def test_the_pool_checks_each_cache_once_when_made(monkeypatch):
    """Validation of the views runs at pool creation (once per layer), never on a later get or write."""
    from m3_kernels.formats import cache as cache_module

    calls = []
    check = cache_module.check_index_k_cache
    monkeypatch.setattr(cache_module, "check_index_k_cache", lambda *a: calls.append(1) or check(*a))
    pool = _pool("mxfp4")
    assert len(calls) == 3
    k = torch.randn(2, 1, 128).to(torch.bfloat16)
    for _ in range(3):
        pool.get_index_k_buffer(2)
        pool.set_index_k_buffer(_Layer(2), torch.tensor([5, 6]), k)
    assert len(calls) == 3
