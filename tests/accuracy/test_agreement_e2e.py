"""The agreement study end to end on CPU: the tiny MiniMax-M3.1 config (dummy weights) served by
real SGLang servers, dense control, fp8 and mxfp4, one needle prompt of 18 blocks (past top-16)."""

import json
from pathlib import Path

import pytest

from accuracy import agreement

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "minimax-m3.1-tiny"
CPU_LAUNCH = ["--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "4096",
              "--load-format", "dummy", "--skip-server-warmup"]
LENGTH = 18 * 128  # the prompt ends in block 17: its last rows see 18 blocks
GEN = 3


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dense_fp8_mxfp4_on_the_tiny_server(tmp_path):
    out = tmp_path / "agr"
    argv = ["--model", str(TINY), "--formats", "dense", "fp8", "mxfp4", "--lengths", str(LENGTH), "--samples", "1",
            "--depths", "1", "--gen-tokens", str(GEN), "--prompt-rows", "96", "--launch-timeout", "600",
            "--out", str(out), "--", *CPU_LAUNCH]
    summary = agreement.main(argv)
    # Saved per format: a second call with --reuse serves nothing and gives the same numbers.
    logs = {p: p.stat().st_mtime_ns for p in out.glob("server-*.log")}
    again = agreement.main(["--reuse", *argv])
    assert again == summary and logs == {p: p.stat().st_mtime_ns for p in out.glob("server-*.log")}
    assert json.loads((out / "agreement.json").read_text())["run"]["formats"] == ["dense", "fp8", "mxfp4"]
    assert "### Needle-block recall" in (out / "agreement.md").read_text()
    assert not list(out.glob("records-*")), "raw records are deleted"
    # The dense server ran with top-k = the blocks of the longest request, bf16 index cache ...
    (doc,) = summary["docs"]
    topk = summary["run"]["topk"]
    assert topk["dense"] == -(-(LENGTH + 128) // 128) and topk["fp8"] == topk["mxfp4"] == 16
    assert "index-K cache: bf16 " in (out / "server-dense.log").read_text()
    assert "index-K cache: mxfp4 " in (out / "server-mxfp4.log").read_text()
    # ... and every recorded selection (96 prompt rows and the answer rows, every sparse layer and head)
    # holds every visible block, though those rows see more than 16.
    dense = [r for r in summary["dense"] if r["layer"] == agreement.ALL_LAYERS]
    assert {r["rows"]: r["n"] for r in dense} == {"prompt": 3 * 4 * 96, "answer": 3 * 4 * GEN}
    assert all(r["all_visible"] == 1.0 for r in dense)
    assert doc["prompt_len"] > 16 * 128
    # The recorder kept the prompts' tails (index_k_debug_rows): per layer, the last 96 rows of each
    # 2048-token prefill chunk and the decode rows, not all ~2300 rows.
    for fmt in ("dense", "fp8", "mxfp4"):
        assert 3 * (96 + GEN - 1) <= summary["run"]["recorded_rows"][fmt] <= 3 * (2 * 96 + GEN - 1)
    recall = {(r["name"], r["rows"], r["layer"]): r for r in summary["recall"]}
    assert recall[("dense", "answer", agreement.ALL_LAYERS)]["recall"] == 1.0
    for fmt in ("fp8", "mxfp4"):
        for rows in agreement.RECALL_ROWS:
            r = recall[(fmt, rows, agreement.ALL_LAYERS)]
            assert 0.0 <= r["recall"] <= r["recall_any"] <= 1.0 and 0.0 < r["chance"] < 1.0
    pairs = [r for r in summary["agreement"] if r["name"] == "fp8/mxfp4"]
    assert {(r["layer"], r["rows"]) for r in pairs} == {(lay, rows) for lay in (1, 2, 3, "all")
                                                         for rows in agreement.AGREEMENT_ROWS}
    for r in pairs:
        assert 0.0 <= r["identical"] <= r["overlap"] <= 1.0 and r["n"] > 0
