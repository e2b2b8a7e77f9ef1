"""The runner end to end on CPU: two SGLang servers of the tiny MiniMax-M3.1 config (dummy
weights), one per index-K format, real lm-eval through local-completions, then the report."""

import json
from pathlib import Path

import pytest

from accuracy import run

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "minimax-m3.1-tiny"
CPU_LAUNCH = ["--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "4096",
              "--load-format", "dummy", "--skip-server-warmup"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_formats_against_the_tiny_server(tmp_path):
    out = tmp_path / "acc"
    summary = run.compare_formats([
        "--model", str(TINY), "--formats", "fp8", "mxfp4", "--tasks", "m3_niah_single", "m3_short_arith",
        "--lengths", "640", "--samples", "2", "--depths", "2", "--limit", "2", "--concurrency", "2",
        "--max-gen-toks", "6", "--bootstrap", "200", "--launch-timeout", "400", "--out", str(out), "--", *CPU_LAUNCH,
    ])
    # The format switch reached each server: the plugin logs the cache format it built.
    for fmt in ("fp8", "mxfp4"):
        assert f"index-K cache: {fmt} " in (out / f"server-{fmt}.log").read_text()
        for task, n in (("m3_niah_single", 2), ("m3_short_arith", 2)):
            rows = [json.loads(line) for line in (out / "samples" / fmt / f"{task}.jsonl").read_text().splitlines()]
            assert len(rows) == n
            assert all(r["score"] in (0.0, 1.0) and isinstance(r["response"], str) for r in rows)
    niah = summary["tasks"]["m3_niah_single"]
    assert [g["length"] for g in niah] == [640, "all"]
    paired = niah[-1]["paired"]["mxfp4"]
    assert paired["n"] == 2 and 0.0 <= paired["p_mcnemar"] <= 1.0
    assert paired["ci_lo"] <= paired["diff"] <= paired["ci_hi"]
    assert "### m3_short_arith" in (out / "report.md").read_text()
    results = json.loads((out / "results.json").read_text())
    assert results["run"]["formats"] == ["fp8", "mxfp4"]
    # each server said what it serves, checked against its label before any prompt (sglang_m3.server_info)
    for fmt in ("fp8", "mxfp4"):
        served = results["servers"][fmt]
        assert served["model_path"] == str(TINY) and served["m3_index_k"]["format"] == fmt
        assert served["m3_index_k"]["sparse_layers"] > 0 and served["sglang_version"]
    assert "## Servers" in (out / "report.md").read_text()
    assert (out / "accuracy_vs_length.png").stat().st_size > 1000
