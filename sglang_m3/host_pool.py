"""Host (HiCache) tier of the paged MiniMax-M3.1 index-K cache.

SGLang's own M3 HiCache (``hybrid_pool_assembler.build_minimax_sparse_hicache_stack``) keeps the main
K/V in a host pool that owns the host slot allocator (the anchor) and gives the index-K pool a host
sidecar (``PoolName.INDEXER``, ``indices_from_pool=KV``): every write-back and load-back of the index
cache uses the very host and device slot indices of the K/V transfer. Its sidecar class,
``MHATokenToKOnlyPoolHost``, copies one ``[1, 128]`` row per slot; our index cache is paged (bf16 / fp8
``[pages, 128, 128]``, MXFP4 pages of ``[128 x 64 B data][128 x 4 B e8m0 scales]``), so
``IndexKPoolHost`` takes its place for an ``IndexKPool`` and copies whole pages: host slot ``h`` is host
page ``h // 128``, row ``h % 128``, exactly as on the device, so a page moves as its bytes (data and
scales together) and every format round-trips bit for bit.

SGLang's radix tree, controller, host allocator and storage (L3) code stay in charge; the plugin only
puts ``KOnlyPoolHost`` in the place of SGLang's sidecar class (it makes an ``IndexKPoolHost`` for our pool
and is SGLang's class for any other) and counts the index bytes in ``--hicache-size``
(``hicache_stack_counting_index_bytes``). This module imports the pools lazily: the plugin loads it in
every SGLang process.
"""

import copy
import logging

import psutil
import torch

from m3_kernels.formats import MXFP4_PAGE_BYTES, MXFP4_PAGE_DATA_BYTES, PAGE_SIZE, IndexKCache
from sglang.srt.mem_cache.pool_host.base import HICACHE_HOST_MEMORY_RESERVE_BYTES, HostKVCache
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKOnlyPoolHost

logger = logging.getLogger(__name__)


def page_regions(cache: IndexKCache) -> list[torch.Tensor]:
    """The bytes of ``cache`` as uint8 ``[pages, region_bytes]`` views, one row per page, that together hold
    everything a page stores: bf16 / fp8 one region (``128 x 256`` or ``128 x 128`` B); MXFP4 in the
    single-region page one region of ``MXFP4_PAGE_BYTES`` (data then scales); MXFP4 in separate data and
    scale tensors two regions (``128 x 64`` B, ``128 x 4`` B)."""
    data, scale = cache.views()
    if scale is None:
        return [data.view(torch.uint8).flatten(1)]
    single = (data.stride(0) == scale.stride(0) == MXFP4_PAGE_BYTES
              and scale.data_ptr() - data.data_ptr() == MXFP4_PAGE_DATA_BYTES)
    if single:
        return [data.as_strided((cache.num_pages, MXFP4_PAGE_BYTES), (MXFP4_PAGE_BYTES, 1))]
    return [data.flatten(1), scale.flatten(1)]


def slot_pages(indices: torch.Tensor) -> torch.Tensor:
    """Page ids of token slots ``indices`` given as whole pages (``[n * 128]``, each run of 128 one aligned
    page, as SGLang's paged allocators hand them out): ``indices[::128] // 128``, on ``indices``' device.

    ValueError unless the count is a multiple of 128; slots on the CPU are also checked to be whole aligned
    pages (on a GPU that check would cost a synchronisation per transfer)."""
    n = indices.numel()
    if n % PAGE_SIZE:
        raise ValueError(f"index-K host transfers move whole pages: got {n} slots, not a multiple of {PAGE_SIZE}")
    runs = indices.view(-1, PAGE_SIZE)
    pages = torch.div(runs[:, 0], PAGE_SIZE, rounding_mode="floor")
    if indices.device.type == "cpu" and n:
        expected = pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, dtype=indices.dtype)
        if not torch.equal(runs, expected):
            raise ValueError("index-K host transfers move whole pages: slots must come in aligned runs of "
                             f"{PAGE_SIZE} (page p = slots p*{PAGE_SIZE} .. p*{PAGE_SIZE}+{PAGE_SIZE - 1})")
    return pages


def copy_pages(src: list[torch.Tensor], dst: list[torch.Tensor], src_pages: torch.Tensor,
               dst_pages: torch.Tensor) -> None:
    """``dst[r][dst_pages[i]] = src[r][src_pages[i]]`` for every region ``r`` (``page_regions`` views); the
    gather runs on the source's device, the scatter on the destination's (an empty transfer does nothing)."""
    if src_pages.numel() != dst_pages.numel():
        raise ValueError(f"src_pages and dst_pages must have one entry per page, got {src_pages.numel()} "
                         f"and {dst_pages.numel()}")
    if src_pages.numel() == 0:
        return
    for s, d in zip(src, dst, strict=True):
        rows = s.index_select(0, src_pages.to(s.device))
        # Device to host blocks (the CPU scatter reads the rows); host to device may run on the stream.
        rows = rows.to(d.device, non_blocking=d.device.type != "cpu")
        d.index_copy_(0, dst_pages.to(d.device), rows)


