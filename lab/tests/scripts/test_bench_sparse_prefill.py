"""lab/gpu/bench_sparse_prefill.py: the requests it times hold what the selector would give (checked on the
CPU for lengths 1, 127, 128, 129 and a chunk past a prefix); on CUDA (marked gpu) every candidate it times is
right against the float64 reference and the table names one to hold."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "lab" / "gpu"))
import bench_sparse_prefill as bench  # noqa: E402


@pytest.mark.parametrize("context, chunk", [(1, 8), (127, 127), (128, 128), (129, 129), (1000, 300)])
def test_a_request_selects_its_own_block_and_distinct_earlier_ones(context, chunk):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    req = bench.make_request(context, chunk, hq=4, hkv=2, d=16, topk=4, gen=gen, dev="cpu")
    n = min(chunk, context)
    assert req["q"].shape == (n, 4, 16) and req["topk_idx"].shape == (2, n, 4)
    assert req["prefix_lens"].item() == context - n and req["positions"].tolist() == list(range(context - n, context))
    for h in range(2):
        for r, pos in enumerate(req["positions"].tolist()):
            row = req["topk_idx"][h, r].tolist()
            own = pos // bench.BLOCK
            valid = [b for b in row if b >= 0]
            assert row == sorted(row, reverse=True) and row[: len(valid)] == valid  # -1 only after the blocks
            assert valid[0] == own and len(set(valid)) == len(valid) and all(b < own for b in valid[1:])
            assert len(valid) == min(4, own + 1)


def test_without_cuda_it_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    proc = subprocess.run([sys.executable, str(ROOT / "lab" / "gpu" / "bench_sparse_prefill.py")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_candidate_is_timed_and_right(tmp_path):
    assert bench.main(["--contexts", "129,1000", "--chunk", "300", "--warmup-picks", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench_sparse_prefill.json").read_text())
    assert len(data["rows"]) == 2 * 9 and len(data["warmup_picks"]) == 2
    assert all(r["max_err"] < 0.05 and r["ms"] > 0 for r in data["rows"])  # bf16 output of randn values, |v| < 6
    assert tuple(data["best"]) in {(r["warps"], r["stages"]) for r in data["rows"]}
    assert "M3_SPARSE_PREFILL_CONFIG=" in (tmp_path / "bench_sparse_prefill.md").read_text()
