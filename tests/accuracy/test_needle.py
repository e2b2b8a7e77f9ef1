"""Locally generated needle samples: sized in tokens, needle at its depth, scored by whole number."""

from pathlib import Path

import pytest

from accuracy import haystack, needle

TINY = Path(__file__).resolve().parents[2] / "configs" / "minimax-m3.1-tiny"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY))


def test_haystack_is_deterministic_and_varied():
    a = [s for s, _ in zip(haystack.sentences(5), range(200))]
    assert a == [s for s, _ in zip(haystack.sentences(5), range(200))]
    assert a != [s for s, _ in zip(haystack.sentences(6), range(200))]
    assert len(set(a)) > 150


def test_depth_grid():
    assert needle.depth_grid(1) == [50.0]
    assert needle.depth_grid(5) == [0.0, 25.0, 50.0, 75.0, 100.0]
    with pytest.raises(ValueError, match="num_depths"):
        needle.depth_grid(0)


@pytest.mark.parametrize("n_keys", [1, 4])
def test_samples_fit_their_length(tokenizer, n_keys):
    lengths = [1024, 3000]
    docs = needle.generate(tokenizer, lengths, num_samples=5, num_depths=5, n_keys=n_keys, seed=1)
    assert [d["length"] for d in docs] == [1024] * 5 + [3000] * 5
    for d in docs:
        tokens = len(tokenizer(d["input"], add_special_tokens=False)["input_ids"])
        assert tokens == d["tokens"]
        assert d["length"] - needle.GEN_TOKENS - 64 <= tokens <= d["length"] - needle.GEN_TOKENS
        assert d["input"].count(f'is {d["target"]}.') == 1
        assert d["input"].count("The special number for") == n_keys
        assert d["input"].endswith(f'the special number for "{d["key"]}" is')
    assert docs == needle.generate(tokenizer, lengths, 5, 5, n_keys, 1)  # deterministic


def test_needle_lands_at_its_depth(tokenizer):
    docs = needle.generate(tokenizer, [4096], num_samples=5, num_depths=5, n_keys=1, seed=2)
    for d in docs:
        context = d["input"].split("\n\n")[1]
        at = context.index("The special number for") / len(context)
        assert abs(100 * at - d["depth"]) < 5, (d["depth"], at)


def test_too_short_length_raises(tokenizer):
    with pytest.raises(ValueError, match="too short"):
        needle.generate(tokenizer, [40], 1, 1, 1, 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n_keys", [0, 16 * 16 + 1])
def test_key_count_is_checked(tokenizer, n_keys):
    # 0 keys has no needle to ask for (was an IndexError); more than the 256 distinct keys looped forever.
    with pytest.raises(ValueError, match="n_keys"):
        needle.generate(tokenizer, [100000], 1, 1, n_keys, 0)


def test_score_whole_numbers_only():
    assert needle.score(" 4793957.", "4793957") == 1.0
    assert needle.score("it is 14793957", "4793957") == 0.0
    assert needle.score("47939570", "4793957") == 0.0
    assert needle.score("no idea", "4793957") == 0.0


@pytest.mark.parametrize("n_keys", [1, 4])
def test_each_sample_has_its_own_seed(tokenizer, n_keys):
    # Sample i is the same generated alone, among others, or after a longer length grew the haystack pool.
    full = needle.generate(tokenizer, [1024, 2048], num_samples=4, num_depths=3, n_keys=n_keys, seed=5)
    alone = needle.generate(tokenizer, [2048], 0, 3, n_keys, 5, sample_ids=[3, 1])
    assert alone == [full[7], full[5]]
    needle.generate(tokenizer, [8192], 1, 3, n_keys, 5)
    assert needle.generate(tokenizer, [1024], 0, 3, n_keys, 5, sample_ids=[2]) == [full[2]]
    assert [d["depth"] for d in full[:4]] == [0.0, 50.0, 100.0, 0.0]
    assert len({d["input"] for d in full}) == 8


def test_a_grown_pool_gives_the_fresh_pool_s_sample(tokenizer):
    # make_sample's window depends on the sample, not on how far other samples grew the shared pool
    # (examples/needle_demo.py draws from a fresh pool: its seeds replay the prompts they always had).
    import random

    grown = needle.HaystackPool(tokenizer)
    grown.ensure(100000)
    for n_keys in (1, 4):
        fresh = needle.make_sample(tokenizer, needle.HaystackPool(tokenizer), 3000, 40.0, n_keys, random.Random("a"), 0)
        assert needle.make_sample(tokenizer, grown, 3000, 40.0, n_keys, random.Random("a"), 0) == fresh


def test_questions_share_one_context(tokenizer):
    docs = needle.generate(tokenizer, [1024, 2048], 0, 4, 4, seed=3, sample_ids=[5, 4, 7, 1], questions=4)
    assert [d["sample"] for d in docs] == [5, 4, 7, 1] * 2 and [d["question"] for d in docs[:4]] == [1, 0, 3, 1]
    by = {}
    for d in docs:
        assert d["context"] == d["sample"] // 4 and d["question"] == d["sample"] % 4
        assert d["tokens"] == len(tokenizer(d["input"], add_special_tokens=False)["input_ids"])
        assert d["tokens"] <= d["length"] - needle.GEN_TOKENS and d["target"] in d["input"]
        assert f'"{d["key"]}" is' in d["input"].rsplit("Question:", 1)[1]  # each asks its own needle
        by.setdefault((d["length"], d["context"]), []).append(d)
    for group in by.values():
        contexts = {d["input"].rsplit("\n\nQuestion:", 1)[0] for d in group}
        assert len(contexts) == 1 and len({d["target"] for d in group}) == len(group)
    # Asked alone, a sample is the same; with one question a context is the plain sample.
    assert needle.generate(tokenizer, [1024], 0, 4, 4, seed=3, sample_ids=[7], questions=4)[0] == docs[2]
    plain = needle.generate(tokenizer, [1024], 2, 4, 4, seed=3)
    assert all("context" not in d for d in plain)
    assert plain != needle.generate(tokenizer, [1024], 2, 4, 4, seed=3, questions=2)[:2]
    with pytest.raises(ValueError, match=r"questions must be in \[1, n_keys = 4\]"):
        needle.generate(tokenizer, [1024], 1, 4, 4, seed=3, questions=5)


def test_the_saved_runs_prompts_are_pinned(tokenizer):
    """Committed runs resume on these draws (``retrieval.DOCS_VERSION`` 2): a change to any generator's seed
    (a single needle's drawing a multi-key sample's keys, say) must bump the version and re-pin these."""
    def draws(n_keys, questions):
        docs = needle.generate(tokenizer, [2048], 4, 10, n_keys, 0, questions=questions)
        return [(d["key"], d["target"]) for d in docs]

    assert draws(1, 1) == [("wandering-otter", "1723614"), ("painted-willow", "4501906"),
                           ("velvet-otter", "1525700"), ("northern-juniper", "1376989")]
    assert draws(4, 1) == [("frozen-kettle", "2392611"), ("silver-anchor", "2530820"),
                           ("northern-bramble", "4738018"), ("wandering-kettle", "5305644")]
    assert draws(4, 4) == [("bitter-lantern", "2090707"), ("northern-willow", "3666961"),
                           ("gentle-beacon", "3101765"), ("quiet-otter", "7100695")]
