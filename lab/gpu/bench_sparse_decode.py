"""SGLang's sparse decode attention under each of its autotune candidates, at a model's decode shapes, on one GPU:
time per step of one layer (CUDA-graph replay, as a server runs it), GB/s of the K and V it reads, % of the GPU's
measured copy bandwidth, ratio to the fastest, whether each candidate's output equals the first's bit for bit and
its error against a float64 reference; then what the autotuner picks, several times over, at each batch (its key
holds the batch's power-of-two bucket; a server picks while it captures its CUDA graphs).

    source lab/gpu/bundle_env.sh && python3 lab/gpu/bench_sparse_decode.py [--batches 1,8,32,64]
        [--contexts 8192,32768,131072] [--q-heads 8] [--kv-heads 4] [--head-dim 128] [--topk 16] [--picks 3]
        [--out DIR]

Each request decodes its row at position ``context - 1`` over its own (last, partial when ``context`` is not a
multiple of 128) block and ``topk - 1`` distinct earlier ones per KV head; requests' tokens lie in disjoint random
slots. The defaults are configs/msa-medium's geometry (block 128). Replays read the same blocks, so a cell whose K
and V read fit in the GPU's L2 cache (batch 1 and 8 at these sizes) is timed from it: its GB/s are marked "L2" and are
not HBM's. The last line names the candidate with the least geometric mean of its time over the fastest's, to hold
with ``M3_SPARSE_DECODE_CONFIG`` (sglang_m3/sparse_attention.py). ``--out`` gets the table as markdown and JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sparse_prefill import BLOCK, select_blocks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def make_batch(batch: int, context: int, hq: int, hkv: int, d: int, topk: int, gen: torch.Generator,
               dev: str = "cuda") -> dict:
    """The plugin's decode arguments for ``batch`` requests of ``context`` tokens each, one row each at
    ``context - 1``, its blocks from ``bench_sparse_prefill.select_blocks`` (``topk_idx`` ``[hkv, batch, topk]``)."""
    n_blocks = -(-context // BLOCK)
    own = torch.full((batch,), n_blocks - 1, device=dev)
    sel = select_blocks(own, n_blocks, hkv, topk, gen, dev)
    slots = batch * context
    return {
        "q": torch.randn(batch, hq, d, generator=gen, device=dev).bfloat16(),
        "k_cache": torch.randn(slots, hkv, d, generator=gen, device=dev, dtype=torch.bfloat16),
        "v_cache": torch.randn(slots, hkv, d, generator=gen, device=dev, dtype=torch.bfloat16),
        "req_to_token": torch.randperm(slots, generator=gen, device=dev).int().view(batch, context),
        "req_pool_indices": torch.randperm(batch, generator=gen, device=dev),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=dev),
        "topk_idx": sel,
        "block_size": BLOCK,
        "sm_scale": 1 / math.sqrt(d),
    }


def bytes_read(req: dict) -> int:
    """Bytes of K and V the selected blocks hold (the last block only up to the request's length)."""
    context = int(req["seq_lens"][0])
    sel = req["topk_idx"].long()
    tokens = torch.where(sel < 0, 0, torch.clamp(context - sel * BLOCK, max=BLOCK)).sum()
    _, _, d = req["q"].shape
    return int(tokens) * d * req["k_cache"].element_size() * 2


def references(req: dict, requests: int) -> dict[int, torch.Tensor]:
    """{request: float64 reference output ``[1, Hq, D]``} for the first and last ``requests // 2`` requests (at
    least the first)."""
    from m3_kernels.ops.attention.naive import sparse_attention_ref

    batch = req["q"].shape[0]
    picks = sorted({*range(max(1, requests // 2)), *range(max(0, batch - requests // 2), batch)})
    want = {}
    for b in picks:
        row = req["req_to_token"][req["req_pool_indices"][b]].long()  # this request's slots, in token order
        k, v = req["k_cache"][row].cpu(), req["v_cache"][row].cpu()
        n = k.shape[0]
        want[b] = sparse_attention_ref(req["q"][b:b + 1].cpu(), k, v, torch.arange(n)[None],
                                       torch.zeros(1, dtype=torch.long), torch.tensor([n]), torch.tensor([0, 1]),
                                       torch.tensor([n - 1]), req["topk_idx"][:, b:b + 1].cpu(), BLOCK,
                                       req["sm_scale"])
    return want


def reference_error(out: torch.Tensor, want: dict[int, torch.Tensor]) -> float:
    """Largest |out - reference| over the requests ``want`` holds."""
    return max(float((out[b:b + 1].double().cpu() - w).abs().max()) for b, w in want.items())


def summarize(rows: list[dict]) -> tuple[dict, tuple[int, int]]:
    """Adds ``x_fastest`` (time over the cell's fastest) to every row; returns {(warps, stages): geometric mean of
    it over the cells} and the candidate with the least."""
    cells = {(r["batch"], r["context"]) for r in rows}
    fastest = {cell: min(r["us"] for r in rows if (r["batch"], r["context"]) == cell) for cell in cells}
    for r in rows:
        r["x_fastest"] = r["us"] / fastest[(r["batch"], r["context"])]
    candidates = {(r["warps"], r["stages"]) for r in rows}
    gmean = {c: math.exp(sum(math.log(r["x_fastest"]) for r in rows if (r["warps"], r["stages"]) == c) / len(cells))
             for c in sorted(candidates)}
    return gmean, min(gmean, key=gmean.get)


def render(rows: list[dict], picks: dict, gmean: dict, best: tuple[int, int], copy_gbs: tuple[float, float],
           l2_bytes: int) -> str:
    """The markdown table, then the autotuner's picks and the candidate to hold."""
    head = [f"Copy bandwidth {copy_gbs[0]:.0f} GB/s at the start, {copy_gbs[1]:.0f} at the end; % of copy uses the "
            f"first. L2: the K and V read fit in the {l2_bytes / 2**20:.0f} MiB L2 cache; replays read them from it.",
            "", "| batch | context | warps, stages | us | GB/s | % of copy | x fastest | equals the first | "
            "max abs err vs float64 |", "|---|---|---|---|---|---|---|---|---|"]
    body = [f"| {r['batch']} | {r['context']} | {r['warps']}, {r['stages']} | {r['us']:.1f} | {r['gbs']:.0f} | "
            f"{r['pct_copy']:.0f}{' L2' if r['in_l2'] else ''} | {r['x_fastest']:.2f} | "
            f"{'yes' if r['equals_first'] else 'no'} | {r['max_err']:.2e} |" for r in rows]
    tail = ["Autotuner picks, " + "; ".join(f"batch {b}: " + ", ".join(f"{w},{s}" for w, s in p)
                                           for b, p in picks.items()),
            f"Least geometric mean of time over the fastest: {best[0]} warps, {best[1]} stages, {gmean[best]:.3f} "
            f"(the worst candidate {max(gmean.values()):.3f}): M3_SPARSE_DECODE_CONFIG={best[0]},{best[1]}"]
    return "\n".join(head + body + [""] + tail)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--ref-requests", type=int, default=2)
    ap.add_argument("--picks", type=int, default=3, help="autotuner picks to record at each batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (SGLang's Triton kernel)")
    if min(batches + contexts) < 1 or args.q_heads % args.kv_heads:
        ap.error("--batches and --contexts must be positive, --q-heads a multiple of --kv-heads")

    import triton

    sys.path.insert(0, str(ROOT / "tests" / "benchmarks"))
    from bench_score import copy_bandwidth

    from sglang_m3.sparse_attention import autotuner, pin_config, sparse_attention_decode

    tuner = autotuner("decode")
    pin_config("decode", None, tuner)
    candidates = [(c.num_warps, c.num_stages) for c in tuner.configs]
    copy_start = copy_bandwidth()
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    call = lambda req: sparse_attention_decode(**req)  # noqa: E731
    rows = []
    for batch in batches:
        for context in contexts:
            req = make_batch(batch, context, args.q_heads, args.kv_heads, args.head_dim, args.topk, gen)
            nbytes, want = bytes_read(req), references(req, args.ref_requests)
            first = None
            for warps, stages in candidates:
                pin_config("decode", f"{warps},{stages}", tuner)
                out = call(req)
                torch.cuda.synchronize()
                us = 1e3 * triton.testing.do_bench_cudagraph(lambda: call(req), rep=50, return_mode="median")
                first = out if first is None else first
                rows.append({"batch": batch, "context": context, "warps": warps, "stages": stages, "us": us,
                             "gbs": nbytes / us / 1e3, "pct_copy": 100 * nbytes / us / 1e3 / copy_start,
                             "in_l2": nbytes <= l2_bytes,
                             "equals_first": bool(torch.equal(out, first)),
                             "max_err": reference_error(out, want)})
            req = first = out = want = None  # this cell's tensors freed before the next one's
            torch.cuda.empty_cache()
    copy_end = copy_bandwidth()
    gmean, best = summarize(rows)

    # what a server does: the autotuner's own pick at each batch's bucket (a short context: the pick's key holds
    # no length)
    picks = {}
    pin_config("decode", None, tuner)
    for batch in batches:
        req = make_batch(batch, 1024, args.q_heads, args.kv_heads, args.head_dim, args.topk, gen)
        picks[batch] = []
        for _ in range(args.picks):
            tuner.cache.clear()
            call(req)
            picks[batch].append((tuner.best_config.num_warps, tuner.best_config.num_stages))

    text = render(rows, picks, gmean, best, (copy_start, copy_end), l2_bytes)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_sparse_decode.md").write_text(text + "\n")
        (args.out / "bench_sparse_decode.json").write_text(json.dumps(
            {"args": vars(args) | {"out": str(args.out)}, "rows": rows, "copy_gbs": [copy_start, copy_end],
             "l2_bytes": l2_bytes,
             "picks": {str(b): p for b, p in picks.items()}, "best": list(best),
             "gmean_x_fastest": {f"{w},{s}": g for (w, s), g in gmean.items()},
             "device": torch.cuda.get_device_name()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
