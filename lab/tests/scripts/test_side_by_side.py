"""lab/gpu/side_by_side.py on a CPU: arguments, the arms' configs (the upstream one loads as SGLang's own M3 and is
left alone by the plugin), the launches tried per arm, the time plan and the table (no server is started)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "lab" / "gpu"))

import side_by_side as sbs  # noqa: E402


@pytest.mark.parametrize("name,want", [
    ("up-bf16", {"upstream": True, "fmt": "bf16", "fp8kv": False}),
    ("up-fp8kv", {"upstream": True, "fmt": "bf16", "fp8kv": True}),
    ("m3-mxfp4", {"upstream": False, "fmt": "mxfp4", "fp8kv": False}),
    ("m3-fp8-fp8kv", {"upstream": False, "fmt": "fp8", "fp8kv": True}),
])
def test_arms_parse(name, want):
    assert sbs.parse_arm(name) == {"name": name, **want}


@pytest.mark.parametrize("name", ["up", "up-fp8", "up-bf16-fp8kv", "m3-fp4", "m3", "sglang-bf16", ""])
def test_unknown_arms_are_refused_naming_the_choices(name):
    with pytest.raises(ValueError, match=rf"--arms: '{name}' is not an arm; choices: up-bf16, up-fp8kv"):
        sbs.parse_arm(name)


def test_cells_parse_and_bad_cells_name_the_flag():
    assert sbs.parse_cells("32768x8, 131072x32,8192", "--decode") == [(32768, 8), (131072, 32), (8192, 1)]
    assert sbs.parse_cells("", "--decode") == []
    for bad in ("32kx8", "8192x0", "x8"):
        with pytest.raises(ValueError, match=rf"--decode: '{bad}'"):
            sbs.parse_cells(bad, "--decode")


def test_defaults_and_reference(tmp_path):
    args = sbs.parse_args(["--out", str(tmp_path)])
    assert [a["name"] for a in args.arm_specs] == ["up-bf16", "m3-fp8", "m3-mxfp4"]
    assert args.reference == "up-bf16" and args.decode_cells == [(32768, 8), (131072, 8)]
    assert args.ttft_lengths == [8192, 32768] and args.short_cells == [(512, 1), (2048, 8)]
    assert sbs.parse_args(["--out", str(tmp_path), "--arms", "m3-fp8,m3-mxfp4"]).reference == "m3-fp8"


@pytest.mark.parametrize("argv,message", [
    (["--arms", "m3-fp8,m3-fp8"], "each once"),
    (["--reference", "up-fp8kv"], "--reference 'up-fp8kv' must be one of --arms"),
    (["--decode", "128kx8"], "--decode: '128kx8'"),
    (["--sparse", "0"], "--dense and --sparse must be >= 1"),
])
def test_bad_arguments_exit_naming_the_flag(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        sbs.parse_args(["--out", str(tmp_path), *argv])
    assert message in capsys.readouterr().err


def test_configs_have_m3_geometry_and_the_arms_model_type(tmp_path):
    args = sbs.parse_args(["--out", str(tmp_path), "--dense", "2", "--sparse", "4"])
    up = json.loads((sbs.write_config(tmp_path / "up", sbs.parse_arm("up-bf16"), args) / "config.json").read_text())
    ours = json.loads((sbs.write_config(tmp_path / "m3", sbs.parse_arm("m3-mxfp4"), args) / "config.json").read_text())
    for cfg in (up, ours):
        assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == \
            (6144, 64, 4, 128)
        assert cfg["sparse_attention_config"]["sparse_attention_freq"] == [0, 0, 1, 1, 1, 1]
        assert cfg["sparse_attention_config"]["sparse_disable_index_value"] == [0, 0, 1, 1, 1, 1]
        assert cfg["sparse_attention_config"]["sparse_num_index_heads"] == 4
        assert cfg["num_hidden_layers"] == 6 and cfg["architectures"] == ["MiniMaxM3SparseForCausalLM"]
        assert cfg["max_position_embeddings"] >= sbs.context_length(args)
    assert up["model_type"] == "minimax_m2" and not any(k.startswith("index_k") for k in up)
    assert ours["model_type"] == "minimax_m3_1" and ours["index_k_format"] == "mxfp4"
    assert {k: v for k, v in up.items() if k != "model_type" and not k.startswith("index_k")} == \
        {k: v for k, v in ours.items() if k != "model_type" and not k.startswith("index_k")}


def test_the_upstream_config_loads_as_sglangs_own_m3_without_the_plugin(tmp_path):
    """In a process with SGLANG_PLUGINS=none (as the upstream server runs): SGLang's ModelConfig reads the
    upstream arm's config as MiniMax-M3 sparse (its sparse config, layer split and rope theta intact)."""
    args = sbs.parse_args(["--out", str(tmp_path)])
    path = sbs.write_config(tmp_path / "up", sbs.parse_arm("up-bf16"), args)
    code = (
        "import json, sys\n"
        "from sglang.srt.configs.model_config import ModelConfig, is_minimax_sparse, "
        "get_minimax_sparse_attention_config, get_minimax_sparse_layer_ids\n"
        "from sglang.srt.utils.hf_transformers_utils import get_rope_config\n"
        "import sglang.srt.plugins as p\n"
        "p.load_plugins()\n"
        "c = ModelConfig(sys.argv[1])\n"
        "sac = get_minimax_sparse_attention_config(c.hf_config)\n"
        "print(json.dumps([is_minimax_sparse(c.hf_config), c.hf_config.architectures[0], c.hf_config.model_type,"
        " get_minimax_sparse_layer_ids(sac), get_rope_config(c.hf_config)[0], str(c.dtype),"
        " 'sglang_m3.plugin' in sys.modules]))\n")
    env = dict(os.environ, SGLANG_PLUGINS="none")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == [True, "MiniMaxM3SparseForCausalLM", "minimax_m2", [[0], [1, 2, 3, 4, 5]], 5000000.0,
                   "torch.bfloat16", False]


