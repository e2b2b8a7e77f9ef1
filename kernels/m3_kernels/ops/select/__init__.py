"""MSA block selection (top-k blocks per query row and index head)."""

from ...formats import INIT_BLOCKS, LOCAL_BLOCKS, TOPK_BLOCKS
from .naive import visible_blocks  # noqa: F401


def select_blocks(scores, n_visible, topk=TOPK_BLOCKS, local_blocks=LOCAL_BLOCKS, init_blocks=INIT_BLOCKS):
    """int32 ``[H, rows, topk]`` block ids (contract: ``naive.select_blocks_ref``)."""
    from .naive import select_blocks_ref

    return select_blocks_ref(scores, n_visible, topk, local_blocks, init_blocks)
