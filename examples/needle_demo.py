"""Serve a MiniMax-M3.1-geometry model on the CPU, ask one needle question, show what MSA picked, stop.

    python examples/needle_demo.py [--model configs/msa-small] [--index-k-format mxfp4] [--length 8192] [--seed N]

By default it serves ``configs/msa-small`` (the small MSA model trained here, real weights) with the
chosen index-K cache, builds a needle prompt it has never seen (``accuracy.needle``: the evaluation
haystack, which training never reads, and a fresh random 7-digit value), and prints the question, the
answer, whether it is right, and for the last prompt token (the row that produces the first answer
token) the blocks each index head of each sparse layer picked against the block holding the needle.
Then the pool capacity per index-K format (``sglang_m3.capacity``, full-size M3.1 at a 100 GiB budget).

``--model DIR`` serves another folder; one without weight files (``configs/minimax-m3.1-tiny``) is
served with SGLang's random dummy weights, and its answer is gibberish by construction.
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from m3_kernels.formats import PAGE_SIZE, TOPK_BLOCKS, IndexKFormat

from sglang_m3.config import register_config
from sglang_m3.server import Server, cpu_args

REPO = Path(__file__).resolve().parent.parent  # the checkout this example sits in
TRAINED_MODEL = REPO / "configs" / "msa-small"
TINY_MODEL = REPO / "configs" / "minimax-m3.1-tiny"
# The dummy-weight prompt (about 2,450 tokens at 34 repeats with the tiny model's tokenizer).
PROMPT = ("MiniMax-M3 scores every 128-token block of the context with a small indexer and attends to the best "
          "sixteen; the indexer keys live in a paged cache, here stored as MXFP4. ")


def has_weights(model: Path) -> bool:
    return any(model.glob("*.safetensors")) or any(model.glob("*.bin"))


def server(model: Path, index_k_format: str, log_path: Path, max_total_tokens: int = 16384,
           overrides: dict | None = None, context_length: int | None = None, port: int | None = None) -> Server:
    """A CPU server of ``model`` with the ``index_k_format`` cache (``sglang_m3.server``; dummy weights when the
    folder has none); ``with`` starts it, waits until it answers and stops it."""
    args = [*cpu_args(max_total_tokens), "--index-k-format", index_k_format]
    if not has_weights(model):
        args += ["--load-format", "dummy"]
    if context_length is not None:
        args += ["--context-length", str(context_length)]
    if overrides:
        args += ["--json-model-override-args", json.dumps(overrides)]
    return Server(model, args, log_path, port=port)


def last_row_selections(records: list[dict], position: int) -> dict[int, list[list[int]]]:
    """``{layer: [per index head: sorted block ids]}`` the row at ``position`` picked (extend records)."""
    picked = {}
    for rec in records:
        if rec["mode"] != "extend" or position not in rec["positions"]:
            continue
        r = rec["positions"].index(position)
        picked[rec["layer"]] = [sorted(b for b in head[r] if b >= 0) for head in rec["selected"]]
    return dict(sorted(picked.items()))


def selection_lines(picked: dict[int, list[list[int]]], needle_blocks: list[int], n_blocks: int) -> list[str]:
    """One line per layer and head: the picked blocks, needle blocks starred, and whether all were picked."""
    lines = []
    for layer, heads in picked.items():
        for h, blocks in enumerate(heads):
            shown = " ".join(f"*{b}*" if b in needle_blocks else str(b) for b in blocks)
            hit = "needle picked" if set(needle_blocks) <= set(blocks) else "needle MISSED"
            lines.append(f"  layer {layer} head {h}: {len(blocks)}/{n_blocks} blocks [{shown}]  {hit}")
    return lines


def needle_doc(tokenizer, length: int, seed: int) -> dict:
    """One single-needle prompt of at most ``length`` tokens at a random depth (``accuracy.needle``), with its
    token ids and needle blocks (``accuracy.agreement.prepare``)."""
    from accuracy import agreement, needle

    depth = random.Random(seed).uniform(5.0, 95.0)
    rng = random.Random(f"demo-{seed}")
    doc = needle.make_sample(tokenizer, needle.HaystackPool(tokenizer), length, depth, 1, rng, 0)
    return doc | agreement.prepare(tokenizer, doc, 0)


def _post(url: str, payload: dict, timeout: float = 900) -> dict:
    req = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _server_info(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/get_server_info", timeout=30) as r:
            return json.loads(r.read())
    except urllib.error.URLError:
        return {}


def run_needle(url: str, model: Path, length: int, seed: int, record: Path, new_tokens: int) -> bool:
    from transformers import AutoTokenizer

    from accuracy import agreement, needle

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    doc = needle_doc(tokenizer, length, seed)
    question = doc["input"][doc["input"].rindex("Question:"):]
    n_blocks = -(-doc["prompt_len"] // PAGE_SIZE)
    print(f"\nprompt: {doc['prompt_len']} tokens = {n_blocks} blocks of {PAGE_SIZE}; the needle "
          f"{needle.NEEDLE.format(key=doc['key'], value=doc['target'])!r} sits at {doc['depth']:.0f}% depth, "
          f"tokens {doc['needle_tokens'][0]}-{doc['needle_tokens'][1] - 1}, block(s) {doc['needle_blocks']}")
    print("question:", question.replace("\n", " | "))
    record.unlink(missing_ok=True)  # drop what the health probe recorded
    t0 = time.monotonic()
    out = _post(url, {"input_ids": doc["input_ids"], "sampling_params": {"max_new_tokens": new_tokens,
                                                                          "temperature": 0, "stop": ["\n"]}})
    dt = time.monotonic() - t0
    answer = out["text"]
    right = needle.score(answer, doc["target"]) == 1.0
    print(f"answer:   {answer!r}  ({out['meta_info']['completion_tokens']} tokens in {dt:.1f} s)")
    print(f"expected: {doc['target']!r} -> {'RIGHT' if right else 'WRONG'}")
    records = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    picked = last_row_selections(records, doc["prompt_len"] - 1)
    print(f"blocks picked for the last prompt token (top-16 of {n_blocks}; needle block(s) starred):")
    print("\n".join(selection_lines(picked, doc["needle_blocks"], n_blocks)) or "  (no selection recorded)")
    lists = [set(blocks) for heads in picked.values() for blocks in heads]
    hits = sum(set(doc["needle_blocks"]) <= blocks for blocks in lists)
    chance = agreement.chance_recall(n_blocks, doc["needle_blocks"], TOPK_BLOCKS)
    print(f"the needle's block(s) in {hits} of {len(lists)} (layer, head) lists; a random top-{TOPK_BLOCKS} list "
          f"would hold them with probability {chance:.2f}")
    return right


def run_dummy(url: str, new_tokens: int) -> None:
    t0 = time.monotonic()
    out = _post(url, {"text": PROMPT * 34, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}})
    meta = out["meta_info"]
    print(f"/generate: {meta['prompt_tokens']} prompt tokens ({-(-meta['prompt_tokens'] // PAGE_SIZE)} blocks), "
          f"{meta['completion_tokens']} new tokens in {time.monotonic() - t0:.1f} s")
    print(f"answer (dummy weights, gibberish by construction): {out['text']!r}")


def main(argv=None) -> int:
    register_config()  # this process loads the model folder's tokenizer
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=TRAINED_MODEL,
                        help="model folder; without weight files it is served with dummy weights")
    parser.add_argument("--index-k-format", default=IndexKFormat.MXFP4.value, choices=[f.value for f in IndexKFormat])
    parser.add_argument("--length", type=int, default=8192, help="needle prompt budget in tokens (trained models)")
    parser.add_argument("--seed", type=int, default=None, help="needle seed (default: a fresh one, printed)")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free loopback port")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--no-capacity", action="store_true", help="skip the pool capacity table")
    args = parser.parse_args(argv)
    model = args.model.resolve()
    dummy = not has_weights(model)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    with tempfile.TemporaryDirectory(prefix="sglang-m3-demo-") as tmp:
        record = Path(tmp) / "selections.jsonl"
        overrides = None if dummy else {"index_k_debug_record": str(record), "index_k_debug_rows": 1}
        srv = server(model, args.index_k_format, Path(tmp) / "server.log", max(16384, 2 * args.length), overrides,
                     context_length=None if dummy else args.length + 64, port=args.port or None)
        t0 = time.monotonic()
        print("$", " ".join(srv.start().command()), flush=True)
        try:
            srv.wait_ready()
            info = _server_info(srv.url)
            print(f"server ready in {time.monotonic() - t0:.0f} s at {srv.url}: {model.name} "
                  f"({'DUMMY weights' if dummy else 'trained weights'}), index-K cache {args.index_k_format}, "
                  f"pool {info.get('max_total_num_tokens')} tokens, page {info.get('page_size')}")
            if dummy:
                run_dummy(srv.url, args.max_new_tokens)
            else:
                print(f"needle seed {seed} (replay with --seed {seed})")
                run_needle(srv.url, model, args.length, seed, record, args.max_new_tokens)
        except Exception:
            print(srv.log_tail(), file=sys.stderr)
            raise
        finally:
            srv.stop()
    print("server stopped")
    if not args.no_capacity:
        print("\npool capacity per index-K format (full-size MiniMax-M3.1, SGLang's own pool sizing):")
        run = subprocess.run([sys.executable, "-m", "sglang_m3.capacity"], capture_output=True, text=True)
        print(run.stdout, end="")
        if run.returncode != 0:
            print(run.stderr[-4000:], file=sys.stderr)
            return run.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
