"""lab/gpu/sglang_h200.py: the scheduler's decode rate read from its log and the decode table built from it
(no server); the --tp argument rules; and (slow) the driver's TP path end to end with two CPU ranks."""

import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "lab" / "gpu"))

import sglang_h200  # noqa: E402


def _line(bs: int, rate: float) -> str:
    return (f"[2026-12-02 14:22:11] Decode batch, #running-req: {bs}, #token: 4198400, token usage: 0.73, "
            f"cuda graph: True, gen throughput (token/s): {rate:.2f}, #queue-req: 0")


def test_server_decode_rate_is_the_median_of_the_batchs_lines_and_ignores_gaps_and_other_batches():
    rng = random.Random()
    steady = [rng.uniform(3950.0, 3990.0) for _ in range(25)]
    gaps = [rng.uniform(200.0, 350.0) for _ in range(4)]  # intervals that span the gap between requests
    other = [_line(8, rng.uniform(1900.0, 2100.0)) for _ in range(10)]
    lines = [_line(32, r) for r in steady + gaps] + other + ["INFO: POST /generate 200 OK", _line(1, 7.9)]
    rng.shuffle(lines)
    got = sglang_h200.server_decode_rate("\n".join(lines), 32)
    rates = [float(f"{r:.2f}") for r in steady + gaps]
    assert got["lines"] == 29
    assert abs(got["tok_s"] - statistics.median(rates)) < 1e-9
    assert 3950.0 <= got["tok_s"] <= 3990.0  # four gap lines do not move the median out of the steady band
    assert abs(got["tpot_ms"] - 32 / got["tok_s"] * 1e3) < 1e-12
    q1, _, q3 = statistics.quantiles([32 / r for r in rates], n=4)
    assert abs(got["tpot_iqr_half_ms"] - (q3 - q1) / 2 * 1e3) < 1e-12
    assert sglang_h200.server_decode_rate("\n".join(lines), 8)["lines"] == 10


def test_server_decode_rate_needs_three_lines_of_the_batch():
    text = "\n".join([_line(32, 3960.0), _line(32, 3970.0), _line(8, 2000.0)])
    assert sglang_h200.server_decode_rate(text, 32) is None
    assert sglang_h200.server_decode_rate("", 1) is None
    assert sglang_h200.server_decode_rate(text + "\n" + _line(32, 3980.0), 32)["tok_s"] == 3970.0


def test_decode_table_shows_both_measures_and_the_ratio_from_the_scheduler():
    def row(tok_s, sched):
        server = None if sched is None else {"tok_s": sched, "tpot_ms": 32e3 / sched, "lines": 30,
                                             "tpot_iqr_half_ms": 0.01}
        return {"tok_s": tok_s, "tpot_ms": 32e3 / tok_s, "tpot_spread_ms": 3.5, "server": server}

    results = {"env": {"date_utc": "2026-12-02 14:15"}, "notes": [], "formats": {
        "fp8": {"decode": {"131072x32": row(3658.0, 3969.8), "131072x8": row(1951.0, None)}},
        "mxfp4": {"decode": {"131072x32": row(3727.0, 4583.3), "131072x8": row(2110.0, None)}}}}
    table = sglang_h200.render_table(results, [131072], [8, 32], 1, 19)
    b32 = next(ln for ln in table.splitlines() if ln.startswith("| 128k | 32 |"))
    assert "8.061 ±0.010" in b32 and "6.982 ±0.010" in b32
    assert b32.rstrip(" |").endswith(f"{4583.3 / 3969.8:.3f}")  # scheduler rates, not the HTTP ones
    b8 = next(ln for ln in table.splitlines() if ln.startswith("| 128k | 8 |"))
    assert b8.rstrip(" |").endswith(f"{2110.0 / 1951.0:.3f}")  # no scheduler rate: the HTTP one
    assert b8.count("| - |") == 2


class _TimedServer:
    """Stand-in for ``sglang_h200.Server`` on a fake clock (``now``, patched in for ``time.perf_counter``):
    a request for ``n`` new tokens advances it by the next of ``seconds[n]`` and returns ``n`` tokens."""

    def __init__(self, tmp_path, seconds: dict):
        self.seconds = {k: list(v) for k, v in seconds.items()}
        self.now = 0.0
        self.log_path = tmp_path / "server.log"
        self.log_path.write_text("")

    def generate(self, ids, new_tokens):
        self.now += self.seconds[new_tokens].pop(0)
        return [{"output_ids": [0] * new_tokens} for _ in ids]


def _measure(tmp_path, monkeypatch, seconds, batch, repeats):
    server = _TimedServer(tmp_path, seconds)
    monkeypatch.setattr(sglang_h200.time, "perf_counter", lambda: server.now)
    m = sglang_h200.measure_decode(server, [[1, 2, 3]] * batch, decode_tokens=4, repeats=repeats)
    assert all(not v for v in server.seconds.values())  # warm-up pair, then every timed pair
    return m


