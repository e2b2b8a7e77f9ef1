"""m3-accuracy --resume through real lm-eval against stand-in completions servers (conftest's
FakeCompletions, which answer by reading the prompt): rows appended per round, nothing asked twice,
more samples asked for later only add the new ones, the budget stops cleanly, and the report pairs
each candidate with the baseline on the samples both have."""

import json
import random
from pathlib import Path

import pytest

from accuracy import report, run

ROOT = Path(__file__).resolve().parents[2]
MSA = str(ROOT / "configs" / "msa-small")
TASKS = ["m3_niah_single", "m3_niah_multikey", "m3_kv", "m3_vt"]


def _argv(out, urls, *extra):
    return ["--model", MSA, "--formats", *urls, "--base-url", *(f"{f}={u}" for f, u in urls.items()),
            "--tasks", *TASKS, "--lengths", "1024", "2048", "--resume", "--concurrency", "2", "--bootstrap", "100",
            "--out", str(out), *extra]


def _rows(out, fmt, task):
    return [json.loads(x) for x in (out / "samples" / fmt / f"{task}.jsonl").read_text().splitlines()]


def test_resume_appends_skips_and_extends(tmp_path, fake_completions, wrong_rule):
    out = tmp_path / "acc"
    with fake_completions() as a, fake_completions(wrong=wrong_rule(3), serves="mxfp4") as b:
        urls = {"fp8": a.url, "mxfp4": b.url}
        summary = run.compare_formats(_argv(out, urls, "--samples", "3", "--chunk", "2"))
        assert len(a.prompts) == len(b.prompts) == 4 * 2 * 3  # tasks x lengths x samples, once each
        for task in TASKS:
            rows = _rows(out, "fp8", task)
            assert sorted(r["doc_id"] for r in rows) == sorted(f"{n}/{i}" for n in (1024, 2048) for i in range(3))
            assert all(r["score"] == 1.0 for r in rows)  # the oracle reads every answer off its prompt
        # mxfp4's stand-in spoils about a third of its answers: the pairs' discordant counts are those.
        wrong = {task: sum(1 for r in _rows(out, "mxfp4", task) if r["score"] == 0.0) for task in TASKS}
        assert 0 < sum(wrong.values()) < 24
        pair = summary["pairs"]["mxfp4"]["tasks"]
        assert {t: pair[t][-1]["paired"]["mxfp4"]["n10"] for t in TASKS} == wrong
        assert all(pair[t][-1]["paired"]["mxfp4"]["n01"] == 0 and pair[t][-1]["n"] == 6 for t in TASKS)
        assert summary["coverage"]["fp8"]["m3_kv"]["2048"] == [3, 3]
        # No --served-on: the rows carry no served_on, and the report has no table of where pairs were served.
        assert not any("served_on" in r for f in urls for t in TASKS for r in _rows(out, f, t))
        assert "served_on" not in summary["pairs"]["mxfp4"]

        # The same command again asks nothing and reports the same numbers.
        again = run.compare_formats(_argv(out, urls, "--samples", "3", "--chunk", "2"))
        assert len(a.prompts) == len(b.prompts) == 24
        assert again["pairs"] == summary["pairs"]

        # More samples for fp8 only: only its new ones are asked; the pair keeps the 3 both have.
        bigger = run.compare_formats(_argv(out, urls, "--samples", "3", "--format-samples", "fp8=4", "--chunk", "3"))
        assert len(a.prompts) == 24 + 8 and len(b.prompts) == 24
        assert set(a.prompts[24:]).isdisjoint(a.prompts[:24])
        assert bigger["pairs"]["mxfp4"]["tasks"]["m3_vt"][-1]["n"] == 6
        assert bigger["coverage"]["fp8"]["m3_vt"]["1024"] == [4, 4]
        assert bigger["coverage"]["mxfp4"]["m3_vt"]["1024"] == [3, 3]

        # Paired prompts: the two formats were sent the very same texts.
        assert sorted(a.prompts[:24]) == sorted(b.prompts)
    md = (out / "report.md").read_text()
    assert "## mxfp4 vs fp8 (the samples both have)" in md and "### m3_vt" in md and "4/4" in md
    assert "where they were served" not in md
    saved = json.loads((out / "results.json").read_text())
    assert report.markdown(saved) == md and saved["run"]["resume"]


