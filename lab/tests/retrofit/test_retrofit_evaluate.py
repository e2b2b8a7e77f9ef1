"""retrofit.evaluate: batching pads without changing a sample's scores; the summary's paired statistics
are accuracy.stats'; the recall table reads the probe counts."""

import random

import torch

from m3_kernels.formats import PAGE_SIZE, TOPK_BLOCKS
from retrofit.evaluate import markdown, probe_rows, score_batch, summarize
from retrofit.model import RetrofitLM
from retrofit.tasks import Prompts



def tiny_llama(seed: int, layers: int):
    """A random 64-wide Llama (test_retrofit_model's, smaller)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      rope_theta=10000.0, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def char_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(
        ["[UNK]"] + [chr(i) for i in range(32, 127)] + ["\n"])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return tok


def test_probe_rows():
    lo = TOPK_BLOCKS * PAGE_SIZE
    assert probe_rows(lo, [5, 7], 4).tolist() == [5, 7]  # nothing binds: the answers only
    rows = probe_rows(lo + 400, [3], 4).tolist()
    assert rows == [3, lo, lo + 100, lo + 200, lo + 300]


def test_batched_scores_equal_single(gen):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    model = RetrofitLM(tiny_llama(seed, layers=2), dense_layers=1, seed=seed)
    prompts = Prompts(char_tokenizer(), evaluation=True)
    samples = [prompts.sample("single", random.Random(seed), 2300), prompts.sample("kv", random.Random(seed), 2200)]
    formats = ["bf16", "mxfp4"]
    both = score_batch(model, prompts, samples, formats, 4, "cpu")
    one = [score_batch(model, prompts, [s], formats, 4, "cpu")[0] for s in samples]
    for b, o in zip(both, one):
        assert b["scores"] == o["scores"] and set(b["scores"]) == {"dense", "bf16", "mxfp4"}
        assert set(b["probe"]) == {"1"} and set(b["probe"]["1"]) == {"mxfp4"}


def test_summary_uses_paired_statistics():
    from accuracy.stats import compare_paired

    rng = random.Random(0)
    rows = []
    for i in range(40):
        s = {"dense": float(rng.random() < 0.8), "bf16": float(rng.random() < 0.7), "fp8": float(rng.random() < 0.7),
             "mxfp4": float(rng.random() < 0.6)}
        rows.append({"task": "single", "length": 4096, "sample": i, "scores": s,
                     "probe": {"3": {"fp8": [15, 16], "mxfp4": [12, 16]}}, "kept": {"3": 0.5}})
    summary = summarize(rows, ["bf16", "fp8", "mxfp4"])
    cell = next(c for c in summary["cells"] if c["task"] == "single")
    ref = compare_paired([r["scores"]["fp8"] for r in rows], [r["scores"]["mxfp4"] for r in rows])
    assert cell["paired"]["mxfp4-fp8"]["ci_lo"] == ref.ci_lo and cell["paired"]["mxfp4-fp8"]["n"] == 40
    assert "bf16-dense" in cell["paired"] and "fp8-dense" not in cell["paired"]
    assert summary["recall"]["mxfp4"]["3"] == 0.75
    text = markdown(summary, ["bf16", "fp8", "mxfp4"])
    assert "| mxfp4 | 75.0 | 75.0 |" in text and "| all | 4096 | 40 |" in text
