"""training.probe on an untrained micro model: answers counted per question kind, accuracies in
[0, 1], and an untrained model far from copying keys (its key-word loss above the no-context chance)."""

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from accuracy import needle
from training import data, probe
from training.model import MSAConfig, MSAForCausalLM


def test_probe_counts_and_chance():
    cfg = MSAConfig.from_dict(json.loads((Path(probe.__file__).parent / "configs" / "msa-micro.json").read_text()))
    model = MSAForCausalLM(cfg)
    model.init_weights(0)
    out = probe.probe(model.eval(), length=512, samples=4)
    first, repeat = out["first"], out["repeat"]
    # every kv / multikey sample asks >= 2 distinct keys at T=512, and repeats half of them
    assert first["n"] >= 8 and 0 < repeat["n"] <= first["n"] // 2 + 2
    for d in (first, repeat):
        assert all(0.0 <= d[k] <= 1.0 for k in ("exact", "digit1", "digits2_7"))
    for task, ce in out["key_word_ce"].items():
        assert ce > probe.KEY_WORD_CHANCE[task], (task, ce)  # random init: worse than uniform over the list


class _FirstDigitAndKeyReader(torch.nn.Module):
    """Sure and right exactly where the input token is a space (the row predicting an answer's first digit) or
    the target is a key word's first token; sure and wrong everywhere else."""

    def __init__(self, space: int, key_words: set):
        super().__init__()
        self.space, self.key_words = space, torch.tensor(sorted(key_words))

    def forward(self, input_ids, attention, logit_rows):
        rows = logit_rows.clamp(max=input_ids.shape[1] - 2)
        here, nxt = input_ids.gather(1, rows), input_ids.gather(1, rows + 1)
        right = (here == self.space) | torch.isin(nxt, self.key_words)
        return 30.0 * F.one_hot(torch.where(right, nxt, (nxt + 1) % 2048), 2048).float(), {}


def test_probe_splits_the_first_digit_from_the_others():
    """A model right only on each answer's first digit and on the asked keys' words: digit1 1, digits2_7 0,
    exact 0, key-word loss about 0, for first and repeated questions alike."""
    tok = data.load_tokenizer()
    words = {tok.encode(w, add_special_tokens=False).ids[0]
             for w in data.KV_FIRST_WORDS + data.KV_SECOND_WORDS + needle.KEY_FIRST_WORDS + needle.KEY_SECOND_WORDS}
    out = probe.probe(_FirstDigitAndKeyReader(tok.token_to_id("Ġ"), words), length=512, samples=4)
    for kind in ("first", "repeat"):
        assert out[kind]["n"] > 0
        assert (out[kind]["digit1"], out[kind]["digits2_7"], out[kind]["exact"]) == (1.0, 0.0, 0.0), kind
    assert set(out["key_word_ce"]) == {"kv", "multikey"} and all(v < 1e-6 for v in out["key_word_ce"].values())
