"""lab/scripts/accuracy_pairs_split.py: pairs read from a dump, counts against a brute-force count, Fisher's p against
exact enumeration, the chi-square p against its closed form at one degree of freedom, bad rows, the printed text."""

import json
import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import accuracy_pairs_split as aps  # noqa: E402


def _rows(rng, n_docs=60):
    """Rows of fp8, mxfp4 and bf16 for two tasks at two lengths, some docs answered by one format only."""
    rows = []
    for task in ("m3_kv_64", "m3_vt_value"):
        for length in (8192, 32768):
            for i in range(n_docs):
                for fmt, card in (("fp8", "H200"), ("mxfp4", rng.choice(["H100", "H200"])), ("bf16", "H100")):
                    if rng.random() < 0.1:
                        continue
                    rows.append({"format": fmt, "task": task, "doc_id": f"{length}/{i}", "length": length,
                                 "score": float(rng.random() < 0.6), "served_on": card})
    rng.shuffle(rows)
    return rows


def _write(tmp_path, rows, name="s.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return path


def _fisher_two_sided(a, b, c, d):
    """Sum of the hypergeometric probabilities of every table with the margins of [[a, b], [c, d]] that is no
    more probable than it (with a relative tolerance for ties)."""
    row1, col1, n = a + b, a + c, a + b + c + d

    def prob(x):
        return math.comb(col1, x) * math.comb(n - col1, row1 - x) / math.comb(n, row1)

    observed = prob(a)
    return sum(prob(x) for x in range(max(0, row1 + col1 - n), min(row1, col1) + 1)
               if prob(x) <= observed * (1 + 1e-7))


def test_pairs_and_counts_match_a_brute_force_count(tmp_path):
    rng = random.Random()
    rows = _rows(rng)
    pairs = aps.load_pairs(_write(tmp_path, rows), "fp8", "mxfp4")
    by = {(r["format"], r["task"], r["doc_id"]): r for r in rows}
    expect = sorted((t, d) for f, t, d in by if f == "fp8" and ("mxfp4", t, d) in by)
    assert sorted((p["task"], f"{p['length']}/{p['index']}") for p in pairs) == expect
    assert [(p["task"], p["length"], p["index"]) for p in pairs] == sorted(
        (p["task"], p["length"], p["index"]) for p in pairs)
    for p in pairs:
        key = f"{p['length']}/{p['index']}"
        b, c = by[("fp8", p["task"], key)], by[("mxfp4", p["task"], key)]
        assert (p["base"], p["cand"], p["base_on"], p["cand_on"]) == (b["score"], c["score"], "H200", c["served_on"])
    n10 = sum(by[("fp8", t, d)]["score"] > by[("mxfp4", t, d)]["score"] for t, d in expect)
    n01 = sum(by[("fp8", t, d)]["score"] < by[("mxfp4", t, d)]["score"] for t, d in expect)
    assert aps.counts(pairs) == (len(expect), n10, n01)
    cards = aps.by_cards(pairs)
    assert set(cards) <= {"H200 / H100", "H200 / H200"}
    assert [sum(c[k] for c in cards.values()) for k in range(3)] == [len(expect), n10, n01]


@pytest.mark.parametrize("split", [1, 17, 30, 59, 60, 1000])
def test_split_counts_and_fisher_p(tmp_path, split):
    pairs = aps.load_pairs(_write(tmp_path, _rows(random.Random())), "fp8", "mxfp4")
    got = aps.split_test(pairs, split)
    low = [p for p in pairs if p["index"] < split]
    high = [p for p in pairs if p["index"] >= split]
    assert got["low"] == aps.counts(low) and got["high"] == aps.counts(high)
    if not high:
        assert math.isnan(got["p"])
        return
    d_low = sum(p["base"] != p["cand"] for p in low)
    d_high = sum(p["base"] != p["cand"] for p in high)
    assert got["p"] == pytest.approx(_fisher_two_sided(d_low, len(low) - d_low, d_high, len(high) - d_high),
                                     rel=1e-9)


def _pair(index, base, cand):
    return {"task": "t", "length": 8192, "index": index, "base": base, "cand": cand, "base_on": "A", "cand_on": "B"}


def test_fisher_p_of_a_hand_table():
    # 3 of 10 discordant below index 10, 0 of 10 above: p = 2 * C(3,3)C(17,7)/C(20,10) = 0.2105...
    pairs = [_pair(i, 1, 0 if i < 3 else 1) for i in range(20)]
    assert aps.split_test(pairs, 10)["p"] == pytest.approx(2 * math.comb(17, 7) / math.comb(20, 10))


def test_ranges_and_the_chi_square_p_at_one_degree_of_freedom():
    rng = random.Random()
    pairs = [_pair(i, 1, int(rng.random() < 0.8)) for i in range(50)]
    pairs[0]["cand"], pairs[40]["cand"] = 0, 1  # at least one discordant and one concordant
    ranges, p = aps.by_range(pairs, 25)
    assert [(a, b) for a, b, _ in ranges] == [(0, 24), (25, 49)]
    (a, c), (b, d) = [(x[1] + x[2], x[0] - x[1] - x[2]) for _, _, x in ranges]
    n = a + b + c + d
    x2 = n * (a * d - b * c) ** 2 / ((a + b) * (c + d) * (a + c) * (b + d))
    assert p == pytest.approx(math.erfc(math.sqrt(x2 / 2)))
    # the last range ends at its highest index; no discordant pair, or one range, gives no test
    assert aps.by_range(pairs[:30], 25)[0][-1][:2] == (25, 29)
    assert math.isnan(aps.by_range([_pair(i, 1, 1) for i in range(50)], 25)[1])
    assert math.isnan(aps.by_range(pairs, 100)[1])


@pytest.mark.parametrize("row, match", [
    ({"score": 0.5}, r"s.jsonl:1: score 0.5 is not 0 or 1"),
    ({"doc_id": "8192-3"}, r"doc_id '8192-3' of t is not <length>/<index>"),
])
def test_bad_rows_are_named(tmp_path, row, match):
    good = {"task": "t", "doc_id": "8192/3", "score": 1.0}
    rows = [{"format": "fp8", **good, **row}, {"format": "mxfp4", **good, **row}]
    with pytest.raises(ValueError, match=match):
        aps.load_pairs(_write(tmp_path, rows), "fp8", "mxfp4")


def test_a_doc_answered_twice_is_named(tmp_path):
    row = {"format": "fp8", "task": "t", "doc_id": "8192/3", "score": 1.0}
    with pytest.raises(ValueError, match=r":2: fp8 answered \('t', '8192/3'\) twice"):
        aps.load_pairs(_write(tmp_path, [row, row]), "fp8", "mxfp4")


def test_a_target_that_differs_between_formats_is_named(tmp_path):
    rows = [{"format": f, "task": "t", "doc_id": "8192/3", "score": 1.0, "target": target}
            for f, target in (("fp8", "123"), ("mxfp4", "124"))]
    with pytest.raises(ValueError, match=r"t doc 8192/3: target '123' in fp8 but '124' in mxfp4"):
        aps.load_pairs(_write(tmp_path, rows), "fp8", "mxfp4")
    rows[1]["target"] = "123"
    assert len(aps.load_pairs(_write(tmp_path, rows), "fp8", "mxfp4")) == 1


def test_a_missing_card_is_not_recorded(tmp_path):
    rows = [{"format": "fp8", "task": "t", "doc_id": "8192/3", "score": 1.0, "served_on": "H200"},
            {"format": "mxfp4", "task": "t", "doc_id": "8192/3", "score": 0.0}]
    pairs = aps.load_pairs(_write(tmp_path, rows), "fp8", "mxfp4")
    assert aps.by_cards(pairs) == {"H200 / not recorded": (1, 1, 0)}


def test_cards_count_as_the_report_counts(tmp_path):
    from accuracy.report import served_on_pairs
    rows = [r for r in _rows(random.Random(), n_docs=40) if r["format"] != "bf16"]
    docs = {f: {(r["task"], r["doc_id"]) for r in rows if r["format"] == f} for f in ("fp8", "mxfp4")}
    rows = [{**r, "target": "x"} for r in rows
            if (r["task"], r["doc_id"]) in docs["fp8"] & docs["mxfp4"]]  # the report needs both, and targets
    expect = {}
    for task in {r["task"] for r in rows}:
        per = {f: [r for r in rows if r["format"] == f and r["task"] == task] for f in ("fp8", "mxfp4")}
        for key, n in served_on_pairs(per["fp8"], per["mxfp4"], task, "mxfp4").items():
            expect[key] = tuple(a + b for a, b in zip(expect.get(key, (0, 0, 0)), n))
    assert aps.by_cards(aps.load_pairs(_write(tmp_path, rows), "fp8", "mxfp4")) == dict(sorted(expect.items()))


def test_the_default_dump_is_the_one_the_landing_script_appends_to():
    import accuracy_h200_land
    assert aps.DEFAULT.name == accuracy_h200_land.SAMPLES and aps.DEFAULT.is_file()


def test_printed_text(tmp_path, capsys):
    rows = [{"format": f, "task": t, "doc_id": f"8192/{i}", "score": float(s), "served_on": "H200"}
            for t in ("a", "b") for i in range(4) for f, s in (("fp8", i != 1), ("mxfp4", i != 2))]
    aps.main([str(_write(tmp_path, rows)), "--split", "2", "--width", "2"])
    out = capsys.readouterr().out
    assert "## all tasks: 4 of 8 (50.00%; 2 / 2)" in out
    assert "index < 2: 2 of 4 (50.00%; 0 / 2)" in out and "index >= 2: 2 of 4 (50.00%; 2 / 0)" in out
    assert "## a: 2 of 4 (50.00%; 1 / 1)" in out and "## b: 2 of 4" in out
    assert "cards H200 / H200: 4 of 8" in out and "index < 2, cards H200 / H200: 2 of 4" in out
    assert "indices 0-1: 2 of 4" in out and "indices 2-3: 2 of 4" in out
    with pytest.raises(SystemExit):
        aps.main([str(_write(tmp_path, rows)), "--split", "0"])
    assert "--split (0) and --width (128) must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no \\(task, doc_id\\) answered by both fp8 and bf16"):
        aps.main([str(_write(tmp_path, rows)), "--cand", "bf16"])