class IndexKPoolHost(HostKVCache):
    """Host copy of an ``IndexKPool``: per region of a page (``page_regions``) one uint8 host buffer
    ``[layers, host_pages, region_bytes]``, keyed on the anchor (K/V) host pool's slots.

    - ``size`` / ``page_num``: the anchor's (host slot ``h`` is page ``h // 128``, row ``h % 128``);
    - ``size_per_token``: the format's bytes per token times the local sparse layers (MXFP4: 68 B a layer);
    - ``backup_from_device_all_layer`` / ``load_to_device_per_layer``: page copies keyed on the K/V transfer's
      host and device slots (whole pages; either device, any ``io_backend``: the copies are torch ops);
    - ``get_data_page`` / ``set_from_flat_data_page``: one host page of every layer as flat bytes (L3 storage).
    """

    def __init__(self, device_pool, anchor_host, layout: str, pin_memory: bool | None = None,
                 device: str = "cpu", allocator_type=None):
        if anchor_host.page_size != PAGE_SIZE:
            raise ValueError(f"the index-K host pool needs HiCache pages of {PAGE_SIZE} slots, "
                             f"got {anchor_host.page_size}")
        # HostKVCache.__init__ sizes and allocates a K/V buffer of its own: this sidecar takes the anchor's slots.
        self.device_pool = device_pool
        self.page_size = PAGE_SIZE
        self.layout = layout
        self.device = device
        self.pin_memory = torch.device(device_pool.device).type == "cuda" if pin_memory is None else pin_memory
        self.allocator = getattr(anchor_host, "allocator", None)
        self.can_use_write_back_jit = False
        self.dtype = torch.uint8
        self.start_layer = device_pool.start_layer
        self.end_layer = device_pool.end_layer
        self.layer_num = device_pool.layer_num
        self.fmt = device_pool.settings.fmt
        self.size = anchor_host.size
        self.page_num = anchor_host.page_num
        self.size_per_token = self.get_size_per_token()
        requested = self.page_num * PAGE_SIZE * self.size_per_token
        available = psutil.virtual_memory().available - HICACHE_HOST_MEMORY_RESERVE_BYTES
        if requested > available:
            raise ValueError(
                f"--hicache-ratio / --hicache-size: the {self.fmt.value} index-K host cache needs "
                f"{requested / 1e9:.2f} GB beside the K/V host cache, only {available / 1e9:.2f} GB are free; "
                "lower --hicache-ratio or --hicache-size"
            )
        logger.info("Allocating %.2f GB host memory for the %s index-K cache (%d host pages, %d layers).",
                    requested / 1e9, self.fmt.value, self.page_num, self.layer_num)
        self.kv_buffer = self.init_kv_buffer()
        self._destroyed = False

    # ---- layout ------------------------------------------------------------------------------

    def _device_regions(self, device_pool, layer: int) -> list[torch.Tensor]:
        return page_regions(device_pool.caches[layer])

    def get_size_per_token(self) -> int:
        return self.fmt.token_bytes * self.layer_num

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token()

    def init_kv_buffer(self) -> list[torch.Tensor]:
        widths = [r.shape[1] for r in self._device_regions(self.device_pool, 0)] if self.layer_num else []
        return [torch.zeros(self.layer_num, self.page_num, w, dtype=torch.uint8, device=self.device,
                            pin_memory=self.pin_memory) for w in widths]

    def host_regions(self, layer: int) -> list[torch.Tensor]:
        """Host buffers of pool-local layer ``layer``, one uint8 ``[host_pages, region_bytes]`` per region."""
        return [b[layer] for b in self.kv_buffer]

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return list(self.kv_buffer)

    def clear(self) -> None:
        """Nothing to reset: the anchor (K/V) host pool owns the slots."""

    def destroy(self) -> None:
        self._destroyed = True
        self.kv_buffer = None

    # ---- device <-> host ---------------------------------------------------------------------

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        """Write back the pages at device slots ``device_indices`` of every layer to host slots ``host_indices``."""
        src, dst = slot_pages(device_indices), slot_pages(host_indices)
        for layer in range(self.layer_num):
            copy_pages(self._device_regions(device_pool, layer), self.host_regions(layer), src, dst)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend) -> None:
        """Load back pool-local layer ``layer_id``'s pages at host slots ``host_indices`` to ``device_indices``."""
        copy_pages(self.host_regions(layer_id), self._device_regions(device_pool, layer_id),
                   slot_pages(host_indices), slot_pages(device_indices))

    # ---- L3 storage: one host page of every layer as flat bytes ------------------------------

    def _page_of(self, index: int) -> int:
        if index % PAGE_SIZE or not 0 <= index < self.page_num * PAGE_SIZE:
            raise ValueError(f"index must be a host page's first slot in [0, {self.page_num * PAGE_SIZE}), "
                             f"a multiple of {PAGE_SIZE}; got {index}")
        return index // PAGE_SIZE

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        page = self._page_of(int(index))
        parts = [b[:, page] for b in self.kv_buffer]  # each [layers, region_bytes]
        return torch.cat([p.flatten() for p in parts]) if flat else parts

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_bytes(), dtype=torch.uint8, device=self.device, pin_memory=self.pin_memory)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page_of(int(index))
        flat = data_page.reshape(-1).view(torch.uint8)
        if flat.numel() != self.page_bytes():
            raise ValueError(f"data_page must hold {self.page_bytes()} bytes (one page of every layer), "
                             f"got {flat.numel()}")
        offset = 0
        for b in self.kv_buffer:
            n = b.shape[0] * b.shape[2]
            b[:, page].copy_(flat[offset:offset + n].view(b.shape[0], b.shape[2]))
            offset += n

    def page_bytes(self) -> int:
        """Bytes of one host page across all layers (``size_per_token * 128``)."""
        return sum(b.shape[0] * b.shape[2] for b in self.kv_buffer)


