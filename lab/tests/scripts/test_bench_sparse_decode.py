"""lab/gpu/bench_sparse_decode.py: the batches it times hold what the selector would give and the bytes it
counts are the selected tokens' K and V (checked on the CPU for lengths 1, 127, 128, 129 and past 16 blocks); on
CUDA (marked gpu) every candidate it times is right against the float64 reference and the table names one to hold."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "lab" / "gpu"))
import bench_sparse_decode as bench  # noqa: E402


@pytest.mark.parametrize("context", [1, 127, 128, 129, 2500])
def test_a_batch_selects_each_requests_own_block_and_distinct_earlier_ones(context):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    batch, hkv, d, topk = 3, 2, 16, 4
    req = bench.make_batch(batch, context, hq=4, hkv=hkv, d=d, topk=topk, gen=gen, dev="cpu")
    assert req["q"].shape == (batch, 4, d) and req["topk_idx"].shape == (hkv, batch, topk)
    assert req["k_cache"].shape == (batch * context, hkv, d) and req["req_to_token"].shape == (batch, context)
    assert sorted(req["req_to_token"].flatten().tolist()) == list(range(batch * context))  # disjoint slots
    assert req["seq_lens"].tolist() == [context] * batch
    own = (context - 1) // bench.BLOCK
    tokens = 0
    for h in range(hkv):
        for b in range(batch):
            row = req["topk_idx"][h, b].tolist()
            valid = [x for x in row if x >= 0]
            assert row == sorted(row, reverse=True) and row[: len(valid)] == valid  # -1 only after the blocks
            assert valid[0] == own and len(set(valid)) == len(valid) and len(valid) == min(topk, own + 1)
            tokens += sum(min(bench.BLOCK, context - x * bench.BLOCK) for x in valid)
    assert bench.bytes_read(req) == tokens * d * 2 * 2  # K and V, bf16


def test_the_reference_is_the_whole_context_oracle_of_each_picked_request():
    """``references`` gathers a request's slots in token order: equal to the oracle run on the pool itself."""
    from m3_kernels.ops.attention.naive import sparse_attention_ref

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    req = bench.make_batch(5, 300, hq=4, hkv=2, d=16, topk=3, gen=gen, dev="cpu")
    want = bench.references(req, 4)
    assert sorted(want) == [0, 1, 3, 4]
    b = 3
    direct = sparse_attention_ref(req["q"][b:b + 1], req["k_cache"], req["v_cache"], req["req_to_token"],
                                  req["req_pool_indices"][b:b + 1], req["seq_lens"][b:b + 1], torch.tensor([0, 1]),
                                  torch.tensor([299]), req["topk_idx"][:, b:b + 1], bench.BLOCK, req["sm_scale"])
    torch.testing.assert_close(want[b], direct, rtol=0, atol=0)
    out = torch.cat([want.get(i, torch.zeros_like(want[0])) for i in range(5)]).bfloat16()
    assert bench.reference_error(out, want) <= 2.0**-8 * float(out.abs().max())
    out[4, 1, 7] += 1.0
    assert bench.reference_error(out, want) >= 0.99


def test_without_cuda_it_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    proc = subprocess.run([sys.executable, str(ROOT / "lab" / "gpu" / "bench_sparse_decode.py")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_candidate_is_timed_and_right(tmp_path):
    assert bench.main(["--batches", "1,5", "--contexts", "129,1000", "--picks", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench_sparse_decode.json").read_text())
    assert len(data["rows"]) == 2 * 2 * 8 and {len(p) for p in data["picks"].values()} == {2}
    assert all(r["max_err"] < 0.05 and r["us"] > 0 for r in data["rows"])  # bf16 output of randn values, |v| < 6
    assert tuple(data["best"]) in {(r["warps"], r["stages"]) for r in data["rows"]}
    assert "M3_SPARSE_DECODE_CONFIG=" in (tmp_path / "bench_sparse_decode.md").read_text()


def test_the_summary_ranks_candidates_by_geometric_mean_and_the_table_names_the_one_to_hold():
    """Two cells, three candidates: (4, 2) fastest in one cell and 4x slower in the other, (8, 3) 1.5x in both,
    (4, 3) fastest in the second and 2x in the first: geometric means 2, 1.5 and 1.414, so (4, 3) is named."""
    times = {(4, 2): (10.0, 40.0), (8, 3): (15.0, 15.0), (4, 3): (20.0, 10.0)}
    rows = [{"batch": b, "context": 8192, "warps": w, "stages": s, "us": us[i], "gbs": 1.0, "pct_copy": 1.0,
             "in_l2": b == 1, "equals_first": (w, s) == (4, 2), "max_err": 1e-3}
            for i, b in enumerate((1, 32)) for (w, s), us in times.items()]
    gmean, best = bench.summarize(rows)
    assert best == (4, 3)
    assert gmean[(4, 2)] == pytest.approx(2.0) and gmean[(8, 3)] == pytest.approx(1.5)
    assert gmean[(4, 3)] == pytest.approx(2 ** 0.5)
    assert [r["x_fastest"] for r in rows] == pytest.approx([1.0, 1.5, 2.0, 4.0, 1.5, 1.0])
    text = bench.render(rows, {1: [(4, 2), (8, 3)], 32: [(4, 3), (4, 3)]}, gmean, best, (4200.0, 4150.0), 50 * 2**20)
    lines = text.splitlines()
    assert lines[0].startswith("Copy bandwidth 4200 GB/s at the start, 4150 at the end") and "50 MiB L2" in lines[0]
    assert "| 1 | 8192 | 4, 2 | 10.0 | 1 | 1 L2 | 1.00 | yes | 1.00e-03 |" in lines
    assert "| 32 | 8192 | 4, 2 | 40.0 | 1 | 1 | 4.00 | yes | 1.00e-03 |" in lines
    assert lines[-2] == "Autotuner picks, batch 1: 4,2, 8,3; batch 32: 4,3, 4,3"
    assert lines[-1].endswith("4 warps, 3 stages, 1.414 (the worst candidate 2.000): M3_SPARSE_DECODE_CONFIG=4,3")
