"""Documents of the long-context lm-eval tasks, each sample seeded by its own index.

Six tasks (``TASKS``, lm-eval names):

- ``m3_niah_single``, ``m3_niah_multikey``: needles of ``accuracy.needle`` (1 and 4 needles, the
  queried one at a depth of the ``num_depths`` grid), scored by ``accuracy.needle.score`` (the 7 digits
  anywhere in the response as a whole number);
- ``m3_kv`` (key-value retrieval) and ``m3_vt`` (variable tracking): the ``kv`` and ``vt`` samples of
  ``accuracy.prompts.TaskGenerator``, the formats the MSA models here are trained on, with one question
  and every parameter drawn as in training (``TaskGenerator.sample``), over the evaluation's haystack
  stream (``accuracy.prompts.EVAL_HAYSTACK_SEED``, never trained on). The prompt is the sample without
  its answer; the answer is the trained one (``" 1234567."``, ``" ABCDE, FGHIJ, KLMNO."``), and
  ``exact`` scores 1 only when the response begins with it, final period included (leading
  whitespace aside): a value with a digit more, or a chain with a name more or less, scores 0.
- ``m3_kv_64`` and ``m3_vt_value``: the same with one parameter fixed instead of drawn. ``m3_kv_64`` has
  ``KV_FIXED_PAIRS`` (64) pairs at every length from 3072 tokens on (one per 48 tokens below), so that the
  length grows, not the count of distractors (``m3_kv`` draws 4 to ``min(512, length // 48)``, the same
  range at every length from 24k on);
  ``m3_vt_value`` always asks the value of chain 0's last variable (``m3_vt`` asks that or the list of
  the chain's variables, at random). Why these two: ``docs/accuracy.md``, section 5.

Sample ``i`` of a task at context length ``L`` is a pure function of ``(task, L, i, seed)``, the
tokenizer and, for the needles, ``num_depths``: its own generator is seeded from them, so every
index-K format is asked the same prompts (pairs), and any subset of indices (``sample_ids``) can be
generated alone, in any order (a long comparison runs in pieces and resumes). Lengths count tokens
of the served model's tokenizer: a prompt has at most ``L - gen_tokens(task)`` tokens, so prompt and
generation fit ``L``. For ``m3_kv`` / ``m3_vt`` the count is the generator's (the sum of its pieces'
tokens, equal to the prompt's own tokenization for tokenizers whose pre-tokenizer splits at spaces and
newlines, as the training tokenizer's does; ``tests/accuracy/test_retrieval.py`` checks it).

Several questions per context (``docs(questions=q)``, the tasks of ``QUESTIONS_MAX``): sample ``i`` is
question ``i % q`` on context ``i // q``, a pure function of ``(task, L, i // q, q, seed)``; the
context's prompts differ only after the context, so a prefix cache prefills it once, and the report
counts the context as one cluster (``accuracy.stats.compare_clustered``).

Doc fields: ``input`` (prompt), ``target`` (the answer without its leading space and final period: the
digits, or the names joined by ``", "``), ``length``, ``depth`` (percent: needles, their grid depth; kv
and vt, where the first fact the answer is read from starts, by tokens), ``tokens`` (prompt tokens),
``sample``, ``task``; kv and vt add ``answer`` (the trained answer text).

``docs`` keeps what it made in memory (up to ``CACHE_CHARS`` characters of prompts), so formats served
one after the other in one process do not generate the same prompts again; ``docs_entries`` and
``adopt`` move such entries between processes (the runner builds a round's prompts ahead in a child).
"""

import functools
import random
from collections import OrderedDict

from . import needle