# ---- SGLang hooks ----------------------------------------------------------------------------

class KOnlyPoolHost(MHATokenToKOnlyPoolHost):
    """SGLang's ``MHATokenToKOnlyPoolHost`` (the plugin puts this class in its place), except that for our
    paged ``IndexKPool`` construction returns an ``IndexKPoolHost``; any other pool gets SGLang's host pool
    unchanged. SGLang's M3 stack calls ``(device_pool, anchor_host, layout, allocator_type=...)``."""

    def __new__(cls, device_pool, *args, **kwargs):
        from .pool import IndexKPool

        if isinstance(device_pool, IndexKPool):
            anchor_host = args[0] if args else kwargs["anchor_host"]
            layout = args[1] if len(args) > 1 else kwargs["layout"]
            return IndexKPoolHost(device_pool, anchor_host, layout)
        return super().__new__(cls)


def kv_share_of_host_bytes(sparse_pool) -> float:
    """The K/V's share of a host slot's bytes (K/V of every local layer plus the index key of every local
    sparse layer in the pool's format)."""
    main = sparse_pool.main_pool
    kv = main.layer_num * 2 * main.head_num * main.head_dim * main.store_dtype.itemsize
    index = sparse_pool.index_k_pool.layer_num * sparse_pool.settings.fmt.token_bytes
    return kv / (kv + index)


def hicache_stack_counting_index_bytes(original, *args, **kwargs):
    """Around SGLang's ``build_minimax_sparse_hicache_stack``: for our pool, ``--hicache-size`` GB covers the
    K/V and the index-K host buffers together (SGLang sizes the K/V host pool from it alone and adds the
    index sidecar on top); ``--hicache-ratio`` already counts slots, the same for both."""
    from .pool import MiniMaxM31SparseKVPool

    sparse_pool, server_args = kwargs.get("sparse_pool"), kwargs.get("server_args")
    if isinstance(sparse_pool, MiniMaxM31SparseKVPool) and server_args is not None and server_args.hicache_size > 0:
        scaled = copy.copy(server_args)  # private to this call: set past ServerArgs' resolved-field guard
        object.__setattr__(scaled, "hicache_size", server_args.hicache_size * kv_share_of_host_bytes(sparse_pool))
        kwargs["server_args"] = scaled
    return original(*args, **kwargs)


STORAGE_BACKENDS = (None, "file")  # L3 backends whose index-K pages go through the flat-page API above


def check_hicache_launch(server_args) -> None:
    """NotImplementedError, one line naming the flag, for a HiCache launch the index-K host tier does not
    cover: ``--device cpu`` (SGLang's K/V host pool pins its buffer with ``cudaHostRegister`` and copies
    with CUDA-only ``sgl_kernel`` ops, for every model), an L3 backend other than ``file`` (zero-copy
    backends address host pages by pointer and layout, which the paged index pool does not describe), or
    an SGLang whose M3 HiCache stack is built without ``server_args`` (after 0.5.16; not verified here)."""
    import inspect

    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    if getattr(server_args, "device", None) == "cpu":
        raise NotImplementedError(
            "--enable-hierarchical-cache with --device cpu: SGLang's HiCache K/V host pool needs CUDA (it pins "
            "host memory with cudaHostRegister and copies with sgl_kernel); launch without "
            "--enable-hierarchical-cache"
        )
    backend = getattr(server_args, "hicache_storage_backend", None)
    if backend not in STORAGE_BACKENDS:
        raise NotImplementedError(
            f"--hicache-storage-backend {backend}: the MiniMax-M3.1 index-K pages go to L3 storage through the "
            "file backend only; launch with --hicache-storage-backend file or without it"
        )
    stack = getattr(hybrid_pool_assembler, "build_minimax_sparse_hicache_stack", None)
    if stack is None or "server_args" not in inspect.signature(stack).parameters:
        raise NotImplementedError(
            "--enable-hierarchical-cache: the MiniMax-M3.1 index-K host tier is built for SGLang 0.5.16's M3 "
            "HiCache stack, which this SGLang release has changed; launch without --enable-hierarchical-cache"
        )