def test_budget_stops_cleanly_and_still_reports(tmp_path, fake_completions):
    out = tmp_path / "acc"
    with fake_completions() as a, fake_completions(delay_s=0.5, serves="mxfp4") as b:
        urls = {"fp8": a.url, "mxfp4": b.url}
        summary = run.compare_formats(_argv(out, urls, "--samples", "5", "--budget-s", "0"))
        assert a.prompts == [] and b.prompts == []
        assert summary["coverage"]["mxfp4"]["m3_niah_single"]["1024"] == [0, 5]
        assert (out / "report.md").is_file()
        # fp8's share (half of 100 s) is below --min-format-s: not served; mxfp4 then has it all.
        run.compare_formats(_argv(out, urls, "--samples", "1", "--budget-s", "100", "--min-format-s", "60"))
        assert a.prompts == [] and len(b.prompts) == 8
        # mxfp4 alone, 3 s, no rate saved (the last run's would predict the first round too: the next test):
        # its first round (8 prompts, 0.5 s each, 2 at a time: 2 s at least) is run, the next is predicted
        # to end past the budget and is not started.
        (out / "rates.json").unlink()
        summary = run.compare_formats(_argv(out, {"mxfp4": b.url}, "--samples", "5", "--chunk", "1",
                                            "--budget-s", "3", "--min-format-s", "0"))
        assert len(b.prompts) == 16
        assert summary["coverage"]["mxfp4"]["m3_vt"] == {"1024": [2, 5], "2048": [2, 5]}
        assert summary["pairs"] == {}


def test_saved_rates_predict_the_first_round_of_the_next_run(tmp_path, fake_completions):
    out = tmp_path / "acc"
    with fake_completions(delay_s=0.25, serves="mxfp4") as b:
        run.compare_formats(_argv(out, {"mxfp4": b.url}, "--samples", "2", "--chunk", "1"))
        rates = json.loads((out / "rates.json").read_text())
        assert rates["mxfp4"] > 0 and rates["any"] == rates["mxfp4"]  # seconds per context token
        served = len(b.prompts)
        # The saved rate predicts a round of 8 prompts at 0.25 s, 2 at a time (1 s at least): past 0.3 s.
        run.compare_formats(_argv(out, {"mxfp4": b.url}, "--samples", "3", "--chunk", "1",
                                  "--budget-s", "0.3", "--min-format-s", "0"))
        assert len(b.prompts) == served
        (out / "rates.json").unlink()  # no rate known: a server's first round may use the whole budget
        run.compare_formats(_argv(out, {"mxfp4": b.url}, "--samples", "3", "--chunk", "1",
                                  "--budget-s", "0.3", "--min-format-s", "0"))
        assert len(b.prompts) == served + 8


def test_questions_per_context_are_pinned_and_clustered(tmp_path, fake_completions, wrong_rule):
    out = tmp_path / "acc"
    with fake_completions() as a, fake_completions(wrong=wrong_rule, serves="mxfp4") as b:
        urls = {"fp8": a.url, "mxfp4": b.url}
        summary = run.compare_formats(_argv(out, urls, "--samples", "4", "--questions", "4"))
        rows = _rows(out, "fp8", "m3_kv")
        assert sorted(r["context"] for r in rows) == [0] * 4 * 2  # 4 questions on context 0, at each length
        assert all("context" not in r for r in _rows(out, "fp8", "m3_vt"))  # vt takes one question a context
        assert len(set(a.prompts)) == len(a.prompts) == 4 * 4 * 2  # 4 tasks x 4 samples x 2 lengths, all new
        pairs = summary["pairs"]["mxfp4"]["tasks"]
        for task, method in (("m3_kv", "tango_rao_scott"), ("m3_niah_multikey", "tango_rao_scott"),
                             ("m3_vt", "tango"), ("m3_niah_single", "tango")):
            group = pairs[task][0]["paired"]["mxfp4"]
            assert group["ci_method"] == method, task
            if method == "tango_rao_scott":
                assert group["clusters"] == 1 and group["design_effect"] == 4.0  # one context: 4 alike
                pooled = pairs[task][-1]["paired"]["mxfp4"]  # over both lengths: context 0 of each is its own
                assert pairs[task][-1]["length"] == "all" and pooled["clusters"] == 2, task
        assert "Rao-Scott clustered" in (out / "report.md").read_text()
        with pytest.raises(ValueError, match="questions"):  # the prompts differ: the state is another run's
            run.compare_formats(_argv(out, urls, "--samples", "4", "--questions", "2"))


