"""The runner's argument handling and the format switch (the end-to-end run is test_run_e2e.py)."""

import json

import pytest

from accuracy import run


def test_format_switch_adds_the_override():
    args = run.format_launch_args("mxfp4", ["--tp", "8"])
    assert args[:2] == ["--tp", "8"]
    assert args[2] == run.OVERRIDE_FLAG and json.loads(args[3]) == {"index_k_format": "mxfp4"}


@pytest.mark.parametrize("style", ["split", "equals"])
def test_format_switch_merges_user_overrides(style):
    user = json.dumps({"rope_theta": 1.0, "index_k_format": "bf16"})
    override = [run.OVERRIDE_FLAG, user] if style == "split" else [f"{run.OVERRIDE_FLAG}={user}"]
    launch = ["--tp", "2", *override]
    args = run.format_launch_args("fp8", launch)
    assert args.count(run.OVERRIDE_FLAG) == 1
    assert json.loads(args[-1]) == {"rope_theta": 1.0, "index_k_format": "fp8"}
    assert args[:2] == ["--tp", "2"]


def test_format_switch_rejects_unknown_format():
    with pytest.raises(ValueError, match="mxfp4_rot"):
        run.format_launch_args("fp4", [])


def test_default_lengths():
    assert run.default_lengths(8192) == [1024, 2048, 4096, 8192]
    assert run.default_lengths(5000) == [1024, 2048, 4096, 5000]


def test_base_urls():
    assert run._parse_base_urls(["http://h:1"], ["fp8"]) == {"fp8": "http://h:1"}
    urls = run._parse_base_urls(["fp8=http://a", "mxfp4=http://b"], ["fp8", "mxfp4"])
    assert urls == {"fp8": "http://a", "mxfp4": "http://b"}
    with pytest.raises(ValueError, match="one format"):
        run._parse_base_urls(["http://h:1"], ["fp8", "mxfp4"])
    with pytest.raises(ValueError, match="fmt=URL"):
        run._parse_base_urls(["fp8=http://a", "http://b"], ["fp8", "mxfp4"])
    with pytest.raises(ValueError, match="twice"):  # the first URL was silently dropped
        run._parse_base_urls(["fp8=http://a", "fp8=http://b"], ["fp8"])