NEEDLE_KEYS = {"m3_niah_single": 1, "m3_niah_multikey": 4}  # needles per sample (one asked)
KV_FIXED_PAIRS = 64  # m3_kv_64: the pair count at every length (m3_kv draws 4 .. min(512, length // 48))
# lm-eval task -> (accuracy.prompts task, the parameters fixed instead of drawn: TaskGenerator.sample)
TRAINED = {"m3_kv": ("kv", {}), "m3_vt": ("vt", {}),
           "m3_kv_64": ("kv", {"n_pairs": KV_FIXED_PAIRS}), "m3_vt_value": ("vt", {"ask": "last"})}
TASKS = (*NEEDLE_KEYS, *TRAINED)
# Questions one context can take (``docs(questions=...)``): one needle or kv key asked each; the others one.
QUESTIONS_MAX = {"m3_niah_multikey": NEEDLE_KEYS["m3_niah_multikey"], "m3_kv": 4, "m3_kv_64": 16}
# Tokens a task's answer may take (the lm-eval YAMLs' max_gen_toks): a vt chain of 5 names is up to ~33.
GEN_TOKENS = {"m3_niah_single": needle.GEN_TOKENS, "m3_niah_multikey": needle.GEN_TOKENS, "m3_kv": 24, "m3_vt": 40,
              "m3_kv_64": 24, "m3_vt_value": 24}
DOCS_VERSION = 2  # saved results record it: 2 = samples seeded per index (1: a generator per length, needles only)
HAYSTACK_SENTENCES = 1 << 15  # fixed: a sample's window depends on the haystack's size (~650k tokens)
CACHE_CHARS = 1 << 31


def gen_tokens(task: str) -> int:
    """Tokens reserved for the answer of ``task`` (its YAML's ``max_gen_toks``)."""
    if task not in GEN_TOKENS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    return GEN_TOKENS[task]


def register_m3_config() -> None:
    """Let transformers know the plugin's config class before a tokenizer is loaded from one of our model
    folders (else it warns that it instantiates a model of type ''); nothing without the package (the
    accuracy tools also work against deployments of other models)."""
    try:
        from sglang_m3.config import register_config
    except ImportError:
        return
    register_config()


@functools.cache
def tokenizer(name: str):
    """The served model's tokenizer (transformers ``AutoTokenizer``), one per name per process."""
    from transformers import AutoTokenizer

    register_m3_config()
    return AutoTokenizer.from_pretrained(name, trust_remote_code=True)


@functools.cache
def _generator(name: str):
    from .prompts import EVAL_HAYSTACK_SEED, TaskGenerator

    tok = tokenizer(name)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise NotImplementedError(f"{name}: m3_kv and m3_vt need a fast tokenizer (tokenizers.Tokenizer backend)")
    return TaskGenerator(backend, EVAL_HAYSTACK_SEED, HAYSTACK_SENTENCES, evaluation=True)


def sample_rng(task: str, length: int, index: int, seed: int) -> random.Random:
    """The generator of sample ``index`` of a trained-format task (see the module doc)."""
    return random.Random(f"{task}-{seed}-{length}-{index}")


