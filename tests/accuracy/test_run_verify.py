"""m3-accuracy checks each deployment against its label before any prompt is sent (stand-in servers that
answer ``/get_server_info`` as an sglang-m3 server does), records what each said, and ends a caller's
mistake in one or two lines naming the argument, the value and the rule."""

import json
from pathlib import Path

import pytest

from accuracy import run

ROOT = Path(__file__).resolve().parents[2]
MSA = str(ROOT / "configs" / "msa-small")


def _argv(out, urls, *extra):
    return ["--model", MSA, "--formats", *urls, "--base-url", *(f"{f}={u}" for f, u in urls.items()),
            "--tasks", "m3_kv", "--lengths", "1024", "--samples", "1", "--bootstrap", "100", "--out", str(out), *extra]


def _refused(capsys, argv, out: Path) -> str:
    """The stderr of ``main(argv)``, which must exit with status 2 and leave no ``out`` folder."""
    with pytest.raises(SystemExit) as e:
        run.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("m3-accuracy: error: ") and "Traceback" not in err and len(err.strip().splitlines()) <= 2
    assert not out.exists()
    return err


def test_a_label_that_is_not_the_served_format_is_refused(tmp_path, fake_completions, capsys):
    out = tmp_path / "acc"
    with fake_completions(serves="mxfp4") as a, fake_completions(serves="mxfp4") as b:
        err = _refused(capsys, _argv(out, {"fp8": a.url, "mxfp4": b.url}), out)
        assert not a.prompts and not b.prompts
    assert f"--base-url fp8={a.url}" in err and "index_k_format fp8" in err and "says index_k_format mxfp4" in err


def test_two_labels_on_one_server_are_refused(tmp_path, fake_completions, capsys):
    """The mislabel of the issue: both labels on one MXFP4 server read as 100% agreement."""
    out = tmp_path / "acc"
    with fake_completions(serves="mxfp4") as a:
        err = _refused(capsys, _argv(out, {"mxfp4": a.url, "mxfp4@2": a.url + "/"}), out)
        assert not a.prompts
    assert f"--base-url mxfp4={a.url}" in err and f"mxfp4@2={a.url}/" in err and "one server" in err


def test_servers_of_different_models_are_refused(tmp_path, fake_completions, capsys):
    out = tmp_path / "acc"
    with fake_completions(model_path="a-model") as a, fake_completions(serves="mxfp4", model_path="b-model") as b:
        err = _refused(capsys, _argv(out, {"fp8": a.url, "mxfp4": b.url}), out)
        assert not a.prompts and not b.prompts
    assert "'a-model'" in err and "'b-model'" in err and "one model" in err


@pytest.mark.parametrize("serves, length, ok", [("dense", 8192, True), ("bf16", 1024, True), ("bf16", 8192, False),
                                                ("fp8", 1024, False), (None, 1024, False)])
def test_the_dense_label_needs_a_dense_server(tmp_path, fake_completions, serves, length, ok):
    """Dense: bf16 with every layer dense, or a top-k (the stand-in's: 16 blocks) covering every block of the
    longest request (1024 tokens: 9 blocks; 8192: 65)."""
    argv = [*_argv(tmp_path / "acc", {"dense": "URL"}), "--lengths", str(length), "--limit", "1"]
    with fake_completions(serves=serves) as a:
        argv = [f"dense={a.url}" if x == "dense=URL" else x for x in argv]
        if ok:
            summary = run.compare_formats(argv)
            assert summary["servers"]["dense"]["url"] == a.url
        else:
            with pytest.raises(ValueError, match="dense server" if serves else "no MiniMax-M3.1 index-K cache"):
                run.compare_formats(argv)
            assert not a.prompts


def test_a_format_label_refuses_a_dense_server(tmp_path, fake_completions):
    with fake_completions(serves="dense") as a:
        with pytest.raises(ValueError, match="every layer dense"):
            run.compare_formats(_argv(tmp_path / "acc", {"bf16": a.url}))


def test_results_and_report_record_what_each_server_said(tmp_path, fake_completions):
    out = tmp_path / "acc"
    with fake_completions() as a, fake_completions(serves="mxfp4") as b:
        summary = run.compare_formats(_argv(out, {"fp8": a.url, "mxfp4": b.url}))
    saved = json.loads((out / "results.json").read_text())["servers"]
    assert saved == summary["servers"]
    assert saved["mxfp4"]["url"] == b.url and saved["mxfp4"]["model_path"] == MSA
    assert saved["mxfp4"]["m3_index_k"]["format"] == "mxfp4" and saved["fp8"]["m3_index_k"]["format"] == "fp8"
    assert saved["fp8"]["sglang_version"] == "0.0-fake"
    md = (out / "report.md").read_text()
    assert "## Servers" in md and f"| mxfp4 | {b.url} | {MSA} | mxfp4 | rceil | - | 3 | 16 | 0.0-fake |" in md
    # --reuse: the report still says what each server said, from samples/<fmt>/server.json
    again = run.compare_formats(_argv(out, {"fp8": a.url, "mxfp4": b.url}, "--reuse"))
    assert again["servers"] == summary["servers"]