def test_launch_attempts_per_arm(tmp_path):
    args = sbs.parse_args(["--out", str(tmp_path)])
    up = sbs.attempts(sbs.parse_arm("up-fp8kv"), args)
    assert [note for note, _, _ in up] == ["fused K/index store off",
                                          "fused store off, no CUDA graphs (the graph start failed)"]
    for _, flags, env in up:
        assert env["SGLANG_PLUGINS"] == "none" and env[sbs.FUSED_STORE_ENV] == "0"
        assert flags[:2] == ["--kv-cache-dtype", "fp8_e4m3"] and "disabled" in flags
    assert "--disable-cuda-graph" in up[1][1] and "--disable-cuda-graph" not in up[0][1]
    on = sbs.parse_args(["--out", str(tmp_path), "--upstream-fused-store", "on", "--upstream-prefill-graph",
                         "default"])
    first = sbs.attempts(sbs.parse_arm("up-bf16"), on)[0]
    assert first == ("", [], {"SGLANG_PLUGINS": "none"})
    assert sbs.attempts(sbs.parse_arm("m3-mxfp4"), args) == [("", [], {})]
    graph = sbs.parse_args(["--out", str(tmp_path), "--m3-prefill-graph"])
    assert sbs.attempts(sbs.parse_arm("m3-fp8"), graph) == [
        ("prefill graph on", ["--cuda-graph-backend-prefill", "breakable"], {"SGLANG_M3_PREFILL_GRAPH": "1"})]
    flags = sbs.common_flags(args)
    assert flags[flags.index("--attention-backend") + 1] == "triton" and flags[flags.index("--page-size") + 1] == "128"
    assert flags[flags.index("--cuda-graph-bs") + 1:flags.index("--cuda-graph-bs") + 4] == ["1", "3", "8"]


def test_the_default_plan_fits_the_budget(tmp_path):
    est = sbs.estimate_s(sbs.parse_args(["--out", str(tmp_path)]))
    assert est["all"] < 500
    assert est["arm"] == pytest.approx(est["start"] + est["prefill"] + est["decode"] + est["profile"])


