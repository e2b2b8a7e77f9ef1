"""Torch reference MSA block selector (MiniMax MSA reference semantics).

For a query row that sees ``n`` blocks (its own block is ``n - 1``):

- ``n <= topk``: every visible block in order, ``0 .. n-1``, then -1 padding.
- otherwise: the ``init_blocks`` sink blocks ``0 .. I-1`` (M3: none), then the best
  ``topk - I - L`` of the remaining non-local blocks ranked by (-score, block id) -- ties go to
  the lower id -- then the ``local_blocks`` = L last blocks in order, the query's own block last.

NaN scores rank below every number, -inf included. Output int32 ``[H, rows, topk]`` of global block ids.
"""

import torch

from ...formats import INIT_BLOCKS, LOCAL_BLOCKS, TOPK_BLOCKS


def visible_blocks(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Blocks a query at 0-based ``positions`` sees: ``pos // block_size + 1`` (0 for pos < 0)."""
    return torch.where(positions >= 0, positions // block_size + 1, 0)


def select_blocks_ref(scores, n_visible, topk: int = TOPK_BLOCKS, local_blocks: int = LOCAL_BLOCKS, init_blocks: int = INIT_BLOCKS):
    """Args:
        scores: ``[H, rows, nb]`` float, global block order; columns >= ``n_visible[row]`` ignored.
        n_visible: ``[rows]`` int, visible blocks per row (``visible_blocks``), at most nb.
    Returns:
        int32 ``[H, rows, topk]``.
    """
    if not (0 <= init_blocks and 1 <= local_blocks and init_blocks + local_blocks <= topk):
        raise ValueError(
            f"need init_blocks >= 0, local_blocks >= 1 and init_blocks + local_blocks <= topk, "
            f"got init_blocks={init_blocks}, local_blocks={local_blocks}, topk={topk}"
        )
    H, rows, nb = scores.shape
    n = n_visible.to(device=scores.device, dtype=torch.long)
    if n.shape != (rows,) or (rows and (int(n.max()) > nb or int(n.min()) < 0)):
        raise ValueError(f"n_visible must be [rows={rows}] with values in [0, {nb}]")
    ids = torch.arange(nb, device=scores.device)
    s = torch.nan_to_num(scores.double(), nan=float("-inf"))
    ranked = topk - init_blocks - local_blocks
    candidate = (ids[None] >= init_blocks) & (ids[None] < (n - local_blocks)[:, None])  # [rows, nb]
    # Two stable sorts: by score (ties keep ascending id), then candidates first.
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    cand_sorted = candidate.expand(H, rows, nb).gather(-1, order)
    order = order.gather(-1, torch.sort(cand_sorted.int(), dim=-1, descending=True, stable=True).indices)
    best = order[..., :ranked] if ranked <= nb else torch.cat([order, order.new_full((H, rows, ranked - nb), -1)], -1)

    slot = torch.arange(topk, device=scores.device)
    # Sparse rows: [init..., best..., local...].
    local = (n[:, None] - local_blocks + (slot[None] - init_blocks - ranked))  # valid where slot >= I + ranked
    sparse = torch.where(slot < init_blocks, slot, 0).expand(H, rows, topk).clone()
    sparse[..., init_blocks : init_blocks + ranked] = best
    sparse = torch.where(slot >= init_blocks + ranked, local.expand(H, rows, topk), sparse)
    # Dense rows: arange(n), -1 padded.
    dense = torch.where(slot[None] < n[:, None], slot[None], -1).expand(H, rows, topk)
    return torch.where((n > topk)[None, :, None], sparse, dense).to(torch.int32)
