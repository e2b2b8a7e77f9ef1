"""training.probe on an untrained micro model: answers counted per question kind, accuracies in
[0, 1], and an untrained model far from copying keys (its key-word loss above the no-context chance)."""

import json
from pathlib import Path

from training import probe
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
