"""lab/gpu/accuracy_h200.sh on the CPU at tiny size (DEVICE=cpu: the trained configs/msa-small served
by real CPU SGLang servers, fp8 and mxfp4, the four long-context tasks at one length, 2 samples each,
and the agreement of bf16 and mxfp4): the files it leaves, then a second call on the same "machine"
and a call on a fresh one from the returned state.tgz, neither of which asks a server anything."""

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "lab" / "gpu" / "accuracy_h200.sh"
TASKS = ["m3_niah_single", "m3_niah_multikey", "m3_kv_64", "m3_vt_value"]  # the script's default
LENGTH = 18 * 128  # 18 blocks: past top-16, so the formats' selections can differ


def _call(tmp_path, out: str, run_dir: str, model: Path = ROOT / "configs" / "msa-small", **env):
    full = {**os.environ, "OUT": str(tmp_path / out), "RUN_DIR": str(tmp_path / run_dir), "DEVICE": "cpu",
            "PYTHON": sys.executable, "FORMATS": "fp8 mxfp4", "MAX_FORMATS": "2", "N_LARGE": "2", "N_SMALL": "1",
            "LENGTHS": str(LENGTH), "CHUNK": "2", "CONCURRENCY": "2", "AGREE_FORMATS": "bf16 mxfp4",
            "AGREE_SAMPLES": "1", "BUDGET_S": "1500", "AGREE_S": "500", **env}
    proc = subprocess.run(["bash", str(SCRIPT), str(model)], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=1700)
    log = tmp_path / out / "call.log"
    return proc.returncode, log.read_text() if log.exists() else proc.stdout + proc.stderr


def _check_files(out: Path) -> dict:
    files = {str(f.relative_to(out)): f for f in out.rglob("*") if f.is_file()}
    assert len(files) <= 8, sorted(files)
    for name, f in files.items():
        assert f.stat().st_size <= 15 * 2**20, name
        assert name.count("/") <= 2 and all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in name.split("/"))
    assert {"call.log", "report.md", "state.tgz", "results.json", "logs.tgz"} <= set(files), sorted(files)
    last = files["report.md"].stat().st_mtime_ns
    assert all(f.stat().st_mtime_ns <= last for n, f in files.items() if n != "call.log")  # report.md last
    return files


