"""Host (HiCache) tier of the index-K pools: page layout per format, write-back and load-back of whole
pages bit for bit (last partial page included, untouched pages left as they were), flat pages for L3
storage, the per-format byte count in ``--hicache-size``, and the sidecar class swap."""

import re
import types

import pytest
import torch

from m3_kernels.formats import MXFP4_PAGE_BYTES, PAGE_SIZE, IndexKCache, IndexKFormat, ScaleRule
from sglang_m3.config import IndexKSettings
from sglang_m3.host_pool import (
    IndexKPoolHost,
    copy_pages,
    hicache_stack_counting_index_bytes,
    KOnlyPoolHost,
    kv_share_of_host_bytes,
    page_regions,
    slot_pages,
)
from sglang_m3.pool import MiniMaxM31SparseKVPool

FORMATS = list(IndexKFormat)


def _sglang_m3_hicache_stack_is_0516s() -> bool:
    """Whether SGLang's M3 HiCache stack is built from ``server_args`` as in 0.5.16 (the plugin refuses HiCache
    on releases where it is not, 0.5.23 among them)."""
    import inspect

    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    stack = getattr(hybrid_pool_assembler, "build_minimax_sparse_hicache_stack", None)
    return stack is not None and "server_args" in inspect.signature(stack).parameters


needs_0516_stack = pytest.mark.skipif(not _sglang_m3_hicache_stack_is_0516s(),
                                      reason="this SGLang's M3 HiCache stack is not 0.5.16's: HiCache is refused")
DEVICE_PAGES = 8  # token-slot pages of the device pool (plus its padding page)
HOST_PAGES = 6
SPARSE = (1, 2, 3)


def _pool(fmt):
    return MiniMaxM31SparseKVPool(
        size=DEVICE_PAGES * PAGE_SIZE, page_size=PAGE_SIZE, dtype=torch.bfloat16, head_num=4, head_dim=128,
        idx_head_dim=128, dense_layer_ids=[0], sparse_layer_ids=list(SPARSE), device="cpu",
        settings=IndexKSettings(IndexKFormat(fmt), ScaleRule.RCEIL, 7 if fmt == "mxfp4_rot" else None),
        disable_value_sparse_layer_ids=list(SPARSE), start_layer=0, end_layer=4,
    )


def _anchor(pages=HOST_PAGES):
    return types.SimpleNamespace(page_size=PAGE_SIZE, size=pages * PAGE_SIZE, page_num=pages, allocator=None)


def _slots(pages):
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).flatten()


def _page_bytes(pool, layer, page):
    """Every byte page ``page`` of pool-local sparse layer ``layer`` stores, from the cache's own views."""
    return _cache_page_bytes(pool.index_k_pool.caches[layer], page)


def _cache_page_bytes(cache, page):
    data, scale = cache.views()
    parts = [data[page].contiguous().view(torch.uint8).flatten()]
    if scale is not None:
        parts.append(scale[page].contiguous().flatten())
    return torch.cat(parts)


def _poison(pool, byte):
    for r in (r for c in pool.index_k_pool.caches for r in page_regions(c)):
        r.fill_(byte)