def trained_params(task: str, length: int) -> dict:
    """The ``TaskGenerator.sample`` parameters ``task`` fixes at ``length``: ``TRAINED``'s, with kv's pair
    count capped at one pair per 48 tokens as ``m3_kv`` draws it (64 pairs need 3072 tokens)."""
    fixed = dict(TRAINED[task][1])
    if "n_pairs" in fixed:
        fixed["n_pairs"] = min(fixed["n_pairs"], max(4, length // 48))
    return fixed


def trained_doc(gen, task: str, length: int, index: int, seed: int) -> dict:
    """Sample ``index`` of ``m3_kv`` / ``m3_vt`` at ``length`` from ``TaskGenerator`` ``gen``."""
    budget = length - gen_tokens(task)
    kind, _ = TRAINED[task]
    s = gen.sample(kind, sample_rng(task, length, index, seed), budget, **trained_params(task, length))
    (answer,) = s.answer_texts
    if not s.text.endswith(answer) or s.answer_start < 1:
        raise AssertionError(f"{task} sample {index}: the sample does not end with its answer {answer!r}")
    prompt = s.text[: len(s.text) - len(answer)]
    first_fact = min(start for start, _ in s.evidence) if s.evidence else 0
    return {"input": prompt, "target": answer.strip().removesuffix("."), "answer": answer, "length": length,
            "depth": round(100.0 * first_fact / s.answer_start, 2), "tokens": s.answer_start, "sample": index,
            "task": task}


def max_questions(task: str) -> int:
    """How many questions one context of ``task`` can take (``QUESTIONS_MAX``; 1 for the others)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    return QUESTIONS_MAX.get(task, 1)


def questions_for(task: str, asked: int) -> int:
    """Questions per context ``task`` is built with when ``asked`` are: as many as it can take."""
    return min(int(asked), max_questions(task))


def trained_context_docs(gen, task: str, length: int, context: int, seed: int, questions: int) -> list[dict]:
    """``questions`` docs of ``m3_kv`` / ``m3_kv_64`` on one context: the kv sample of ``queries =
    questions`` (no key asked twice) cut after its context, doc ``j`` asking key ``j``. Their prompts
    share everything up to the question (a server's prefix cache prefills it once) and are shorter than
    ``length - gen_tokens`` by the other questions and answers (about 25 tokens each). ``depth``: where
    the asked value sits in the context, by characters."""
    budget = length - gen_tokens(task)
    kind, _ = TRAINED[task]
    rng = random.Random(f"{task}-{seed}-{length}-{context}-q{questions}")
    s = gen.sample(kind, rng, budget, queries=questions, repeat=False, **trained_params(task, length))
    asked = list(zip(s.question_texts, s.answer_texts))
    if len(asked) != questions:
        raise ValueError(f"{task} at length {length}: a context takes {len(asked)} questions, not {questions}")
    tail = "".join(q + a for q, a in asked)
    if not s.text.endswith(tail):
        raise AssertionError(f"{task} context {context}: the sample does not end with its questions and answers")
    text = s.text[: len(s.text) - len(tail)]
    docs = []
    for j, (question, answer) in enumerate(asked):
        value = answer.strip().removesuffix(".")
        at = text.rfind(value)
        if at < 0:
            raise AssertionError(f"{task} context {context}: answer {value!r} is not in the context")
        docs.append({"input": text + question, "target": value, "answer": answer, "length": length,
                     "depth": round(100.0 * at / len(text), 2), "tokens": s.query_start + gen._count([question]),
                     "sample": context * questions + j, "task": task, "context": context, "question": j})
    return docs


_CACHE: "OrderedDict[tuple, dict]" = OrderedDict()
_cached_chars = 0


def _remember(key: tuple, doc: dict) -> None:
    global _cached_chars
    _CACHE[key] = doc
    _cached_chars += len(doc["input"])
    while _cached_chars > CACHE_CHARS and len(_CACHE) > 1:
        _, old = _CACHE.popitem(last=False)
        _cached_chars -= len(old["input"])


def _forget(key: tuple) -> None:
    global _cached_chars
    _cached_chars -= len(_CACHE.pop(key)["input"])


def _doc_key(task: str, tokenizer_name: str, length: int, index: int, seed: int, num_depths: int,
             questions: int) -> tuple:
    """A doc's key in the cache: what it is a pure function of (see the module doc)."""
    return (task, tokenizer_name, length, index, seed, num_depths if task in NEEDLE_KEYS else None, questions)


def clear_cache() -> None:
    global _cached_chars
    _CACHE.clear()
    _cached_chars = 0


def docs(task: str, tokenizer_name: str, lengths, sample_ids, seed: int = 0, num_depths: int = 10,
         questions: int = 1) -> list[dict]:
    """The docs of ``task`` for every length (ascending) and sample index in ``sample_ids`` (in order).

    ``questions = q > 1`` (at most ``max_questions(task)``): sample ``i`` is question ``i % q`` on context
    ``i // q``, and the docs carry ``context`` and ``question``; the prompts are other ones than with
    ``q = 1``. The paired statistics then treat a context's samples as one cluster."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    ids = [int(i) for i in sample_ids]
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"sample_ids must be distinct indices >= 0, got {ids[:10]}")
    if not 1 <= int(questions) <= max_questions(task):
        raise ValueError(f"questions must be in [1, {max_questions(task)}] for {task} (one context takes at most "
                         f"that many), got {questions}")
    q = int(questions)
    out = []
    for length in sorted({int(n) for n in lengths}):
        keys = {i: _doc_key(task, tokenizer_name, length, i, seed, num_depths, q) for i in ids}
        missing = [i for i in ids if keys[i] not in _CACHE]
        if missing and task in NEEDLE_KEYS:
            made = needle.generate(tokenizer(tokenizer_name), [length], len(missing), num_depths, NEEDLE_KEYS[task],
                                   seed, sample_ids=missing, questions=q)
            for doc in made:
                _remember(keys[doc["sample"]], {**doc, "task": task})
        elif missing and q > 1:
            gen = _generator(tokenizer_name)
            for c in dict.fromkeys(i // q for i in missing):
                for doc in trained_context_docs(gen, task, length, c, seed, q):
                    if doc["sample"] in keys:
                        _remember(keys[doc["sample"]], doc)
        elif missing:
            gen = _generator(tokenizer_name)
            for i in missing:
                _remember(keys[i], trained_doc(gen, task, length, i, seed))
        for i in ids:
            _CACHE.move_to_end(keys[i])
            out.append(dict(_CACHE[keys[i]]))
    return out


def _doc_keys(task: str, tokenizer_name: str, lengths, sample_ids, seed: int, num_depths: int,
              questions: int) -> list[tuple]:
    """The cache keys of what ``docs`` returns for these arguments, in its order."""
    return [_doc_key(task, tokenizer_name, n, int(i), seed, num_depths, int(questions))
            for n in sorted({int(n) for n in lengths}) for i in sample_ids]


def has_docs(task: str, tokenizer_name: str, lengths, sample_ids, seed: int = 0, num_depths: int = 10,
             questions: int = 1) -> bool:
    """Whether ``docs`` with these arguments finds every doc in this process's cache (makes none)."""
    return all(k in _CACHE for k in _doc_keys(task, tokenizer_name, lengths, sample_ids, seed, num_depths, questions))


def docs_entries(task: str, tokenizer_name: str, lengths, sample_ids, seed: int = 0, num_depths: int = 10,
                 questions: int = 1) -> list[tuple]:
    """``docs``'s cache entries ``[(key, doc)]`` for these arguments, made here and then dropped from this
    process's cache: for ``adopt`` in another process (``accuracy.run.DocPrefetch``)."""
    docs(task, tokenizer_name, lengths, sample_ids, seed, num_depths, questions)
    keys = _doc_keys(task, tokenizer_name, lengths, sample_ids, seed, num_depths, questions)
    entries = [(k, _CACHE[k]) for k in keys]
    for k in keys:
        _forget(k)
    return entries


def adopt(entries) -> None:
    """Put ``docs_entries``'s entries, made in any process, into this process's cache (kept ones stay)."""
    for key, doc in entries:
        if key not in _CACHE:
            _remember(tuple(key), doc)


def exact(response: str, answer: str) -> float:
    """1.0 when ``response`` begins with ``answer`` (leading whitespace of both aside), else 0.0."""
    return 1.0 if response.lstrip().startswith(answer.lstrip()) else 0.0


def score(doc: dict, response: str) -> float:
    """The 0/1 score of ``response`` to ``doc``: ``needle.score`` for needles, ``exact`` for kv and vt."""
    if doc["task"] in NEEDLE_KEYS:
        return needle.score(response, doc["target"])
    return exact(response, doc["answer"])

