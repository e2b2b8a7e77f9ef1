"""Needle-in-a-haystack samples generated locally (RULER-style), sized in tokens of the served model.

A sample is a chronicle (``accuracy.haystack``) with one or more needles, sentences of the form
``The special number for "<key>" is <7 digits>.``, and a question about one key. ``single`` has one
needle; ``multikey`` has ``n_keys`` needles with distinct keys and asks for one of them (the others
are distractors at random depths). The queried needle sits at ``depth`` percent of the context, so
with a depth grid the needle lands in many different 128-token blocks. ``length`` is the budget of
prompt tokens plus ``gen_tokens`` generated tokens.

Seeds: sample ``i`` at ``length`` with ``n_keys`` needles is drawn from its own generator, seeded by
``(seed, length, n_keys, i)``, and reads a window of the haystack stream within a span fixed by its
own token budget (the span a fresh pool holds, however far other samples grew the shared pool), so a
sample is the same whichever other samples or lengths are generated with it
(``sample_ids`` picks any of them: a long run can be evaluated in pieces and resumed). The runs
dated 2026-12-01 and earlier in docs/accuracy.md drew their samples from one generator per length in
turn: the same distribution, other prompts.

Doc fields: ``input`` (prompt), ``target`` (the digits), ``length``, ``depth``, ``tokens`` (prompt
tokens measured), ``key``, ``n_keys``, ``sample``; with several questions per context
(``make_context``), ``context`` and ``question`` too.
"""

import bisect
import random
import re
import weakref

from .haystack import sentences

PROMPT = (
    "Some special numbers are hidden in the chronicle below. Remember them: you will be asked for one.\n\n"
    "{context}\n\n"
    'Question: what is the special number for "{key}" in the chronicle above?\n'
    'Answer: the special number for "{key}" is'
)
NEEDLE = 'The special number for "{key}" is {value}.'
KEY_FIRST_WORDS = ["amber", "silver", "quiet", "northern", "crooked", "velvet", "hollow", "bitter", "golden", "rusty",
          "painted", "frozen", "scarlet", "gentle", "iron", "wandering"]
KEY_SECOND_WORDS = ["falcon", "orchard", "lantern", "harbour", "thistle", "anchor", "meadow", "compass", "sparrow",
          "kettle", "willow", "beacon", "otter", "bramble", "chapel", "juniper"]
GEN_TOKENS = 24  # tokens the model may generate; a 7-digit answer needs far fewer
POOL_SEED = 1234  # haystack stream shared by all samples (each sample reads its own window)


def depth_grid(num_depths: int) -> list[float]:
    """``num_depths`` evenly spaced needle depths in percent, 0 and 100 included (50 for one)."""
    if num_depths < 1:
        raise ValueError(f"num_depths must be >= 1, got {num_depths}")
    if num_depths == 1:
        return [50.0]
    return [100.0 * i / (num_depths - 1) for i in range(num_depths)]


POOL_BATCH = 512  # sentences the pool grows by


