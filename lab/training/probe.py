"""Where a checkpoint stands on retrieval: per-answer-digit accuracy, split by first and repeated
questions, and the loss on the asked key's words in the questions.

    python -m training.probe <run dir or state.pt> [--length 512] [--samples 48]

Held-out ``kv`` and ``multikey`` samples (``training.data.HELDOUT_HAYSTACK_SEED``) with up to 8
questions each (``training.data.asked_keys``: a second, shorter round repeats half of them). Chance,
for a model that does not read the context: answer digits 1/10 (the first digit 1/9), exact match
of a 7-digit answer 1e-7, key words ln(40) = 3.69 nats in ``kv`` and ln(16) = 2.77 in ``multikey``
(each key word is drawn uniformly from a list of 40, resp. 16; ``KEY_WORD_CHANCE``).
A key word's loss well below that means the model copies keys from the context (an induction
step); digit accuracy well above 0.1 means it retrieves values.
"""

import argparse
import json
import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from accuracy import needle
from training import data

# CE of a key word for a model that does not read the context: each word is uniform over its list
KEY_WORD_CHANCE = {"kv": math.log(len(data.KV_FIRST_WORDS)), "multikey": math.log(len(needle.KEY_FIRST_WORDS))}


def load(path: str | Path):
    """``(model, step)`` from a run directory, its ``ckpt/``, or a ``state.pt``."""
    from training.model import MSAConfig, MSAForCausalLM

    path = Path(path)
    for cand in (path / "ckpt" / "state.pt", path / "state.pt", path):
        if cand.is_file():
            state = torch.load(cand, map_location="cpu", weights_only=False)
            break
    else:
        raise ValueError(f"{path}: no ckpt/state.pt or state.pt there")
    model = MSAForCausalLM(MSAConfig.from_dict(json.loads(Path(state["plan"]["config"]).read_text())))
    model.load_state_dict(state["model"])
    return model.eval(), state["step"]


@torch.no_grad()
def probe(model, length: int = 512, samples: int = 48, seed: int = 5) -> dict:
    """Teacher-forced, dense attention. Returns ``{"first"|"repeat": {"n", "exact", "digit1",
    "digits2_7"}, "key_word_ce": {task: mean CE}}`` (means over answers and key-word rows)."""
    tok = data.load_tokenizer()
    gen = data.TaskGenerator(tok, data.HELDOUT_HAYSTACK_SEED, num_sentences=4096)
    key_words = {task: {tok.encode(w, add_special_tokens=False).ids[0] for w in a + b}
                 for task, a, b in (("kv", data.KV_FIRST_WORDS, data.KV_SECOND_WORDS), ("multikey", needle.KEY_FIRST_WORDS, needle.KEY_SECOND_WORDS))}
    rng = random.Random(seed)
    acc = {kind: {"n": 0, "exact": 0.0, "digit1": 0.0, "digits2_7": 0.0} for kind in ("first", "repeat")}
    key_ce: dict = {"kv": [], "multikey": []}
    for i in range(samples):
        task = ("kv", "multikey")[i % 2]
        s = gen.sample(task, rng, length, queries=8)
        b = data.collate([s], length, rng, 0, 0, query_rows=True)
        logits, _ = model(b.input_ids, attention="dense", logit_rows=b.loss_rows)
        ok = (logits.argmax(-1) == b.loss_targets)[0]
        ce = F.cross_entropy(logits[0], b.loss_targets[0], reduction="none")
        rows = b.loss_rows[0].tolist()
        at = {r: k for k, r in enumerate(rows)}
        seen = set()
        for a, e in s.answers:
            value = tuple(s.input_ids[a:e])
            d = acc["repeat" if value in seen else "first"]
            seen.add(value)
            hits = [bool(ok[at[r]]) for r in range(a - 1, e - 1)]  # " ", 7 digits, "."
            d["n"] += 1
            d["exact"] += all(hits)
            d["digit1"] += hits[1]
            d["digits2_7"] += sum(hits[2:8]) / 6
        for r in s.query_rows():
            if s.input_ids[r + 1] in key_words[task]:
                key_ce[task].append(float(ce[at[r]]))
    out = {kind: {k: (v if k == "n" else v / max(1, d["n"])) for k, v in d.items()} for kind, d in acc.items()}
    out["key_word_ce"] = {task: sum(v) / max(1, len(v)) for task, v in key_ce.items()}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="run directory, its ckpt/, or a state.pt")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--samples", type=int, default=48)
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, step = load(args.run)
    result = probe(model, args.length, args.samples)
    print(json.dumps({"step": step, "length": args.length, **result}))
    return result


if __name__ == "__main__":
    main()
