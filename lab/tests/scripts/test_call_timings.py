"""lab/gpu/call_timings.py on a hand-written call: a held machine's log keeps an earlier call's server, which
is left out; launch to ready, capture, rounds, the prefill rate and Triton's autotuning picks (printed as Triton
3.6 prints them) come from this call's server only."""

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "lab" / "gpu" / "call_timings.py"
sys.path.insert(0, str(SCRIPT.parent))
import call_timings  # noqa: E402

EARLIER_SERVER = """[2026-12-03 09:00:00] server_args=ServerArgs(model_path='m')
[2026-12-03 09:00:30] sglang-m3: sparse prefill attention held to 2 warps, 2 stages (M3_SPARSE_PREFILL_CONFIG)
Triton autotuning for function _gqa_share_sparse_fwd_kernel,
with key as (64, 128, 128, 128, 2, 'torch.bfloat16'),
finished after 2.00s,
best config selected: num_warps: 8, num_ctas: 1, num_stages: 4, maxnreg: None;
[2026-12-03 09:01:10] Capture target decode CUDA graph end. elapsed=40.00 s, mem usage=0.06 GB
[2026-12-03 09:01:30] The server is fired up and ready to roll!
[2026-12-03 09:02:00] Prefill batch, #new-seq: 1, #new-token: 999999, #cached-token: 0
[2026-12-03 09:02:09] Prefill batch, #new-seq: 1, #new-token: 999999, #cached-token: 0
"""
THIS_SERVER = """[2026-12-03 10:00:05] server_args=ServerArgs(model_path='m')
[2026-12-03 10:00:20] sglang-m3: sparse prefill attention held to 8 warps, 4 stages (M3_SPARSE_PREFILL_CONFIG)
[2026-12-03 10:00:20] sglang-m3: sparse decode attention held to 4 warps, 5 stages (M3_SPARSE_DECODE_CONFIG)
Triton autotuning for function _gqa_share_sparse_decode_kernel,
with key as (1, 128, 'torch.bfloat16'),
finished after 0.50s,
best config selected: BLOCK_SIZE_K: 64, num_warps: 2, num_ctas: 1, num_stages: 2, maxnreg: None;
Triton autotuning for function _gqa_share_sparse_decode_kernel,
with key as (8, 128, 'torch.bfloat16'),
finished after 0.50s,
best config selected: BLOCK_SIZE_K: 128, num_warps: 4, num_ctas: 1, num_stages: 2, maxnreg: None;
[2026-12-03 10:00:30] Capture target decode CUDA graph end. elapsed=6.25 s, mem usage=0.06 GB
noise without a stamp: Prefill batch, #new-token: 5
[2026-12-03 10:00:44] The server is fired up and ready to roll!
Triton autotuning for function _gqa_share_sparse_fwd_kernel,
with key as (64, 128, 128, 128, 2, 'torch.bfloat16'),
finished after 1.52s,
best config selected: num_warps: 4, num_ctas: 1, num_stages: 3, maxnreg: None;
[2026-12-03 10:01:00] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 0, token usage: 0.02
[2026-12-03 10:01:00] Decode batch, #running-req: 1, #token: 8200
[2026-12-03 10:01:04] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 0, token usage: 0.02
[2026-12-03 10:01:08] Prefill batch, #new-seq: 1, #new-token: 4096, #cached-token: 4096, token usage: 0.03
"""
CALL_LOG = """accuracy_h200: start 2026-12-03T10:00:00Z, model configs/msa-medium, budget 540s
[resume] mxfp4: round of 64 prompts in 40.5 s (64 this time)
[resume] mxfp4: round of 64 prompts in 28.25 s (128 this time)
[resume] mxfp4: round of 64 prompts in 30.0 s (192 this time)
GPU samples: 80 of 100 at >= 50% utilization: SM 1980 MHz
"""


def _call(tmp_path: Path) -> Path:
    d = tmp_path / "7"
    d.mkdir()
    (d / "call.log").write_text(CALL_LOG)
    with tarfile.open(d / "logs.tgz", "w:gz") as tar:
        for name, text in [("logs/acc-server-mxfp4.log", EARLIER_SERVER + THIS_SERVER),
                           ("logs/triton-kernels.txt", "k 1 2\n")]:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return d


