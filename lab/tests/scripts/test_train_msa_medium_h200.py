"""lab/gpu/train_msa_medium_h200.sh on the CPU at micro size: a new run, a refused restart over its
checkpoint, an exact resume on the same "machine" and a resume on a fresh one from the returned
portable parts; each call leaves at most 8 files (call.log, metrics, probe, export.tgz, state parts)."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "lab" / "gpu" / "train_msa_medium_h200.sh"
MICRO = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "rotary_dim": 16, "dense_intermediate_size": 128, "intermediate_size": 128,
         "moe_layer_freq": [0, 0], "max_position_embeddings": 4096}
PLAN = ["--steps", "4", "--dense-steps", "2", "--train-s", "0", "--curriculum", "0:256;0.5:512", "--token-budget",
        "512", "--lm-rows", "16", "--kl-rows", "16", "--warmup-steps", "1"]
CALL = ["--eval-samples", "0", "--log-every", "1"]


def _call(tmp_path, out: str, run_dir: str, *args, **env):
    full = {**os.environ, "OUT": str(tmp_path / out), "RUN_DIR": str(tmp_path / run_dir), "BUDGET_S": "400",
            "PROBE_S": "120", "PYTHON": sys.executable, "DEVICE": "cpu",
            "PROBE_ARGS": "--lengths 512 --tasks single,kv --modes fp8,mxfp4 --samples 2 --round 2", **env}
    proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=900)
    return proc.returncode, (tmp_path / out / "call.log").read_text() if (tmp_path / out / "call.log").exists() else ""


def _files(out: Path) -> dict:
    return {str(f.relative_to(out)): f.stat().st_size for f in out.rglob("*") if f.is_file()}


@pytest.mark.slow
def test_calls_resume_and_leave_at_most_eight_files(tmp_path):
    base = json.loads((ROOT / "lab" / "training" / "configs" / "msa-small.json").read_text())
    base.update(MICRO)
    base["sparse_attention_config"].update(sparse_attention_freq=[0, 1], sparse_disable_index_value=[0, 1],
                                           sparse_num_index_heads=2, sparse_topk_blocks=2)
    config = tmp_path / "micro.json"
    config.write_text(json.dumps(base))

    rc, log = _call(tmp_path, "out1", "run", "--config", str(config), *PLAN, *CALL, "--stop-at-step", "2")
    assert rc == 0, log
    files = _files(tmp_path / "out1")
    assert {"call.log", "metrics.jsonl", "probe/probe.json", "probe/probe.md", "export.tgz",
            "portable.pt.part-aa"} <= set(files) and len(files) <= 8, files
    assert all(size <= 16 * 2**20 for size in files.values())
    with tarfile.open(tmp_path / "out1" / "export.tgz") as tar:
        assert "export/config.json" in tar.getnames()
    probe = json.loads((tmp_path / "out1" / "probe" / "probe.json").read_text())
    assert probe["step"] == 2 and {c["n"] for c in probe["cells"].values()} == {2}
    assert "done: step 2 of 4" in log

    rc, log = _call(tmp_path, "out2", "run")
    assert rc == 2 and "holds a checkpoint" in log

    rc, log = _call(tmp_path, "out3", "run", *CALL, "--stop-at-step", "3", RESUME=str(tmp_path / "run"))
    assert rc == 0 and "resume exact" in log and "done: step 3 of 4" in log, log

    carried = tmp_path / "carried"
    carried.mkdir()
    for part in (tmp_path / "out3").glob("portable.pt.part-*"):
        (carried / part.name).write_bytes(part.read_bytes())
    rc, log = _call(tmp_path, "out4", "fresh-machine", *CALL, RESUME=str(carried))
    assert rc == 0 and "resume from portable state" in log and "done: step 4 of 4" in log, log
    assert json.loads((tmp_path / "out4" / "probe" / "probe.json").read_text())["step"] == 4
