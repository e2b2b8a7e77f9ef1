"""Retrieval prompts for the retrofitted model, in SmolLM2's tokens, from the product's generators.

Tasks (``TASKS``): ``single``, ``multikey`` (4 needles, one asked: ``m3_niah_multikey``'s), ``kv`` and
``vt`` from ``accuracy.prompts.TaskGenerator`` over the evaluation's synthetic chronicle (training
reads the training stream), and ``prose``: one needle (``accuracy.needle`` format) in real English
prose, CPython's bundled documentation topics (``pydoc_data``), odd-numbered topics for evaluation,
even-numbered for training. ``kv`` asks one of ``length // KV_TOKENS_PER_PAIR`` pairs.

Scoring is teacher-forced greedy: a sample is right (1.0) when the argmax of the logits at every
answer row is the answer's next token, the answer's final ``.`` excluded (``answer_rows``), i.e. a
greedy decoder would write the answer's digits (or names) first. One forward scores a sample.
"""

import random
import re

from accuracy.prompts import EVAL_HAYSTACK_SEED, TRAIN_HAYSTACK_SEED, Haystack, Sample, TaskGenerator

TASKS = ("single", "multikey", "kv", "vt", "prose")
KV_TOKENS_PER_PAIR = 256
MULTIKEY_NEEDLES = 4
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def prose_sentences(evaluation: bool) -> list[str]:
    """Sentences of the pydoc topics (odd-numbered topics for evaluation, even for training): one line
    each, 20-400 characters."""
    from pydoc_data.topics import topics

    names = sorted(topics)[int(evaluation)::2]
    out = []
    for name in names:
        for s in _SENTENCE.split(" ".join(topics[name].split())):
            if 20 <= len(s) <= 400:
                out.append(s)
    return out


class ProseHaystack(Haystack):
    """``Haystack`` over ``prose_sentences`` (the same fields, so ``TaskGenerator`` reads it as is)."""

    def __init__(self, tokenizer, evaluation: bool):
        self.text = prose_sentences(evaluation)
        self.ids = [e.ids for e in tokenizer.encode_batch([" " + s for s in self.text], add_special_tokens=False)]
        self.cum = [0]
        for ids in self.ids:
            self.cum.append(self.cum[-1] + len(ids))


class Prompts:
    """Samples of ``TASKS`` in one tokenizer (a ``tokenizers.Tokenizer``)."""

    def __init__(self, tokenizer, evaluation: bool = True):
        self.tok = tokenizer
        seed = EVAL_HAYSTACK_SEED if evaluation else TRAIN_HAYSTACK_SEED
        self.chronicle = TaskGenerator(tokenizer, seed, evaluation=evaluation)
        self.prose = TaskGenerator.__new__(TaskGenerator)
        self.prose.tok, self.prose.hay = tokenizer, ProseHaystack(tokenizer, evaluation)

    def sample(self, task: str, rng: random.Random, length: int) -> Sample:
        """One sample of ``task`` with at most ``length`` tokens."""
        if task == "single":
            return self.chronicle.needles(rng, length, 1)
        if task == "multikey":
            return self.chronicle.needles(rng, length, MULTIKEY_NEEDLES)
        if task == "kv":
            return self.chronicle.kv(rng, length, max(4, length // KV_TOKENS_PER_PAIR))
        if task == "vt":
            return self.chronicle.vt(rng, length)
        if task == "prose":
            s = self.prose.needles(rng, length, 1)
            s.task = "prose"
            return s
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")

    def answer_rows(self, s: Sample) -> list[int]:
        """Rows scored: the answer rows of the first answer, without a final ``.`` token."""
        a, b = s.answers[0]
        if b - a > 1 and self.tok.decode([s.input_ids[b - 1]]).strip() == ".":
            b -= 1
        return list(range(a - 1, b - 1))


def sample_rng(task: str, length: int, index: int, seed: int) -> random.Random:
    """The generator of sample ``index`` of ``(task, length)``: the same sample whatever else runs."""
    return random.Random(f"retrofit/{seed}/{task}/{length}/{index}")