def test_cli_validates_before_starting_anything(tmp_path):
    with pytest.raises(ValueError, match="repeat"):
        run.compare_formats(["--model", "m", "--formats", "fp8", "fp8", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--tasks"):
        run.compare_formats(["--model", "m", "--tasks", "gsm8k", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--base-url names"):
        run.compare_formats(["--model", "m", "--formats", "fp8", "mxfp4", "--base-url", "fp8=http://a", "bf16=http://b",
                  "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="set by the runner"):
        run.compare_formats(["--model", "m", "--out", str(tmp_path), "--", "--tp", "2", "--port=9000"])


TINY_SPARSE = {"sparse_topk_blocks": 16, "sparse_block_size": 128, "sparse_local_block": 1, "sparse_init_block": 0}


def test_dense_control_raises_topk_to_every_block():
    assert run.dense_topk_blocks(1) == 1 and run.dense_topk_blocks(128) == 1 and run.dense_topk_blocks(129) == 2
    assert run.dense_topk_blocks(32768) == 256
    # The longest needle context, one spare block; generation past the needle budget adds to it.
    assert run.dense_max_tokens([4096, 32768]) == 32768 + 128
    assert run.dense_max_tokens([4096], max_gen_toks=100) == 4096 + 100 - 24 + 128
    user = json.dumps({"rope_theta": 1.0, "sparse_attention_config": {"sparse_local_block": 2}})
    args = run.format_launch_args("dense", ["--tp", "2", run.OVERRIDE_FLAG, user], sparse_config=TINY_SPARSE,
                                  max_tokens=32768 + 128, via="topk")
    overrides = json.loads(args[-1])
    assert overrides["index_k_format"] == "bf16" and overrides["rope_theta"] == 1.0
    # SGLang replaces the whole dict: every model key is carried, the user's keys merged, top-k raised.
    assert overrides["sparse_attention_config"] == {**TINY_SPARSE, "sparse_local_block": 2, "sparse_topk_blocks": 257}
    # Never below the model's own top-k.
    small = run.format_launch_args("dense", [], sparse_config=TINY_SPARSE, max_tokens=300, via="topk")
    assert json.loads(small[-1])["sparse_attention_config"]["sparse_topk_blocks"] == 16
    with pytest.raises(ValueError, match="sparse_config"):
        run.format_launch_args("dense", [])
    with pytest.raises(ValueError, match="max_tokens"):
        run.format_launch_args("dense", [], sparse_config=TINY_SPARSE, via="topk")


def test_dense_control_via_layers_marks_every_layer_dense():
    model = {**TINY_SPARSE, "sparse_attention_freq": [0, 1, 1, 1], "sparse_disable_index_value": [0, 1, 1, 1]}
    user = json.dumps({"rope_theta": 1.0, "sparse_attention_config": {"sparse_local_block": 2}})
    args = run.format_launch_args("dense", ["--tp", "2", run.OVERRIDE_FLAG, user], sparse_config=model)
    assert args[:2] == ["--tp", "2"]
    overrides = json.loads(args[-1])
    assert overrides["index_k_format"] == "bf16" and overrides["rope_theta"] == 1.0
    # Only the per-layer switch changes: the top-k stays the model's (no layer reads it), no max_tokens needed.
    assert overrides["sparse_attention_config"] == {**model, "sparse_local_block": 2, "sparse_attention_freq": [0] * 4}
    with pytest.raises(ValueError, match="per-layer list"):
        run.format_launch_args("dense", [], sparse_config={**model, "sparse_attention_freq": 2})
    with pytest.raises(ValueError, match="via must be one of"):
        run.format_launch_args("dense", [], sparse_config=model, via="full")


def test_model_sparse_config_reads_the_tiny_config():
    from pathlib import Path

    tiny = Path(__file__).resolve().parents[2] / "configs" / "minimax-m3.1-tiny"
    assert run.model_sparse_config(str(tiny))["sparse_topk_blocks"] == 16


def test_baseline_defaults_to_fp8():
    assert run.resolve_baseline(None, ["dense", "bf16", "fp8", "mxfp4"]) == "fp8"
    assert run.resolve_baseline(None, ["bf16", "mxfp4"]) == "bf16"
    assert run.resolve_baseline("mxfp4", ["fp8", "mxfp4"]) == "mxfp4"
    with pytest.raises(ValueError, match="--baseline"):
        run.resolve_baseline("bf16", ["fp8", "mxfp4"])
    with pytest.raises(ValueError, match="dense"):
        run.parse_variant("fp4")


def test_dense_via_topk_needs_lengths(tmp_path):
    with pytest.raises(ValueError, match="--lengths"):
        run.compare_formats(["--model", "m", "--formats", "dense", "fp8", "--dense-via", "topk",
                             "--out", str(tmp_path)])


def test_reuse_builds_the_report_from_saved_formats(tmp_path):
    settings = {"model": "m", "tokenizer": "m", "tasks": ["m3_niah_single"], "lengths": [1024], "samples": 20,
                "depths": 10, "seed": 0, "limit": None, "max_gen_toks": None, "api": "completions",
                "dense_topk_blocks": None, "docs_version": run.retrieval.DOCS_VERSION}
    for fmt, scores in (("fp8", [1, 1, 0, 0]), ("mxfp4", [1, 0, 0, 0])):
        rows = [{"doc_id": i, "length": 1024, "depth": 0.0, "target": str(i), "response": "", "score": s}
                for i, s in enumerate(scores)]
        run.write_samples(tmp_path, fmt, {"m3_niah_single": rows}, settings)
    argv = ["--model", "m", "--formats", "fp8", "mxfp4", "--tasks", "m3_niah_single", "--lengths", "1024",
            "--bootstrap", "100", "--out", str(tmp_path), "--reuse"]
    summary = run.compare_formats(argv)  # no server: both formats are loaded
    assert summary["tasks"]["m3_niah_single"][0]["paired"]["mxfp4"]["diff"] == -0.25
    assert (tmp_path / "report.md").is_file()
    with pytest.raises(ValueError, match=r"other \['samples'\]"):
        run.compare_formats([*argv[:-3], "--samples", "5", "--out", str(tmp_path), "--reuse"])
    assert run.read_samples(tmp_path, "bf16", settings) is None
    # No --lengths: the saved ones, whatever they are.
    rows, lengths = run.read_samples(tmp_path, "fp8", {**settings, "lengths": None})
    assert lengths == [1024] and [r["score"] for r in rows["m3_niah_single"]] == [1, 1, 0, 0]


@pytest.mark.parametrize("flag, value", [("--samples", "0"), ("--depths", "0"), ("--bootstrap", "0"),
                                         ("--concurrency", "0"), ("--limit", "0"), ("--max-gen-toks", "0"),
                                         ("--questions", "0"), ("--lengths", "24")])
def test_counts_are_checked_before_any_server(tmp_path, flag, value):
    # The URL is unreachable: reaching it (instead of refusing the count) fails with URLError.
    argv = ["--model", "m", "--formats", "fp8", "--base-url", "http://127.0.0.1:9", "--out", str(tmp_path),
            flag, value]
    with pytest.raises(ValueError, match=flag):
        run.compare_formats(argv)


def test_lengths_past_the_served_context_are_refused(monkeypatch):
    monkeypatch.setattr(run, "served_model", lambda url: ("m", 4096))
    monkeypatch.setattr(run, "run_lm_eval", lambda *a: {"m3_niah_single": []})
    args = run.build_parser().parse_args(["--model", "m"])
    assert run._evaluate("http://h", "m", [1024, 4096], args)[1] == [1024, 4096]
    assert run._evaluate("http://h", "m", None, args)[1] == [1024, 2048, 4096]
    with pytest.raises(ValueError, match="max_model_len 4096"):  # every request would be rejected
        run._evaluate("http://h", "m", [1024, 8192], args)


@pytest.mark.parametrize("launch_args,on_cpu", [(["--device", "cpu", "--tp", "2"], True), (["--device=cpu"], True),
                                                (["--tp", "8", "--attention-backend", "triton"], False)])
def test_server_env_turns_off_crash_diagnostics_and_adds_the_cpu_waits_on_cpu(launch_args, on_cpu, monkeypatch):
    """The runner stops a server by signalling its process group; SGLang's crash diagnostics would add 5 s to
    every stop."""
    from sglang_m3.server import CPU_OPENMP_WAITS, CRASH_DIAGNOSTICS_OFF, server_env

    for name in (*CRASH_DIAGNOSTICS_OFF, *CPU_OPENMP_WAITS):
        monkeypatch.delenv(name, raising=False)
    server = run.SGLangServer("m", launch_args, None)
    env = server_env(server.command(), None)
    assert {k: env.get(k) for k in CRASH_DIAGNOSTICS_OFF} == CRASH_DIAGNOSTICS_OFF
    assert (env.get("OMP_WAIT_POLICY") == "PASSIVE") == on_cpu


def test_replica_variants_serve_their_format_as_an_arm_of_their_own():
    assert run.parse_variant("fp8@2") == "fp8@2" and run.parse_variant("mxfp4@03") == "mxfp4@3"
    assert run.parse_variant("dense@2") == "dense@2" and run.is_dense("dense@2") and not run.is_dense("fp8@2")
    assert run.served_as("fp8@2") == "fp8" and run.served_as("dense") == "dense"
    for bad in ("fp8@1", "fp8@", "fp8@x", "fp4@2"):
        with pytest.raises(ValueError, match="--formats"):
            run.parse_variant(bad, "--formats")
    # The replica's server is its format's server.
    assert json.loads(run.format_launch_args("fp8@2", [])[-1]) == json.loads(run.format_launch_args("fp8", [])[-1])
    model = {**TINY_SPARSE, "sparse_attention_freq": [0, 1]}
    assert run.format_launch_args("dense@2", [], sparse_config=model) == run.format_launch_args("dense", [],
                                                                                               sparse_config=model)
    # fp8 and its replica are distinct formats on the command line (own samples, paired like any other).
    _, formats, _ = run.parse_command_line(run.build_parser(), ["--model", "m", "--formats", "fp8", "fp8@2"])
    assert formats == ["fp8", "fp8@2"]


def test_write_atomic_leaves_the_old_text_when_the_write_is_cut(tmp_path, monkeypatch):
    path = tmp_path / "rates.json"
    path.write_text('{"any": 1.0}')

    def cut(src, dst):
        raise OSError("killed")

    with monkeypatch.context() as m:
        m.setattr(run.os, "replace", cut)
        with pytest.raises(OSError):
            run.write_atomic(path, '{"any": 2.0}')
    assert json.loads(path.read_text()) == {"any": 1.0}
    run.write_atomic(path, '{"any": 2.0}')
    assert json.loads(path.read_text()) == {"any": 2.0}


def test_dense_max_tokens_keeps_the_needle_budget_when_fewer_tokens_are_generated():
    """A ``--max-gen-toks`` below the needles' 24 does not shrink the dense top-k's cover (nor its spare block)."""
    for max_gen_toks in (1, 8, 24):
        assert run.dense_max_tokens([2048, 4096], max_gen_toks=max_gen_toks) == 4096 + 128
    assert run.dense_max_tokens([4096], max_gen_toks=25) == 4096 + 1 + 128


def test_a_format_s_identity_holds_only_its_own_settings():
    """What a format's run.json records: the dense settings for the dense control only (adding dense to a run does
    not make fp8's saved samples another run's), and the defaults older runs saved as None (``--questions 1``,
    ``--dense-via topk``) still None."""
    def identity(fmt, *extra, dense_topk=None):
        args = run.build_parser().parse_args(["--model", "m", *extra])
        return run._format_identity(args, "tok", fmt, dense_topk)

    plain = identity("fp8")
    assert plain["dense_topk_blocks"] is None and plain["dense_via"] is None and plain["questions"] is None
    assert identity("fp8", "--dense-via", "topk", dense_topk=257) == plain
    assert identity("fp8", "--dense-via", "layers") == plain
    assert identity("dense", "--dense-via", "topk", dense_topk=257)["dense_topk_blocks"] == 257
    assert identity("dense", "--dense-via", "topk", dense_topk=257)["dense_via"] is None
    assert identity("dense", "--dense-via", "layers")["dense_via"] == "layers"
    assert identity("fp8", "--questions", "1") == plain and identity("fp8", "--questions", "4")["questions"] == 4


def test_a_replica_of_a_candidate_is_also_paired_with_it():
    formats = ["fp8", "mxfp4", "mxfp4@2", "fp8@2", "bf16@2", "mxfp4_rot", "mxfp4_rot@3"]
    assert run.replicas_of(formats, "fp8") == {"mxfp4@2": "mxfp4", "mxfp4_rot@3": "mxfp4_rot"}
    assert run.replicas_of(formats, "mxfp4") == {"fp8@2": "fp8", "mxfp4_rot@3": "mxfp4_rot"}
    assert run.replicas_of(["fp8", "mxfp4"], "fp8") == {}
