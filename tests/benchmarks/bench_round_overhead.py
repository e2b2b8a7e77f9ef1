"""How much of a resumable round is the runner's own work: rounds of ``m3-accuracy --resume`` against the
accuracy tests' stand-in completions server (``tests/accuracy/conftest.py``: ``FakeCompletions``, no model,
answers read off the prompt) answering each request after ``--delay-s``, with the rounds' prompts built
ahead (the default) and in turn (``--no-prefetch``). Prints a table of round times; a round's requests
alone take ``delay * prompts / concurrency`` seconds.

    .venv/bin/python tests/benchmarks/bench_round_overhead.py [--model configs/msa-medium] [--delay-s 2.5]
"""

import argparse
import contextlib
import importlib.util
import io
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from accuracy import retrieval, run  # noqa: E402


def fake_completions():
    """``FakeCompletions`` of the accuracy tests' conftest (loaded by path: ``tests/`` is not a package)."""
    spec = importlib.util.spec_from_file_location("accuracy_test_helpers", ROOT / "tests" / "accuracy" / "conftest.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    return helpers.FakeCompletions


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "configs" / "msa-medium"))
    p.add_argument("--delay-s", type=float, default=2.5)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--chunk", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    args = p.parse_args()
    times = {}
    with fake_completions()(delay_s=args.delay_s, max_model_len=max(args.lengths) + 256) as server:
        for mode, flag in (("built ahead", []), ("built in turn", ["--no-prefetch"])):
            retrieval.clear_cache()  # each mode builds every prompt itself
            with tempfile.TemporaryDirectory() as out:
                argv = ["--model", args.model, "--formats", "fp8", "--base-url", f"fp8={server.url}",
                        "--tasks", "m3_niah_single", "m3_niah_multikey", "m3_kv_64", "m3_vt_value",
                        "--lengths", *map(str, args.lengths), "--samples", str(args.samples), "--questions", "4",
                        "--chunk", str(args.chunk), "--concurrency", str(args.concurrency), "--resume",
                        "--bootstrap", "100", "--out", out, *flag]
                log = io.StringIO()
                t0 = time.time()
                with contextlib.redirect_stdout(log):
                    run.compare_formats(argv)
                total = time.time() - t0
            rounds = [(int(n), float(s)) for n, s in re.findall(r"round of (\d+) prompts in ([\d.]+) s",
                                                                 log.getvalue())]
            times[mode] = (rounds, total)
    requests_s = args.delay_s * rounds[0][0] / args.concurrency
    print(f"| prompts built | rounds (s each; requests alone {requests_s:.1f} s) | later rounds' mean | whole run |")
    print("|---|---|---|---|")
    for mode, (rounds, total) in times.items():
        later = [s for _, s in rounds[1:]]
        mean = f"{sum(later) / len(later):.1f} s" if later else "-"
        print(f"| {mode} | {', '.join(f'{s:.1f}' for _, s in rounds)} | {mean} | {total:.0f} s |")


if __name__ == "__main__":
    main()