def _write_random(pool, gen, slots):
    for layer in SPARSE:
        k = torch.randn(slots.numel(), 1, 128, generator=gen).to(torch.bfloat16) * 4
        pool.set_index_k_buffer(types.SimpleNamespace(layer_id=layer), slots, k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_page_regions_cover_each_page_once_and_alias_the_cache(fmt, gen):
    cache = _pool(fmt).index_k_pool.caches[0]
    regions = page_regions(cache)
    assert all(r.dtype == torch.uint8 and r.shape[0] == cache.num_pages for r in regions)
    assert sum(r.shape[1] for r in regions) == IndexKFormat(fmt).token_bytes * PAGE_SIZE
    if IndexKFormat(fmt).is_mxfp4:
        assert [r.shape[1] for r in regions] == [MXFP4_PAGE_BYTES]  # data then scales, one region
    # A byte written through the regions lands in the cache's views and nowhere else.
    page = 3
    for r in regions:
        r[page] = torch.randint(0, 256, (r.shape[1],), generator=gen, dtype=torch.uint8)
    assert torch.equal(_cache_page_bytes(cache, page), torch.cat([r[page] for r in regions]))
    assert (_cache_page_bytes(cache, page - 1) == 0).all() and (_cache_page_bytes(cache, page + 1) == 0).all()


def test_page_regions_of_split_mxfp4_views_are_data_then_scales():
    cache = IndexKCache.new(3, "mxfp4", "cpu", single_region=False)
    regions = page_regions(cache)
    assert [r.shape for r in regions] == [(3, PAGE_SIZE * 64), (3, PAGE_SIZE * 4)]
    regions[1][2, 5] = 77
    assert cache.scale_e8m0[2, 1, 1] == 77


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_back_then_load_back_is_bit_exact_and_touches_only_the_named_pages(fmt, gen):
    pool = _pool(fmt)
    _poison(pool, 0xC3)
    # Device pages 1, 2, 3 and a last partial page 4 (5 of 128 rows written), slots in a shuffled order.
    slots = torch.arange(PAGE_SIZE, 4 * PAGE_SIZE + 5)
    _write_random(pool, gen, slots[torch.randperm(slots.numel(), generator=gen)])
    host = IndexKPoolHost(pool.index_k_pool, _anchor(), "page_first")
    assert host.size_per_token == IndexKFormat(fmt).token_bytes * len(SPARSE)
    for b in host.kv_buffer:
        b.fill_(0x5A)
    dev_pages, host_pages = [4, 1, 3, 2], [5, 0, 2, 3]
    host.backup_from_device_all_layer(pool.index_k_pool, _slots(host_pages), _slots(dev_pages), "direct")
    for layer in range(len(SPARSE)):
        for d, h in zip(dev_pages, host_pages):
            assert torch.equal(torch.cat([r[h] for r in host.host_regions(layer)]), _page_bytes(pool, layer, d))
        for h in set(range(HOST_PAGES)) - set(host_pages):  # untouched host pages keep their poison
            assert all((r[h] == 0x5A).all() for r in host.host_regions(layer))
    originals = {(layer, d): _page_bytes(pool, layer, d).clone() for layer in range(3) for d in dev_pages}
    _poison(pool, 0x3C)
    back = [6, 2, 7, 1]  # load to other device pages
    for layer in range(len(SPARSE)):
        host.load_to_device_per_layer(pool.index_k_pool, _slots(host_pages), _slots(back), layer, "kernel")
        for src, dst in zip(dev_pages, back):
            assert torch.equal(_page_bytes(pool, layer, dst), originals[(layer, src)])
        for p in set(range(DEVICE_PAGES + 1)) - set(back):  # untouched device pages keep their poison
            assert (_page_bytes(pool, layer, p) == 0x3C).all()


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp4_rot", "fp8"])
def test_loaded_back_cache_reads_the_same_keys(fmt, gen):
    """What a scorer reads (dequantized keys, rotation included) is the same after a round trip."""
    from m3_kernels.formats import dequantize_index_k

    pool = _pool(fmt)
    _write_random(pool, gen, torch.arange(PAGE_SIZE, 3 * PAGE_SIZE))
    cache = pool.index_k_pool.caches[1]
    before = dequantize_index_k(*cache.views())[1:3].clone()
    host = IndexKPoolHost(pool.index_k_pool, _anchor(), "layer_first")
    host.backup_from_device_all_layer(pool.index_k_pool, _slots([0, 4]), _slots([1, 2]), "direct")
    _poison(pool, 0)
    host.load_to_device_per_layer(pool.index_k_pool, _slots([0, 4]), _slots([1, 2]), 1, "direct")
    assert torch.equal(dequantize_index_k(*cache.views())[1:3], before)


def test_an_empty_transfer_moves_nothing():
    pool = _pool("mxfp4")
    host = IndexKPoolHost(pool.index_k_pool, _anchor(), "page_first")
    empty = torch.empty(0, dtype=torch.int64)
    host.backup_from_device_all_layer(pool.index_k_pool, empty, empty, "kernel")
    host.load_to_device_per_layer(pool.index_k_pool, empty, empty, 0, "kernel")
    assert all((b == 0).all() for b in host.kv_buffer)


@pytest.mark.parametrize("slots,rule", [
    (torch.arange(PAGE_SIZE - 1), "not a multiple"),
    (torch.arange(1, PAGE_SIZE + 1), "aligned runs"),
    (torch.arange(PAGE_SIZE).flip(0), "aligned runs"),
])
def test_slot_pages_takes_whole_aligned_pages_only(slots, rule):
    with pytest.raises(ValueError, match=rule):
        slot_pages(slots)


def test_slot_pages_maps_runs_to_pages():
    assert slot_pages(_slots([3, 0, 7])).tolist() == [3, 0, 7]


def test_copy_pages_wants_one_destination_per_source_page():
    src = [torch.zeros(2, 4, dtype=torch.uint8)]
    with pytest.raises(ValueError, match="one entry per page"):
        copy_pages(src, src, torch.tensor([0, 1]), torch.tensor([0]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_flat_data_page_round_trip_for_storage(fmt, gen):
    pool = _pool(fmt)
    _write_random(pool, gen, torch.arange(PAGE_SIZE, 3 * PAGE_SIZE))
    host = IndexKPoolHost(pool.index_k_pool, _anchor(), "page_first")
    host.backup_from_device_all_layer(pool.index_k_pool, _slots([1, 3]), _slots([1, 2]), "direct")
    flat = host.get_data_page(3 * PAGE_SIZE).clone()
    assert flat.numel() == host.page_bytes() == host.size_per_token * PAGE_SIZE
    assert host.get_dummy_flat_data_page().shape == flat.shape
    host.set_from_flat_data_page(4 * PAGE_SIZE, flat)
    for layer in range(len(SPARSE)):
        assert torch.equal(torch.cat([r[4] for r in host.host_regions(layer)]), _page_bytes(pool, layer, 2))
        assert all((r[5] == 0).all() for r in host.host_regions(layer))
    with pytest.raises(ValueError, match="multiple of 128"):
        host.get_data_page(PAGE_SIZE + 1)
    with pytest.raises(ValueError, match="bytes"):
        host.set_from_flat_data_page(0, flat[:-1])


def test_file_storage_round_trips_the_index_pages(tmp_path, gen):
    """SGLang's file (L3) backend stores and restores the index sidecar's pages through the flat-page API."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig, PoolName, PoolTransfer

    pool = _pool("mxfp4")
    _write_random(pool, gen, torch.arange(PAGE_SIZE, 3 * PAGE_SIZE))
    host = IndexKPoolHost(pool.index_k_pool, _anchor(), "page_first")
    host.backup_from_device_all_layer(pool.index_k_pool, _slots([0, 1]), _slots([1, 2]), "direct")
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="m3")
    store = HiCacheFile(config, file_path=str(tmp_path))
    store.register_mem_host_pool_v2(host, PoolName.INDEXER)
    put = PoolTransfer(name=PoolName.INDEXER, host_indices=_slots([0, 1]), keys=["a", "b"])
    assert store.batch_set_v2([put])[PoolName.INDEXER] == [True, True]
    expected = [torch.cat([r[h] for r in host.host_regions(layer)]).clone() for layer in range(3) for h in (0, 1)]
    for b in host.kv_buffer:
        b.fill_(0xEE)
    got = PoolTransfer(name=PoolName.INDEXER, host_indices=_slots([4, 2]), keys=["a", "b"])
    assert store.batch_get_v2([got])[PoolName.INDEXER] == [True, True]
    restored = [torch.cat([r[h] for r in host.host_regions(layer)]) for layer in range(3) for h in (4, 2)]
    assert all(torch.equal(a, b) for a, b in zip(restored, expected, strict=True))


def test_host_bytes_count_the_index_format():
    for fmt in FORMATS:
        pool = _pool(fmt)
        kv = 4 * 2 * 4 * 128 * 2  # 4 layers of bf16 K and V, 4 heads x 128
        index = len(SPARSE) * IndexKFormat(fmt).token_bytes
        assert kv_share_of_host_bytes(pool) == pytest.approx(kv / (kv + index))


def test_hicache_size_covers_kv_and_index_bytes():
    pool = _pool("mxfp4")
    seen = {}

    def original(**kwargs):
        seen.update(kwargs)
        return "stack"

    server_args = types.SimpleNamespace(hicache_size=10, hicache_ratio=2.0)
    assert hicache_stack_counting_index_bytes(original, sparse_pool=pool, server_args=server_args) == "stack"
    assert seen["server_args"].hicache_size == pytest.approx(10 * kv_share_of_host_bytes(pool))
    assert server_args.hicache_size == 10  # the server's own arguments are left alone
    # Ratio sizing (slots) and SGLang's own pool pass through unchanged.
    ratio = types.SimpleNamespace(hicache_size=0, hicache_ratio=2.0)
    hicache_stack_counting_index_bytes(original, sparse_pool=pool, server_args=ratio)
    assert seen["server_args"] is ratio
    hicache_stack_counting_index_bytes(original, sparse_pool=object(), server_args=server_args)
    assert seen["server_args"] is server_args


class _ResolvedArgs:
    """Like SGLang's resolved ServerArgs under its strict harness: a plain assignment to a field raises."""

    def __init__(self, hicache_size):
        object.__setattr__(self, "hicache_size", hicache_size)

    def __setattr__(self, name, value):
        raise AttributeError(f"server_args.{name} assigned after resolution")


def test_hicache_size_is_scaled_on_a_private_copy_of_resolved_server_args():
    pool = _pool("fp8")
    seen = {}
    resolved = _ResolvedArgs(hicache_size=4)
    hicache_stack_counting_index_bytes(lambda **kw: seen.update(kw), sparse_pool=pool, server_args=resolved)
    assert seen["server_args"].hicache_size == pytest.approx(4 * kv_share_of_host_bytes(pool))
    assert resolved.hicache_size == 4


def test_the_sidecar_class_makes_ours_for_our_pool_and_sglangs_otherwise():
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKOnlyPoolHost

    pool = _pool("fp8")
    host = KOnlyPoolHost(pool.index_k_pool, _anchor(), "page_first", allocator_type="default")
    assert type(host) is IndexKPoolHost and host.layout == "page_first"
    assert type(KOnlyPoolHost(pool.index_k_pool, anchor_host=_anchor(), layout="layer_first")) is IndexKPoolHost
    # Any other pool: SGLang's own class runs (its __init__ reads the device pool's attributes).
    assert issubclass(KOnlyPoolHost, MHATokenToKOnlyPoolHost)
    with pytest.raises(AttributeError, match="store_dtype"):
        KOnlyPoolHost(object(), _anchor(), "page_first")


def test_host_pages_must_be_the_index_page():
    pool = _pool("bf16")
    anchor = _anchor()
    anchor.page_size = 64
    with pytest.raises(ValueError, match="pages of 128"):
        IndexKPoolHost(pool.index_k_pool, anchor, "page_first")


@needs_0516_stack
@pytest.mark.parametrize("backend", [None, "file"])
def test_a_hicache_launch_with_file_storage_or_none_passes(backend):
    from sglang_m3.host_pool import check_hicache_launch

    check_hicache_launch(types.SimpleNamespace(hicache_storage_backend=backend))


def test_a_cpu_launch_is_refused_in_one_line():
    """SGLang's own K/V host pool cannot start without CUDA (seen: ``torch.cuda.cudart()`` raises in its
    ``cudaHostRegister`` on a CPU server), so the launch stops at the pool with one line instead."""
    from sglang_m3.host_pool import check_hicache_launch

    with pytest.raises(NotImplementedError, match="--enable-hierarchical-cache with --device cpu") as e:
        check_hicache_launch(types.SimpleNamespace(hicache_storage_backend=None, device="cpu"))
    assert "\n" not in str(e.value)


def test_other_storage_backends_are_refused_in_one_line():
    from sglang_m3.host_pool import check_hicache_launch

    with pytest.raises(NotImplementedError, match="--hicache-storage-backend mooncake") as e:
        check_hicache_launch(types.SimpleNamespace(hicache_storage_backend="mooncake"))
    assert "\n" not in str(e.value)


def test_a_changed_hicache_stack_is_refused(monkeypatch):
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    from sglang_m3.host_pool import check_hicache_launch

    monkeypatch.setattr(hybrid_pool_assembler, "build_minimax_sparse_hicache_stack", lambda *, params: None)
    with pytest.raises(NotImplementedError, match="--enable-hierarchical-cache"):
        check_hicache_launch(types.SimpleNamespace(hicache_storage_backend=None))


class _AnchorHost:
    """The K/V host pool's part in SGLang's ``HostPoolGroup``: owns the slots; its copies are recorded only."""

    layout, page_size, device = "page_first", PAGE_SIZE, "cpu"
    size, page_num, allocator = HOST_PAGES * PAGE_SIZE, HOST_PAGES, None

    def __init__(self):
        self.calls = []

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        self.calls.append(("backup", None))

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend):
        self.calls.append(("load", layer_id))


@needs_0516_stack
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4_rot"])
def test_sglangs_host_pool_group_drives_the_index_sidecar_by_the_kv_slots(fmt, gen):
    """SGLang's ``HostPoolGroup`` and ``build_pool_entry`` wired as its M3 stack wires them (the index entry's
    layer mapping from ``index_k_layer_id_mapping``, a sidecar transfer taking the K/V slots): write-back then
    load-back over all main layers (the dense one skipped) restores every sparse layer's pages bit for bit."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.memory_pool_host import HostPoolGroup

    pool = _pool(fmt)
    _poison(pool, 0x11)
    _write_random(pool, gen, torch.arange(2 * PAGE_SIZE, 5 * PAGE_SIZE))
    anchor = _AnchorHost()
    index_host = KOnlyPoolHost(pool.index_k_pool, anchor, "page_first", allocator_type="default")
    layers = pool.main_pool.layer_num
    group = HostPoolGroup([
        build_pool_entry(name=PoolName.KV, host_pool=anchor, device_pool=pool.main_pool,
                         layer_mapping={i: i for i in range(layers)}, transfer_layer_num=layers, is_anchor=True),
        build_pool_entry(name=PoolName.INDEXER, host_pool=index_host, device_pool=pool.index_k_pool,
                         layer_mapping=dict(pool.index_k_layer_id_mapping), transfer_layer_num=layers),
    ])
    kv_host, kv_device = _slots([4, 1, 0]), _slots([2, 3, 4])

    def sidecar(device_indices):
        return [PoolTransfer(name=PoolName.INDEXER, host_indices=kv_host, device_indices=device_indices,
                             indices_from_pool=PoolName.KV)]

    group.backup_from_device_all_layer(pool.main_pool, kv_host, kv_device, "kernel", pool_transfers=sidecar(kv_device))
    before = {(layer, p): _page_bytes(pool, layer, p).clone() for layer in range(3) for p in (2, 3, 4)}
    _poison(pool, 0x22)
    back = _slots([7, 5, 6])
    for layer_id in range(layers):
        group.load_to_device_per_layer(pool.main_pool, kv_host, back, layer_id, "kernel", pool_transfers=sidecar(back))
    for layer in range(3):
        for src, dst in zip((2, 3, 4), (7, 5, 6)):
            assert torch.equal(_page_bytes(pool, layer, dst), before[(layer, src)])
        assert (_page_bytes(pool, layer, 2) == 0x22).all()
    assert anchor.calls == [("backup", None)] + [("load", i) for i in range(layers)]


# ---- servers with HiCache: a CPU one (SGLang's CUDA-only K/V host copies replaced by torch), a GPU one ----

DEVICE_SLOTS = 4096  # holds one long prompt: the next one pushes it to the host
LONG = 20 * PAGE_SIZE + 37  # past 16 blocks, so top-16 selection reads the index keys


def _records(path):
    import json

    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _selection_rows(records):
    """{(mode, layer, position): selected blocks per index head} over ``records``."""
    return {(rec["mode"], rec["layer"], pos): [head[r] for head in rec["selected"]]
            for rec in records for r, pos in enumerate(rec["positions"])}


def _server_args(fmt, record, device_slots):
    import json

    return ["--index-k-format", IndexKFormat(fmt).value, "--skip-tokenizer-init", "--enable-hierarchical-cache",
            "--max-total-tokens", str(device_slots), "--json-model-override-args",
            json.dumps({"index_k_debug_record": str(record)})]


def _long_prompts(n):
    import os
    import random

    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    return [[rng.randrange(3, 2048) for _ in range(LONG)] for _ in range(n)]  # configs/msa-small: 2,048 ids


def _check_host_round_trip(server, record):
    """A prompt past 16 blocks cold, again (a device prefix hit), then after another long prompt pushed it to
    the host, again (a host hit): the same greedy tokens, and the host hit's new rows (and decode rows) pick
    the cold run's blocks, so the loaded-back index keys are the ones the cold run wrote."""
    prompt, filler = _long_prompts(2)
    cold, cold_cached = _generate(server, prompt, max_new_tokens=4)
    cold_rows = _selection_rows(_records(record))
    device_hit, device_cached = _generate(server, prompt, max_new_tokens=4)
    _generate(server, filler, max_new_tokens=1)
    n = len(_records(record))
    host_hit, host_cached = _generate(server, prompt, max_new_tokens=4)
    host_rows = _selection_rows(_records(record)[n:])
    assert cold_cached["device"] + cold_cached["host"] == 0
    assert device_cached["device"] >= (LONG // PAGE_SIZE) * PAGE_SIZE
    assert host_cached["host"] >= (LONG // PAGE_SIZE) * PAGE_SIZE, host_cached
    assert device_hit == cold and host_hit == cold
    extend = [k for k in host_rows if k[0] == "extend"]
    assert extend and min(k[2] for k in extend) >= host_cached["host"] + host_cached["device"]
    shared = [k for k in host_rows if k in cold_rows]
    assert len(shared) >= len(extend)
    assert all(host_rows[k] == cold_rows[k] for k in shared), [k for k in shared if host_rows[k] != cold_rows[k]][:5]


@needs_0516_stack
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])  # one per page layout (bf16 and mxfp4_rot share them): 2.5 min each
def test_a_prefix_loaded_back_from_the_host_on_a_cpu_server_selects_and_answers_as_cold(fmt, tmp_path):
    """configs/msa-small (trained weights) with HiCache on a CPU, ``_check_host_round_trip``: SGLang's radix
    tree, controller and our index sidecar as on a GPU; only SGLang's K/V host copies (CUDA-only) come from
    ``hicache_cpu/``. The GPU test runs every format."""
    import os
    from pathlib import Path

    from sglang_m3.server import Server, cpu_args

    repo = Path(__file__).resolve().parents[2]
    record = tmp_path / "selection.jsonl"
    # Spawned children run hicache_cpu/sitecustomize.py at their start (forked ones were seen without its hooks).
    env = dict(os.environ, M3_TEST_HICACHE_ON_CPU="1", SGLANG_M3_CPU_START="spawn",
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent / "hicache_cpu"),
                                                        os.environ.get("PYTHONPATH")])))
    args = [*cpu_args(DEVICE_SLOTS), *_server_args(fmt, record, DEVICE_SLOTS),
            "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first", "--hicache-size", "1"]
    with Server(repo / "configs" / "msa-small", args, tmp_path / "server.log", cwd=repo, env=env) as server:
        _check_host_round_trip(server, record)
    # --hicache-size 1: the K/V and the index-K host buffers share the 1 GB (SGLang's log, GB to 2 decimals).
    log = (tmp_path / "server.log").read_text()
    kv = re.findall(r"Allocating ([0-9.]+) GB host memory for hierarchical KV cache", log)
    index = re.findall(rf"Allocating ([0-9.]+) GB host memory for the {IndexKFormat(fmt).value} index-K cache", log)
    assert len(kv) == len(index) == 1 and float(index[0]) > 0, (kv, index)
    assert float(kv[0]) + float(index[0]) == pytest.approx(1.0, abs=0.011)