def test_plan_rounds_groups_cells_missing_the_same_samples():
    done = {"m3_kv": {"1024/0", "1024/1", "2048/0"}, "m3_vt": set()}
    rounds = run.plan_rounds(["m3_kv", "m3_vt"], [1024, 2048], n=3, chunk=2, done=done)
    assert [set(r) for r in rounds] == [
        {(("m3_kv",), (2048,), (1,)), (("m3_vt",), (1024, 2048), (0, 1))},
        {(("m3_kv", "m3_vt"), (1024, 2048), (2,))},
    ]
    assert run.round_tokens(rounds[1]) == 2 * (1024 + 2048) * 1
    assert run.plan_rounds(["m3_kv"], [1024], n=2, chunk=2, done={"m3_kv": {"1024/0", "1024/1"}}) == []


def test_sample_log_drops_a_torn_line_and_checks_its_settings(tmp_path):
    ident = {"model": "m", "tokenizer": "m", "depths": 10, "seed": 0, "max_gen_toks": None, "api": "completions",
             "dense_topk_blocks": None, "docs_version": 2}
    log = run.SampleLog(tmp_path, "fp8", ident)
    log.append("m3_kv", [{"doc_id": "1024/0", "length": 1024, "score": 1.0}])
    path = tmp_path / "samples" / "fp8" / "m3_kv.jsonl"
    path.write_text(path.read_text() + '{"doc_id": "1024/1", "len')  # killed while writing
    log = run.SampleLog(tmp_path, "fp8", ident)
    assert log.done("m3_kv") == {"1024/0"}
    log.append("m3_kv", [{"doc_id": "1024/1", "length": 1024, "score": 0.0}])
    assert [json.loads(x)["doc_id"] for x in path.read_text().splitlines()] == ["1024/0", "1024/1"]
    with pytest.raises(ValueError, match=r"other \['seed'\]"):
        run.SampleLog(tmp_path, "fp8", {**ident, "seed": 1})


@pytest.mark.parametrize("extra, match", [
    (["--reuse"], "drop --reuse"),
    (["--limit", "2"], "drop --reuse and --limit"),
    (["--format-samples", "bf16=3"], "not among --formats"),
    (["--format-samples", "fp8=x"], "fmt=N"),
    (["--format-samples", "fp8=0"], "fmt=N"),
])
def test_resume_arguments_are_checked(tmp_path, extra, match):
    argv = ["--model", "m", "--formats", "fp8", "--base-url", "http://127.0.0.1:9", "--tasks", "m3_kv",
            "--lengths", "1024", "--resume", "--out", str(tmp_path), *extra]
    with pytest.raises(ValueError, match=match):
        run.compare_formats(argv)


