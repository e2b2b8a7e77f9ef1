"""Speed of the on-the-fly training data (``training.data``) on the CPU, one thread of Python.

    python lab/tests/benchmarks/bench_training_data.py [--lengths 4096,32768] [--seconds 3]

Prints a markdown table: per task and length, samples/s and tokens/s of ``TaskGenerator.sample``;
then per length, batches/s and tokens/s of ``make_batch`` (sampling + padding + row choice) at a
65536-token budget with the default task mix. Also the one-off haystack pre-tokenization time.
Each cell runs for ``--seconds`` of wall time; the rate is samples done / time taken.
"""

import argparse
import platform
import random
import time

import torch

from training import data


def rate(fn, seconds: float) -> tuple[float, float]:
    """(calls per second, tokens per second) of ``fn() -> tokens`` over ``seconds``."""
    fn()  # warm
    n, tokens, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        tokens += fn()
        n += 1
    dt = time.perf_counter() - t0
    return n / dt, tokens / dt


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="4096,32768")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--token-budget", type=int, default=65536)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"torch threads {torch.get_num_threads()}")
    tok = data.load_tokenizer()
    t0 = time.perf_counter()
    gen = data.TaskGenerator(tok, data.TRAIN_HAYSTACK_SEED, num_sentences=1 << 15)
    print(f"haystack: {len(gen.hay.text)} sentences, {gen.hay.cum[-1]} tokens, pre-tokenized in "
          f"{time.perf_counter() - t0:.2f} s\n")
    rng = random.Random(0)
    print("| task | length | samples/s | tokens/s |\n| --- | ---: | ---: | ---: |")
    for task in data.TASKS:
        for n in lengths:
            sps, tps = rate(lambda: len(gen.sample(task, rng, n).input_ids), args.seconds)
            print(f"| {task} | {n} | {sps:,.1f} | {tps:,.0f} |")
    print(f"\n| make_batch, budget {args.token_budget} | length | batches/s | tokens/s |\n| --- | ---: | ---: | ---: |")
    step = iter(range(10**9))
    for n in lengths:
        spec = data.BatchSpec((n,), args.token_budget)
        bps, tps = rate(lambda: int(data.make_batch(gen, spec, 0, next(step)).lengths.sum()), args.seconds)
        print(f"| default mix | {n} | {bps:,.2f} | {tps:,.0f} |")


if __name__ == "__main__":
    main()
