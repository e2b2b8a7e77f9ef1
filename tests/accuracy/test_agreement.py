"""Selection agreement and needle recall from constructed records (the served run is test_agreement_e2e.py)."""

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from accuracy import agreement, needle

TINY = Path(__file__).resolve().parents[2] / "configs" / "minimax-m3.1-tiny"


def _sel(rows):
    """int32 [H, rows, topk] from per-head lists of block lists (-1 padded to the longest)."""
    topk = max(len(r) for head in rows for r in head)
    return np.array([[r + [-1] * (topk - len(r)) for r in head] for head in rows], dtype=np.int32)


def test_needle_token_span():
    offsets = [(0, 0), (0, 4), (4, 9), (9, 10), (10, 15)]
    assert agreement.needle_token_span(offsets, 5, 10) == (2, 4)
    assert agreement.needle_token_span(offsets, 0, 1) == (1, 2)
    with pytest.raises(ValueError, match="no token"):
        agreement.needle_token_span(offsets, 15, 20)


def test_prepare_finds_the_needle_and_the_question():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY))
    raw = needle.generate(tok, [1500], 3, 3, 1, seed=5)
    for i, doc in enumerate(raw):
        d = agreement.prepare(tok, doc, i)
        n0, n1 = d["needle_tokens"]
        assert d["input_ids"] == tok(doc["input"])["input_ids"] and d["prompt_len"] == len(d["input_ids"])
        sentence = needle.NEEDLE.format(key=doc["key"], value=doc["target"])
        text = tok.decode(d["input_ids"][n0:n1])
        assert sentence in text and sentence not in tok.decode(d["input_ids"][n0 + 1:n1])
        assert sentence not in tok.decode(d["input_ids"][n0:n1 - 1])
        assert d["needle_blocks"] == sorted({t // 128 for t in range(n0, n1)})
        assert tok.decode(d["input_ids"][d["question_start"]:]).lstrip().startswith("Question:")
    # Depths 0, 50, 100 %: the needle moves from the first block towards the last.
    blocks = [agreement.prepare(tok, doc, i)["needle_blocks"][0] for i, doc in enumerate(raw)]
    assert blocks[0] == 0 and blocks[0] < blocks[1] < blocks[2]


def test_set_agreement():
    a = _sel([[[0, 1, 2], [4, 5, 6]], [[0, 1, 2], [7, 8, 9]]])
    n, same, overlap = agreement.set_agreement(a, a)
    assert (n, same, overlap) == (4, 4, 4.0)
    b = _sel([[[2, 1, 0], [4, 5, 3]], [[0, 1], [1, 2, 3]]])  # order ignored; a padded (smaller) set
    n, same, overlap = agreement.set_agreement(a, b)
    assert (n, same) == (4, 1) and math.isclose(overlap, 1 + 2 / 3 + 2 / 3 + 0)
    with pytest.raises(ValueError, match="same selections"):
        agreement.set_agreement(a, b[:, :1])


def test_needle_hits_and_chance():
    sel = _sel([[[3, 5, 9], [5, 6, 9], [1, 2, 9]]])
    assert agreement.needle_hits(sel, [5]) == (3, 2, 2)
    assert agreement.needle_hits(sel, [5, 6]) == (3, 1, 2)
    # 20 visible blocks, top-16 with one local block: 15 of the 19 earlier blocks are ranked in.
    assert math.isclose(agreement.chance_recall(20, [3], 16), 15 / 19)
    assert math.isclose(agreement.chance_recall(20, [3, 4], 16), math.comb(17, 13) / math.comb(19, 15))
    assert agreement.chance_recall(20, [19], 16) == 1.0  # the local block is always kept
    assert agreement.chance_recall(10, [3], 16) == 1.0  # dense row
    assert agreement.chance_recall(10, [12], 16) == 0.0  # not visible yet


def test_answer_rows_in_step():
    assert agreement.answer_rows_in_step([5, 6, 7], [5, 6, 7]) == 3
    assert agreement.answer_rows_in_step([5, 6, 7], [5, 9, 7]) == 2  # rows fed 5 match; the row fed 6/9 not
    assert agreement.answer_rows_in_step([4, 6, 7], [5, 6, 7]) == 1  # the last prompt row only
    assert agreement.answer_rows_in_step([5], [5, 6]) == 1


def _record(mode, layer, positions, selected, n_visible=None, heads=None):
    rec = {"mode": mode, "layer": layer, "positions": positions, "selected": selected,
           "n_visible": n_visible or [p // 128 + 1 for p in positions]}
    if heads is not None:
        rec["heads"] = heads
    return rec


def test_request_rows_orders_and_checks_positions():
    recs = [_record("extend", 1, [8, 9], [[[0], [1]]]), _record("extend", 1, [10], [[[2]]]),
            _record("decode", 1, [11], [[[3]]]), _record("extend", 2, [9, 10, 11], [[[7], [8], [9]]])]
    rows = agreement.request_rows(recs[:3], 9, 12)
    assert list(rows) == [1] and rows[1]["positions"].tolist() == [9, 10, 11]
    assert rows[1]["selected"].tolist() == [[[1], [2], [3]]]
    with pytest.raises(ValueError, match="not recorded"):
        agreement.request_rows(recs[:2], 9, 12)
    with pytest.raises(ValueError, match="twice"):
        agreement.request_rows(recs[:3] + [recs[2]], 9, 12)
    assert agreement.request_rows(recs[3:], 9, 12)[2]["selected"].shape == (1, 3, 1)


def test_merge_ranks_concatenates_heads():
    r0 = [_record("extend", 1, [5], [[[0]], [[1]]], heads=[0, 1])]
    r1 = [_record("extend", 1, [5], [[[2]], [[3]]], heads=[2, 3])]
    merged = agreement.merge_ranks([r1, r0])
    assert merged[0]["heads"] == [0, 1, 2, 3] and merged[0]["selected"] == [[[0]], [[1]], [[2]], [[3]]]
    with pytest.raises(ValueError, match="numbers of records"):
        agreement.merge_ranks([r0, r0 + r1])


def _doc(doc_id, needle_blocks, prompt_len=2600, length=2688):
    return {"doc_id": doc_id, "length": length, "prompt_len": prompt_len, "question_start": prompt_len - 2,
            "needle_blocks": needle_blocks}


def _kinds(sel_by_kind, n_visible=21):
    out = {"n_visible": {}}
    for kind, per_layer in sel_by_kind.items():
        out[kind] = {layer: _sel(s) for layer, s in per_layer.items()}
        out["n_visible"][kind] = {layer: np.full(out[kind][layer].shape[1], n_visible) for layer in per_layer}
    return out


def test_measure_on_a_constructed_case():
    doc = _doc(0, [3])
    hit, miss = list(range(3, 18)) + [20], list(range(4, 19)) + [20]
    # Two heads, layer 1: question rows (2), answer rows (3: the last prompt row and two decode rows).
    fp8 = _kinds({"prompt": {1: [[hit, hit], [miss, hit]]}, "question": {1: [[hit, hit], [miss, hit]]},
                  "answer": {1: [[hit, miss, miss], [hit, hit, hit]]}})
    mx = _kinds({"prompt": {1: [[hit, miss], [miss, hit]]}, "question": {1: [[hit, miss], [miss, hit]]},
                 "answer": {1: [[hit, hit, miss], [hit, hit, hit]]}})
    dense_rows = [list(range(21))]
    dense = _kinds({"prompt": {1: [dense_rows * 2] * 2}, "question": {1: [dense_rows * 2] * 2},
                    "answer": {1: [dense_rows * 3] * 2}})
    dense["answer"][1][0, 2, 5] = -1  # one selection misses a block: not dense
    selections = {"fp8": {0: fp8}, "mxfp4": {0: mx}, "dense": {0: dense}, "fp8_again": {0: fp8}}
    outputs = {"fp8": {0: [7, 8, 9]}, "mxfp4": {0: [7, 1, 9]}, "dense": {0: [7, 8, 9]}, "fp8_again": {0: [7, 8, 9]}}
    topk = {"fp8": 16, "mxfp4": 16, "fp8_again": 16, "dense": 22}
    summary = agreement.measure([doc], selections, outputs, ["dense", "fp8", "mxfp4", "fp8_again"], topk)

    def find(table, **kw):
        (row,) = [r for r in summary[table] if all(r[k] == v for k, v in kw.items())]
        return row

    q = find("recall", layer=1, rows="question", name="fp8")
    assert (q["n"], q["recall"], q["recall_any"]) == (4, 0.75, 0.75)
    assert math.isclose(q["chance"], 15 / 20)  # 21 visible blocks: 15 of the 20 earlier ones ranked in
    a = find("recall", layer=1, rows="answer", name="mxfp4")
    assert (a["n"], a["recall"]) == (6, 5 / 6)
    assert find("recall", layer="all", rows="answer", name="dense")["recall"] == 1.0
    # Prompt rows: 3 of 4 selections identical; hit and miss share 15 of 16 blocks.
    p = find("agreement", layer=1, rows="prompt", name="fp8/mxfp4")
    assert (p["n"], p["identical"]) == (4, 0.75) and math.isclose(p["overlap"], (3 + 15 / 16) / 4)
    # Answer rows: the generated tokens part after the first, so 2 rows x 2 heads are compared.
    ans = find("agreement", layer=1, rows="answer", name="fp8/mxfp4")
    assert (ans["n"], ans["identical"]) == (4, 0.75)
    same = [r for r in summary["agreement"] if r["name"] == "fp8/fp8_again"]
    assert same and all(r["identical"] == 1.0 and r["overlap"] == 1.0 for r in same)
    assert not [r for r in summary["agreement"] if "dense" in r["name"]]
    assert find("dense", layer=1, rows="prompt")["all_visible"] == 1.0
    assert find("dense", layer=1, rows="answer")["all_visible"] == 5 / 6

    summary["run"] = {"model": "m", "formats": ["dense", "fp8", "mxfp4", "fp8_again"], "samples": 1, "prompt_rows": 2,
                      "gen_tokens": 3}
    summary["docs"] = [{"correct": {"dense": 1.0, "fp8": 1.0, "mxfp4": 0.0, "fp8_again": 1.0}}]
    text = agreement.markdown(summary)
    assert "| 2688 | 1 | 75.0 / " in text and "fp8/mxfp4 prompt" in text and "83.3 (" in text
    assert "dense 1/1, fp8 1/1, mxfp4 0/1" in text


def test_saved_format_round_trip(tmp_path):
    sel = _kinds({"prompt": {1: [[[0, 1, 2], [0, 1, 3]]], 2: [[[4, 5, 6], [0, 1, 3]]]},
                  "question": {1: [[[0, 1, 2]]], 2: [[[4, 5, 6]]]}, "answer": {1: [[[7, 8, 9]]], 2: [[[7, 8, 9]]]}})
    agreement.save_format(tmp_path, "fp8", "abc", {3: sel}, {3: [5, 6]}, recorded=12)
    loaded, outputs, recorded = agreement.load_format(tmp_path, "fp8", "abc")
    assert outputs == {3: [5, 6]} and recorded == 12
    for kind in agreement.ROW_KINDS:
        for layer in (1, 2):
            assert np.array_equal(loaded[3][kind][layer], sel[kind][layer])
            assert np.array_equal(loaded[3]["n_visible"][kind][layer], sel["n_visible"][kind][layer])
    assert agreement.load_format(tmp_path, "mxfp4", "abc") is None
    with pytest.raises(ValueError, match="other settings"):
        agreement.load_format(tmp_path, "fp8", "abd")


def test_needle_token_span_skips_zero_width_tokens():
    offsets = [(0, 0), (0, 5), (6, 6), (6, 10)]  # a zero-width token after an uncovered space
    assert agreement.needle_token_span(offsets, 5, 10) == (3, 4)


class _CharTokenizer:
    """A fast-tokenizer stand-in: one token per character, offsets ``(i, i + 1)``."""

    is_fast = True

    def __call__(self, text, return_offsets_mapping=False):
        return {"input_ids": [ord(c) for c in text], "offset_mapping": [(i, i + 1) for i in range(len(text))]}


def test_prepare_takes_the_last_question_and_exact_needle_blocks():
    sentence = needle.NEEDLE.format(key="k", value="42")
    at = 2 * agreement.PAGE_SIZE - len(sentence)  # the needle ends exactly on a block boundary
    prompt = ("x" * 10 + "\n\nQuestion: decoy?").ljust(at, "y") + sentence + "z" * 50 + "\n\nQuestion: k?"
    d = agreement.prepare(_CharTokenizer(), {"input": prompt, "key": "k", "target": "42", "length": 300,
                                             "depth": 50}, 0)
    assert d["needle_tokens"] == [at, 2 * agreement.PAGE_SIZE] and d["needle_blocks"] == [1]
    assert d["question_start"] == prompt.rindex("Question:") and d["prompt_len"] == len(prompt)


def test_merge_ranks_checks_records_are_in_step():
    r0 = [_record("extend", 1, [5], [[[0]]], heads=[0])]
    r1 = [_record("extend", 2, [5], [[[1]]], heads=[1])]
    with pytest.raises(ValueError, match="out of step"):
        agreement.merge_ranks([r0, r1])
    r2 = [_record("extend", 1, [6], [[[1]]], heads=[1])]
    with pytest.raises(ValueError, match="out of step"):
        agreement.merge_ranks([r0, r2])


def test_request_rows_end_is_exclusive():
    recs = [_record("extend", 1, [8, 9, 10, 11], [[[0], [1], [2], [3]]])]
    rows = agreement.request_rows(recs, 9, 11)
    assert rows[1]["positions"].tolist() == [9, 10] and rows[1]["selected"].tolist() == [[[1], [2]]]


def test_set_agreement_of_empty_sets_and_needle_hits_of_the_exact_set():
    empty = np.full((1, 2, 3), -1, dtype=np.int32)
    assert agreement.set_agreement(empty, empty) == (2, 2, 2.0)
    assert agreement.needle_hits(_sel([[[5, 6], [6, 5, 7], [5]]]), [5, 6]) == (3, 2, 3)


def test_chance_recall_edges_against_counting():
    # A needle block one past the row is not visible yet.
    assert agreement.chance_recall(20, [20], 16) == 0.0
    # Init blocks are always kept and leave the pool: 17 candidates, 13 ranked picks.
    assert math.isclose(agreement.chance_recall(20, [3], 16, local_blocks=1, init_blocks=2), 13 / 17)
    assert agreement.chance_recall(20, [1], 16, local_blocks=1, init_blocks=2) == 1.0
    # As many needle blocks as ranked picks: exactly one draw of C(19, 15) holds them all.
    assert math.isclose(agreement.chance_recall(20, list(range(15)), 16), 1 / math.comb(19, 15))


def test_chance_recall_matches_enumeration():
    """Brute force: every ranked draw from the candidate pool, counted exactly."""
    n_visible, topk, local, init = 9, 6, 1, 1
    pool = range(init, n_visible - local)
    for blocks in ([2], [2, 5], [0, 4], [8], [3, 4, 6], [1, 2, 3, 4, 5]):
        draws = list(itertools.combinations(pool, topk - init - local))
        kept = set(range(init)) | set(range(n_visible - local, n_visible))
        hits = sum(set(blocks) <= kept | set(draw) for draw in draws)
        got = agreement.chance_recall(n_visible, blocks, topk, local, init)
        assert math.isclose(got, hits / len(draws)), (blocks, got, hits / len(draws))


def test_row_kinds_positions():
    doc = {"prompt_len": 100, "question_start": 90}
    assert agreement.row_kinds(doc, 3, 16) == {"prompt": (84, 100), "question": (90, 100), "answer": (99, 102)}
    assert agreement.row_kinds(doc, 1, 500)["prompt"] == (0, 100)  # more rows asked than the prompt has


def test_tally_without_rows_gives_none():
    t = agreement.Tally()
    t.add(4096, 1, "answer", "fp8", n=0, all=0)
    (row, every) = t.table({"recall": ("all", "n")})
    assert row["recall"] is None and every["layer"] == agreement.ALL_LAYERS and every["recall"] is None
