"""Test support, on PYTHONPATH of a CPU server only: SGLang's HiCache K/V host pool on a CPU.

SGLang's K/V host pool pins its buffer with ``cudaHostRegister`` and copies with CUDA-only ``sgl_kernel``
ops, so HiCache cannot start without CUDA (the plugin refuses ``--enable-hierarchical-cache`` with
``--device cpu``). With ``M3_TEST_HICACHE_ON_CPU=1`` this module, run by Python at start-up in every
server process, registers SGLang hooks that allocate that buffer unpinned and copy K/V with torch
(``--hicache-mem-layout layer_first``), and lifts the plugin's CPU refusal: everything else (the radix
tree, the controller, its streams and events, the index-K sidecar of ``sglang_m3.host_pool``) is what a
GPU server runs.
"""

import os

if os.environ.get("M3_TEST_HICACHE_ON_CPU") == "1":
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def _alloc(dims, dtype, device, pin_memory, allocator):
        return allocator.allocate(dims, dtype=dtype, device=device)

    def _check_layer_first(host):
        if host.layout != "layer_first":
            raise ValueError(f"the CPU test hooks copy K/V for --hicache-mem-layout layer_first, got {host.layout}")

    def _backup(self, device_pool, host_indices, device_indices, io_backend):
        _check_layer_first(self)
        for layer in range(self.layer_num):
            self.k_buffer[layer][host_indices] = device_pool.k_buffer[layer][device_indices]
            self.v_buffer[layer][host_indices] = device_pool.v_buffer[layer][device_indices]

    def _load(self, device_pool, host_indices, device_indices, layer_id, io_backend):
        _check_layer_first(self)
        device_pool.k_buffer[layer_id][device_indices] = self.k_buffer[layer_id][host_indices]
        device_pool.v_buffer[layer_id][device_indices] = self.v_buffer[layer_id][host_indices]

    host = "sglang.srt.mem_cache.pool_host"
    HookRegistry.register(f"{host}.common.alloc_with_host_register", _alloc, HookType.REPLACE)
    HookRegistry.register(f"{host}.mha.MHATokenToKVPoolHost.backup_from_device_all_layer", _backup, HookType.REPLACE)
    HookRegistry.register(f"{host}.mha.MHATokenToKVPoolHost.load_to_device_per_layer", _load, HookType.REPLACE)
    HookRegistry.register("sglang_m3.host_pool.check_hicache_launch", lambda server_args: None, HookType.REPLACE)