class HaystackPool:
    """Haystack sentences with their token counts and prefix sums, grown on demand."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.stream = sentences(POOL_SEED)
        self.text: list[str] = []
        self.cum = [0]  # cum[i] = tokens of sentences [0, i)

    def ensure(self, tokens: int):
        """Grow the pool (in batches of ``POOL_BATCH`` sentences) until it holds at least ``tokens`` tokens."""
        while self.cum[-1] < tokens:
            batch = [next(self.stream) for _ in range(POOL_BATCH)]
            encoded = self.tokenizer([" " + s for s in batch], add_special_tokens=False)["input_ids"]
            counts = [len(ids) for ids in encoded]
            self.text += batch
            for c in counts:
                self.cum.append(self.cum[-1] + c)


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _key(rng: random.Random, used: set) -> str:
    while True:
        key = f"{rng.choice(KEY_FIRST_WORDS)}-{rng.choice(KEY_SECOND_WORDS)}"
        if key not in used:
            used.add(key)
            return key


def make_sample(tokenizer, pool: HaystackPool, length: int, depth: float, n_keys: int, rng: random.Random, index: int) -> dict:
    """One sample of at most ``length - GEN_TOKENS`` prompt tokens (see module doc)."""
    return make_context(tokenizer, pool, length, depth, n_keys, rng, index, 1)[0]


def make_context(tokenizer, pool: HaystackPool, length: int, depth: float, n_keys: int, rng: random.Random, index: int,
                 questions: int) -> list[dict]:
    """``questions`` samples on one context, each of at most ``length - GEN_TOKENS`` prompt tokens: the
    same chronicle and needles, sample ``j`` asking for needle ``j`` (needle 0 sits at ``depth``, the
    others at random sentence boundaries, their ``depth`` measured the same way). They share the
    prompt up to the question, so a server's prefix cache prefills the context once. ``index`` is the
    context's: sample ``j`` gets ``sample = index * questions + j``, ``context = index``, ``question = j``
    (with ``questions = 1``: sample ``index`` alone, as ``make_sample``, without the two fields)."""
    if not 1 <= questions <= n_keys:
        raise ValueError(f"questions must be in [1, n_keys = {n_keys}] (one needle asked each), got {questions}")
    used: set = set()
    needles = [(_key(rng, used), f"{rng.randrange(10**6, 10**7)}") for _ in range(n_keys)]
    key, value = needles[0]
    frame = _count(tokenizer, PROMPT.format(context="", key=key))
    needle_tokens = sum(_count(tokenizer, " " + NEEDLE.format(key=k, value=v)) for k, v in needles)
    budget = length - GEN_TOKENS - frame - needle_tokens
    if budget <= 0:
        raise ValueError(f"length {length} is too short for the prompt frame "
                         f"({frame} + {needle_tokens} + {GEN_TOKENS} tokens)")
    # The window lies in the part of the pool a fresh pool would hold after growing to 3 x budget tokens
    # (whole batches of POOL_BATCH sentences): a range fixed by the sample itself, however far other
    # samples grew the shared pool, and the one the first sample of a fresh pool always had.
    pool.ensure(3 * budget + 1)  # the pool grows by whole batches: it holds the span
    span = POOL_BATCH * -(-bisect.bisect_left(pool.cum, 3 * budget + 1) // POOL_BATCH)
    for _ in range(8):  # per-sentence counts are an estimate: trim until the prompt fits
        start = rng.randrange(0, max(1, span - 1))
        while pool.cum[span] - pool.cum[start] < budget:
            start = start // 2  # window too close to the end of the span: move it back
        end = bisect.bisect_right(pool.cum, pool.cum[start] + budget) - 1
        hay = pool.text[start:end]
        # Depth is placed by tokens: the needle goes at the sentence boundary nearest depth%.
        offsets = [pool.cum[i] - pool.cum[start] for i in range(start, end + 1)]
        spots = [bisect.bisect_left(offsets, depth / 100.0 * offsets[-1])]
        spots += [rng.randrange(0, len(hay) + 1) for _ in needles[1:]]
        inserts = sorted(zip(spots, range(len(needles))), reverse=True)
        body = list(hay)
        for spot, i in inserts:
            body.insert(min(spot, len(body)), NEEDLE.format(key=needles[i][0], value=needles[i][1]))
        context = " ".join(body)
        prompts = [PROMPT.format(context=context, key=needles[j][0]) for j in range(questions)]
        counts = [_count(tokenizer, p) for p in prompts]
        if max(counts) <= length - GEN_TOKENS:
            if questions == 1:
                return [{"input": prompts[0], "target": value, "length": length, "depth": depth, "tokens": counts[0],
                         "key": key, "n_keys": n_keys, "sample": index}]
            at = [depth] + [round(100.0 * offsets[min(spot, len(offsets) - 1)] / max(1, offsets[-1]), 2)
                            for spot in spots[1:questions]]
            return [{"input": prompts[j], "target": needles[j][1], "length": length, "depth": at[j],
                     "tokens": counts[j], "key": needles[j][0], "n_keys": n_keys, "sample": index * questions + j,
                     "context": index, "question": j} for j in range(questions)]
        budget -= max(counts) - (length - GEN_TOKENS) + 8
    raise RuntimeError(f"could not fit a sample into {length} tokens")


_POOLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> its HaystackPool


def _pool(tokenizer) -> HaystackPool:
    """The haystack pool of ``tokenizer``, kept while the tokenizer lives (its counts are its own)."""
    try:
        pool = _POOLS.get(tokenizer)
    except TypeError:  # not weak-referenceable: a pool per call
        return HaystackPool(tokenizer)
    if pool is None:
        pool = _POOLS[tokenizer] = HaystackPool(tokenizer)
    return pool


def sample_rng(seed: int, length: int, n_keys: int, index: int) -> random.Random:
    """The generator of sample ``index`` (see the module doc)."""
    return random.Random(f"needle-{seed}-{length}-{n_keys}-{index}")


def generate(tokenizer, lengths, num_samples: int, num_depths: int, n_keys: int, seed: int,
             sample_ids=None, questions: int = 1) -> list[dict]:
    """Samples ``0 .. num_samples - 1`` (or the indices ``sample_ids``) per length, shortest length
    first; sample ``i`` has its needle at depth ``depth_grid(num_depths)[i % num_depths]``. With
    ``questions = q > 1``, sample ``i`` is question ``i % q`` on context ``i // q`` (``make_context``),
    the context's first needle at ``depth_grid(num_depths)[(i // q) % num_depths]``, its generator
    seeded by ``(seed, length, n_keys, i // q, q)``: other prompts than ``questions = 1``."""
    ids = list(range(num_samples)) if sample_ids is None else [int(i) for i in sample_ids]
    if sample_ids is None and num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if any(i < 0 for i in ids):
        raise ValueError(f"sample_ids must be >= 0, got {ids}")
    if not 1 <= n_keys <= len(KEY_FIRST_WORDS) * len(KEY_SECOND_WORDS):  # more would loop forever looking for a new key
        raise ValueError(f"n_keys must be in [1, {len(KEY_FIRST_WORDS) * len(KEY_SECOND_WORDS)}] (distinct keys), got {n_keys}")
    pool = _pool(tokenizer)
    grid = depth_grid(num_depths)
    docs = []
    for length in sorted(int(n) for n in lengths):
        if questions == 1:
            for i in ids:
                docs.append(make_sample(tokenizer, pool, length, grid[i % len(grid)], n_keys,
                                        sample_rng(seed, length, n_keys, i), i))
            continue
        made = {}
        for c in dict.fromkeys(i // questions for i in ids):
            rng = random.Random(f"needle-{seed}-{length}-{n_keys}-{c}-q{questions}")
            for doc in make_context(tokenizer, pool, length, grid[c % len(grid)], n_keys, rng, c, questions):
                made[doc["sample"]] = doc
        docs += [made[i] for i in ids]
    return docs


def score(response: str, target: str) -> float:
    """1.0 when the target digits appear in the response as a whole number, else 0.0."""
    return 1.0 if re.search(rf"(?<!\d){re.escape(target)}(?!\d)", response) else 0.0
