"""examples/needle_demo.py: the pieces that need no server: the needle prompt, the selection read-back and its lines."""

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "needle_demo", Path(__file__).resolve().parents[2] / "examples" / "needle_demo.py")
demo = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(demo)


def test_trained_model_is_the_default_and_has_weights():
    assert demo.has_weights(demo.TRAINED_MODEL)
    assert not demo.has_weights(demo.TINY_MODEL)  # served with dummy weights only when asked for


@pytest.mark.parametrize("seed", [3, 12345])
def test_needle_doc_places_the_needle_in_its_blocks(seed):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo.TRAINED_MODEL))
    doc = demo.needle_doc(tok, 2048, seed)
    assert doc["prompt_len"] <= 2048 and doc["input_ids"] == tok(doc["input"])["input_ids"]
    n0, n1 = doc["needle_tokens"]
    assert doc["target"] in tok.decode(doc["input_ids"][n0:n1]) and 5 <= doc["depth"] <= 95
    assert doc["needle_blocks"] == sorted({t // 128 for t in range(n0, n1)})
    assert demo.needle_doc(tok, 2048, seed)["input"] == doc["input"]  # a seed replays its prompt


def test_last_row_selections_and_lines():
    records = [
        {"mode": "extend", "layer": 2, "positions": [98, 99], "selected": [[[0, 1, -1], [5, 2, 1]],
                                                                           [[3, 0, -1], [4, 0, 1]]]},
        {"mode": "decode", "layer": 1, "positions": [99], "selected": [[[7, 8, 9]]]},
        {"mode": "extend", "layer": 1, "positions": [99], "selected": [[[1, 0, -1]], [[2, 3, -1]]]},
    ]
    picked = demo.last_row_selections(records, 99)
    assert picked == {1: [[0, 1], [2, 3]], 2: [[1, 2, 5], [0, 1, 4]]}
    lines = demo.selection_lines(picked, [1], 6)
    assert lines[0] == "  layer 1 head 0: 2/6 blocks [0 *1*]  needle picked"
    assert lines[1] == "  layer 1 head 1: 2/6 blocks [2 3]  needle MISSED"
    assert len(lines) == 4
