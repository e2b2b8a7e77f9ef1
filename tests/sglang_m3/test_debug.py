"""The selection recorder: head ids per attention-TP rank and the JSON line it writes."""

import json

import pytest
import torch

from sglang_m3.debug import SelectionRecorder, index_heads_of_rank


@pytest.mark.parametrize("total,tp,expected", [
    (4, 1, [[0, 1, 2, 3]]),
    (4, 2, [[0, 1], [2, 3]]),
    (4, 4, [[0], [1], [2], [3]]),
    (4, 8, [[0], [0], [1], [1], [2], [2], [3], [3]]),  # M3 at TP8: two ranks per index head
])
def test_index_heads_of_rank(total, tp, expected):
    assert [index_heads_of_rank(total, tp, r) for r in range(tp)] == expected


def test_record_line_holds_heads_and_first_layer_scores(tmp_path):
    path = tmp_path / "sel.jsonl"
    rec = SelectionRecorder(str(path), score_layer=1, heads=[2, 3])
    scores = torch.tensor([[[0.5, float("-inf")]], [[0.25, 1.0]]])  # [H=2, rows=1, nb=2]
    selected = torch.tensor([[[0, -1]], [[0, 1]]], dtype=torch.int32)
    rec.record("decode", 1, torch.tensor([129]), torch.tensor([2]), selected, scores)
    rec.record("decode", 2, torch.tensor([129]), torch.tensor([2]), selected, scores)
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first == {"mode": "decode", "layer": 1, "positions": [129], "heads": [2, 3], "n_visible": [2],
                     "selected": [[[0, -1]], [[0, 1]]], "scores": [[[0.5, None]], [[0.25, 1.0]]]}
    assert "scores" not in second and second["heads"] == [2, 3]


def test_scores_past_each_rows_n_visible_are_none(tmp_path):
    """A preallocated decode buffer is written only up to each row's last visible block: the columns
    past it hold stale or uninitialised values, which the line must not pass off as scores."""
    path = tmp_path / "sel.jsonl"
    rec = SelectionRecorder(str(path), score_layer=1, heads=[0, 1])
    scores = torch.tensor([[[0.5, 0.25, 7.0], [1.5, 1e30, 2.0], [3.0, float("nan"), -1.0]],  # [H=2, rows=3, nb=3]
                           [[0.0, 0.125, 4.0], [2.5, -3.0, 9.0], [1.0, 1.0, 1.0]]])
    n_visible = torch.tensor([3, 1, 2])
    selected = torch.zeros(2, 3, 1, dtype=torch.int32)
    rec.record("decode", 1, torch.tensor([300, 5, 200]), n_visible, selected, scores)
    line = json.loads(path.read_text())
    assert line["scores"] == [[[0.5, 0.25, 7.0], [1.5, None, None], [3.0, None, None]],
                              [[0.0, 0.125, 4.0], [2.5, None, None], [1.0, 1.0, None]]]
    rec.record("decode", 1, torch.tensor([5, 5]), torch.tensor([1, 1]), selected[:, :2], scores[:, :2])
    assert json.loads(path.read_text().splitlines()[1])["scores"] == [[[0.5], [1.5]], [[0.0], [2.5]]]  # nb = 1


def test_last_rows_keeps_the_tail_of_each_request(tmp_path):
    path = tmp_path / "sel.jsonl"
    rec = SelectionRecorder(str(path), score_layer=1, heads=[0], last_rows=2)
    # Two requests in one extend: a 3-row chunk ending at seq_len 5, and a 4-row prompt (seq_len 4).
    positions = torch.tensor([2, 3, 4, 0, 1, 2, 3])
    cu_rows = torch.tensor([0, 3, 7], dtype=torch.int32)
    seq_lens = torch.tensor([5, 4], dtype=torch.int32)
    selected = positions.to(torch.int32).view(1, -1, 1)
    scores = torch.rand(1, 7, 1)
    rec.record("extend", 1, positions, torch.ones(7, dtype=torch.int64), selected, scores, seq_lens, cu_rows)
    rec.record("extend", 2, torch.tensor([0]), torch.ones(1, dtype=torch.int64), selected[:, :1], scores[:, :1],
               torch.tensor([9]), torch.tensor([0, 1]))  # no row in its last 2: no line
    rec.record("decode", 2, torch.tensor([8, 3]), torch.ones(2, dtype=torch.int64), selected[:, :2], scores[:, :2])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["mode"], r["positions"]) for r in lines] == [("extend", [3, 4, 2, 3]), ("decode", [8, 3])]
    assert lines[0]["selected"] == [[[3], [4], [2], [3]]] and len(lines[0]["scores"][0]) == 4


@pytest.mark.parametrize("bad", [0, -1, "last 4", 2.5, True])
def test_last_rows_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="index_k_debug_rows"):
        SelectionRecorder("x", score_layer=1, heads=[0], last_rows=bad)
