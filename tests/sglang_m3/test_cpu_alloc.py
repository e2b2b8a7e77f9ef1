"""Torch paths of SGLang's page-aligned allocator (CPU) against a slot-by-slot oracle."""

import pytest
import torch

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang_m3 import cpu_alloc
from sglang_m3.compat import ALLOCATOR_OFF_TRITON, at_least
from sglang_m3.pool import MiniMaxM31SparseKVPool

PAGE = 4


def _allocator(pages=8):
    alloc = PagedTokenToKVPoolAllocator.__new__(PagedTokenToKVPoolAllocator)
    alloc.page_size, alloc.device, alloc.need_sort = PAGE, "cpu", False
    alloc.free_pages = torch.arange(1, pages + 1, dtype=torch.int64)
    alloc._kvcache = MiniMaxM31SparseKVPool.__new__(MiniMaxM31SparseKVPool)  # the torch paths serve this pool only
    return alloc


def _unreachable(*args, **kwargs):
    raise AssertionError("the CUDA (Triton) path must not run on the CPU")


def test_decode_continues_pages_and_opens_new_ones():
    alloc = _allocator()
    alloc.free_pages = torch.tensor([5, 3, 7], dtype=torch.int64)
    # Request 0 continues its page (seq_len 6: token 5 sits at row 1 of the page holding slot 20..23);
    # requests 1 and 2 open pages (seq_len 5 and 9 start a new page).
    seq_lens = torch.tensor([6, 5, 9])
    last_loc = torch.tensor([20, 15, 43])
    out = cpu_alloc.alloc_decode(_unreachable, alloc, seq_lens, seq_lens, last_loc)
    assert out.tolist() == [21, 5 * PAGE, 3 * PAGE]
    assert alloc.free_pages.tolist() == [7]


def test_decode_without_new_pages_and_when_full():
    alloc = _allocator()
    alloc.free_pages = torch.empty(0, dtype=torch.int64)
    assert cpu_alloc.alloc_decode(_unreachable, alloc, torch.tensor([2]), torch.tensor([2]), torch.tensor([8])).tolist() == [9]
    assert cpu_alloc.alloc_decode(_unreachable, alloc, torch.tensor([5]), torch.tensor([5]), torch.tensor([11])) is None


def test_extend_fills_the_last_page_then_new_pages():
    alloc = _allocator()
    alloc.free_pages = torch.arange(3, 11, dtype=torch.int64)
    prefix = torch.tensor([2, 0])
    seq = torch.tensor([11, 3])
    last_loc = torch.tensor([9, -1])  # request 0's prefix holds slots 8, 9 of page 2
    out = cpu_alloc.alloc_extend(_unreachable, alloc, prefix, prefix, seq, seq, last_loc, int((seq - prefix).sum()))
    # Request 0: rest of page 2 (10, 11), one full new page (3), 3 tokens of page 4; request 1: page 5.
    expected = [10, 11] + [3 * PAGE + i for i in range(PAGE)] + [4 * PAGE + i for i in range(3)]
    expected += [5 * PAGE + i for i in range(3)]
    assert out.tolist() == expected
    assert alloc.free_pages.tolist() == [6, 7, 8, 9, 10]


def _extend_oracle(prefix, seq, last_loc, free_pages):
    """Slot of every new token, request by request: a token at a page start takes the next free
    page, any other token the slot after the previous token's."""
    pages, out = iter(free_pages), []
    for p, s, last in zip(prefix, seq, last_loc):
        for t in range(p, s):
            last = next(pages) * PAGE if t % PAGE == 0 else last + 1
            out.append(last)
    return out


