"""SGLang's sparse prefill attention under each of its autotune candidates, at a model's prefill shape, on one GPU:
time per chunk, TFLOP/s, ratio to the fastest, whether each candidate's output equals the first's bit for bit and
its error against a float64 reference; then what the autotuner picks, several times over, on a server's 128-token
warm-up (the input a server's pick is made on).

    source lab/gpu/bundle_env.sh && python3 lab/gpu/bench_sparse_prefill.py [--contexts 8192,32768,131072]
        [--chunk 8192] [--q-heads 8] [--kv-heads 4] [--head-dim 128] [--topk 16] [--warmup-picks 5] [--out DIR]

One request per context: its last ``--chunk`` tokens extend a cached prefix (what chunked prefill runs), each row
attending its own block and ``topk - 1`` random earlier ones per KV head. The defaults are configs/msa-medium's
geometry (block 128). The last line names the candidate with the least time over the contexts, to hold with
``M3_SPARSE_PREFILL_CONFIG`` (sglang_m3/sparse_attention.py). ``--out`` gets the table as markdown and JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

BLOCK = 128  # M3's sparse block, the index cache's page


def select_blocks(own: torch.Tensor, n_blocks: int, hkv: int, topk: int, gen: torch.Generator,
                  dev: str = "cuda") -> torch.Tensor:
    """``topk_idx`` ``[hkv, rows, topk]`` int32 for rows whose own blocks are ``own`` ``[rows]``: each row's own
    block, then up to ``topk - 1`` distinct earlier ones drawn at random, descending, -1 after them (as the selector
    leaves a row that sees fewer than ``topk`` blocks)."""
    rows = own.shape[0]
    earlier = torch.rand(hkv, rows, n_blocks, generator=gen, device=dev)
    blocks = torch.arange(n_blocks, device=dev)
    earlier.masked_fill_(blocks >= own[:, None], -1.0)  # only blocks before the row's own
    score, pick = earlier.topk(min(topk - 1, n_blocks), dim=-1)
    pick = pick.int().masked_fill(score < 0, -1)
    pick = torch.nn.functional.pad(pick, (0, topk - 1 - pick.shape[-1]), value=-1)
    return torch.cat([own.int().expand(hkv, rows)[..., None], pick], dim=-1).sort(dim=-1, descending=True).values


def make_request(context: int, chunk: int, hq: int, hkv: int, d: int, topk: int, gen: torch.Generator,
                 dev: str = "cuda") -> dict:
    """The plugin's arguments for one request whose last ``chunk`` tokens extend a ``context``-token sequence,
    its rows' blocks from ``select_blocks``."""
    n = min(chunk, context)
    prefix = context - n
    positions = torch.arange(prefix, context, device=dev)
    sel = select_blocks(positions // BLOCK, -(-context // BLOCK), hkv, topk, gen, dev)
    return {
        "q": torch.randn(n, hq, d, generator=gen, device=dev).bfloat16(),
        "k_cache": torch.randn(context, hkv, d, generator=gen, device=dev).bfloat16(),
        "v_cache": torch.randn(context, hkv, d, generator=gen, device=dev).bfloat16(),
        "req_to_token": torch.arange(context, dtype=torch.int32, device=dev)[None],
        "req_pool_indices": torch.zeros(1, dtype=torch.int64, device=dev),
        "seq_lens": torch.tensor([context], device=dev),
        "prefix_lens": torch.tensor([prefix], device=dev),
        "cu_seqlens_q": torch.tensor([0, n], dtype=torch.int32, device=dev),
        "max_seqlen_q": n,
        "positions": positions,
        "topk_idx": sel,
        "block_size": BLOCK,
        "sm_scale": 1 / math.sqrt(d),
    }


def reference_error(req: dict, out: torch.Tensor, rows: int, gen: torch.Generator) -> float:
    """Largest |out - float64 reference| over ``rows`` random rows."""
    from m3_kernels.ops.attention.naive import sparse_attention_ref

    n = req["q"].shape[0]
    idx = torch.randperm(n, generator=gen)[:rows].sort().values
    sub = idx.to(req["q"].device)
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in req.items()}
    cu_rows = torch.tensor([0, len(idx)], dtype=torch.int32)
    want = sparse_attention_ref(cpu["q"][idx], cpu["k_cache"], cpu["v_cache"], cpu["req_to_token"],
                                cpu["req_pool_indices"], cpu["seq_lens"], cu_rows, cpu["positions"][idx],
                                cpu["topk_idx"][:, idx], BLOCK, req["sm_scale"])
    return float((out[sub].double().cpu() - want).abs().max())