def test_a_resumable_run_records_the_servers_too(tmp_path, fake_completions):
    out = tmp_path / "acc"
    with fake_completions() as a, fake_completions(serves="mxfp4") as b:
        summary = run.compare_formats(_argv(out, {"fp8": a.url, "mxfp4": b.url}, "--resume"))
    assert summary["servers"]["mxfp4"]["m3_index_k"]["format"] == "mxfp4"
    assert "## Servers" in (out / "report.md").read_text()


def test_an_unreachable_url_names_its_label_and_url(tmp_path, capsys):
    out = tmp_path / "acc"
    err = _refused(capsys, _argv(out, {"fp8": "http://127.0.0.1:9"}), out)
    assert "--base-url fp8=http://127.0.0.1:9" in err and "no SGLang server answers" in err


def test_a_url_ending_in_v1_is_refused(tmp_path, fake_completions, capsys):
    out = tmp_path / "acc"
    with fake_completions() as a:
        err = _refused(capsys, _argv(out, {"fp8": a.url + "/v1"}), out)
    assert f"--base-url fp8={a.url}/v1" in err and "without /v1" in err


def test_unknown_tasks_are_one_line(tmp_path, capsys):
    out = tmp_path / "acc"
    err = _refused(capsys, ["--model", MSA, "--tasks", "gsm8k", "--out", str(out)], out)
    assert "--tasks" in err and "gsm8k" in err and "m3_niah_single" in err


def test_lengths_beyond_the_served_context_are_refused_before_any_prompt(tmp_path, fake_completions, capsys):
    out = tmp_path / "acc"
    with fake_completions(max_model_len=4096) as a:
        err = _refused(capsys, [*_argv(out, {"fp8": a.url}), "--lengths", "8192"], out)
        assert not a.prompts
    assert "--lengths 8192" in err and "max_model_len 4096" in err and f"fp8={a.url}" in err


def test_lengths_past_the_longest_input_the_server_takes_are_refused(tmp_path, fake_completions, capsys):
    """A server's --max-total-tokens bounds its inputs below its context (max_req_input_len): a longer prompt
    would be rejected by every request."""
    out = tmp_path / "acc"
    with fake_completions(max_model_len=65536, max_req_input_len=8186) as a:
        err = _refused(capsys, [*_argv(out, {"fp8": a.url}), "--lengths", "8192", "16384"], out)
        assert not a.prompts
        run.compare_formats([*_argv(out, {"fp8": a.url}), "--lengths", "8192", "--limit", "1"])  # 8168 tokens fit
    assert "--lengths 16384" in err and "max_req_input_len 8186" in err and "--max-total-tokens" in err


def test_an_out_folder_that_existed_is_kept(tmp_path, capsys):
    out = tmp_path / "acc"
    out.mkdir()
    with pytest.raises(SystemExit):
        run.main(["--model", MSA, "--tasks", "gsm8k", "--out", str(out)])
    assert out.is_dir()


