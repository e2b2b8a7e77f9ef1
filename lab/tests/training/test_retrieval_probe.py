"""training.retrieval_probe on the CPU: an exported micro model probed per task, length and mode; an
oracle model that reads the answer scores 1 and one that predicts the current token scores 0; the
same prompts in every mode and run; the budget leaves cells short, not wrong; Wilson intervals
against Newcombe (1998), Table I."""

import json
from pathlib import Path

import pytest
import torch

from training import retrieval_probe
from training.export import export_checkpoint
from training.model import MSAConfig, MSAForCausalLM

MICRO = Path(retrieval_probe.__file__).parent / "configs" / "msa-micro.json"
TOKENIZER = Path(retrieval_probe.__file__).parent / "tokenizer"


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    config = json.loads(MICRO.read_text())
    model = MSAForCausalLM(MSAConfig.from_dict(config))
    model.init_weights(0)
    return export_checkpoint(model, config, TOKENIZER, tmp_path_factory.mktemp("micro") / "export")


ARGS = ["--lengths", "512,1024", "--tasks", "single,kv", "--samples", "3", "--round", "2", "--budget-s", "600",
        "--device", "cpu"]


@pytest.mark.slow
def test_probe_fills_every_cell_and_pairs_modes(export, tmp_path):
    out = retrieval_probe.main([str(export), *ARGS, "--modes", "dense,sparse,fp8,mxfp4", "--pairs",
                                "fp8:mxfp4,dense:sparse", "--out", str(tmp_path)])
    assert set(out["cells"]) == {"single/512", "single/1024", "kv/512", "kv/1024"}
    for key, cell in out["cells"].items():
        task, length = key.split("/")
        rows = [r for r in out["samples"] if r["task"] == task and r["length"] == int(length)]
        assert cell["n"] == 3 and sorted(r["index"] for r in rows) == [0, 1, 2]
        for mode in ("dense", "sparse", "fp8", "mxfp4"):
            assert cell[mode]["correct"] == sum(r[mode] for r in rows)
            lo, hi = cell[mode]["ci95"]
            assert 0.0 <= lo <= cell[mode]["acc"] <= hi <= 1.0
        pair = cell["pairs"]["fp8:mxfp4"]
        assert pair["a_only"] == sum(r["fp8"] > r["mxfp4"] for r in rows)
        assert pair["b_only"] == sum(r["mxfp4"] > r["fp8"] for r in rows)
    saved = json.loads((tmp_path / "probe.json").read_text())
    assert saved["cells"] == json.loads(json.dumps(out["cells"]))
    assert "| kv | 1024 | 3 |" in (tmp_path / "probe.md").read_text()
    again = retrieval_probe.main([str(export), *ARGS, "--modes", "mxfp4"])
    assert [r["mxfp4"] for r in again["samples"]] == [r["mxfp4"] for r in out["samples"]]


class _Reader(torch.nn.Module):
    """Logits that put all mass on ``input_ids[row + shift]``: shift 1 reads the answer, shift 0 repeats."""

    def __init__(self, shift: int):
        super().__init__()
        self.shift = shift

    def forward(self, input_ids, attention, logit_rows, index_k_format=None):
        target = input_ids.gather(1, (logit_rows + self.shift).clamp(max=input_ids.shape[1] - 1))
        return torch.nn.functional.one_hot(target, 2048).float(), {}


@pytest.mark.parametrize("shift,expected", [(1, 1), (0, 0)])
def test_probe_scores_what_the_model_predicts(shift, expected):
    results = retrieval_probe.run(_Reader(shift), [512], ["single", "multikey", "kv", "vt"], ["dense", "mxfp4"],
                                  samples=2, budget_s=600, device=torch.device("cpu"), log=lambda _: None)
    assert len(results) == 8
    assert all(r["dense"] == r["mxfp4"] == expected for r in results)


def test_budget_leaves_cells_short(export):
    out = retrieval_probe.main([str(export), *ARGS[:-4], "--budget-s", "0", "--device", "cpu"])
    assert out["samples"] == [] and all(c["n"] == 0 for c in out["cells"].values())


def test_arguments_are_validated(export):
    for bad, match in ((["--modes", "dense,dense"], "--modes"), (["--modes", "fp4"], "--modes"),
                       (["--tasks", "copy"], "--tasks"), (["--lengths", "500"], "--lengths"),
                       (["--pairs", "fp8:bf16"], "--pairs"), (["--samples", "0"], "--samples")):
        with pytest.raises(ValueError, match=match):
            retrieval_probe.main([str(export), "--device", "cpu", *bad])


