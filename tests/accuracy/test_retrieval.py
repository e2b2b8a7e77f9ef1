"""The long-context task documents (accuracy.retrieval): seeded per (task, length, index), the same
prompts however they are asked for, answers a reader can find in the prompt (the oracle of conftest),
prompts sized in the served tokenizer's tokens, and kv / vt in exactly lab/training/data.py's formats."""

import random
import re
from pathlib import Path

import pytest
import yaml

from accuracy import needle, retrieval
from accuracy import prompts as data

ROOT = Path(__file__).resolve().parents[2]
MSA = str(ROOT / "configs" / "msa-small")  # the training tokenizer (lab/training/tokenizer), as the MSA models serve it
TINY = str(ROOT / "configs" / "minimax-m3.1-tiny")  # another BPE: merges across digits and words
TASKS = retrieval.TASKS


def _fresh(task, name, lengths, ids, seed=0, depths=10):
    retrieval.clear_cache()
    return retrieval.docs(task, name, lengths, ids, seed, depths)


@pytest.mark.parametrize("task", TASKS)
def test_docs_are_a_function_of_task_length_index_and_seed(task):
    full = _fresh(task, MSA, [1024, 2048], range(5))
    assert [(d["length"], d["sample"]) for d in full] == [(n, i) for n in (1024, 2048) for i in range(5)]
    assert _fresh(task, MSA, [2048, 1024], range(5)) == full  # regenerated from nothing: the same
    by_key = {(d["length"], d["sample"]): d for d in full}
    # Any subset, alone, in another order, at one length: the same prompts (every format is asked these).
    for d in _fresh(task, MSA, [2048], [4, 1]) + _fresh(task, MSA, [1024], [3]):
        assert d == by_key[(d["length"], d["sample"])]
    assert retrieval.docs(task, MSA, [1024], [3]) == [by_key[(1024, 3)]]  # the cached copy too
    prompts = [d["input"] for d in full]
    assert len(set(prompts)) == len(prompts)  # every (length, index) its own prompt
    assert len({d["target"] for d in full}) >= 8
    other_seed = _fresh(task, MSA, [1024], range(5), seed=1)
    assert all(a["input"] != b["input"] for a, b in zip(other_seed, full))


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("name", [MSA, TINY], ids=["msa", "tiny"])
def test_the_answer_is_in_the_prompt(task, name, read_answer):
    for d in _fresh(task, name, [1024, 4096], range(6)):
        assert read_answer(d["input"]) == d["target"], (d["length"], d["sample"])
        assert retrieval.score(d, " " + d["target"] + ".") == 1.0


def _corrupt(doc: dict) -> list[str]:
    """Prompts that no longer hold the doc's answer: the fact removed, or its value changed."""
    p, t = doc["input"], doc["target"]
    context_end = p.rindex("\n\nQuestion:")
    first = t.split(", ")[0]
    if doc["task"] == "m3_vt" and "," in t:  # "which variables ... the value V": drop the chain's first link
        at = p.index(f"VAR {first} = ")
        cut = p[:at] + p[p.index(".", at) + 1:]
        return [cut, p.replace(f"VAR {first} = ", f"VAR {first}Q = ", 1)]
    at = p.rindex(t, 0, context_end) if doc["task"] != "m3_vt" else p.rindex(" = " + t, 0, context_end) + 3
    changed = p[:at] + str((int(t[0]) + 1) % 10) + p[at + 1:]
    return [p[:at] + p[at + len(t):], changed]


@pytest.mark.parametrize("task", TASKS)
def test_the_oracle_fails_when_the_answer_is_not_there(task, read_answer):
    for d in _fresh(task, MSA, [2048], range(4)):
        for bad in _corrupt(d):
            try:
                got = read_answer(bad)
            except ValueError:
                continue
            assert got != d["target"], (d["sample"], got)


