"""MSA block selection (top-k blocks per query row and index head).

CUDA/ROCm tensors go to the Triton selector (``triton.py``), others to the torch reference; both
follow ``naive.select_blocks_ref`` exactly.
"""

from dataclasses import dataclass
from typing import Callable

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


@dataclass(frozen=True, eq=False)
class SelectPlan:
    """One batch's selection, checked once: ``n_visible [rows]`` on ``device``, ``H`` heads, ``nb`` score
    columns, the MSA parameters and the bound run (the Triton selector on a GPU, else the torch reference)."""

    n_visible: torch.Tensor
    H: int
    nb: int
    topk: int
    local_blocks: int
    init_blocks: int
    run: Callable

    @property
    def rows(self) -> int:
        return self.n_visible.shape[0]


def plan_select(n_visible, H: int, nb: int, topk=TOPK_BLOCKS, local_blocks=LOCAL_BLOCKS, init_blocks=INIT_BLOCKS):
    """Plan the selection of a batch whose scores will be ``[H, rows, nb]`` with ``n_visible [rows]`` int32/int64
    visible blocks per row (the GPU path clamps it to ``[0, nb]`` instead of raising, to avoid a sync); the
    parameters' rules as ``check_select_params``. ValueError naming the argument otherwise."""
    check_select_params(topk, local_blocks, init_blocks)
    for name, value in (("H", H), ("nb", nb)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "H" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'H' else 0}, got {value!r}")
    if not isinstance(n_visible, torch.Tensor) or n_visible.dim() != 1 or n_visible.dtype not in (torch.int32,
                                                                                                  torch.int64):
        raise ValueError(f"n_visible must be int32/int64 [rows], got {getattr(n_visible, 'dtype', n_visible)!r} "
                         f"{tuple(getattr(n_visible, 'shape', ()))}")
    if n_visible.device.type == "cuda":
        from .triton import select_blocks_triton as run
    else:
        from .naive import select_blocks_ref as run
    return SelectPlan(n_visible, H, nb, topk, local_blocks, init_blocks, run)


def select_planned(plan: SelectPlan, scores):
    """int32 ``[H, rows, topk]`` block ids of ``scores`` (contract: ``naive.select_blocks_ref``), checked against
    the plan on the host (no sync): ``scores`` float ``[H, rows, nb]`` on the plan's device."""
    if scores.dim() != 3 or not scores.is_floating_point() or tuple(scores.shape) != (plan.H, plan.rows, plan.nb):
        raise ValueError(f"scores must be a float [H={plan.H}, rows={plan.rows}, nb={plan.nb}] tensor (the plan's), "
                         f"got {scores.dtype} {tuple(scores.shape)}")
    if scores.device != plan.n_visible.device:
        raise ValueError(f"n_visible must be on the scores' device {scores.device}, got {plan.n_visible.device}")
    return plan.run(scores, plan.n_visible, plan.topk, plan.local_blocks, plan.init_blocks)


def select_blocks(scores, n_visible, topk=TOPK_BLOCKS, local_blocks=LOCAL_BLOCKS, init_blocks=INIT_BLOCKS):
    """int32 ``[H, rows, topk]`` block ids (contract: ``naive.select_blocks_ref``): ``plan_select`` and
    ``select_planned`` in one call (a server plans once per batch and runs per layer).

    ``scores [H, rows, nb]`` in global block order, ``n_visible [rows]`` visible blocks per row
    (at most nb; the GPU path clamps it to ``[0, nb]`` instead of raising, to avoid a sync).
    """
    if scores.dim() != 3 or not scores.is_floating_point():
        raise ValueError(f"scores must be a float [H, rows, nb] tensor, got {scores.dtype} {tuple(scores.shape)}")
    if not isinstance(n_visible, torch.Tensor) or n_visible.shape != (scores.shape[1],):
        raise ValueError(f"n_visible must be int32/int64 [rows={scores.shape[1]}], got "
                         f"{tuple(getattr(n_visible, 'shape', ()))}")
    plan = plan_select(n_visible, max(1, scores.shape[0]), scores.shape[2], topk, local_blocks, init_blocks)
    if scores.shape[0] == 0:
        return torch.empty((0, scores.shape[1], topk), dtype=torch.int32, device=scores.device)
    return select_planned(plan, scores)
