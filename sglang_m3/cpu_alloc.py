"""Torch paths for SGLang's page-aligned token allocator off CUDA.

``PagedTokenToKVPoolAllocator.alloc_extend`` / ``alloc_decode`` launch Triton kernels, which do
not run on a CPU; the index-K cache needs ``--page-size 128``, so a CPU server needs the paged
allocator. These AROUND hooks keep SGLang's method on CUDA and for any pool but the MiniMax-M3.1
index-K one, and compute the same slots with torch otherwise (extend through SGLang's own
``alloc_extend_naive``, the NPU path).
"""

import torch

from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive
from sglang.srt.utils import get_num_new_pages


def _on_cuda(allocator) -> bool:
    """Whether SGLang's own (Triton) method runs: on CUDA, or for a pool that is not the index-K one."""
    from .pool import MiniMaxM31SparseKVPool

    return torch.device(allocator.device).type == "cuda" or not isinstance(
        getattr(allocator, "_kvcache", None), MiniMaxM31SparseKVPool)


def alloc_extend(original, self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                 extend_num_tokens: int, num_new_pages: int = None):
    if _on_cuda(self):
        return original(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                        num_new_pages)
    bs = len(prefix_lens)
    if self.need_sort and extend_num_tokens // self.page_size + bs + 1 > len(self.free_pages):
        self.merge_and_sort_free()
    if num_new_pages is None:
        num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu)
    if num_new_pages > len(self.free_pages):
        return None
    out_indices = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
    alloc_extend_naive(prefix_lens_cpu.long(), seq_lens_cpu.long(), last_loc.cpu().long(), self.free_pages.cpu(),
                       out_indices, self.page_size, self.device)
    self.free_pages = self.free_pages[num_new_pages:]
    return out_indices


def alloc_decode(original, self, seq_lens, seq_lens_cpu, last_loc):
    if _on_cuda(self):
        return original(self, seq_lens, seq_lens_cpu, last_loc)
    bs = len(seq_lens)
    if self.need_sort and bs > len(self.free_pages):
        self.merge_and_sort_free()
    num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
    if num_new_pages > len(self.free_pages):
        return None
    if num_new_pages == 0:
        return (last_loc + 1).to(torch.int64)
    # The new token opens a page when it is the first of one: (seq_len - 1) % page_size == 0.
    opens_page = (seq_lens - 1) % self.page_size == 0
    page_rank = torch.cumsum(opens_page.long(), 0) - 1
    new_page_start = self.free_pages[page_rank.clamp(min=0)] * self.page_size
    out_indices = torch.where(opens_page, new_page_start, last_loc + 1).to(torch.int64)
    self.free_pages = self.free_pages[num_new_pages:]
    return out_indices