def test_this_calls_server_only(tmp_path):
    d = _call(tmp_path)
    start, rounds, servers, gpu = call_timings.read_call(d)
    assert rounds == {"mxfp4": [40.5, 28.25, 30.0]}
    assert len(servers) == 1
    s = servers[0]
    assert (s.ready - s.launched).total_seconds() == 39 and s.capture_s == 6.25
    assert s.prefill_tokens == 8192 + 8192 + 4096 and s.prefill_rate == (8192 + 8192 + 4096) / 8
    assert s.autotuned == [("_gqa_share_sparse_fwd_kernel", "w8 s4 held"),
                           ("_gqa_share_sparse_decode_kernel", "w4 s5 held"),
                           ("_gqa_share_sparse_decode_kernel", "BLOCK_SIZE_K=64 w2 s2"),
                           ("_gqa_share_sparse_decode_kernel", "BLOCK_SIZE_K=128 w4 s2"),
                           ("_gqa_share_sparse_fwd_kernel", "w4 s3")]
    table = call_timings.table([d], ["call 30"])
    assert ("| call 30 (10:00 UTC) | mxfp4 | 3 | 39 | 6.2 | 40.5; 28.2-30.0 | 2.6k | gqa_share_sparse_fwd w8 s4 held, "
            "w4 s3; gqa_share_sparse_decode w4 s5 held, BLOCK_SIZE_K=64 w2 s2, BLOCK_SIZE_K=128 w4 s2 |") in table
    assert table.endswith("call 30: GPU samples: 80 of 100 at >= 50% utilization: SM 1980 MHz")


def test_a_folder_without_call_log_is_named(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and f"calls: {tmp_path} holds no call.log" in proc.stderr


def _tar(path: Path, members: list) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_rows_in_launch_order_from_the_start_second_on(tmp_path):
    """Two servers whose logs lie in the archive later one first: rows in launch order. The fp8 server was launched
    in the call's start second (1-s stamps: it is the call's), ran two rounds and logged its two prefill batches
    in one second (no rate: no time span to divide by)."""
    d = tmp_path / "8"
    d.mkdir()
    (d / "call.log").write_text("accuracy_h200: start 2026-12-03T10:00:00Z, model m\n"
                                "[resume] fp8: round of 64 prompts in 12.0 s (64 this time)\n"
                                "[resume] mxfp4: round of 64 prompts in 11.0 s (64 this time)\n"
                                "[resume] fp8: round of 64 prompts in 9.5 s (128 this time)\n")
    _tar(d / "logs.tgz", [
        ("logs/acc-server-mxfp4.log", "[2026-12-03 10:05:00] server_args=ServerArgs()\n"
                                      "[2026-12-03 10:05:30] The server is fired up and ready to roll!\n"),
        ("logs/acc-server-fp8.log", "[2026-12-03 09:59:59] server_args=ServerArgs()\n"  # an earlier call's
                                    "[2026-12-03 10:00:00] server_args=ServerArgs()\n"
                                    "[2026-12-03 10:00:40] The server is fired up and ready to roll!\n"
                                    "[2026-12-03 10:01:00] Prefill batch, #new-seq: 1, #new-token: 8192\n"
                                    "[2026-12-03 10:01:00] Prefill batch, #new-seq: 1, #new-token: 8192\n"),
    ])
    _, _, servers, _ = call_timings.read_call(d)
    assert [s.fmt for s in servers] == ["fp8", "mxfp4"] and servers[0].prefill_rate is None
    assert call_timings.table([d], ["call 8"]).splitlines()[2:] == [
        "| call 8 (10:00 UTC) | fp8 | 2 | 40 | - | 12.0; 9.5-9.5 | - | - |",
        "| call 8 (10:00 UTC) | mxfp4 | 1 | 30 | - | 11.0; - | - | - |"]


def test_a_call_log_without_its_start_line_is_named(tmp_path):
    (tmp_path / "call.log").write_text("[resume] fp8: round of 64 prompts in 12.0 s\n")
    with pytest.raises(SystemExit, match="call.log has no 'accuracy_h200: start' line"):
        call_timings.read_call(tmp_path)