# ---- on a GPU: a real server per format ------------------------------------------------------

def _gpu_server(fmt, tmp_path, *extra, env=None):
    from pathlib import Path

    from sglang_m3.server import Server

    repo = Path(__file__).resolve().parents[2]
    args = [*_server_args(fmt, tmp_path / "selection.jsonl", DEVICE_SLOTS), "--attention-backend", "triton",
            "--sampling-backend", "pytorch", "--grammar-backend", "none", "--chunked-prefill-size", "1024",
            "--max-running-requests", "4", "--disable-cuda-graph", "--mem-fraction-static", "0.3", *extra]
    server = Server(repo / "configs" / "msa-small", args, tmp_path / "server.log", cwd=repo, env=env, timeout_s=600)
    return server.start().wait_ready()


def _generate(server, input_ids, max_new_tokens=8):
    import json
    import urllib.request

    payload = {"input_ids": input_ids,
               "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(server.url + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        body = json.loads(r.read())
    meta = body["meta_info"]
    details = meta.get("cached_tokens_details") or {"device": meta.get("cached_tokens", 0), "host": 0}
    return body["output_ids"], details


@needs_0516_stack
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_prefix_loaded_back_from_the_host_selects_and_answers_as_cold_on_cuda(fmt, tmp_path):
    """``_check_host_round_trip`` on a GPU server (``--attention-backend triton``, configs/msa-small, a
    4,096-slot device pool, eager so the selection record sees every forward)."""
    server = _gpu_server(fmt, tmp_path)
    try:
        _check_host_round_trip(server, tmp_path / "selection.jsonl")
    finally:
        server.stop()


@needs_0516_stack
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_prefix_restored_from_file_storage_gives_the_cold_tokens_on_cuda(tmp_path):
    """The same with SGLang's file (L3) backend, MXFP4: after ``/flush_cache`` empties the device and host
    tiers, the prompt's pages (K/V and index-K, each its own file) come back from the files."""
    import json
    import os
    import time
    import urllib.request

    (prompt,) = _long_prompts(1)
    env = dict(os.environ, SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=str(tmp_path / "l3"))
    server = _gpu_server("mxfp4", tmp_path, "--hicache-storage-backend", "file",
                         "--hicache-storage-prefetch-policy", "wait_complete", env=env)
    try:
        cold, _ = _generate(server, prompt)
        time.sleep(5)  # host -> file write-back runs on SGLang's storage thread
        stored = sorted(p.name for p in (tmp_path / "l3").iterdir())
        assert any("INDEXER" in name or "indexer" in name for name in stored), stored[:10]
        with urllib.request.urlopen(urllib.request.Request(server.url + "/flush_cache", data=b"{}"), timeout=60) as r:
            assert r.status == 200, json.loads(r.read() or b"{}")
        restored, cached = _generate(server, prompt)
        assert cached.get("storage", 0) >= (LONG // PAGE_SIZE) * PAGE_SIZE, (cached, server.log_tail())
        assert restored == cold
    finally:
        server.stop()