def test_extend_matches_the_oracle_at_page_edges(gen):
    # Prefixes and ends on both sides of page edges (0, 1, PAGE - 1, PAGE, PAGE + 1), random pages.
    prefix = torch.tensor([0, 0, 0, PAGE, PAGE - 1, 1, PAGE, 2 * PAGE + 1])
    seq = torch.tensor([1, PAGE, PAGE + 1, PAGE + 1, PAGE, PAGE - 1, 3 * PAGE, 2 * PAGE + 2])
    used = torch.randperm(40, generator=gen)[:8] + 1  # the pages the prefixes live on
    last_loc = torch.where(prefix > 0, used * PAGE + (prefix - 1) % PAGE, -1)
    alloc = _allocator()
    alloc.free_pages = torch.randperm(40, generator=gen)[:12] + 41
    free = alloc.free_pages.tolist()
    out = cpu_alloc.alloc_extend(_unreachable, alloc, prefix, prefix, seq, seq, last_loc, int((seq - prefix).sum()))
    expected = _extend_oracle(prefix.tolist(), seq.tolist(), last_loc.tolist(), free)
    assert out.tolist() == expected
    new_pages = len({slot // PAGE for slot in expected} - set(used.tolist()))
    assert alloc.free_pages.tolist() == free[new_pages:]


def test_extend_without_enough_pages_returns_none_and_keeps_the_free_list():
    alloc = _allocator()
    alloc.free_pages = torch.tensor([3, 4], dtype=torch.int64)
    prefix, seq = torch.tensor([0]), torch.tensor([2 * PAGE + 1])  # needs 3 pages
    last_loc = torch.tensor([-1])
    assert cpu_alloc.alloc_extend(_unreachable, alloc, prefix, prefix, seq, seq, last_loc, 2 * PAGE + 1) is None
    assert alloc.free_pages.tolist() == [3, 4]


@pytest.mark.skipif(not at_least(ALLOCATOR_OFF_TRITON), reason="before SGLang 0.5.22 the plugin's torch path serves")
def test_sglang_own_torch_path_matches_the_oracle_where_the_plugin_rows_are_dropped(gen):
    """From 0.5.22 SGLang picks torch allocator paths where Triton is missing, so the plugin's
    allocator rows do not apply; that path must give the oracle's slots (decode included)."""
    from sglang.srt.platforms import current_platform

    assert not current_platform.capabilities.supports_triton  # on this CPU, SGLang takes its torch path
    prefix = torch.tensor([0, 0, PAGE, PAGE - 1, 1, 2 * PAGE + 1])
    seq = torch.tensor([1, PAGE + 1, PAGE + 1, PAGE, PAGE - 1, 2 * PAGE + 2])
    used = torch.randperm(40, generator=gen)[:6] + 1
    last_loc = torch.where(prefix > 0, used * PAGE + (prefix - 1) % PAGE, -1)
    alloc = _allocator()
    alloc.use_triton_kernels, alloc.debug_mode, alloc.staged_pages, alloc.num_staged_pages = False, False, [], 0
    alloc.free_pages = torch.randperm(40, generator=gen)[:12] + 41
    free = alloc.free_pages.tolist()
    out = PagedTokenToKVPoolAllocator.alloc_extend(alloc, prefix, prefix, seq, seq, last_loc, int((seq - prefix).sum()))
    assert out.tolist() == _extend_oracle(prefix.tolist(), seq.tolist(), last_loc.tolist(), free)
    alloc.free_pages = torch.tensor([5, 3, 7], dtype=torch.int64)
    seq_lens, last_loc = torch.tensor([6, 5, 9]), torch.tensor([20, 15, 43])
    assert PagedTokenToKVPoolAllocator.alloc_decode(alloc, seq_lens, seq_lens, last_loc).tolist() == [21, 20, 12]
    assert alloc.free_pages.tolist() == [7]


def test_other_pools_keep_sglangs_allocator_on_the_cpu():
    """Another model's pool (any KV cache but the index-K one) gets SGLang's own method, arguments unchanged."""
    alloc = _allocator()
    alloc._kvcache = object()
    calls = []
    args = (torch.tensor([2]), torch.tensor([2]), torch.tensor([8]))
    assert cpu_alloc.alloc_decode(lambda *a: calls.append(a) or "sglang", alloc, *args) == "sglang"
    assert calls[0][0] is alloc and calls[0][1] is args[0]
    assert cpu_alloc.alloc_extend(lambda *a: "sglang", alloc, *args, args[0], args[2], 1) == "sglang"
    assert alloc.free_pages.tolist() == list(range(1, 9))