def test_dry_run_starts_nothing(tmp_path, capsys):
    plan = sbs.main(["--out", str(tmp_path), "--dry-run", "--arms", "up-bf16,m3-mxfp4"])
    assert list(plan["commands"]) == ["up-bf16", "m3-mxfp4"]
    assert "SGLANG_PLUGINS=none" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def _results(arms, reference="up-bf16"):
    args = {"decode_cells": [(32768, 8)], "ttft_lengths": [8192], "short_cells": [(512, 1)]}
    return {"args": args, "arms": arms, "reference": reference, "geometry": "g", "machine": "m", "date": "d"}


def test_table_rows_ratios_agreement_and_errors():
    def decode(rate, pairs=None):
        return {"32768x8": {"tok_s": pairs, "server": {"tok_s": rate} if rate else None}}

    arms = {
        "up-bf16": {"capacity_tokens": 1000, "launch": {"note": "fused K/index store off"}, "greedy": [[1, 2], [3]],
                    "decode": decode(100.0), "ttft_s": {"8192": 0.5}, "short_ttft_s": {"512x1": 0.05}},
        "m3-mxfp4": {"capacity_tokens": 1100, "launch": {"note": ""}, "greedy": [[1, 2], [4]],
                     "decode": decode(None, 120.0), "ttft_s": {"8192": 0.4}, "short_ttft_s": {},
                     "skipped": ["decode 131072x8"]},
        "m3-fp8": {"error": "no launch served (failed_starts)"},
    }
    results = _results(arms)
    sbs.agreement(results, "up-bf16")
    assert arms["m3-mxfp4"]["agree"] == {"equal": 1, "of": 2, "first_divergence": [None, 0]}
    table = sbs.render_table(results)
    lines = table.splitlines()
    assert lines[2].startswith("| arm | pool tokens | launch | greedy = up-bf16 | decode tok/s 32768x8 | "
                               "TTFT ms 8192 | short TTFT ms 512x1 |")
    assert "| up-bf16 | 1000 | fused K/index store off | 2/2 | 100.0 | 500 | 50 |" in lines
    assert "| m3-mxfp4 | 1100 | as is | 1/2 | 120.0 | 400 | - |" in lines
    assert any(line.startswith("| m3-fp8 | error: no launch served") for line in lines)
    assert "| m3-mxfp4 | 1.200 | 0.800 |" in lines
    assert lines[-1] == "Skipped (time budget or pool): m3-mxfp4: decode 131072x8"


def test_table_without_a_usable_reference_has_no_ratio_block():
    results = _results({"up-bf16": {"error": "not started (time budget)"}, "m3-fp8": {"capacity_tokens": 5}})
    table = sbs.render_table(results)
    assert "Against" not in table and "| m3-fp8 | 5 | as is | - | - | - | - |" in table


def test_agreement_falls_back_to_the_first_arm_that_served():
    arms = {"up-bf16": {"error": "x"}, "m3-fp8": {"greedy": [[1, 2]]}, "m3-mxfp4": {"greedy": [[1, 3]]}}
    results = _results(arms)
    sbs.agreement(results, "up-bf16")
    assert results["agreement_reference"] == "m3-fp8"
    assert arms["m3-mxfp4"]["agree"] == {"equal": 0, "of": 1, "first_divergence": [1]}
    assert "greedy = m3-fp8" in sbs.render_table(results)


def test_a_failed_start_is_reported_by_its_error_line():
    log = repr(RuntimeError("up-bf16-0: server exited with 1:\n  File \"x.py\", line 1\n"
                            "ModuleNotFoundError: No module named 'vllm'\n[t] Received sigquit from a child process."))
    assert sbs.last_error_line(log) == "ModuleNotFoundError: No module named 'vllm'"


