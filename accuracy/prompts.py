"""Long-context retrieval prompts in the formats the MSA models here are trained on, shared by the
served evaluation (``accuracy.retrieval``: the ``m3_kv`` and ``m3_vt`` tasks) and the lab's trainer
(``lab/training/data.py``, which batches these samples as token ids).

Tasks (``TASKS``); each ``Sample`` is ``input_ids`` = prompt + answer, the answer being the last tokens:

- ``single``: ``accuracy.needle.PROMPT`` with one ``accuracy.needle.NEEDLE``, the exact format of
  the evaluation task ``m3_niah_single``; the answer is ``" <7 digits>."``.
- ``multikey``: the same with 2-8 needles of distinct keys, one asked (``m3_niah_multikey`` uses 4).
- ``kv``: ``"key": value`` lines (4 up to one line per 48 context tokens, capped at ``MAX_KV_PAIRS``)
  interleaved with the prose, one key asked (``KV_PROMPT``).
- ``vt``: variable tracking (RULER-style): chains ``VAR A = 12345.``, ``VAR B = VAR A.``, ... (1-3
  chains of 2-5 hops, each with its own value) in the prose; the question asks either which variables
  hold a chain's value (answer: the names in chain order) or the value of a chain's last variable.
- ``copy`` (a training aid, not in ``EVAL_TASKS``): 7-digit numbers on their own lines in the prose;
  the answer repeats them all in order.

The queried fact sits at a depth drawn uniformly in [0, 100] percent of the context (by tokens, at a
sentence boundary, as in ``accuracy.needle``); other facts (and ``vt``'s statements) sit at uniform
random sentence boundaries.

Haystack: ``accuracy.haystack.sentences(seed)``. The evaluation reads ``EVAL_HAYSTACK_SEED``
(``accuracy.needle.POOL_SEED``) and only a generator made with ``evaluation=True`` reads it; training
reads ``TRAIN_HAYSTACK_SEED`` and ``HELDOUT_HAYSTACK_SEED``, never the evaluation's. Each sentence is
pre-tokenized once (``Haystack``); a sample's text is a list of pieces (sentences, needles, lines)
joined by single separators, and its ids are the concatenation of the pieces' ids, which equals
encoding the joined text for a tokenizer whose pre-tokenizer splits at every separator (the MSA models'
tokenizer; ``lab/tests/training/test_data.py`` checks it).
"""

import bisect
import random
import string
from dataclasses import dataclass, field
from itertools import islice

from tokenizers import Tokenizer

from . import needle
from .haystack import sentences
from m3_kernels.formats import PAGE_SIZE

BLOCK = PAGE_SIZE  # sparse-attention block (tokens); batch lengths are multiples of it
TASKS = ("single", "multikey", "kv", "vt", "copy")
EVAL_TASKS = ("single", "multikey", "kv", "vt")  # copy is a training aid
DEFAULT_TASK_WEIGHTS = {"single": 0.3, "multikey": 0.3, "kv": 0.2, "vt": 0.2}
TRAIN_HAYSTACK_SEED = 20261   # training samples read this haystack stream
HELDOUT_HAYSTACK_SEED = 40961  # held-out samples (training-time evaluation) read this one
EVAL_HAYSTACK_SEED = needle.POOL_SEED  # the served evaluation (accuracy tasks) reads this one, never training
MAX_KV_PAIRS = 512
MULTIKEY_RANGE = (2, 8)
COPY_MAX_NUMBERS = 64
QUERY_TOKENS = 128  # a sample of T tokens asks at most T // QUERY_TOKENS distinct keys (~40 tokens each)
_FIT_ATTEMPTS = 8  # builds per sample before TaskGenerator._fit gives up

KV_PROMPT = (
    "Some keys and their values are listed in the chronicle below. Remember them: you will be asked for one.\n\n"
    "{context}\n\n"
    'Question: what is the value of "{key}" in the chronicle above?\n'
    'Answer: the value of "{key}" is'
)
KV_LINE_KEY = '"{key}":'
COPY_PROMPT = (
    "Some numbers are listed in the chronicle below. Remember them: you will be asked to repeat them.\n\n"
    "{context}\n\n"
    "Question: which numbers are listed in the chronicle above, in order?\n"
    "Answer: the numbers are"
)
VT_PROMPT = (
    "Some variables are assigned in the chronicle below. Follow each chain of assignments.\n\n"
    "{context}\n\n"
    "Question: {question}\n"
    "Answer: {lead}"
)
VT_ASK_MEMBERS = ("which variables are assigned the value {value} in the chronicle above?",
                  "the variables assigned the value {value} are")