def test_a_server_that_does_not_start_is_two_lines(tmp_path, capsys, monkeypatch):
    """A launch argument SGLang refuses: the server's exit code, its log and the log's last line."""
    import sys

    from sglang_m3.server import Server

    def spawn(argv, *, env, cwd, log):  # stands in for SGLang refusing the arguments (no import of SGLang)
        import subprocess

        code = "import sys; print('launch_server: error: unrecognized arguments: --bogus', file=sys.stderr); sys.exit(2)"
        return subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    monkeypatch.setattr(Server, "spawn", staticmethod(spawn))
    out = tmp_path / "acc"
    with pytest.raises(SystemExit) as e:
        run.main(["--model", MSA, "--formats", "fp8", "--tasks", "m3_kv", "--lengths", "1024", "--out", str(out),
                  "--", "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    err = err[err.index("m3-accuracy: error: "):]  # after the progress bar
    assert len(err.strip().splitlines()) == 2, err
    assert "server exited with 2" in err and "server-fp8.log" in err and "unrecognized arguments: --bogus" in err


# ---- the info endpoints, the model, the formats from the labels ----------------------------------------------

def test_the_server_info_is_read_where_the_sglang_release_has_it(tmp_path, fake_completions):
    """/server_info and /model_info (SGLang 0.5.16-0.5.23), or only the older /get_server_info."""
    out = tmp_path / "acc"
    with fake_completions(serves="mxfp4", info_paths=("/get_server_info",)) as old, \
            fake_completions(serves="fp8", info_paths=("/server_info", "/model_info")) as new:
        summary = run.compare_formats([*_argv(out, {"fp8": new.url, "mxfp4": old.url}), "--limit", "1"])
    assert summary["servers"]["mxfp4"]["m3_index_k"]["format"] == "mxfp4"
    assert summary["servers"]["fp8"]["m3_index_k"]["format"] == "fp8"
    assert summary["servers"]["fp8"]["architectures"] == ["MiniMaxM3SparseForCausalLM"]


def test_a_server_without_any_server_info_is_one_line(tmp_path, fake_completions, capsys):
    out = tmp_path / "acc"
    with fake_completions(info_paths=()) as a:
        err = _refused(capsys, _argv(out, {"fp8": a.url}), out)
    assert f"--base-url fp8={a.url}" in err and "/server_info" in err


def test_a_model_other_than_the_served_one_is_refused(tmp_path, fake_completions, capsys):
    """The issue's case: --model configs/msa-medium against servers of configs/msa-small."""
    out = tmp_path / "acc"
    medium = str(ROOT / "configs" / "msa-medium")
    with fake_completions() as a, fake_completions(serves="mxfp4") as b:
        argv = _argv(out, {"fp8": a.url, "mxfp4": b.url})
        err = _refused(capsys, [medium if x == MSA else x for x in argv], out)
        assert not a.prompts and not b.prompts
    assert err.count("\n") == 1 and f"--model {medium}" in err and repr(MSA) in err and "drop --model" in err


def test_without_model_and_formats_the_servers_and_labels_say_them(tmp_path, fake_completions):
    """``--base-url mxfp4=URL`` alone: the format from its label, the model from the server; one format prints
    no paired-statistics legend."""
    out = tmp_path / "acc"
    with fake_completions(serves="mxfp4") as a:
        summary = run.compare_formats(["--base-url", f"mxfp4={a.url}", "--tasks", "m3_kv", "--lengths", "1024",
                                       "--samples", "1", "--limit", "1", "--out", str(out)])
    assert summary["run"]["model"] == MSA and summary["run"]["formats"] == ["mxfp4"]
    report = (out / "report.md").read_text()
    assert "Baseline:" not in report and "McNemar" not in report


def test_the_legend_is_printed_when_there_is_a_pair(tmp_path, fake_completions):
    out = tmp_path / "acc"
    with fake_completions() as a, fake_completions(serves="mxfp4") as b:
        run.compare_formats([*_argv(out, {"fp8": a.url, "mxfp4": b.url}), "--limit", "1"])
    assert "Baseline: fp8" in (out / "report.md").read_text()


def _hub_answers(kind):
    """A stand-in for ``HfApi.model_info``: no such model, no answer, or a gated one."""
    import httpx
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    def model_info(self, repo_id, **kw):
        response = httpx.Response(404 if kind == "missing" else 403, request=httpx.Request("GET", "http://hub/x"))
        if kind == "missing":
            raise RepositoryNotFoundError("404", response=response)
        if kind == "gated":
            raise GatedRepoError("403", response=response)
        raise ConnectionError("connection refused")

    return model_info


@pytest.mark.parametrize("model, env, hub, said", [
    ("configs/no-such-model", {}, None, "no such model folder"),
    ("configs", {}, None, "holds no config.json"),
    ("no-such-org/no-such-model", {"HF_HUB_OFFLINE": "1"}, None, "HF_HUB_OFFLINE is set"),
    ("no-such-org/no-such-model", {}, "missing", "the hub has no such model"),
    ("no-such-org/no-such-model", {}, "down", "the hub does not answer (ConnectionError)"),
])
def test_a_model_that_does_not_exist_is_refused_before_a_server_starts(tmp_path, capsys, monkeypatch, model, env,
                                                                        hub, said):
    import time

    from huggingface_hub import HfApi

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(HfApi, "model_info", _hub_answers(hub) if hub else _hub_answers("down"))
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(run.SGLangServer, "start", lambda self: pytest.fail("a server was started"))
    out = tmp_path / "acc"
    t0 = time.monotonic()
    err = _refused(capsys, ["--model", model, "--formats", "fp8", "--out", str(out)], out)
    assert time.monotonic() - t0 < 15
    assert f"--model {model}" in err and said in err and err.count("\n") == 1


def test_a_hub_model_that_exists_or_is_gated_passes(monkeypatch):
    from huggingface_hub import HfApi

    monkeypatch.setattr(HfApi, "model_info", lambda self, repo_id, **kw: None)
    run.check_model("some-org/some-model")
    monkeypatch.setattr(HfApi, "model_info", _hub_answers("gated"))
    run.check_model("some-org/some-model")


def test_starting_servers_needs_a_model(tmp_path, capsys):
    out = tmp_path / "acc"
    err = _refused(capsys, ["--formats", "fp8", "--out", str(out)], out)
    assert "--model is needed" in err


# ---- SGLang's own MiniMax-M3 path as an arm (accuracy.upstream) -------------------------------------------------
# The stand-in answers SGLang 0.5.16's recorded server and model info (tests/accuracy/data): SGLang's own M3 path
# cannot start on a CPU with the pinned transformers.

UPSTREAM_FP8 = {"version": "0.5.22", "kv_cache_dtype": "fp8_e4m3", "attention_backend": "trtllm_mha"}


def test_upstream_arms_are_paired_with_ours(tmp_path, fake_completions, wrong_rule):
    out = tmp_path / "acc"
    with fake_completions(serves="upstream", model_path="m3-upstream") as bf16, \
            fake_completions(serves="upstream", model_path="m3-upstream", **UPSTREAM_FP8) as fp8, \
            fake_completions(serves="mxfp4", wrong=wrong_rule(3)) as ours:
        summary = run.compare_formats(["--base-url", f"upstream-fp8={fp8.url}", f"upstream-bf16={bf16.url}",
                                       f"mxfp4={ours.url}", "--tasks", "m3_kv", "--lengths", "1024", "--samples",
                                       "4", "--bootstrap", "100", "--out", str(out)])
    assert summary["run"]["formats"] == ["upstream-fp8", "upstream-bf16", "mxfp4"]
    assert summary["baseline"] == "upstream-fp8" and summary["run"]["model"] == MSA
    paired = summary["tasks"]["m3_kv"][0]["paired"]
    assert set(paired) == {"upstream-bf16", "mxfp4"} and paired["mxfp4"]["n10"] > 0
    assert summary["servers"]["upstream-bf16"]["m3_index_k"] is None
    assert summary["servers"]["upstream-fp8"]["kv_cache_dtype"] == "fp8_e4m3"


@pytest.mark.parametrize("label, serves, info, said", [
    ("upstream-fp8", "upstream", {}, "keeps it in bf16 (SGLang 0.5.16"),
    ("upstream-bf16", "upstream", UPSTREAM_FP8, "keeps it in fp8"),
    ("upstream-fp8", "upstream", {"version": "0.5.23", "kv_cache_dtype": "fp8_e4m3", "attention_backend": "fa3"},
     "names no GPU"),
    ("upstream-bf16", "mxfp4", {}, "runs sglang-m3's index-K cache (index_k_format mxfp4): label it mxfp4"),
    ("upstream-bf16", None, {}, "needs a MiniMax-M3 server"),
    ("fp8", "upstream", {}, "SGLang's own MiniMax-M3 path (no m3_index_k in its server info), not sglang-m3's "
                            "index-K cache: label it upstream-bf16"),
])
def test_an_upstream_mislabel_is_refused(tmp_path, fake_completions, capsys, label, serves, info, said):
    out = tmp_path / "acc"
    with fake_completions(serves=serves, **info) as a:
        err = _refused(capsys, ["--base-url", f"{label}={a.url}", "--tasks", "m3_kv", "--lengths", "1024",
                                "--out", str(out)], out)
        assert not a.prompts
    assert f"--base-url {label}={a.url}" in err and said in err and err.count("\n") == 1


def test_upstream_arms_of_two_models_are_refused_and_an_upstream_label_needs_a_url(tmp_path, fake_completions,
                                                                                  capsys):
    out = tmp_path / "acc"
    with fake_completions(serves="upstream", model_path="a") as a, \
            fake_completions(serves="upstream", model_path="b", **UPSTREAM_FP8) as b:
        err = _refused(capsys, ["--base-url", f"upstream-bf16={a.url}", f"upstream-fp8={b.url}", "--out", str(out)],
                       out)
    assert "'a'" in err and "'b'" in err and "one model" in err
    err = _refused(capsys, ["--model", MSA, "--formats", "upstream-fp8", "mxfp4", "--out", str(out)], out)
    assert "--base-url upstream-fp8=URL" in err
    err = _refused(capsys, ["--base-url", "upstream-int4=http://h:1", "--out", str(out)], out)
    assert "upstream-bf16 or upstream-fp8" in err


def test_the_model_of_the_servers():
    ours = {"url": "http://a", "model_path": MSA}
    theirs = {"url": "http://b", "model_path": "m3-upstream"}
    assert run.model_of_servers(None, {"upstream-fp8": theirs, "mxfp4": ours}) == MSA  # ours first
    assert run.model_of_servers(None, {"upstream-fp8": theirs}) == "m3-upstream"
    same = str(ROOT / "configs" / ".." / "configs" / "msa-small")  # another spelling of the served folder
    assert run.model_of_servers(same, {"mxfp4": ours}) == same
    with pytest.raises(ValueError, match="--model is needed"):
        run.model_of_servers(None, {"fp8": None})