def test_cpu_plumbing_flags(tmp_path):
    args = sbs.parse_args(["--out", str(tmp_path), "--cpu", "--decode", "1024x2"])
    flags = sbs.common_flags(args)
    assert flags[:2] == ["--device", "cpu"] and "--disable-cuda-graph" in flags and "--cuda-graph-bs" not in flags
    assert int(flags[flags.index("--max-total-tokens") + 1]) >= 2 * 1024
    (note, extra, env), = sbs.attempts(sbs.parse_arm("up-bf16"), args)
    assert note == "cpu" and env["SGLANG_PLUGINS"] == "none" and env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_the_profiled_cell_is_the_widest_or_one_of_the_decode_cells(tmp_path):
    assert sbs.parse_args(["--out", str(tmp_path)]).profile_cell == (131072, 8)
    assert sbs.parse_args(["--out", str(tmp_path), "--profile", "32768x8"]).profile_cell == (32768, 8)
    assert sbs.parse_args(["--out", str(tmp_path), "--profile", ""]).profile_cell is None
    assert sbs.parse_args(["--out", str(tmp_path), "--decode", ""]).profile_cell is None


def test_a_profile_cell_outside_the_decode_cells_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sbs.parse_args(["--out", str(tmp_path), "--profile", "65536x8"])
    assert "must be one of the --decode cells" in capsys.readouterr().err


@pytest.mark.parametrize("name,kind", [
    ("_score_kernel", "index scoring + top-k"), ("score_decode_mxfp4_kernel<4, 8>", "index scoring + top-k"),
    ("_select_kernel", "index scoring + top-k"), ("_decode_score_kernel", "index scoring + top-k"),
    ("_topk_index_partial_kernel", "index scoring + top-k"), ("_gqa_share_sparse_decode_kernel", "sparse attention"),
    ("_write_index_k_kernel", "K/V + index-K store"), ("_fwd_grouped_kernel_stage1", "dense attention"),
    ("fused_moe_kernel", "MoE"), ("topk_softmax", "MoE"), ("nvjet_tst_128x64", "GEMM"),
    ("elementwise_kernel", "other"),
])
def test_kernel_kinds(name, kind):
    assert sbs.kernel_kind(name) == kind


def test_kernel_breakdown_sums_kernel_time_per_step_by_kind():
    events = [{"cat": "kernel", "name": "_score_kernel", "dur": 300.0},
              {"cat": "kernel", "name": "_select_kernel", "dur": 100.0},
              {"cat": "kernel", "name": "fused_moe_kernel", "dur": 500.0},
              {"cat": "kernel", "name": "elementwise_kernel", "dur": 100.0},
              {"cat": "cpu_op", "name": "aten::mm", "dur": 9999.0},  # host ops do not count
              {"cat": "kernel", "name": "no duration"}]
    got = sbs.kernel_breakdown({"traceEvents": events}, steps=2)
    assert got["ms_per_step"]["index scoring + top-k"] == pytest.approx(0.2)
    assert got["ms_per_step"]["MoE"] == pytest.approx(0.25) and got["ms_per_step"]["other"] == pytest.approx(0.05)
    assert got["total_ms"] == pytest.approx(0.5) and got["index_share"] == pytest.approx(0.4)
    assert got["top"][0] == ("fused_moe_kernel", pytest.approx(0.25))
    assert sbs.kernel_breakdown({"traceEvents": []}, steps=2)["index_share"] is None


def test_the_table_shows_each_arms_decode_step_by_kind():
    breakdown = sbs.kernel_breakdown({"traceEvents": [{"cat": "kernel", "name": "_score_kernel", "dur": 1000.0},
                                                      {"cat": "kernel", "name": "nvjet", "dur": 3000.0}]}, steps=4)
    results = _results({"up-bf16": {"capacity_tokens": 1, "profile": breakdown,
                                    "decode": {"131072x8": {"tok_s": 1.0, "tpot_ms": 1.25, "server": None}}},
                        "m3-fp8": {"capacity_tokens": 1, "profile": {"error": "TimeoutError: no DECODE trace"}}})
    results["args"]["profile_cell"] = [131072, 8]
    table = sbs.render_table(results)
    assert "Decode step at 131072x8: kernel ms per step by kind (torch profiler, 4 steps)" in table
    assert "| up-bf16 | 0.250 | 0.000 | 0.000 | 0.000 | 0.000 | 0.750 | 0.000 | 1.000 | 25.0% | 1.250 |" in table
    assert "Profile failed: m3-fp8: TimeoutError: no DECODE trace" in table