VT_ASK_LAST = ("what is the value of VAR {name} in the chronicle above?", "the value of VAR {name} is")
KV_FIRST_WORDS = ["amber", "silver", "quiet", "northern", "crooked", "velvet", "hollow", "bitter", "golden", "rusty",
         "painted", "frozen", "scarlet", "gentle", "iron", "wandering", "little", "broken", "distant", "hidden",
         "woollen", "copper", "sleepy", "bright", "ancient", "hungry", "patient", "restless", "narrow", "salted",
         "western", "eastern", "tall", "humble", "careful", "windy", "dusty", "lucky", "silent", "stony"]
KV_SECOND_WORDS = ["falcon", "orchard", "lantern", "harbour", "thistle", "anchor", "meadow", "compass", "sparrow",
         "kettle", "willow", "beacon", "otter", "bramble", "chapel", "juniper", "badger", "cottage", "ferry",
         "granary", "heron", "island", "ladder", "mill", "needle", "pasture", "quarry", "ribbon", "saddle",
         "tavern", "valley", "wagon", "barrel", "candle", "fiddle", "garden", "hammer", "mirror", "pebble",
         "shovel"]

if TRAIN_HAYSTACK_SEED == needle.POOL_SEED or HELDOUT_HAYSTACK_SEED == needle.POOL_SEED:
    raise RuntimeError("training haystack seeds must differ from the evaluation's accuracy.needle.POOL_SEED")


class Haystack:
    """``num_sentences`` sentences of ``accuracy.haystack.sentences(seed)``, each pre-tokenized with a
    leading space; ``cum[i]`` = tokens of sentences ``[0, i)``."""

    def __init__(self, tokenizer: Tokenizer, seed: int, num_sentences: int = 1 << 15, evaluation: bool = False):
        if evaluation and seed != EVAL_HAYSTACK_SEED:
            raise ValueError(f"an evaluation haystack reads seed {EVAL_HAYSTACK_SEED}, got {seed}")
        if not evaluation and seed == EVAL_HAYSTACK_SEED:
            raise ValueError(f"seed must differ from the evaluation's haystack seed {needle.POOL_SEED}")
        self.text = list(islice(sentences(seed), num_sentences))
        self.ids = [e.ids for e in tokenizer.encode_batch([" " + s for s in self.text], add_special_tokens=False)]
        self.cum = [0]
        for ids in self.ids:
            self.cum.append(self.cum[-1] + len(ids))

    def window(self, rng: random.Random, tokens: int) -> range:
        """A random run of consecutive sentences holding at most ``tokens`` tokens (as many as fit)."""
        if self.cum[-1] < 2 * tokens:
            raise ValueError(f"haystack of {self.cum[-1]} tokens is too small for {tokens}-token windows")
        last_start = bisect.bisect_right(self.cum, self.cum[-1] - tokens) - 1
        start = rng.randrange(0, last_start + 1)
        end = bisect.bisect_right(self.cum, self.cum[start] + tokens) - 1
        return range(start, end)


@dataclass
class Piece:
    """One piece of a context: a haystack sentence (``pool`` index) or literal ``text``.

    ``line`` pieces are joined to their neighbours by a newline, others by a space; a ``cont`` piece
    continues the previous one (always joined by a space, keeps its line-ness)."""
    text: str = ""
    pool: int = -1
    line: bool = False
    cont: bool = False
    evidence: bool = False


