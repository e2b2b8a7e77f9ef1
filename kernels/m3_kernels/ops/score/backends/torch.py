"""Fast torch block scorers for the CPU server (same contract as ``naive.py``, which stays the oracle).

Where the reference loops over requests and dequantizes every page per row chunk in float64-ready
steps, this path:

- decodes MXFP4 pages with one 256-entry table lookup (byte -> two e2m1 values) and one scale
  multiply per 32-element group, in fp32 (exact: e2m1 x 2^e is representable; products beyond
  fp32's range overflow to inf exactly as the reference's float64 -> fp32 cast does);
- scores a whole decode batch with one batched matmul over each request's visible pages (no
  Python loop over requests), and a prefill request with one matmul per row chunk against the
  pages that chunk can see (the causal triangle is skipped page-wise);
- takes the page max before ``sm_scale`` like the reference.

Scores are fp32 and agree with ``naive.score_*_ref`` (float64) to fp32 rounding of the dot
products; masked pages are -inf in both, and so are pages whose id lies outside the cache (read as
page 0, never indexed outside it); a query vector holding a NaN or Inf scores NaN on every page it
sees (``naive.py``'s rules, the Triton kernels' too).
"""

import torch

from ....formats import PAGE_SIZE, e2m1_decode, e8m0_to_float, unpack_e2m1

_KEY_PAGES = 32  # pages of keys one prefill matmul scores (128 rows x 4 heads x 4096 keys: 8 MiB of fp32; on 2 cores
# 8 pages took 175 ms at an 8k prefill, 32 pages 142-146, 64 pages 152: fewer, larger calls win over cache residency)
_LUTS: dict[torch.device, torch.Tensor] = {}


def _byte_table(device: torch.device) -> torch.Tensor:
    """fp32 ``[256, 2]``: the two e2m1 values of each packed byte (low nibble first)."""
    table = _LUTS.get(device)
    if table is None:
        codes = unpack_e2m1(torch.arange(256, dtype=torch.uint8, device=device).unsqueeze(1))  # [256, 2]
        table = _LUTS[device] = e2m1_decode(codes, torch.float32).contiguous()
    return table


def dequantize_pages(k_cache: torch.Tensor, k_scale: torch.Tensor | None, pages: torch.Tensor) -> torch.Tensor:
    """fp32 ``[*pages.shape, 128, 128]`` keys of ``pages`` (int64 ids, any shape), exact.

    ``k_cache``/``k_scale`` as in ``naive``: bf16/e4m3 ``[P, 128, 128]`` and None, or MXFP4
    ``[P, 128, 64]`` + ``[P, 128, 4]`` uint8."""
    flat = pages.flatten()
    if k_scale is None:
        return k_cache.index_select(0, flat).view(*pages.shape, *k_cache.shape[1:]).float()
    data = k_cache.index_select(0, flat).view(*pages.shape, *k_cache.shape[1:])  # [..., 128, 64] uint8
    values = _byte_table(data.device).index_select(0, data.flatten().int())  # [n, 2]
    values = values.view(*data.shape[:-1], k_scale.shape[-1], -1)  # [..., 128, 4, 32]
    scale = e8m0_to_float(k_scale.index_select(0, flat).view(*pages.shape, *k_scale.shape[1:]), torch.float32)
    scale = scale.unsqueeze(-1)  # [..., 128, 4, 1]
    return values.mul_(scale).flatten(-2)  # in place: a second buffer made 32 pages 2.0 ms instead of 0.8 on 2 cores


def page_ids(block_table: torch.Tensor, n_pages: torch.Tensor, num_cache_pages: int):
    """``(int64 [batch, max(n_pages)] page ids, bool outside)``: ids of the first ``n_pages`` columns of each
    request; ids outside ``[0, num_cache_pages)`` (``outside``) and columns past a request's ``n_pages`` are
    replaced by page 0, so nothing reads outside the cache (such a page scores -inf)."""
    width = int(n_pages.max()) if n_pages.numel() else 0
    pages = block_table[:, :width].long()
    visible = torch.arange(width, device=pages.device)[None] < n_pages[:, None]
    outside = visible & ((pages < 0) | (pages >= num_cache_pages))
    return torch.where(visible & ~outside, pages, 0), outside


def finite_or_nan(q: torch.Tensor) -> torch.Tensor:
    """fp32 ``q [rows, H, 128]`` with every query vector that holds a NaN or Inf made all NaN (it then scores
    NaN on every page it sees, whatever K holds)."""
    qf = q.float()
    return qf.masked_fill(~torch.isfinite(qf).all(dim=-1, keepdim=True), float("nan"))


def check_plan(plan, batch):
    """Nothing to prepare: the torch scorers read the plan's tensors as they are."""
    return None


def run(plan, q, cache, out):
    """Scores of ``plan`` (decode or prefill) for ``q`` over ``cache`` into ``out`` (checked by the caller):
    every column is written."""
    if plan.op == "decode":
        return decode_scores(q, cache, plan.block_table, plan.seq_lens, plan.S, plan.sm_scale, plan.max_block, out,
                             plan.cp_rank, plan.cp_world)
    return prefill_scores(q, cache, plan.block_table, plan.seq_lens, plan.cu_seqlens_q, plan.sm_scale, plan.max_block,
                          out, plan.skip_rows_seeing)