def _rows(run_dir: Path) -> dict:
    return {(fmt.name, task): len((fmt / f"{task}.jsonl").read_text().splitlines())
            for fmt in sorted((run_dir / "acc" / "samples").iterdir()) for task in TASKS}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_calls_resume_and_leave_at_most_eight_files(tmp_path):
    model = tmp_path / "msa-small"  # a copy: the third call carries one of its shards as xz
    shutil.copytree(ROOT / "configs" / "msa-small", model)
    rc, log = _call(tmp_path, "out1", "run", model=model, CACHE_OUT="1")
    assert rc == 0, log
    files = _check_files(tmp_path / "out1")
    assert "compile-cache.tar.xz" in files and "compile caches packed: 0 Triton files, 0 JIT modules" in log
    run_dir = tmp_path / "run"
    assert _rows(run_dir) == {(f, t): 2 for f in ("fp8", "mxfp4") for t in TASKS}
    with tarfile.open(files["state.tgz"]) as tar:
        names = tar.getnames()
    assert {f"acc/samples/{f}/{t}.jsonl" for f in ("fp8", "mxfp4") for t in TASKS} <= set(names)
    assert {"agreement/formats/bf16.npz", "agreement/formats/mxfp4.json"} <= set(names)
    report = (tmp_path / "out1" / "report.md").read_text()
    for task in TASKS:
        assert f"### {task}" in report
    assert "## mxfp4 vs fp8 (the samples both have)" in report and "| task | length | fp8 | mxfp4 |" in report
    assert all(f"| {task} | {LENGTH} | 2/2 | 2/2 |" in report for task in TASKS)
    assert "Top-k block agreement" in report and "bf16/mxfp4" in report
    results = json.loads((tmp_path / "out1" / "results.json").read_text())
    pair = results["pairs"]["mxfp4"]["tasks"]
    assert all(pair[t][-1]["n"] == 2 and pair[t][-1]["paired"]["mxfp4"]["ci_method"] == "tango" for t in TASKS)
    # The format switch reached each server.
    for fmt in ("fp8", "mxfp4"):
        assert f"index-K cache: {fmt} " in (run_dir / "acc" / f"server-{fmt}.log").read_text()
    servers = {p: p.stat().st_mtime_ns for p in run_dir.rglob("server-*.log")}
    assert len(servers) == 4

    # The same machine again: every sample and every agreement format is there; no server is started. A stand-in
    # nvidia-smi on PATH: the call samples it and sums the samples up.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho 1755, 3201, 612.40, 61, 98, 0x0000000000000004\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    rc, log = _call(tmp_path, "out2", "run", model=model, PATH=f"{fake_bin}:{os.environ['PATH']}",
                    WRITTEN_ROOTS=f"{tmp_path} {model}")
    assert rc == 0, log
    files2 = _check_files(tmp_path / "out2")
    # what the call wrote outside its run directory and $OUT (both under tmp_path, both written to): nothing
    assert "written during this call outside its run directory: 0 files (0 .pyc), 0.0 MiB" in log, log
    assert re.search(r"GPU samples: (\d+) of \1 at >= 50% utilization: SM 1755 MHz, memory 3201 MHz, 612 W", log), log
    assert "clock-event reasons (samples): sw-power-cap" in log
    with tarfile.open(files2["logs.tgz"]) as tar:
        assert any(re.fullmatch(r"logs/gpu-clocks-\d{8}T\d{6}Z\.csv", n) for n in tar.getnames()), tar.getnames()
        assert "logs/files-written.txt" in tar.getnames()
    assert "fp8: all 2 samples per task and length done" in log and "serving" not in log
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("server-*.log")} == servers
    assert _rows(run_dir) == {(f, t): 2 for f in ("fp8", "mxfp4") for t in TASKS}

    # A fresh machine, from the returned state and compile caches, its weights carried as xz (one shard here):
    # nothing asked either, the same tables.
    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "state.tgz").write_bytes(files["state.tgz"].read_bytes())
    (carried / "compile-cache.tar.xz").write_bytes(files["compile-cache.tar.xz"].read_bytes())
    shard = min(model.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    subprocess.run(["xz", "-0", "-T1", str(shard)], check=True)  # leaves only <shard>.xz
    rc, log = _call(tmp_path, "out3", "fresh", model=model, RESUME=str(carried), CACHE_IN=str(carried))
    assert rc == 0 and "resumed from" in log and "compile caches unpacked" in log, log
    assert shard.read_bytes() == (ROOT / "configs" / "msa-small" / shard.name).read_bytes()
    assert not list((tmp_path / "fresh").rglob("server-*.log"))
    strip = lambda text: text.split("\n", 3)[3]  # noqa: E731  (the header names the call's time)
    assert strip((tmp_path / "out3" / "report.md").read_text()) == strip(report)

    # The calls land in a repo's perf_data (lab/scripts/accuracy_h200_land.py) from a committed state with no rows.
    sys.path.insert(0, str(ROOT / "lab" / "scripts"))
    import accuracy_h200_land as land

    perf = tmp_path / "perf_data"
    (perf / "accuracy_h200_resume").mkdir(parents=True)
    (tmp_path / "empty" / "acc").mkdir(parents=True)
    subprocess.run(["tar", "-C", str(tmp_path / "empty"), "-czf", str(perf / land.STATE), "acc"], check=True)
    out = land.land([tmp_path / "out1", tmp_path / "out2", tmp_path / "out3"], perf, "2026-12-03", report=False)
    assert out["rows_added"] == out["rows"] == 2 * 2 * len(TASKS) and len(out["logs"]) == 3
    dumped = [json.loads(line) for line in (perf / land.SAMPLES).read_text().splitlines()]
    assert {(r["format"], r["task"]) for r in dumped} == {(f, t) for f in ("fp8", "mxfp4") for t in TASKS}
    assert str(ROOT) not in (perf / out["logs"][0]).read_text()


@pytest.mark.parametrize("formats", ["mxfp4", "mxfp4_rot bf16", "fp8x mxfp4"])
def test_formats_without_the_fp8_baseline_fail_at_once(tmp_path, formats):
    rc, log = _call(tmp_path, "out", "run", FORMATS=formats)
    assert rc == 2, log
    assert "must include fp8" in log and f'FORMATS="{formats}"' in log
    assert not (tmp_path / "run" / "acc").exists()  # refused before any server or state


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_round_that_runs_long_is_stopped_in_the_reserve_and_the_rows_come_back(tmp_path):
    # A stand-in for python: the runner appends one row, then hangs in its round. The call is killed at
    # BUDGET_S + 30 s, as a call made with BUDGET_S=570 is by the machine's 600 s limit: by then the runner has
    # been stopped at the end of the reserve and the state packed, so the row comes back in $OUT.
    fake = tmp_path / "python"
    fake.write_text("""#!/usr/bin/env bash
[ "$1" = -c ] && exit 0
while [ $# -gt 0 ]; do case "$1" in --out) out=$2; shift;; --budget-s) budget=$2; shift;; --) break;; esac; shift; done
mkdir -p "$out/samples/fp8"
[ "$budget" = 0 ] && exit 0
echo '{"doc_id": "8192/0", "score": 1.0}' >> "$out/samples/fp8/m3_niah_single.jsonl"
exec sleep 1000
""")
    fake.chmod(0o755)
    budget = 30  # with the step minimum lowered to 5 s (a real call keeps 60), the runner still gets its turn
    env = {**os.environ, "OUT": str(tmp_path / "out"), "RUN_DIR": str(tmp_path / "run"), "DEVICE": "cpu",
           "PYTHON": str(fake), "FORMATS": "fp8", "AGREE_FORMATS": "", "BUDGET_S": str(budget), "RESERVE_S": "10",
           "MIN_STEP_S": "5"}
    model = ROOT / "configs" / "msa-small"
    subprocess.run(["timeout", "-s", "KILL", str(budget + 30), "bash", str(SCRIPT), str(model)],
                   cwd=ROOT, env=env, capture_output=True, timeout=budget + 60)
    log = (tmp_path / "out" / "call.log").read_text()
    assert "m3-accuracy exit 124" in log, log
    with tarfile.open(tmp_path / "out" / "state.tgz") as tar:
        row = tar.extractfile("acc/samples/fp8/m3_niah_single.jsonl").read().decode()
    assert json.loads(row) == {"doc_id": "8192/0", "score": 1.0}
