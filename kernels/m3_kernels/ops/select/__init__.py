"""MSA block selection (top-k blocks per query row and index head).

CUDA/ROCm tensors go to the Triton selector (``triton.py``), others to the torch reference; both
follow ``naive.select_blocks_ref`` exactly.
"""

import torch

from ...formats import INIT_BLOCKS, LOCAL_BLOCKS, TOPK_BLOCKS
from .naive import visible_blocks  # noqa: F401


def check_select_params(topk, local_blocks, init_blocks) -> None:
    """ValueError naming the rule the selection parameters broke (a server checks them at start-up)."""
    for name, value in (("topk", topk), ("local_blocks", local_blocks), ("init_blocks", init_blocks)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if not (0 <= init_blocks and 1 <= local_blocks and init_blocks + local_blocks <= topk):
        raise ValueError(
            f"need init_blocks >= 0, local_blocks >= 1 and init_blocks + local_blocks <= topk, "
            f"got init_blocks={init_blocks}, local_blocks={local_blocks}, topk={topk}"
        )


def check_select_args(scores, n_visible, topk, local_blocks, init_blocks) -> None:
    """ValueError naming the argument and the rule it broke (no device synchronisation)."""
    check_select_params(topk, local_blocks, init_blocks)
    if scores.dim() != 3 or not scores.is_floating_point():
        raise ValueError(f"scores must be a float [H, rows, nb] tensor, got {scores.dtype} {tuple(scores.shape)}")
    if n_visible.shape != (scores.shape[1],) or n_visible.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"n_visible must be int32/int64 [rows={scores.shape[1]}], got {n_visible.dtype} "
                         f"{tuple(n_visible.shape)}")
    if n_visible.device != scores.device:
        raise ValueError(f"n_visible must be on {scores.device}, got {n_visible.device}")


def select_blocks(scores, n_visible, topk=TOPK_BLOCKS, local_blocks=LOCAL_BLOCKS, init_blocks=INIT_BLOCKS):
    """int32 ``[H, rows, topk]`` block ids (contract: ``naive.select_blocks_ref``).

    ``scores [H, rows, nb]`` in global block order, ``n_visible [rows]`` visible blocks per row
    (at most nb; the GPU path clamps it to ``[0, nb]`` instead of raising, to avoid a sync).
    """
    check_select_args(scores, n_visible, topk, local_blocks, init_blocks)
    if scores.device.type == "cuda":
        from .triton import select_blocks_triton

        return select_blocks_triton(scores, n_visible, topk, local_blocks, init_blocks)
    from .naive import select_blocks_ref

    return select_blocks_ref(scores, n_visible, topk, local_blocks, init_blocks)