def test_budget_needs_resume(tmp_path):
    with pytest.raises(ValueError, match="need --resume"):
        run.compare_formats(["--model", "m", "--formats", "fp8", "--base-url", "http://127.0.0.1:9",
                             "--lengths", "1024", "--budget-s", "10", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="long-context tasks"):
        run.compare_formats(["--model", "m", "--formats", "fp8", "--base-url", "http://127.0.0.1:9",
                             "--lengths", "1024", "--resume", "--tasks", "m3_short_arith", "--out", str(tmp_path)])


def test_a_failing_format_is_reported_and_the_next_one_runs(tmp_path, fake_completions, monkeypatch):
    out = tmp_path / "acc"
    evaluate = run.run_lm_eval

    def run_lm_eval(base_url, *args, **kwargs):  # fp8's server goes away after the check
        if base_url == a.url:
            raise ConnectionError(f"{base_url} went away")
        return evaluate(base_url, *args, **kwargs)

    monkeypatch.setattr(run, "run_lm_eval", run_lm_eval)
    with fake_completions() as a, fake_completions(serves="mxfp4") as b:
        urls = {"fp8": a.url, "mxfp4": b.url}
        summary = run.compare_formats(_argv(out, urls, "--samples", "1", "--tasks", "m3_kv"))
    assert "fp8" in summary["errors"] and len(b.prompts) == 2
    assert summary["coverage"]["mxfp4"]["m3_kv"] == {"1024": [1, 1], "2048": [1, 1]}
    assert "**fp8 failed in this run**" in (out / "report.md").read_text()


def test_max_formats_serves_those_furthest_behind(tmp_path, fake_completions):
    out = tmp_path / "acc"
    with fake_completions() as a, fake_completions(serves="mxfp4") as b, fake_completions(serves="bf16") as c:
        urls = {"fp8": a.url, "mxfp4": b.url, "bf16": c.url}
        common = ["--tasks", "m3_kv", "--samples", "4", "--chunk", "1", "--max-formats", "1"]
        run.compare_formats(_argv(out, urls, *common, "--format-samples", "bf16=2"))  # all at 0 %: fp8 first
        assert (len(a.prompts), len(b.prompts), len(c.prompts)) == (8, 0, 0)
        more = [*common, "--format-samples", "fp8=8", "bf16=2"]  # fp8 now at 50 %, the others at 0 %
        run.compare_formats(_argv(out, urls, *more))
        assert (len(a.prompts), len(b.prompts), len(c.prompts)) == (8, 8, 0)
        run.compare_formats(_argv(out, urls, *more))  # bf16 (0 %) before fp8 (50 %)
        assert (len(a.prompts), len(b.prompts), len(c.prompts)) == (8, 8, 4)
        run.compare_formats(_argv(out, urls, *more))
        assert (len(a.prompts), len(b.prompts), len(c.prompts)) == (16, 8, 4)


def test_plain_runs_take_the_new_tasks_too(tmp_path, fake_completions, wrong_rule):
    # Without --resume: one lm-eval call per format over --samples per length, then report.build.
    out = tmp_path / "plain"
    with fake_completions() as a, fake_completions(wrong=wrong_rule(2), serves="mxfp4") as b:
        argv = ["--model", MSA, "--formats", "fp8", "mxfp4", "--base-url", f"fp8={a.url}", f"mxfp4={b.url}",
                "--tasks", "m3_kv", "m3_vt", "--lengths", "1024", "--samples", "4", "--concurrency", "2",
                "--bootstrap", "100", "--out", str(out)]
        summary = run.compare_formats(argv)
    assert len(a.prompts) == 8 and sorted(a.prompts) == sorted(b.prompts)
    for task in ("m3_kv", "m3_vt"):
        rows = _rows(out, "mxfp4", task)
        assert [r["doc_id"] for r in rows] == [f"1024/{i}" for i in range(4)]
        paired = summary["tasks"][task][-1]["paired"]["mxfp4"]
        assert paired["n10"] == sum(r["score"] == 0.0 for r in rows) and paired["ci_method"] == "tango"
        assert paired["newcombe_lo"] <= paired["diff"] <= paired["newcombe_hi"]


def test_a_plain_run_refuses_an_out_that_holds_a_resumable_run(tmp_path, fake_completions):
    # A plain run rewrites samples/<fmt>/ whole; into a --resume run's --out it would drop every kept row. It
    # refuses before it asks anything, and the rows stay as they were.
    out = tmp_path / "acc"
    with fake_completions() as a, fake_completions(serves="mxfp4") as b:
        urls = {"fp8": a.url, "mxfp4": b.url}
        run.compare_formats(_argv(out, urls, "--samples", "2", "--chunk", "2"))
        kept = {f: _rows(out, f, "m3_kv") for f in urls}
        asked = len(a.prompts) + len(b.prompts)
        plain = [x for x in _argv(out, urls, "--samples", "1") if x != "--resume"]
        with pytest.raises(ValueError, match=r"holds the samples of a --resume run for \['fp8', 'mxfp4'\]"):
            run.compare_formats(plain)
        assert len(a.prompts) + len(b.prompts) == asked
    assert {f: _rows(out, f, "m3_kv") for f in urls} == kept and len(kept["fp8"]) == 4


def test_prompts_built_ahead_are_the_ones_built_in_turn(tmp_path, fake_completions, wrong_rule, capsys):
    # Each round's prompts come from the child process (run.DocPrefetch) or from lm-eval's own build: the same
    # prompts and rows either way.
    prompts, rows = {}, {}
    for flag in ([], ["--no-prefetch"]):
        out = tmp_path / ("plain" if flag else "ahead")
        with fake_completions(wrong=wrong_rule(3), serves="mxfp4") as a:
            run.compare_formats(_argv(out, {"mxfp4": a.url}, "--samples", "3", "--chunk", "1", "--questions", "4",
                                      *flag))
        prompts[bool(flag)] = a.prompts
        rows[bool(flag)] = {t: _rows(out, "mxfp4", t) for t in TASKS}
    assert len(prompts[True]) == 4 * 2 * 3 and sorted(prompts[True]) == sorted(prompts[False])
    assert rows[True] == rows[False]
    assert "building prompts ahead failed" not in capsys.readouterr().out


def test_doc_prefetch_builds_in_a_child_and_reports_its_failure(capsys):
    from accuracy import retrieval

    pieces = [(("m3_niah_single", "m3_kv_64"), (1024,), (0, 1)), (("m3_vt_value",), (1024, 2048), (5,))]
    retrieval.clear_cache()
    expected = {t: retrieval.docs(t, MSA, ls, ids, 0, 10, retrieval.questions_for(t, 4))
                for ts, ls, ids in pieces for t in ts}
    retrieval.clear_cache()
    ahead = run.DocPrefetch(MSA, seed=0, num_depths=10, questions=4)
    try:
        ahead.submit(pieces)
        assert len(ahead.pending) == 3
        ahead.collect(pieces[:1])  # one round's worth: the other stays pending
        assert len(ahead.pending) == 1
        ahead.collect(pieces)
        assert not ahead.pending and ahead.error is None
        for ts, ls, ids in pieces:
            for t in ts:
                q = retrieval.questions_for(t, 4)
                assert retrieval.has_docs(t, MSA, ls, ids, 0, 10, q)
                assert retrieval.docs(t, MSA, ls, ids, 0, 10, q) == expected[t]
        ahead.submit(pieces)  # all cached here: nothing to build
        assert not ahead.pending
    finally:
        ahead.close()
    retrieval.clear_cache()

    broken = run.DocPrefetch(str(ROOT / "no-such-tokenizer"), seed=0, num_depths=10, questions=1)
    try:
        broken.submit(pieces[:1])
        broken.collect(pieces[:1])  # the child's error is reported, not raised: lm-eval builds the docs itself
        assert broken.error is not None and "no-such-tokenizer" in broken.error
        assert "building prompts ahead failed" in capsys.readouterr().out
        broken.submit(pieces)  # and no more is tried
        assert not broken.pending
    finally:
        broken.close()


def test_a_run_refuses_other_server_arguments_and_adopts_them_once(tmp_path, fake_completions, monkeypatch):
    """The server's launch arguments are part of a resumable run: a pair must not mix, say, two attention
    backends. A run.json from before they were recorded takes the current ones once, then holds to them."""
    launched = []

    class StubServer:  # stands in for SGLangServer: "serves" through a fake completions server
        def __init__(self, model, launch_args, log_path, timeout_s=None):
            launched.append(launch_args)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    out = tmp_path / "acc"
    meta = out / "samples" / "fp8" / "run.json"
    with fake_completions() as a:
        StubServer.base_url = a.url
        monkeypatch.setattr(run, "SGLangServer", StubServer)

        def compare(backend):
            return run.compare_formats(["--model", MSA, "--formats", "fp8", "--tasks", "m3_kv", "--lengths", "1024",
                                        "--resume", "--samples", "1", "--bootstrap", "100", "--out", str(out),
                                        "--", "--attention-backend", backend])

        compare("triton")
        assert json.loads(meta.read_text())["launch_args"] == ["--attention-backend", "triton"]
        with pytest.raises(ValueError, match=r"other \['launch_args'\].*'triton'.*'fa3'"):
            compare("fa3")
        assert len(a.prompts) == 1 and len(launched) == 1  # refused before a server started

        saved = json.loads(meta.read_text())
        del saved["launch_args"]  # a run from before launch arguments were recorded
        meta.write_text(json.dumps(saved))
        compare("fa3")
        assert json.loads(meta.read_text())["launch_args"] == ["--attention-backend", "fa3"]
        with pytest.raises(ValueError, match="launch_args"):
            compare("triton")


def test_each_row_says_where_it_was_served_and_the_report_counts_the_pairs_so(tmp_path, fake_completions, wrong_rule):
    out = tmp_path / "acc"
    with fake_completions() as a, fake_completions(wrong=wrong_rule(3), serves="mxfp4") as b:
        urls = {"fp8": a.url, "mxfp4": b.url}
        run.compare_formats(_argv(out, urls, "--samples", "2", "--served-on", "card A"))
        # A later call on another machine continues the same run (where it runs is no part of its identity).
        summary = run.compare_formats(_argv(out, urls, "--samples", "3", "--served-on", "card B"))
    for fmt in urls:
        for task in TASKS:
            served = {r["doc_id"]: r["served_on"] for r in _rows(out, fmt, task)}
            assert served == {f"{n}/{i}": "card A" if i < 2 else "card B" for n in (1024, 2048) for i in range(3)}
    counts = summary["pairs"]["mxfp4"]["served_on"]["mxfp4"]
    assert sorted(counts) == ["card A / card A", "card B / card B"]
    assert counts["card A / card A"][0] == 4 * 2 * 2 and counts["card B / card B"][0] == 4 * 2
    wrong = sum(1 for task in TASKS for r in _rows(out, "mxfp4", task) if r["score"] == 0.0)
    assert counts["card A / card A"][1] + counts["card B / card B"][1] == wrong
    assert "### Pairs by where they were served, mxfp4 vs fp8" in (out / "report.md").read_text()


IDENTITY = {"model": "m", "tokenizer": "m", "depths": 10, "seed": 0, "max_gen_toks": None, "api": "completions",
            "dense_topk_blocks": None, "dense_via": None, "docs_version": 2, "questions": None,
            "launch_args": ["--tp", "2"]}


@pytest.mark.parametrize("key, other", [("model", "m2"), ("tokenizer", "t2"), ("depths", 5), ("seed", 1),
                                        ("max_gen_toks", 16), ("api", "chat"), ("dense_topk_blocks", 257),
                                        ("dense_via", "layers"), ("docs_version", 1), ("questions", 4),
                                        ("launch_args", ["--tp", "4"])])
def test_sample_log_refuses_a_run_that_differs_in_any_identity_setting(tmp_path, key, other):
    """Each setting that defines the prompts or the server is checked on its own: samples made under another value
    are another run's."""
    run.SampleLog(tmp_path, "fp8", IDENTITY).append("m3_kv", [{"doc_id": "1024/0", "length": 1024, "score": 1.0}])
    with pytest.raises(ValueError, match=rf"other \['{key}'\]"):
        run.SampleLog(tmp_path, "fp8", {**IDENTITY, key: other})
    assert run.SampleLog(tmp_path, "fp8", IDENTITY).done("m3_kv") == {"1024/0"}  # the same settings go on


def test_sample_log_reads_the_last_row_of_an_id(tmp_path):
    log = run.SampleLog(tmp_path, "fp8", IDENTITY)
    log.append("m3_kv", [{"doc_id": "1024/0", "length": 1024, "score": 0.0, "response": "first"}])
    log.append("m3_kv", [{"doc_id": "1024/0", "length": 1024, "score": 1.0, "response": "again"}])
    assert log.rows["m3_kv"]["1024/0"]["response"] == "again"
    (row,) = run.SampleLog(tmp_path, "fp8", IDENTITY).select(["m3_kv"], [1024])["m3_kv"]
    assert row["response"] == "again" and row["score"] == 1.0


def test_sample_log_selects_the_asked_lengths_and_samples_in_numeric_order(tmp_path):
    """``select(tasks, lengths, n)``: rows at ``lengths`` with sample < n (a later, smaller --samples reports
    fewer), by length then sample as a number (1024/10 after 1024/9)."""
    rng = random.Random(7)
    rows = [{"doc_id": f"{n}/{i}", "length": n, "score": float(rng.random() < 0.5)}
            for n in (1024, 2048, 4096) for i in range(12)]
    rng.shuffle(rows)
    log = run.SampleLog(tmp_path, "fp8", IDENTITY)
    log.append("m3_kv", rows)
    picked = log.select(["m3_kv", "m3_vt"], [4096, 1024], 11)
    assert [r["doc_id"] for r in picked["m3_kv"]] == [f"{n}/{i}" for n in (1024, 4096) for i in range(11)]
    assert picked["m3_vt"] == []
    assert len(log.select(["m3_kv"], [2048])["m3_kv"]) == 12
    cover = run.coverage({"fp8": log}, ["m3_kv"], [1024, 2048], {"fp8": 3})
    assert cover == {"fp8": {"m3_kv": {"1024": [3, 3], "2048": [3, 3]}}}


def test_a_server_s_first_round_may_use_the_whole_budget(tmp_path, fake_completions):
    """With two formats to serve, each has half the budget; fp8's first round, predicted (from the saved rates) at
    70 % of the budget, is still run (a server's start-up is paid by then), and mxfp4 gets what is left."""
    out = tmp_path / "acc"
    out.mkdir()
    tokens = 1024 + 2048  # one m3_kv sample at each length: the single round of each format
    (out / "rates.json").write_text(json.dumps({"fp8": 70.0 / tokens, "mxfp4": 1e-6, "any": 1e-6}))
    with fake_completions() as a, fake_completions(serves="mxfp4") as b:
        summary = run.compare_formats(_argv(out, {"fp8": a.url, "mxfp4": b.url}, "--tasks", "m3_kv", "--samples", "1",
                                            "--budget-s", "100", "--min-format-s", "0"))
        assert len(a.prompts) == 2 and len(b.prompts) == 2
    assert summary["coverage"]["fp8"]["m3_kv"] == {"1024": [1, 1], "2048": [1, 1]}


def test_a_replica_of_a_candidate_is_paired_with_it_too(tmp_path, fake_completions, wrong_rule):
    """mxfp4@2 served again (here by a stand-in that spoils other prompts than mxfp4's) is paired with fp8
    like any candidate and with mxfp4 as its replica; its discordant pairs with mxfp4 are the prompts one of
    the two spoils and the other does not."""
    out = tmp_path / "acc"
    spoil, spoil_again = wrong_rule(3), (lambda prompt: wrong_rule(2)(prompt + "again"))
    with fake_completions() as a, fake_completions(wrong=spoil, serves="mxfp4") as b,\
            fake_completions(wrong=spoil_again, serves="mxfp4") as c:
        urls = {"fp8": a.url, "mxfp4": b.url, "mxfp4@2": c.url}
        summary = run.compare_formats(_argv(out, urls, "--samples", "2"))
    assert sorted(b.prompts) == sorted(c.prompts)
    n10 = sum(1 for p in b.prompts if not spoil(p) and spoil_again(p))
    n01 = sum(1 for p in b.prompts if spoil(p) and not spoil_again(p))
    assert n10 + n01 > 0
    pair = summary["replicas"]["mxfp4@2"]
    pooled = [groups[-1]["paired"]["mxfp4@2"] for groups in pair["tasks"].values()]
    assert pair["baseline"] == "mxfp4" and sum(p["n"] for p in pooled) == len(b.prompts)
    assert (sum(p["n10"] for p in pooled), sum(p["n01"] for p in pooled)) == (n10, n01)
    assert set(summary["pairs"]) == {"mxfp4", "mxfp4@2"}
    md = (out / "report.md").read_text()
    assert "## mxfp4@2 vs mxfp4, served again" in md and f"| mxfp4@2 | {len(b.prompts)} | {n10} / {n01} |" in md
