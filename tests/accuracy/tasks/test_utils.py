"""Hooks of the lm-eval tasks: what counts as the arithmetic answer, and the long tasks' data hooks reading
docs built ahead of them."""

from pathlib import Path

import pytest

from accuracy import needle, retrieval
from accuracy.tasks import utils

MSA = str(Path(__file__).resolve().parents[3] / "configs" / "msa-small")


@pytest.mark.parametrize("response, answer, acc", [
    (" 42", 42, 1.0),
    (" 42.\nQuestion: 7", 42, 1.0),  # a sentence-ending period, then later numbers: the first one counts
    (" 1,200 pence", 1200, 1.0),
    (" 3.5", 3, 0.0),  # a decimal is not its integer part
    (" 42.0 pence", 42, 1.0),  # ... but a decimal with the same value is the answer
    (" -3", 3, 0.0),
    (" 43", 42, 0.0),
    (" 420", 42, 0.0),
    (" forty-two", 42, 0.0),
    (" 7 and then 42", 42, 0.0),  # only the first number is the answer
])
def test_arith_results(response, answer, acc):
    assert utils.arith_results({"answer": answer}, [response]) == {"acc": acc}


def test_needle_results_uses_the_whole_number_match():
    assert utils.needle_results({"target": "4793957"}, [" 4793957."]) == {"acc": 1.0}
    assert utils.needle_results({"target": "4793957"}, [" 14793957"]) == {"acc": 0.0}


def test_the_lm_eval_hooks_find_docs_built_ahead_by_the_runner(monkeypatch):
    # The runner's prefetch keys (run.DocPrefetch) must be the ones the lm-eval hooks ask for, else every
    # prefetched doc is made again.
    from accuracy import run

    pieces = [(("m3_niah_multikey", "m3_kv_64", "m3_vt_value"), (1024, 2048), (4, 5, 6, 7))]
    ahead = run.DocPrefetch(MSA, seed=2, num_depths=4, questions=4)
    try:
        requests = list(ahead._requests(pieces))
    finally:
        ahead.close()
    retrieval.clear_cache()
    for request in requests:
        retrieval.adopt(retrieval.docs_entries(*request))

    def refuse(*a, **k):
        raise AssertionError("the hook generated a doc instead of reading the cache")
    for mod, name in ((needle, "generate"), (retrieval, "trained_doc"), (retrieval, "trained_context_docs")):
        monkeypatch.setattr(mod, name, refuse)
    meta = {"max_seq_lengths": [1024, 2048], "sample_ids": [4, 5, 6, 7], "num_depths": 4, "seed": 2, "questions": 4,
            "tokenizer": MSA, "tokenized_requests": False}  # as run.run_lm_eval passes them
    for hook in (utils.niah_multikey, utils.kv_retrieval_64, utils.variable_tracking_value):
        assert len(hook(**meta)["test"]) == 8
    with pytest.raises(AssertionError, match="generated a doc"):
        utils.niah_multikey(**{**meta, "seed": 3})
    retrieval.clear_cache()


@pytest.mark.parametrize("model_args, ok", [
    ({}, False),  # lm-eval's default 2048 would cut a 4096-token prompt
    ({"max_length": 4096}, False),
    ({"max_length": 4097}, True),
    ({"max_length": "4097", "add_bos_token": "True"}, False),  # a BOS token takes one more
    ({"max_length": 4098, "add_bos_token": True}, True),
    ({"tokenized_requests": False}, True),  # text is sent whole: lm-eval cuts nothing
    ({"tokenized_requests": "True"}, False),
])
def test_a_max_length_that_would_cut_a_prompt_is_refused(model_args, ok):
    if ok:
        utils.check_max_length("m3_kv", [1024, 4096], model_args)
    else:
        with pytest.raises(ValueError, match=r"m3_kv: max_length \d+ .*max_length=409[78]"):
            utils.check_max_length("m3_kv", [1024, 4096], model_args)


@pytest.mark.parametrize("task", sorted(retrieval.TASKS))
def test_the_needed_max_length_keeps_every_prompt_whole(task):
    """lm-eval's API models keep the last ``max_length - 1 - max_gen_toks`` tokens of a prompt (tokenized
    without special tokens): at ``needed_max_length`` that is every token of every prompt of the task."""
    import yaml
    from transformers import AutoTokenizer

    retrieval.register_m3_config()
    tok = AutoTokenizer.from_pretrained(MSA)
    lengths = [1024, 2048]
    text = (Path(utils.__file__).parent / f"{task}.yaml").read_text()
    gen = yaml.safe_load(text.replace("!function", ""))["generation_kwargs"]["max_gen_toks"]
    kept = utils.needed_max_length(lengths) - 1 - gen
    for doc in retrieval.docs(task, MSA, lengths, range(2), 0, 2, retrieval.questions_for(task, 4)):
        assert len(tok(doc["input"], add_special_tokens=False).input_ids) <= kept - (max(lengths) - doc["length"])


@pytest.mark.parametrize("argv0", ["/venv/bin/lm_eval", "/venv/bin/lm-eval"])
def test_under_the_lm_eval_command_line_a_refusal_is_one_line_and_exit_2(argv0, monkeypatch, capsys):
    """lm-eval prints a whole traceback around a task's ValueError; its command line gets one line instead."""
    monkeypatch.setattr("sys.argv", [argv0, "--tasks", "x"])
    with pytest.raises(SystemExit) as e:
        utils.check_max_length("m3_kv", [4096], {})
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("lm_eval: error: m3_kv: max_length 2048") and err.count("\n") == 1
    with pytest.raises(SystemExit):
        utils._tokenizer_name({})
    assert "--model_args tokenizer=" in capsys.readouterr().err


def test_the_long_tasks_check_max_length_when_lm_eval_builds_them():
    with pytest.raises(ValueError, match="max_length=2049"):
        utils.niah_single(max_seq_lengths=[2048], num_samples=1, num_depths=1, tokenizer=MSA)