def test_measure_decode_reports_a_difference_lost_in_noise_as_below_noise(tmp_path, monkeypatch):
    # two timed pairs whose longer requests are no slower than the short ones (medians 0.055 s and 0.045 s)
    m = _measure(tmp_path, monkeypatch, {1: [9.0, 0.06, 0.05], 5: [9.0, 0.04, 0.05]}, batch=1, repeats=2)
    assert m["below_noise"] and m["tok_s"] is None and m["tpot_ms"] is None
    assert m["tpot_spread_ms"] == pytest.approx(((0.05 - 0.05) - (0.04 - 0.06)) / 4 * 1e3)
    table = sglang_h200.render_table({"env": {"date_utc": "2026-12-03"}, "notes": [], "formats": {
        "fp8": {"decode": {"1024x1": m}}, "mxfp4": {"decode": {"1024x1": m}}}}, [1024], [1], 1, 1)
    row = next(ln for ln in table.splitlines() if ln.startswith("| 1k | 1 |"))
    assert row.count("below noise") == 2 and row.rstrip(" |").endswith("-")


def test_measure_decode_takes_the_difference_of_medians_per_token(tmp_path, monkeypatch):
    m = _measure(tmp_path, monkeypatch, {1: [9.0, 0.02, 0.03, 0.01], 5: [9.0, 0.22, 0.20, 0.27]},
                 batch=2, repeats=3)
    assert not m["below_noise"]
    assert m["tpot_ms"] == pytest.approx((0.22 - 0.02) / 4 * 1e3)  # medians, not means; the warm-up left out
    assert m["tok_s"] == pytest.approx(2 / ((0.22 - 0.02) / 4))
    assert m["t_short_s"] == pytest.approx([0.02, 0.03, 0.01]) and m["t_long_s"] == pytest.approx([0.22, 0.20, 0.27])


