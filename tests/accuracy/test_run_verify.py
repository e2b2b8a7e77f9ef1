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
    assert saved["mxfp4"]["url"] == b.url and saved["mxfp4"]["model_path"] == "fake-model"
    assert saved["mxfp4"]["m3_index_k"]["format"] == "mxfp4" and saved["fp8"]["m3_index_k"]["format"] == "fp8"
    assert saved["fp8"]["sglang_version"] == "0.0-fake"
    md = (out / "report.md").read_text()
    assert "## Servers" in md and f"| mxfp4 | {b.url} | fake-model | mxfp4 | rceil | - | 3 | 16 | 0.0-fake |" in md
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
