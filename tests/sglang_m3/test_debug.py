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
