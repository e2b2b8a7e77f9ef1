"""Reference selector against a brute-force Python sort."""

import math

import pytest
import torch

from m3_kernels.ops.select.naive import select_blocks_ref, visible_blocks


def brute_select(scores, n_visible, topk, local, init):
    H, rows, _ = scores.shape
    out = torch.full((H, rows, topk), -1, dtype=torch.int32)
    for h in range(H):
        for r in range(rows):
            n = int(n_visible[r])
            if n <= topk:
                chosen = list(range(n))
            else:
                s = scores[h, r, :n].tolist()
                # NaN ranks below every number, -inf included; ties go to the lower id.
                key = [(1, 0.0) if math.isnan(v) else (0, -v) for v in s]
                middle = sorted(range(init, n - local), key=lambda i: (key[i], i))
                chosen = list(range(init)) + middle[: topk - init - local] + list(range(n - local, n))
            out[h, r, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


@pytest.mark.parametrize("topk,local,init", [(16, 1, 0), (16, 2, 1), (4, 1, 0), (1, 1, 0)])
def test_matches_brute_force(gen, topk, local, init):
    H, rows, nb = 3, 40, 64
    # Coarse integer scores force many ties; a few -inf and NaN.
    scores = torch.randint(0, 4, (H, rows, nb), generator=gen).double()
    scores[scores == 3] = -math.inf
    scores[torch.rand(scores.shape, generator=gen) < 0.1] = math.nan
    scores[:, 4] = -math.inf  # a row where NaN and -inf compete: the NaN block must not be picked
    scores[:, 4, 3] = math.nan
    n_visible = torch.randint(0, nb + 1, (rows,), generator=gen)
    n_visible[:6] = torch.tensor([0, 1, topk, topk + 1, nb, 17])
    got = select_blocks_ref(scores, n_visible, topk, local, init)
    assert torch.equal(got, brute_select(scores, n_visible, topk, local, init))


def test_own_block_last_and_ties_to_lower_id():
    scores = torch.zeros(1, 1, 40)
    got = select_blocks_ref(scores, torch.tensor([40]))
    assert got[0, 0].tolist() == list(range(15)) + [39]


def test_visible_blocks():
    pos = torch.tensor([-1, 0, 127, 128, 255, 256])
    assert visible_blocks(pos, 128).tolist() == [0, 1, 1, 2, 2, 3]


def test_rejects_bad_options():
    with pytest.raises(ValueError, match="local_blocks >= 1"):
        select_blocks_ref(torch.zeros(1, 1, 4), torch.tensor([4]), 16, 0, 0)
    with pytest.raises(ValueError, match="n_visible"):
        select_blocks_ref(torch.zeros(1, 1, 4), torch.tensor([5]))


def test_dispatcher_rejects_what_the_gpu_path_rejects():
    """``select_blocks`` on CPU applies the plan's checks too: same ValueError on every device."""
    from m3_kernels.ops.select import select_blocks

    scores = torch.zeros(1, 2, 20)
    with pytest.raises(ValueError, match="n_visible must be int32/int64"):
        select_blocks(scores, torch.tensor([20.0, 3.0]))
    with pytest.raises(ValueError, match="scores must be a float"):
        select_blocks(torch.zeros(2, 20, dtype=torch.int64)[None], torch.tensor([20, 3]))
    with pytest.raises(ValueError, match="scores must be a float"):
        select_blocks(torch.zeros(2, 20), torch.tensor([20, 3]))
    assert select_blocks(scores, torch.tensor([20, 3], dtype=torch.int32)).shape == (1, 2, 16)


def test_a_plan_serves_every_layer_of_a_batch(gen):
    """``plan_select`` once per batch, ``select_planned`` per layer: the one-call ``select_blocks`` result."""
    from m3_kernels.ops.select import plan_select, select_blocks, select_planned

    n_vis = torch.tensor([1, 17, 40, 40], dtype=torch.int32)
    plan = plan_select(n_vis, 2, 40)
    for _ in range(3):
        scores = torch.randn(2, 4, 40, generator=gen)
        assert torch.equal(select_planned(plan, scores), select_blocks(scores, n_vis))