@dataclass
class Sample:
    """``input_ids`` = prompt + answer(s). ``answers`` holds the ``[start, end)`` token spans of the
    answers, in order; the last ends the sample; ``answer_start`` is the first one's start (one query:
    the answer is ``input_ids[answer_start:]``). ``evidence`` holds the ``[start, end)`` token spans of
    the facts the first answer is read from (the queried needle's value, the queried line's value, the
    queried chain's statements)."""
    input_ids: list[int]
    answer_start: int
    evidence: list[tuple[int, int]]
    task: str
    text: str = field(repr=False, default="")
    answers: list[tuple[int, int]] = field(default_factory=list)
    query_start: int = -1  # first token after the context (the first question's); -1: unknown
    answer_texts: list[str] = field(default_factory=list)  # the answers' text, in order (" 1234567.")
    question_texts: list[str] = field(default_factory=list)  # the text before each answer (its question)

    def __post_init__(self):
        if not self.answers:
            self.answers = [(self.answer_start, len(self.input_ids))]

    def query_rows(self) -> list[int]:
        """Rows whose next-token prediction is a question token after the context (the question and
        answer lead, e.g. the asked key, which a model can copy from the context); no answer rows."""
        if self.query_start < 0:
            return []
        answer = set(self.answer_rows())
        return [r for r in range(self.query_start - 1, len(self.input_ids) - 1) if r not in answer]

    def answer_rows(self) -> list[int]:
        """Rows whose next-token prediction is an answer token (of any query), ascending."""
        return [r for a, b in self.answers for r in range(a - 1, b - 1)]

    def evidence_blocks(self, block: int = BLOCK) -> list[int]:
        """Sparse-attention blocks (``block`` tokens) overlapping an evidence span."""
        return sorted({p // block for s, e in self.evidence for p in range(s, e)})


def _value7(rng: random.Random) -> str:
    return str(rng.randrange(10**6, 10**7))


def _keys(rng: random.Random, n: int, first: list[str], second: list[str]) -> list[str]:
    if n > len(first) * len(second):
        raise ValueError(f"{n} distinct keys asked for, only {len(first) * len(second)} exist")
    used: set[str] = set()
    while len(used) < n:
        used.add(f"{rng.choice(first)}-{rng.choice(second)}")
    keys = sorted(used)
    rng.shuffle(keys)
    return keys


class TaskGenerator:
    """Samples of ``TASKS`` over one haystack (see module doc)."""

    def __init__(self, tokenizer: Tokenizer, haystack_seed: int = TRAIN_HAYSTACK_SEED,
                 num_sentences: int = 1 << 15, evaluation: bool = False):
        self.tok = tokenizer
        self.hay = Haystack(tokenizer, haystack_seed, num_sentences, evaluation)

    # -- assembly -----------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _frame(self, prompt: str, **fields) -> tuple[str, str]:
        head, tail = prompt.split("{context}")
        return head, tail.format(**fields)

    def _assemble(self, head: str, pieces: list[Piece], qa: list[tuple[str, str]], task: str) -> Sample:
        """``head`` + pieces + for each ``(tail, answer)`` of ``qa``: the tail (question), then its answer."""
        chunks: list[list[int] | None] = []  # per piece: cached ids, or None (encoded below)
        texts: list[str] = []
        prev_line, first = True, True  # the head ends with a newline: the first piece gets no separator
        for piece in pieces:
            if piece.cont:
                sep = " "
            else:
                sep = "" if first else ("\n" if (piece.line or prev_line) else " ")
                prev_line = piece.line
            first = False
            body = self.hay.text[piece.pool] if piece.pool >= 0 else piece.text
            texts.append(sep + body)
            chunks.append(self.hay.ids[piece.pool] if piece.pool >= 0 and sep == " " else None)
        literal = [i for i, c in enumerate(chunks) if c is None]
        flat_qa = [t for pair in qa for t in pair]
        encoded = self.tok.encode_batch([head] + flat_qa + [texts[i] for i in literal], add_special_tokens=False)
        for i, e in zip(literal, encoded[1 + len(flat_qa):]):
            chunks[i] = e.ids
        ids = list(encoded[0].ids)
        evidence = []
        for piece, chunk in zip(pieces, chunks):
            if piece.evidence:
                evidence.append((len(ids), len(ids) + len(chunk)))
            ids.extend(chunk)
        answers, query_start = [], len(ids)
        for k in range(len(qa)):
            ids.extend(encoded[1 + 2 * k].ids)
            answers.append((len(ids), len(ids) + len(encoded[2 + 2 * k].ids)))
            ids.extend(encoded[2 + 2 * k].ids)
        text = head + "".join(texts) + "".join(t + a for t, a in qa)
        return Sample(ids, answers[0][0], evidence, task, text, answers, query_start, [a for _, a in qa],
                      [t for t, _ in qa])

    def _place(self, rng: random.Random, length: int, fixed_tokens: int, depth: float,
               facts: list[list[Piece]]) -> list[Piece]:
        """Haystack of at most ``length - fixed_tokens`` tokens with ``facts`` (groups of pieces) inserted
        at sentence boundaries: the first at ``depth`` percent, the others uniformly at random."""
        budget = length - fixed_tokens
        if budget < 0:
            raise ValueError(f"length {length} is too short for this sample's {fixed_tokens} fixed tokens")
        window = self.hay.window(rng, budget) if budget > 0 else range(0, 0)
        n = len(window)
        offsets = [self.hay.cum[i] - self.hay.cum[window.start] for i in range(window.start, window.stop + 1)]
        spots = [min(bisect.bisect_left(offsets, depth / 100.0 * offsets[-1]), n)]
        spots += [rng.randrange(0, n + 1) for _ in facts[1:]]
        at: dict[int, list[list[Piece]]] = {}
        for spot, fact in zip(spots, facts):
            at.setdefault(spot, []).append(fact)
        pieces: list[Piece] = []
        for k in range(n + 1):
            for fact in at.get(k, []):
                pieces.extend(fact)
            if k < n:
                pieces.append(Piece(pool=window.start + k))
        return pieces

    def _fit(self, build, length: int) -> Sample:
        """Calls ``build(slack)`` until the sample fits ``length`` tokens (the first sentence, encoded
        without its leading space, and newline-joined pieces can differ from the estimate).

        Each retry adds the overshoot plus 2, times ``2**attempt``: a retry draws a new haystack window,
        which holds whole sentences, so the same overshoot can come back; the doubling ends that."""
        slack = 0
        for attempt in range(_FIT_ATTEMPTS):
            sample = build(slack)
            overshoot = len(sample.input_ids) - length
            if overshoot <= 0:
                return sample
            slack += (overshoot + 2) << attempt
        raise RuntimeError(f"could not fit a sample into {length} tokens in {_FIT_ATTEMPTS} attempts")

    def _questions(self, qa: list[tuple[str, str]], context: int, length: int) -> list[tuple[str, str]]:
        """``qa`` without its last pairs (never the first) until ``context`` fixed tokens plus the
        questions and answers fill at most 3/4 of ``length``."""
        while len(qa) > 1 and context + self._count([t for pair in qa for t in pair]) > 3 * length // 4:
            qa = qa[:-1]
        return qa

    def _count(self, texts: list[str]) -> int:
        return sum(len(e.ids) for e in self.tok.encode_batch(texts, add_special_tokens=False))

    # -- tasks ------------------------------------------------------------------------------------------
    def needles(self, rng: random.Random, length: int, n_keys: int, depth: float | None = None,
                queries: int = 1) -> Sample:
        """``accuracy.needle`` format: ``n_keys`` needles; the first ``min(queries, n_keys)`` keys are
        asked in turn (question, answer, next question, ...; see ``asked_keys``), the first at ``depth``."""
        depth = rng.uniform(0.0, 100.0) if depth is None else depth
        keys = _keys(rng, n_keys, needle.KEY_FIRST_WORDS, needle.KEY_SECOND_WORDS)
        values = [_value7(rng) for _ in keys]
        head, _ = self._frame(needle.PROMPT, key=keys[0])
        facts = []
        for i, (k, v) in enumerate(zip(keys, values)):
            key_part, value_part = needle.NEEDLE.format(key=k, value=v).rsplit(" ", 1)
            facts.append([Piece(text=key_part), Piece(text=value_part, cont=True, evidence=i == 0)])
        context = self._count([head]) + self._count([" " + " ".join(p.text for p in f) for f in facts])
        qa = self._questions([(self._frame(needle.PROMPT, key=keys[i])[1], f" {values[i]}.")
                              for i in asked_keys(rng, n_keys, queries, length)], context, length)
        fixed = context + self._count([t for pair in qa for t in pair])
        task = "single" if n_keys == 1 else "multikey"
        return self._fit(lambda slack: self._assemble(
            head, self._place(random.Random(rng.random()), length, fixed + slack, depth, facts), qa, task),
            length)

    def kv(self, rng: random.Random, length: int, n_pairs: int | None = None, depth: float | None = None,
           queries: int = 1, repeat: bool = True) -> Sample:
        """``"key": value`` lines in the prose; the first ``min(queries, n_pairs)`` keys are asked in turn
        (``asked_keys``; ``repeat=False``: no key asked twice)."""
        depth = rng.uniform(0.0, 100.0) if depth is None else depth
        if n_pairs is None:
            n_pairs = rng.randint(4, max(4, min(MAX_KV_PAIRS, length // 48)))
        keys = _keys(rng, n_pairs, KV_FIRST_WORDS, KV_SECOND_WORDS)
        values = [_value7(rng) for _ in keys]
        head, _ = self._frame(KV_PROMPT, key=keys[0])
        facts = [[Piece(text=KV_LINE_KEY.format(key=k), line=True), Piece(text=v, cont=True, evidence=i == 0)]
                 for i, (k, v) in enumerate(zip(keys, values))]
        context = self._count([head]) + self._count(
            ["\n" + KV_LINE_KEY.format(key=k) + " " + v + "\n" for k, v in zip(keys, values)]) - n_pairs
        qa = self._questions([(self._frame(KV_PROMPT, key=keys[i])[1], f" {values[i]}.")
                              for i in asked_keys(rng, n_pairs, queries, length, repeat)], context, length)
        fixed = context + self._count([t for pair in qa for t in pair])
        return self._fit(lambda slack: self._assemble(
            head, self._place(random.Random(rng.random()), length, fixed + slack, depth, facts), qa, "kv"),
            length)

    def copy(self, rng: random.Random, length: int, n_numbers: int | None = None) -> Sample:
        """7-digit numbers on their own lines in the prose; the answer repeats them all in order. A dense
        digit-copy signal (every answer digit after the first of a number is an induction copy), the
        step the retrieval tasks need and learn slowest (docs/accuracy.md, "Training the small MSA model")."""
        if n_numbers is None:  # numbers fill about 1/4 to 1/2 of the sample (context and answer)
            hi = max(2, min(COPY_MAX_NUMBERS, length // 32))
            n_numbers = rng.randint(min(hi, max(2, length // 64)), hi)
        if n_numbers < 1:
            raise ValueError(f"n_numbers must be >= 1, got {n_numbers}")
        numbers = [_value7(rng) for _ in range(n_numbers)]
        head, tail = self._frame(COPY_PROMPT)
        answer = " " + " ".join(numbers) + "."
        fixed = self._count([head, tail, answer]) + self._count(["\n" + v + "\n" for v in numbers]) - n_numbers

        def build(slack):
            pieces = self._place(random.Random(rng.random()), length, fixed + slack, rng.uniform(0.0, 100.0),
                                 [[Piece(text=v, line=True, evidence=True)] for v in numbers])
            slots = [i for i, p in enumerate(pieces) if p.pool < 0]  # the numbers, in context order
            for i, v in zip(slots, numbers):
                pieces[i] = Piece(text=v, line=True, evidence=True)
            return self._assemble(head, pieces, [(tail, answer)], "copy")

        return self._fit(build, length)

    def vt(self, rng: random.Random, length: int, n_chains: int | None = None, hops: int | None = None,
           ask: str | None = None, _drawn: tuple[bool, bool] | None = None) -> Sample:
        """Variable tracking; chain 0 is asked; ``ask`` is ``"members"`` (which variables hold its
        value) or ``"last"`` (the value of its last variable). Statements sit at uniform random
        sentence boundaries, each chain's in hop order."""
        drawn = (n_chains is None, hops is None) if _drawn is None else _drawn
        n_chains = rng.randint(1, 3) if n_chains is None else n_chains
        hops = rng.randint(2, 5) if hops is None else hops
        ask = rng.choice(("members", "last")) if ask is None else ask
        if ask not in ("members", "last"):
            raise ValueError(f"ask must be 'members' or 'last', got {ask!r}")
        if n_chains < 1 or hops < 1:
            raise ValueError(f"n_chains and hops must be >= 1, got {n_chains}, {hops}")
        names: set[str] = set()
        while len(names) < n_chains * hops:
            names.add("".join(rng.choice(string.ascii_uppercase) for _ in range(5)))
        names_list = sorted(names)
        rng.shuffle(names_list)
        chains = [names_list[c * hops:(c + 1) * hops] for c in range(n_chains)]
        values: list[str] = []
        while len(values) < n_chains:
            v = str(rng.randrange(10**4, 10**5))
            if v not in values:
                values.append(v)
        statements = []  # (chain, hop, text)
        for c, chain in enumerate(chains):
            statements.append((c, 0, f"VAR {chain[0]} = {values[c]}."))
            statements += [(c, h, f"VAR {chain[h]} = VAR {chain[h - 1]}.") for h in range(1, hops)]
        if ask == "members":
            question, lead = (s.format(value=values[0]) for s in VT_ASK_MEMBERS)
            answer = " " + ", ".join(chains[0]) + "."
        else:
            question, lead = (s.format(name=chains[0][-1]) for s in VT_ASK_LAST)
            answer = f" {values[0]}."
        head, tail = self._frame(VT_PROMPT, question=question, lead=lead)
        fixed = self._count([head, tail, answer]) + self._count([" " + t for _, _, t in statements])
        if fixed > length and (drawn[0] and n_chains > 1 or drawn[1] and hops > 2):
            # Drawn sizes that do not fit a short context: fewer chains first, then fewer hops.
            fewer_chains = drawn[0] and n_chains > 1
            return self.vt(rng, length, n_chains - 1 if fewer_chains else n_chains,
                           hops if fewer_chains else hops - 1, ask, _drawn=drawn)
        facts = [[Piece(text=t, evidence=c == 0)] for c, _, t in statements]

        def build(slack):
            pieces = self._place(random.Random(rng.random()), length, fixed + slack, rng.uniform(0.0, 100.0), facts)
            return self._assemble(head, _order_chains(pieces, statements), [(tail, answer)], "vt")

        return self._fit(build, length)

    def sample(self, task: str, rng: random.Random, length: int, queries: int = 1, n_pairs: int | None = None,
               ask: str | None = None, repeat: bool = True) -> Sample:
        """One sample of ``task`` (``TASKS``) of at most ``length`` tokens, parameters drawn from ``rng``;
        ``multikey`` and ``kv`` ask up to ``queries`` of their keys (``single`` and ``vt`` ask one).
        ``n_pairs`` fixes kv's pair count and ``ask`` vt's question (``"members"`` or ``"last"``)
        instead of drawing them; they are refused for the other tasks. ``repeat=False``: kv asks no key
        twice (the evaluation's several questions per context)."""
        if n_pairs is not None and task != "kv":
            raise ValueError(f"n_pairs is a kv parameter, got it for task {task!r}")
        if ask is not None and task != "vt":
            raise ValueError(f"ask is a vt parameter, got it for task {task!r}")
        if n_pairs is not None and n_pairs < 1:
            raise ValueError(f"n_pairs must be >= 1, got {n_pairs}")
        if task == "single":
            return self.needles(rng, length, 1)
        if task == "multikey":
            return self.needles(rng, length, rng.randint(*MULTIKEY_RANGE), queries=queries)
        if task == "kv":
            return self.kv(rng, length, n_pairs, queries=queries, repeat=repeat)
        if task == "vt":
            return self.vt(rng, length, ask=ask)
        if task == "copy":
            return self.copy(rng, length)
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def asked_keys(rng: random.Random, n_keys: int, queries: int, length: int, repeat: bool = True) -> list[int]:
    """Indices of the keys asked, in order: keys ``0 .. k - 1`` with ``k = min(queries, n_keys,
    max(1, length // QUERY_TOKENS))`` (questions fill at most about a third of the sample), then (only
    when ``k > 1``) ``k // 2`` of them, drawn at random, asked again. A repeated question's answer can be
    copied from its first answer a few lines up (the same prefix: a plain induction copy of a digit
    string), which teaches the digit-copying step that every answer needs."""
    if queries < 1:
        raise ValueError(f"queries must be >= 1, got {queries}")
    first = list(range(min(queries, n_keys, max(1, length // QUERY_TOKENS))))
    return first + (rng.sample(first, len(first) // 2) if repeat and len(first) > 1 else [])


def _order_chains(pieces: list[Piece], statements: list[tuple[int, int, str]]) -> list[Piece]:
    """Rewrites the statement pieces so each chain's statements appear in hop order (the spots were
    drawn independently); prose pieces stay where they are."""
    text_to_key = {t: (c, h) for c, h, t in statements}
    slots = [i for i, p in enumerate(pieces) if p.pool < 0]
    by_chain: dict[int, list[int]] = {}
    for i in slots:
        by_chain.setdefault(text_to_key[pieces[i].text][0], []).append(i)
    out = list(pieces)
    for c, idx in by_chain.items():
        ordered = sorted((pieces[i] for i in idx), key=lambda p: text_to_key[p.text][1])
        for i, p in zip(idx, ordered):
            out[i] = p
    return out


# -- batches -------------------------------------------------------------------------------------------
