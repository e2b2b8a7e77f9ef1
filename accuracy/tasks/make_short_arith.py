"""Regenerate ``data/short_arith.jsonl``, the bundled short-context task (our own problems).

    python -m accuracy.tasks.make_short_arith

Two-step whole-number word problems from fixed templates and a fixed seed; every answer is
computed here, so the file is its own answer key.
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).parent / "data" / "short_arith.jsonl"
N_PROBLEMS = 60
_WHO = ["The miller", "A shepherd", "The ferryman", "The weaver", "The innkeeper", "The carter", "The parson",
        "A tinker", "The lamplighter", "The bargeman"]
_ITEMS = ["sacks of barley", "pears", "bolts of wool", "candles", "eggs", "loaves", "nails", "apples", "sheep",
          "jars of honey"]


def _problem(rng: random.Random) -> dict:
    who, item = rng.choice(_WHO), rng.choice(_ITEMS)
    kind = rng.randrange(4)
    a, b = rng.randrange(12, 60), rng.randrange(3, 12)
    if kind == 0:
        c = rng.randrange(1, a)
        q = f"{who} had {a} {item}, bought {b} more and then gave away {c}. How many {item} are left?"
        ans = a + b - c
    elif kind == 1:
        q = f"{who} packs {item} into {b} crates with {a} in each crate. How many {item} is that in all?"
        ans = a * b
    elif kind == 2:
        per = rng.randrange(2, 9)
        q = (f"{who} shares {per * b} {item} equally among {b} neighbours, then each neighbour eats 1. "
             "How many does each neighbour have now?")
        ans = per - 1
    else:
        c = rng.randrange(2, 6)
        q = (f"{who} sells {item} at {c} pence each. He sells {a} on Monday and {b} on Tuesday. "
             "How many pence does he take?")
        ans = c * (a + b)
    return {"question": q, "answer": ans}


def main():
    rng = random.Random(7)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w") as f:
        for i in range(N_PROBLEMS):
            f.write(json.dumps({"id": i, **_problem(rng)}) + "\n")
    print(f"wrote {N_PROBLEMS} problems to {OUT.name}")


if __name__ == "__main__":
    main()
