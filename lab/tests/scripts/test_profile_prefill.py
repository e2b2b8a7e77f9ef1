"""lab/gpu/profile_prefill.py without a server: the launch arguments it passes SGLang and the kernel table
it reads from a torch-profiler trace. (The whole script ran on the CPU with ``--device cpu --model
configs/msa-small``; it starts two servers, too slow for the suite.)"""

import gzip
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "lab" / "gpu"))

import profile_prefill  # noqa: E402


def _flag(args: list[str], name: str):
    return args[args.index(name) + 1] if name in args else None


def test_launch_args_carry_the_format_and_only_an_asked_chunk_size():
    default = profile_prefill.launch_args(131328, 0, "mxfp4", 8, "cuda")
    assert json.loads(_flag(default, "--json-model-override-args")) == {"index_k_format": "mxfp4"}
    assert _flag(default, "--chunked-prefill-size") is None  # SGLang's own default
    assert _flag(default, "--attention-backend") == "triton" and _flag(default, "--cuda-graph-max-bs") == "8"
    assert _flag(default, "--context-length") == "131328"
    big = profile_prefill.launch_args(131328, 32768, "fp8", 8, "cuda")
    assert _flag(big, "--chunked-prefill-size") == "32768" and _flag(big, "--max-prefill-tokens") == "32768"
    cpu = profile_prefill.launch_args(4096, 0, "fp8", 2, "cpu")
    assert _flag(cpu, "--device") == "cpu" and "--cuda-graph-max-bs" not in cpu


def test_kernel_table_sums_gpu_events_by_name_and_ignores_the_rest(tmp_path):
    events = [
        {"ph": "X", "cat": "kernel", "name": "_score_kernel", "ts": 100.0, "dur": 30.0},
        {"ph": "X", "cat": "kernel", "name": "_score_kernel", "ts": 200.0, "dur": 10.0},
        {"ph": "X", "cat": "kernel", "name": "_fwd_kernel", "ts": 140.0, "dur": 50.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 90.0, "dur": 2.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 1000.0},  # not GPU time
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5.0},  # not a complete event
    ]
    old = tmp_path / "old.trace.json.gz"
    with gzip.open(old, "wt") as f:
        json.dump({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "stale", "ts": 0, "dur": 9}]}, f)
    new = tmp_path / "new.trace.json.gz"
    with gzip.open(new, "wt") as f:
        json.dump({"traceEvents": events}, f)
    os.utime(old, (1_000_000, 1_000_000))  # older than new
    t = profile_prefill.kernel_table(tmp_path, top=2)
    assert t["trace"] == new.name  # the newest trace
    assert t["gpu_busy_ms"] == 92.0 / 1e3
    assert abs(t["gpu_span_ms"] - (210.0 - 90.0) / 1e3) < 1e-12
    assert [(k["name"], k["calls"]) for k in t["kernels"]] == [("_fwd_kernel", 1), ("_score_kernel", 2)]
    assert abs(t["kernels"][0]["share"] - 50 / 92) < 1e-12
    cpu = profile_prefill.kernel_table(tmp_path, top=5, cats=("cpu_op",))
    assert [k["name"] for k in cpu["kernels"]] == ["aten::mm"]


def test_kernel_table_says_when_there_is_no_trace(tmp_path):
    assert "no trace" in profile_prefill.kernel_table(tmp_path, top=5)["error"]


def test_arms_outputs_are_compared_with_the_first_arm_of_their_format():
    results = [
        {"arm": "fp8 triton", "format": "fp8", "check_outputs": [[1, 2, 3], [4, 5]]},
        {"arm": "mxfp4 triton", "format": "mxfp4", "check_outputs": [[1, 2, 9], [4, 5]]},
        {"arm": "fp8 fa3", "format": "fp8", "check_outputs": [[1, 2, 3], [4, 6]]},
        {"arm": "fp8 short", "format": "fp8", "check_outputs": [[1, 2], [4, 5]]},
        {"arm": "fp8 failed", "format": "fp8", "error": "RuntimeError()"},
    ]
    profile_prefill.same_outputs(results)
    assert results[0]["check_same"] and results[0]["check_against"] == "fp8 triton"
    assert results[1]["check_same"] and results[1]["check_against"] == "mxfp4 triton"  # its own format's first
    assert not results[2]["check_same"] and results[2]["check_first_divergence"] == [None, 1]
    assert results[3]["check_first_divergence"] == [2, None]  # one output ended early
    assert "check_same" not in results[4]