def flops(req: dict) -> float:
    """QK and PV multiply-adds over the selected blocks (128 keys each, causal mask not subtracted), times 2."""
    hq, d = req["q"].shape[1], req["q"].shape[2]
    return 2 * 2 * float((req["topk_idx"] >= 0).sum()) / req["topk_idx"].shape[0] * BLOCK * hq * d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--ref-rows", type=int, default=32)
    ap.add_argument("--warmup-picks", type=int, default=5, help="autotuner picks on a 128-token warm-up to record")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (SGLang's Triton kernel)")
    if any(c < 1 for c in contexts) or args.chunk < 1 or args.q_heads % args.kv_heads:
        ap.error("--contexts and --chunk must be positive, --q-heads a multiple of --kv-heads")

    import triton
    from sglang_m3.sparse_attention import autotuner, pin_config, sparse_attention_extend

    tuner = autotuner("prefill")
    pin_config("prefill", None, tuner)
    candidates = [(c.num_warps, c.num_stages) for c in tuner.configs]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    cpu_gen = torch.Generator().manual_seed(args.seed)
    call = lambda req: sparse_attention_extend(**req)  # noqa: E731
    rows = []
    for context in contexts:
        req = make_request(context, args.chunk, args.q_heads, args.kv_heads, args.head_dim, args.topk, gen)
        first = None
        for warps, stages in candidates:
            pin_config("prefill", f"{warps},{stages}", tuner)
            out = call(req)
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(lambda: call(req), warmup=25, rep=200, return_mode="median")
            first = out if first is None else first
            rows.append({"context": context, "tokens": req["q"].shape[0], "warps": warps, "stages": stages, "ms": ms,
                         "tflops": flops(req) / ms / 1e9, "equals_first": bool(torch.equal(out, first)),
                         "max_err": reference_error(req, out, args.ref_rows, cpu_gen)})
        req = first = out = None  # this context's tensors freed before the next one's
        torch.cuda.empty_cache()
    fastest = {c: min(r["ms"] for r in rows if r["context"] == c) for c in contexts}
    total = {(w, s): sum(r["ms"] for r in rows if (r["warps"], r["stages"]) == (w, s)) for w, s in candidates}
    best = min(total, key=total.get)

    # what a server does: the autotuner's own pick, at its first call, on a 128-token warm-up
    picks = []
    pin_config("prefill", None, tuner)
    for _ in range(args.warmup_picks):
        tuner.cache.clear()
        call(make_request(128, 128, args.q_heads, args.kv_heads, args.head_dim, args.topk, gen))
        picks.append((tuner.best_config.num_warps, tuner.best_config.num_stages))

    head = ["| context | new tokens | warps, stages | ms | TFLOP/s | x fastest | equals the first | max abs err vs "
            "float64 |", "|---|---|---|---|---|---|---|---|"]
    body = [f"| {r['context']} | {r['tokens']} | {r['warps']}, {r['stages']} | {r['ms']:.3f} | {r['tflops']:.1f} | "
            f"{r['ms'] / fastest[r['context']]:.2f} | {'yes' if r['equals_first'] else 'no'} | {r['max_err']:.2e} |"
            for r in rows]
    tail = [f"Autotuner picks on a 128-token warm-up, {len(picks)} times: "
            + ", ".join(f"{w},{s}" for w, s in picks),
            f"Least time over the contexts: {best[0]} warps, {best[1]} stages, {total[best]:.3f} ms against "
            f"{max(total.values()):.3f} ms for the slowest: M3_SPARSE_PREFILL_CONFIG={best[0]},{best[1]}"]
    text = "\n".join(head + body + [""] + tail)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_sparse_prefill.md").write_text(text + "\n")
        (args.out / "bench_sparse_prefill.json").write_text(json.dumps(
            {"args": vars(args) | {"out": str(args.out)}, "rows": rows, "warmup_picks": picks,
             "best": list(best), "device": torch.cuda.get_device_name()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