def test_exact_match_is_the_whole_trained_answer():
    assert retrieval.exact(" 4793957.", " 4793957.") == 1.0
    assert retrieval.exact("4793957.\nQuestion: x", " 4793957.") == 1.0
    assert retrieval.exact(" 4793957", " 4793957.") == 0.0  # no period: the answer did not end
    assert retrieval.exact(" 47939578.", " 4793957.") == 0.0
    assert retrieval.exact(" the value is 4793957.", " 4793957.") == 0.0
    assert retrieval.exact(" ABCDE, FGHIJ.", " ABCDE, FGHIJ.") == 1.0
    assert retrieval.exact(" ABCDE, FGHIJ, KLMNO.", " ABCDE, FGHIJ.") == 0.0  # a name too many
    assert retrieval.exact(" ABCDE.", " ABCDE, FGHIJ.") == 0.0


def _tokens(name, text):
    return len(retrieval.tokenizer(name)(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [8192, 32768])
def test_prompts_fill_their_length_in_the_served_tokens(task, length):
    gen = retrieval.gen_tokens(task)
    for d in _fresh(task, MSA, [length], range(3)):
        tokens = _tokens(MSA, d["input"])
        assert tokens == d["tokens"]
        assert length - gen - 128 <= tokens <= length - gen, (tokens, length, gen)


@pytest.mark.parametrize("task", ["m3_kv", "m3_vt"])
def test_long_prompts_fill_their_length(task):
    length = 131072
    (d,) = _fresh(task, MSA, [length], [7])
    tokens = _tokens(MSA, d["input"])
    assert tokens == d["tokens"] and length - retrieval.gen_tokens(task) - 128 <= tokens <= length - 24
    assert ROOT.joinpath("lab", "training", "tokenizer", "tokenizer.json").read_bytes() == \
        ROOT.joinpath("configs", "msa-small", "tokenizer.json").read_bytes()


@pytest.mark.parametrize("task", ["m3_kv", "m3_vt"])
def test_other_tokenizers_are_counted_too(task):
    # The generator counts a prompt as the sum of its pieces' tokens: exact when the pre-tokenizer splits
    # at spaces and newlines; for the tiny BPE it still has to land within the budget.
    for d in _fresh(task, TINY, [4096], range(4)):
        tokens = _tokens(TINY, d["input"])
        assert 4096 - retrieval.gen_tokens(task) - 160 <= tokens <= 4096 - retrieval.gen_tokens(task) + 8, tokens


def test_kv_and_vt_are_training_samples_without_their_answer():
    tok = retrieval.tokenizer(MSA)
    gen = data.TaskGenerator(tok.backend_tokenizer, data.EVAL_HAYSTACK_SEED, retrieval.HAYSTACK_SENTENCES,
                             evaluation=True)
    for task, (kind, _) in retrieval.TRAINED.items():
        for i in range(6):
            d = retrieval.docs(task, MSA, [4096], [i])[0]
            s = gen.sample(kind, retrieval.sample_rng(task, 4096, i, 0), 4096 - retrieval.gen_tokens(task),
                           **retrieval.trained_params(task, 4096))
            assert s.task == kind and d["input"] + d["answer"] == s.text  # the training sample's text
            assert tok(d["input"] + d["answer"], add_special_tokens=False)["input_ids"] == s.input_ids
            assert d["tokens"] == s.answer_start
    kv = retrieval.docs("m3_kv", MSA, [4096], range(6))
    for d in kv:
        head, tail = data.KV_PROMPT.split("{context}")
        assert d["input"].startswith(head) and re.fullmatch(r" \d{7}\.", d["answer"])
        key = re.search(r'what is the value of "([^"]+)"', d["input"]).group(1)
        assert d["input"].endswith(tail.format(key=key)) and d["target"] == d["answer"][1:-1]
    asks = set()
    for d in retrieval.docs("m3_vt", MSA, [4096], range(12)):
        head = data.VT_PROMPT.split("{context}")[0]
        assert d["input"].startswith(head)
        if re.fullmatch(r" \d{5}\.", d["answer"]):
            asks.add("last")
            assert d["input"].endswith(data.VT_ASK_LAST[1].format(name=d["input"].split("VAR ")[-1].split(" ")[0]))
        else:
            asks.add("members")
            assert re.fullmatch(r" [A-Z]{5}(, [A-Z]{5})*\.", d["answer"])
    assert asks == {"last", "members"}


def test_kv_64_has_64_pairs_at_every_length_and_vt_value_asks_the_value():
    line = re.compile(r'^"[^"\n]+": \d{7}$', re.M)
    drawn = set()
    for length in (1024, 3072, 4096, 16384):
        for d in retrieval.docs("m3_kv_64", MSA, [length], range(3)):
            assert len(line.findall(d["input"])) == min(retrieval.KV_FIXED_PAIRS, length // 48), length
        drawn |= {len(line.findall(d["input"])) for d in retrieval.docs("m3_kv", MSA, [length], range(3))}
    assert len(drawn) > 1 and retrieval.KV_FIXED_PAIRS not in drawn  # m3_kv draws its count: the line regex sees it
    docs = retrieval.docs("m3_vt_value", MSA, [4096], range(8))
    assert all(re.fullmatch(r" \d{5}\.", d["answer"]) for d in docs)
    assert all(d["input"].endswith(data.VT_ASK_LAST[1].format(name=d["input"].split("VAR ")[-1].split(" ")[0]))
               for d in docs)
    assert [d["input"] for d in docs] != [d["input"] for d in retrieval.docs("m3_vt", MSA, [4096], range(8))]


@pytest.mark.parametrize(("task", "params", "rule"), [
    ("single", {"n_pairs": 8}, "n_pairs is a kv parameter"), ("kv", {"ask": "last"}, "ask is a vt parameter"),
    ("kv", {"n_pairs": 0}, "n_pairs must be >= 1"), ("vt", {"ask": "first"}, "ask must be 'members' or 'last'")])
def test_fixed_parameters_are_checked(task, params, rule):
    gen = retrieval._generator(MSA)
    with pytest.raises(ValueError, match=rule):
        gen.sample(task, random.Random(0), 2048, **params)


@pytest.mark.parametrize(("task", "q"), [("m3_kv_64", 8), ("m3_kv", 4), ("m3_niah_multikey", 4)])
def test_several_questions_on_one_context(task, q):
    tok = retrieval.tokenizer(MSA)
    ids = [0, 1, q + 2, 2 * q - 1]
    docs = retrieval.docs(task, MSA, [2048, 4096], ids, questions=q)
    assert [d["sample"] for d in docs] == ids * 2
    by = {}
    for d in docs:
        assert d["context"] == d["sample"] // q and d["question"] == d["sample"] % q
        tokens = len(tok(d["input"], add_special_tokens=False)["input_ids"])
        assert tokens <= d["length"] - retrieval.gen_tokens(task) and abs(tokens - d["tokens"]) <= 2
        assert d["target"] in d["input"] and 0 <= d["depth"] <= 100
        by.setdefault((d["length"], d["context"]), []).append(d)
    for group in by.values():  # the prompts differ only in their question: one prefill
        heads = {d["input"].rsplit("\n\nQuestion:", 1)[0] for d in group}
        assert len(heads) == 1 and len({d["target"] for d in group}) == len(group)
    again = retrieval.docs(task, MSA, [4096], [ids[2]], questions=q)  # alone, the same
    retrieval.clear_cache()
    assert again == retrieval.docs(task, MSA, [4096], [ids[2]], questions=q) == [docs[6]]
    if task != "m3_niah_multikey":
        value = re.compile(r'^"[^"\n]+": (\d{7})$', re.M)
        for d in docs:  # the asked value is one of the context's kv lines
            assert d["target"] in value.findall(d["input"])


@pytest.mark.parametrize("task", ["m3_niah_single", "m3_vt", "m3_vt_value", "m3_kv"])
def test_questions_beyond_what_a_task_takes_are_refused(task):
    with pytest.raises(ValueError, match=rf"questions must be in \[1, {retrieval.max_questions(task)}\] for {task}"):
        retrieval.docs(task, MSA, [4096], [0], questions=retrieval.max_questions(task) + 1)


def test_evaluation_haystack_is_the_needles_and_never_training_s():
    assert data.EVAL_HAYSTACK_SEED == needle.POOL_SEED
    tok = retrieval.tokenizer(MSA).backend_tokenizer
    with pytest.raises(ValueError, match="evaluation"):
        data.Haystack(tok, data.EVAL_HAYSTACK_SEED, 16)
    with pytest.raises(ValueError, match="evaluation haystack"):
        data.Haystack(tok, data.HELDOUT_HAYSTACK_SEED, 16, evaluation=True)


@pytest.mark.parametrize("task", TASKS)
def test_yaml_generation_budget_matches(task):
    cfg = yaml.load((ROOT / "accuracy" / "tasks" / f"{task}.yaml").read_text().replace("!function", ""),
                    Loader=yaml.SafeLoader)
    assert cfg["task"] == task and cfg["generation_kwargs"]["max_gen_toks"] == retrieval.gen_tokens(task)


def test_lm_eval_loads_the_tasks_offline():
    from lm_eval.tasks import TaskManager

    meta = {"max_seq_lengths": [1024], "sample_ids": [2, 0], "num_depths": 4, "seed": 3, "tokenizer": MSA}
    manager = TaskManager(include_path=str(ROOT / "accuracy" / "tasks"), include_defaults=False, metadata=meta)
    tasks = manager.load(["m3_kv", "m3_vt", "m3_niah_single"])["tasks"]
    assert set(tasks) == {"m3_kv", "m3_vt", "m3_niah_single"}
    for name, task in tasks.items():
        docs = list(task.test_docs())
        assert [d["sample"] for d in docs] == [2, 0]
        assert [d["input"] for d in docs] == [d["input"] for d in retrieval.docs(name, MSA, [1024], [2, 0], 3, 4)]
        right = " " + docs[0]["target"] + "."
        assert task.process_results(docs[0], [right]) == {"acc": 1.0}
        assert task.process_results(docs[0], [" 0" + docs[0]["target"] + "."]) == {"acc": 0.0}



def test_the_accuracy_tools_load_our_tokenizer_without_the_model_type_warning():
    import subprocess
    import sys

    code = f"from accuracy import retrieval; retrieval.tokenizer({MSA!r})"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "to instantiate a model of type" not in res.stdout + res.stderr


def _no_generation(monkeypatch):
    """Every way ``docs`` makes a doc raises: what it returns then came from its cache."""
    def refuse(*a, **k):
        raise AssertionError("docs generated a doc instead of reading its cache")
    for mod, name in ((needle, "generate"), (retrieval, "trained_doc"), (retrieval, "trained_context_docs")):
        monkeypatch.setattr(mod, name, refuse)


@pytest.mark.parametrize("task", TASKS)
def test_entries_made_elsewhere_are_adopted_as_the_same_docs(task, monkeypatch):
    q = retrieval.questions_for(task, 4)
    ids = list(range(2 * q))
    expected = _fresh(task, MSA, [1024, 2048], ids, seed=3, depths=5) if q == 1 else None
    if q > 1:
        retrieval.clear_cache()
        expected = retrieval.docs(task, MSA, [1024, 2048], ids, 3, 5, q)
    retrieval.clear_cache()
    assert not retrieval.has_docs(task, MSA, [1024, 2048], ids, 3, 5, q)
    entries = retrieval.docs_entries(task, MSA, [2048, 1024], ids, 3, 5, q)
    assert len(entries) == 2 * len(ids)
    assert not retrieval.has_docs(task, MSA, [1024], ids[:1], 3, 5, q)  # dropped here: they are for another process
    assert retrieval._cached_chars == 0
    retrieval.adopt(entries)
    assert retrieval.has_docs(task, MSA, [1024, 2048], ids, 3, 5, q)
    assert not retrieval.has_docs(task, MSA, [1024], ids, 4, 5, q)  # another seed is other docs
    _no_generation(monkeypatch)
    assert retrieval.docs(task, MSA, [1024, 2048], ids, 3, 5, q) == expected
    with pytest.raises(AssertionError, match="generated a doc"):  # the refusal is real: a miss would raise
        retrieval.docs(task, MSA, [1024], [len(ids)], 3, 5, q)
    retrieval.clear_cache()


def test_adopt_keeps_what_is_cached():
    retrieval.clear_cache()
    entries = retrieval.docs_entries("m3_kv", MSA, [1024], [0], 0, 10, 1)
    retrieval.adopt(entries)
    chars = retrieval._cached_chars
    retrieval.adopt([(entries[0][0], {**entries[0][1], "input": "spoiled"})])
    assert retrieval.docs("m3_kv", MSA, [1024], [0]) == [entries[0][1]] and retrieval._cached_chars == chars
    retrieval.clear_cache()


@pytest.mark.parametrize(("task", "q"), [("m3_kv", 2), ("m3_kv_64", 8), ("m3_niah_multikey", 4)])
def test_each_context_is_its_own(task, q):
    """Contexts ``c`` and ``c + 1`` are drawn apart: other haystack windows and other values asked (the report
    counts each context as a cluster of its own); every doc of ``q > 1`` says its context."""
    retrieval.clear_cache()
    docs = retrieval.docs(task, MSA, [2048], range(3 * q), questions=q)
    assert [(d["context"], d["question"]) for d in docs] == [(i // q, i % q) for i in range(3 * q)]
    heads = [{d["input"].rsplit("\n\nQuestion:", 1)[0] for d in docs if d["context"] == c} for c in range(3)]
    assert all(len(h) == 1 for h in heads) and len(set.union(*heads)) == 3
    targets = [{d["target"] for d in docs if d["context"] == c} for c in range(3)]
    assert not (targets[0] & targets[1]) and not (targets[1] & targets[2]) and not (targets[0] & targets[2])
    retrieval.clear_cache()


def test_cached_docs_answer_only_the_same_request():
    """The cache is keyed by what a doc is a function of: a needle doc made for one depth grid, or any doc made
    with one question per context, is not handed out for another grid or another question count."""
    retrieval.clear_cache()
    for num_depths in (5, 3, 5):
        for d in retrieval.docs("m3_niah_single", MSA, [1024], [1, 2], num_depths=num_depths):
            assert d["depth"] == needle.depth_grid(num_depths)[d["sample"] % num_depths]
    for q in (1, 4, 1):
        docs = retrieval.docs("m3_kv", MSA, [1024], [0, 1], questions=q)
        assert all(("context" in d) == (q > 1) for d in docs)
        assert len({d["input"].rsplit("\n\nQuestion:", 1)[0] for d in docs}) == (1 if q > 1 else 2)
    retrieval.clear_cache()


def test_the_cache_drops_its_oldest_docs_first(monkeypatch):
    """Past ``CACHE_CHARS`` the least recently used docs go, never the one just made or read."""
    retrieval.clear_cache()
    made = {i: retrieval.docs_entries("m3_kv", MSA, [1024], [i], 0, 10, 1)[0][1] for i in range(4)}
    chars = {i: len(d["input"]) for i, d in made.items()}
    monkeypatch.setattr(retrieval, "CACHE_CHARS", chars[0] + chars[1] + chars[2] - 1)  # room for two docs, not three
    for i in (0, 1):
        assert retrieval.docs("m3_kv", MSA, [1024], [i]) == [made[i]]
    retrieval.docs("m3_kv", MSA, [1024], [0])  # read again: now the most recent
    assert retrieval.docs("m3_kv", MSA, [1024], [2]) == [made[2]]
    assert [retrieval.has_docs("m3_kv", MSA, [1024], [i]) for i in range(4)] == [True, False, True, False]
    assert retrieval._cached_chars == chars[0] + chars[2]
    retrieval.clear_cache()


@pytest.mark.parametrize("ids", [[], [0, -1], [2, 0, 2]])
def test_sample_ids_must_be_distinct_and_not_negative(ids):
    with pytest.raises(ValueError, match="distinct indices >= 0"):
        retrieval.docs("m3_kv", MSA, [1024], ids)


@pytest.mark.parametrize("task", ["m3_vt", "m3_vt_value"])
def test_vt_depth_is_where_the_chain_starts(task):
    """A vt doc's ``depth`` is where the first fact of the asked chain (its value's assignment) starts, in percent
    of the prompt's tokens, not where a later link sits."""
    for d in _fresh(task, MSA, [4096], range(6)):
        first = d["target"].split(", ")[0]
        start = rf"VAR [A-Z]+ = {first}\." if first.isdigit() else rf"VAR {first} = "  # value asked, or members
        at = re.search(start, d["input"]).start()
        assert abs(d["depth"] - 100.0 * _tokens(MSA, d["input"][:at]) / d["tokens"]) < 0.5, (d["sample"], d["depth"])
