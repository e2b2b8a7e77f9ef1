"""TP2 and TP4 against TP1 on the CPU: real SGLang servers (``--tp 2`` or ``--tp 4``, and ``--tp 1``, torch
paths) load one random checkpoint; ``lab/gpu/sglang_tp2.py --cpu --tp N`` compares greedy tokens, prompt
logprobs and the selected blocks (the TPn ranks' records merged in index-head order). At TP4 each rank holds
one index head, as MiniMax-M3 is served in production; on a 2-core box its four ranks share the cores.

SGLang 0.5.16 serves ``--tp 2 --device cpu`` here given two environment variables the driver sets
for it: ``SGLANG_CPU_OMP_THREADS_BIND="0|1"`` (one core per rank; without it SGLang asserts that
tp_size <= NUMA nodes) and ``SGLANG_NCCL_SO_PATH`` pointing at no library (a CUDA build of torch
finds libnccl, and SGLang's PyNccl communicator then asks for a CUDA device: "Expected a cuda
device, but got: cpu"); all-reduce then runs over gloo.

Config: MiniMax-M3's per-layer geometry (4 KV heads, 4 index heads of 128) with 8 query heads,
hidden 256, 1 dense + 1 sparse layer; one 2200-token prompt (18 blocks: top-16 drops blocks).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "lab" / "gpu" / "sglang_tp2.py"
PROMPT_TOKENS = 2200
TIE_MARGIN = 0.25  # nats; TP1-vs-TP2 prompt logprobs differ by up to ~0.1 here (bf16 all-reduce order)


def _load_check_entry_point(root: Path) -> Path:
    """A dist-info registering lab/gpu/m3_load_check.py as an SGLang plugin (checkpoint coverage)."""
    dist = root / "m3_tp_cpu_check-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: m3-tp-cpu-check\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\nm3_load_check = m3_load_check:register\n")
    return root


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def results(request, tmp_path_factory):
    tp = request.param
    root = tmp_path_factory.mktemp(f"tp{tp}")
    ep = _load_check_entry_point(root / "ep")
    paths = [str(ep), str(REPO / "lab" / "gpu")] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    for attempt in (1, 2):
        out = root / f"out{attempt}"
        cmd = [sys.executable, str(DRIVER), "--cpu", "--tp", str(tp), "--out", str(out), "--formats", "mxfp4", "--lengths",
               str(PROMPT_TOKENS), "--new-tokens", "4", "--dense", "1", "--sparse", "1", "--hidden", "256",
               "--q-heads", "8", "--tie-margin", str(TIE_MARGIN), "--budget-s", "900"]
        run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
        print(run.stdout[-6000:])
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        result = json.loads((out / "results.json").read_text())["formats"]["mxfp4"]
        if "errors" not in result:
            return dict(result, tp=tp)
        # A server that died before answering: seen once in about ten runs of the suite on a 2-core
        # box (the TP2 server; not reproduced in isolation or under load). Its log tail is printed and
        # the pair is started once more; a second death fails every test here.
        print(f"attempt {attempt}: a server died before answering:", json.dumps(result["errors"])[-4000:])
    pytest.fail("both attempts lost a server: " + json.dumps(result["errors"])[-4000:])


def test_both_servers_load_every_parameter_from_the_checkpoint(results):
    loads = {name: s["load"] for name, s in results["servers"].items()}
    tp = results["tp"]
    assert loads["mxfp4-tp1"]["ranks"] == [0] and loads[f"mxfp4-tp{tp}"]["ranks"] == list(range(tp))
    assert all(x["missing"] == [] for x in loads.values()), loads


def test_tpn_selects_tp1_blocks_outside_the_score_difference(results):
    cmp = results["compare"]
    assert cmp["verdict"]["same_rows_recorded"] and cmp["verdict"]["heads_ok"], cmp["head_mapping"]
    layer = cmp["layers"]["1"]  # first sparse layer (JSON keys are strings)
    assert layer["choice_head_rows"] > 0, "no row saw more than 16 blocks"
    assert layer["scored_head_rows"] == layer["head_rows"]
    assert layer["unexplained"] == 0, layer.get("first_unexplained")
    assert layer["choice_equal"] >= 0.8 * layer["choice_head_rows"], layer


def test_tpn_greedy_tokens_match_or_diverge_at_a_near_tie(results):
    (prompt,) = results["compare"]["prompts"]
    assert prompt["ok"], prompt
    assert prompt["prompt_logprob_mean_abs_diff"] < 0.1, prompt