def _driver(*argv, timeout=900):
    path = os.pathsep.join([str(REPO), str(REPO / "kernels"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.run([sys.executable, str(REPO / "lab" / "gpu" / "sglang_h200.py"), *argv], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_tp_needs_eager_skip_and_divisible_heads(tmp_path):
    proc = _driver("--cpu", "--tp", "2", "--out", str(tmp_path), timeout=120)
    assert proc.returncode == 2 and "needs --eager skip" in proc.stderr
    proc = _driver("--cpu", "--tp", "3", "--eager", "skip", "--out", str(tmp_path), timeout=120)
    assert proc.returncode == 2 and "--q-heads 16 must be a multiple of --tp 3" in proc.stderr


@pytest.mark.slow
def test_decode_timing_at_tp2_on_the_cpu(tmp_path):
    """The TP path of the decode-throughput driver (what TP4 on four GPUs runs), smoke-tested with two CPU ranks."""
    out = tmp_path / "out"
    proc = _driver("--cpu", "--tp", "2", "--eager", "skip", "--skip-capacity", "--out", str(out), "--formats",
                   "fp8,mxfp4", "--contexts", "1024", "--batches", "1,2", "--decode-tokens", "48", "--repeats", "2",
                   "--small-sparse", "1", "--hidden", "256", "--q-heads", "8", "--check-lengths", "300,500",
                   "--check-tokens", "4", "--budget-s", "600")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    for fmt in ("fp8", "mxfp4"):
        decode = results["formats"][fmt]["decode"]
        # 48 tokens of decode (a step is 10-40 ms here) stand well above the HTTP timing noise (~50 ms)
        assert {"1024x1", "1024x2"} <= decode.keys() and all(d["tok_s"] > 0 for d in decode.values()), decode
    logs = (out / "server_logs.txt").read_text()
    assert "TP1]" in logs and "tp_size=2" in logs  # two ranks served


def test_server_decode_rate_reads_eager_lines_and_skips_idle_ones():
    """A server without CUDA graphs (``cuda graph: False``: the CPU, eager) logs the same lines; a line of rate 0
    (no step in its interval) says nothing about a step's time."""
    lines = [_line(4, r).replace("cuda graph: True", "cuda graph: False") for r in (100.0, 110.0, 120.0)]
    got = sglang_h200.server_decode_rate("\n".join(lines + [_line(4, 0.0)]), 4)
    assert got["lines"] == 3 and got["tok_s"] == 110.0 and got["tpot_ms"] == pytest.approx(4 / 110.0 * 1e3)


class _LoggingServer(_TimedServer):
    """Also logs one ``Decode batch`` line per request: the warm-up pair at ``warm`` tok/s, the timed ones at
    ``rates`` in turn."""

    def __init__(self, tmp_path, seconds, warm, rates):
        super().__init__(tmp_path, seconds)
        self.rates = [warm, warm, *rates]

    def generate(self, ids, new_tokens):
        with open(self.log_path, "a") as f:
            f.write(_line(len(ids), self.rates.pop(0)) + "\n")
        return super().generate(ids, new_tokens)


def test_measure_decode_reads_the_scheduler_after_the_warm_up(tmp_path, monkeypatch):
    rng = random.Random()
    rates = [rng.uniform(900.0, 1100.0) for _ in range(6)]
    server = _LoggingServer(tmp_path, {1: [9.0, 0.02, 0.03, 0.01], 5: [9.0, 0.22, 0.20, 0.27]}, 5.0, rates)
    monkeypatch.setattr(sglang_h200.time, "perf_counter", lambda: server.now)
    m = sglang_h200.measure_decode(server, [[1, 2, 3]] * 2, decode_tokens=4, repeats=3)
    assert m["server"]["lines"] == 6
    assert m["server"]["tok_s"] == pytest.approx(statistics.median(float(f"{r:.2f}") for r in rates))


def test_measure_decode_with_equal_medians_is_below_noise(tmp_path, monkeypatch):
    m = _measure(tmp_path, monkeypatch, {1: [9.0, 0.05, 0.05], 5: [9.0, 0.05, 0.05]}, batch=1, repeats=2)
    assert m["below_noise"] and m["tok_s"] is None and m["tpot_ms"] is None


def test_bytes_per_token_of_the_m3_geometry():
    """Main K and V of 4 heads x 128 at one byte in every layer; the index key (128 dims) in sparse layers only:
    bf16 2 bytes a dim, fp8 1, MXFP4 half a byte a dim plus one scale byte per 32 dims."""
    main = 60 * 2 * 4 * 128
    assert sglang_h200.bytes_per_token(3, 57, "bf16") == main + 57 * 128 * 2
    assert sglang_h200.bytes_per_token(3, 57, "fp8") == main + 57 * 128
    assert sglang_h200.bytes_per_token(3, 57, "mxfp4") == main + 57 * (128 // 2 + 128 // 32)
    assert sglang_h200.bytes_per_token(1, 0, "mxfp4", kv_bytes=2) == 2 * 2 * 4 * 128


def test_cpu_env_binds_ranks_round_robin_to_the_cores(monkeypatch):
    monkeypatch.setattr(sglang_h200.os, "cpu_count", lambda: 2)
    env = sglang_h200.cpu_env(4)
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1|0|1" and "SGLANG_NCCL_SO_PATH" in env
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in sglang_h200.cpu_env(1)


def test_arm_and_config():
    assert sglang_h200.arm("fp8") == ("fp8", {})
    assert sglang_h200.arm("mxfp4@triton") == ("mxfp4", {"M3_SCORE_BACKEND": "triton"})


def test_make_config_puts_the_dense_layers_first(tmp_path):
    d = sglang_h200.make_config(tmp_path / "c", 2, 3, "mxfp4", 1000, 256, 8, 4096)
    cfg = json.loads((d / "config.json").read_text())
    sac = cfg["sparse_attention_config"]
    assert cfg["num_hidden_layers"] == 5 and cfg["index_k_format"] == "mxfp4" and cfg["num_attention_heads"] == 8
    assert sac["sparse_attention_freq"] == cfg["moe_layer_freq"] == [0, 0, 1, 1, 1]
    assert sac["sparse_disable_index_value"] == [0, 0, 1, 1, 1]


def test_table_ratio_uses_one_measure_for_both_and_names_contexts(tmp_path):
    """One format with a scheduler rate and fp8 without: the ratio is of the HTTP rates. 1500 tokens is no "1k".
    The capacity rows divide fp8's bytes by each format's."""
    def row(tok_s, sched):
        server = None if sched is None else {"tok_s": sched, "tpot_ms": 1e3 / sched, "lines": 5,
                                             "tpot_iqr_half_ms": 0.01}
        return {"tok_s": tok_s, "tpot_ms": 1e3 / tok_s, "server": server}

    bpt = {f: sglang_h200.bytes_per_token(3, 57, f) for f in ("fp8", "mxfp4")}
    cap = {"fp8": 1_000_000, "mxfp4": round(1_000_000 * bpt["fp8"] / bpt["mxfp4"])}
    results = {"env": {"date_utc": "2026-12-02 14:15"}, "notes": [], "formats": {
        f: {"capacity_tokens": cap[f], "capacity_bytes_per_token": bpt[f],
            "decode": {"1500x1": row(100.0, None if f == "fp8" else 500.0), "2048x1": row(90.0, None)}}
        for f in ("fp8", "mxfp4")}}
    lines = sglang_h200.render_table(results, [1500, 2048], [1], 1, 19).splitlines()
    assert next(ln for ln in lines if ln.startswith("| 1500 | 1 |")).rstrip(" |").endswith("| 1.000")
    assert any(ln.startswith("| 2k | 1 |") for ln in lines)
    mx = next(ln for ln in lines if ln.startswith("| mxfp4 |"))
    assert mx == (f"| mxfp4 | {bpt['mxfp4']} | {cap['mxfp4']} | {cap['mxfp4'] / cap['fp8']:.4f} | "
                  f"{bpt['fp8'] / bpt['mxfp4']:.4f} | yes |")