def test_wilson_matches_newcombe_table_1():
    for (k, n), (lo, hi) in {(81, 263): (0.2553, 0.3662), (15, 148): (0.0624, 0.1605), (0, 20): (0.0, 0.1611),
                             (1, 29): (0.0061, 0.1718)}.items():
        got = retrieval_probe.wilson(k, n)
        assert got == pytest.approx((lo, hi), abs=5e-5), (k, n)
    assert retrieval_probe.wilson(0, 0) == (0.0, 1.0)


class _Recorder(torch.nn.Module):
    """A reader (shift 1) that records the attention mode, index-K format and prompts of every forward."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, input_ids, attention, logit_rows, index_k_format=None):
        self.calls.append((attention, index_k_format, input_ids.clone()))
        return _Reader(1)(input_ids, attention, logit_rows)


def test_each_mode_scores_the_same_prompts_with_its_attention_and_format():
    model = _Recorder()
    results = retrieval_probe.run(model, [512], ["kv"], list(retrieval_probe.MODES), samples=3, budget_s=600,
                                  device=torch.device("cpu"), round_size=3, log=lambda _: None)
    assert [r["index"] for r in results] == [0, 1, 2] and all(r[m] == 1 for r in results for m in retrieval_probe.MODES)
    assert [(a, f) for a, f, _ in model.calls] == [("dense", None), ("sparse", None), ("sparse", "bf16"),
                                                   ("sparse", "fp8"), ("sparse", "mxfp4"), ("sparse", "mxfp4_rot")]
    prompts = model.calls[0][2]
    assert all(torch.equal(ids, prompts) for _, _, ids in model.calls)
    assert len({tuple(row.tolist()) for row in prompts}) == 3  # each index its own prompt


def test_budget_skips_a_batch_predicted_to_end_past_it(monkeypatch):
    """A clock that moves 10 s per forward and a 15 s budget: the first batch runs (nothing predicted yet), the
    second is predicted to end at 20 s and skipped."""
    import types

    now = [0.0]

    class Slow(_Reader):
        def forward(self, *args, **kw):
            now[0] += 10.0
            return super().forward(*args, **kw)

    monkeypatch.setattr(retrieval_probe, "time", types.SimpleNamespace(time=lambda: now[0]))
    logged = []
    results = retrieval_probe.run(Slow(1), [512], ["single", "kv"], ["dense"], samples=1, budget_s=15,
                                  device=torch.device("cpu"), log=logged.append)
    assert [(r["task"], r["index"]) for r in results] == [("single", 0)]
    assert any("1 samples not scored" in line for line in logged), logged


def test_summary_counts_pairs_and_intervals_per_cell():
    """20 rows of one cell: fp8 right on none, mxfp4 right on rows 0-4: counts, accuracy, the Wilson interval of
    0/20 from Newcombe (1998), Table I, and the discordant pairs either way."""
    rows = [{"task": "kv", "length": 512, "index": i, "fp8": 0, "mxfp4": int(i < 5)} for i in range(20)]
    cells = retrieval_probe.summarize(rows, [512, 1024], ["kv"], ["fp8", "mxfp4"], [("fp8", "mxfp4"), ("mxfp4", "fp8")])
    cell = cells["kv/512"]
    assert cell["n"] == 20 and cell["fp8"]["correct"] == 0 and cell["mxfp4"]["correct"] == 5
    assert cell["mxfp4"]["acc"] == 0.25 and cell["fp8"]["ci95"] == pytest.approx((0.0, 0.1611), abs=5e-5)
    assert cell["pairs"]["fp8:mxfp4"]["a_only"] == 0 and cell["pairs"]["fp8:mxfp4"]["b_only"] == 5
    assert cell["pairs"]["mxfp4:fp8"]["a_only"] == 5 and cell["pairs"]["mxfp4:fp8"]["b_only"] == 0
    assert cells["kv/1024"]["n"] == 0 and cells["kv/1024"]["fp8"]["acc"] is None


def test_a_pair_must_name_two_different_modes(tmp_path):
    with pytest.raises(ValueError, match="--pairs"):
        retrieval_probe.main([str(tmp_path), "--device", "cpu", "--modes", "fp8,mxfp4", "--pairs", "fp8:fp8"])