def decode_scores(q, cache, block_table, seq_lens, S, sm_scale, max_block, out, cp_rank=0, cp_world=1):
    """Decode block scores, fp32 ``[H, batch*S, max_block]`` into ``out`` (every column written; contract:
    ``naive.score_decode_ref``)."""
    k_cache, k_scale = cache.views()
    batch, H = block_table.shape[0], q.shape[1]
    dev = q.device
    positions = seq_lens.long()[:, None] - S + torch.arange(S, device=dev)  # [batch, S]
    n_global = torch.where(positions[:, -1] >= 0, positions[:, -1] // PAGE_SIZE + 1, 0)
    n_local = ((n_global - cp_rank + cp_world - 1) // cp_world).clamp(0, max_block)  # pages the last row sees
    res = out.fill_(float("-inf"))
    pages, outside = page_ids(block_table, n_local, k_cache.shape[0])  # [batch, P]
    P = pages.shape[1]
    if P and batch:
        k = dequantize_pages(k_cache, k_scale, pages).view(batch, P * PAGE_SIZE, -1)  # [batch, P*128, 128]
        dots = torch.matmul(finite_or_nan(q).view(batch, S * H, -1), k.transpose(1, 2))  # [batch, S*H, P*128]
        token = (torch.arange(P, device=dev)[:, None] * cp_world + cp_rank) * PAGE_SIZE + torch.arange(PAGE_SIZE,
                                                                                                       device=dev)
        hidden = token.flatten()[None, None] > positions[:, :, None]  # [batch, S, P*128]
        dots = dots.view(batch, S, H, -1).masked_fill_(hidden[:, :, None], float("-inf"))
        best = dots.view(batch, S, H, P, PAGE_SIZE).amax(dim=-1) * sm_scale  # [batch, S, H, P]
        best.masked_fill_(outside[:, None, None, :], float("-inf"))
        res[:, :, :P] = best.permute(2, 0, 1, 3).reshape(H, batch * S, P)
    return res


def prefill_scores(q, cache, block_table, seq_lens, cu_seqlens_q, sm_scale, max_block, out, skip_rows_seeing: int = 0):
    """Prefill block scores, fp32 ``[H, total_new_tokens, max_block]`` into ``out`` (contract:
    ``naive.score_prefill_ref``); every column is written.

    ``skip_rows_seeing``: rows that see at most this many pages are not scored (all -inf). MSA selection
    takes every visible block of a row that sees at most ``topk`` of them whatever the scores, so the
    server passes ``topk`` (the first 16 pages of every prompt are then free).

    Per request the new rows go in tiles of one query page; a tile scores the pages it sees (the causal
    triangle, page-wise) in key chunks of ``_KEY_PAGES`` pages: one fp32 matmul per chunk whose
    ``[tile rows x H, chunk tokens]`` products stay in the last-level cache for the page max, and only the tile's
    own page is masked."""
    k_cache, k_scale = cache.views()
    batch, H = block_table.shape[0], q.shape[1]
    dev = q.device
    res = out.fill_(float("-inf"))
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    tok = torch.arange(PAGE_SIZE, device=dev)
    qf_all = finite_or_nan(q)
    for b in range(batch):
        r0, r1 = cu[b], cu[b + 1]
        if r1 <= r0:
            continue
        first_pos = lens[b] - (r1 - r0)
        n_pages = max(0, min(max_block, (lens[b] - 1) // PAGE_SIZE + 1))
        pages, outside = page_ids(block_table[b : b + 1], torch.tensor([n_pages], device=dev), k_cache.shape[0])
        pages, outside = pages[0], outside[0]
        k = dequantize_pages(k_cache, k_scale, pages).view(n_pages * PAGE_SIZE, -1)  # [L, 128]
        qf = qf_all[r0:r1]  # [R, H, 128]
        t0 = 0
        while t0 < r1 - r0:
            page = (first_pos + t0) // PAGE_SIZE  # the tile's query page; rows t0..t1-1 sit in it
            t1 = min(r1 - r0, (page + 1) * PAGE_SIZE - first_pos)
            n = t1 - t0
            if page + 1 <= skip_rows_seeing:
                t0 = t1
                continue
            qt = qf[t0:t1].reshape(n * H, -1)
            seen = min(page + 1, n_pages)  # pages the tile sees (its own page partially)
            for c0 in range(0, seen, _KEY_PAGES):
                c1 = min(seen, c0 + _KEY_PAGES)
                dots = torch.matmul(qt, k[c0 * PAGE_SIZE : c1 * PAGE_SIZE].t()).view(n, H, c1 - c0, PAGE_SIZE)
                if c1 == page + 1:  # the tile's own page: tokens after a row are hidden from it
                    pos = first_pos + torch.arange(t0, t1, device=dev)
                    hidden = page * PAGE_SIZE + tok[None] > pos[:, None]  # [n, 128]
                    dots[:, :, -1].masked_fill_(hidden[:, None], float("-inf"))
                best = dots.amax(dim=-1).mul_(sm_scale)  # [n, H, c1 - c0]
                best.masked_fill_(outside[None, None, c0:c1], float("-inf"))
                res[:, r0 + t0 : r0 + t1, c0:c1] = best.transpose(0, 1)
            t0 = t1
    return res
