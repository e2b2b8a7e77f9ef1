"""Prefill block-scorer benchmark on one sm_90 GPU: the sm_90 scorer (``triton_sm90``) against today's
portable Triton scorer (``triton.score_prefill_triton``), fp8 and MXFP4 index caches.

    python tests/benchmarks/bench_prefill.py [--out DIR] [--ctx 8192,16384,...] [--chunk 8192] [--sweep]

Shape: the last chunk of one prompt (batch 1): ``chunk`` new tokens at positions ``ctx - chunk .. ctx - 1``,
H=4 index heads, dim 128, ``max_block = ctx / 128``; page ids a random permutation of a pool.

Method: each arm is captured once in a CUDA graph holding R calls over R independent input sets (q,
cache, block table, out), replayed ``--replays`` times (>= 10); the median replay time over R is
reported. Per context the arms run in the order A B C D D C B A (today fp8, today MXFP4, sm_90 fp8,
sm_90 MXFP4, then reversed) and the mean of the two rounds is reported. TFLOP/s counts 2 * 128 * 128
FLOP per (query vector, visible page). Before any timing every arm is checked: the sm_90 arms against
the float64 reference at a small shape, and every arm against today's Triton scorer on the benchmark's
own inputs (``|a - b| <= 2e-5 * bound``, bound the score of |q| and |K|, -inf pattern equal, no NaN);
a failure prints ``GATE FAILED`` and the run exits non-zero after the table.

``--sweep`` first times the sm_90 kernel's launch settings (tokens per product, pages per program,
pipeline stages, register cap, the MXFP4 ``mx_join`` path) at two contexts and uses the fastest per format
for the table (gated against the oracle first); without it the table uses ``DEFAULT_LAUNCH``.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

from m3_kernels.formats import PAGE_SIZE, IndexKCache, IndexKFormat
from m3_kernels.ops.score import plan_prefill, triton_sm90
from m3_kernels.ops.score.naive import score_prefill_ref
from m3_kernels.ops.score.triton import score_prefill_triton
from m3_kernels.testing import abs_index_k, assert_scores_close, capture_graph, make_q, q_abs, random_cache

H, D = 4, 128
SM_SCALE = 0.125
FORMATS = {"fp8": IndexKFormat.FP8, "mxfp4": IndexKFormat.MXFP4}


def log(*a):
    print(*a, flush=True)


def make_inputs(gen, fmt, ctx, chunk, sets):
    """``sets`` independent input sets of the shape (module docstring)."""
    n_pages = ctx // PAGE_SIZE
    out = []
    for _ in range(sets):
        k_data, k_scale = random_cache(gen, fmt, n_pages + 8, "cuda")
        bt = torch.randperm(n_pages + 8, generator=gen)[:n_pages].int().reshape(1, n_pages).cuda()
        seq = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        cu = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
        q = make_q(gen, chunk, H, torch.bfloat16, "cuda")
        o = torch.empty(H, chunk, n_pages, device="cuda")
        out.append(dict(q=q, k_data=k_data, k_scale=k_scale, bt=bt, seq=seq, cu=cu, out=o, max_block=n_pages))
    return out


def today(fmt, s, q, k_data, k_scale, out):
    """Today's portable Triton scorer, planned once (``plan_prefill(backend="triton")``): ``(plan, cache)``."""
    cache = IndexKCache(FORMATS[fmt], k_data, k_scale)
    plan = plan_prefill(cache, s["bt"], s["seq"], s["cu"], H, SM_SCALE, s["max_block"], out,
                        cu_seqlens_host=s["cu"].tolist(), seq_lens_host=s["seq"].tolist(), backend="triton")
    return plan, cache


def arm_call(kind, fmt, s, cfg=None):
    """A closure running one scorer call on input set ``s`` (work maps made once, outside)."""
    f = FORMATS[fmt]
    if kind == "today":
        plan, cache = today(fmt, s, s["q"], s["k_data"], s["k_scale"], s["out"])
        return lambda: score_prefill_triton(plan, s["q"], cache, s["out"])
    cfg = cfg or {}
    tiles = triton_sm90.prefill_tiles_device(s["cu"], H, triton_sm90.max_prefill_tiles(s["q"].shape[0], 1, H))
    return lambda: triton_sm90.score_prefill_sm90(s["q"], s["k_data"], s["k_scale"], f, s["bt"], s["seq"], s["cu"],
                                                  SM_SCALE, s["max_block"], s["out"], tiles=tiles, **cfg)


def graph_ms(fns, replays):
    """Median ms of one call: a CUDA graph of all ``fns`` (one per input set), replayed ``replays`` times."""
    graph = capture_graph(lambda: [f() for f in fns])
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / len(fns))
    return statistics.median(times)


def flops(ctx, chunk):
    pos = torch.arange(ctx - chunk, ctx, dtype=torch.int64)
    pages = (pos // PAGE_SIZE + 1).sum().item()
    return 2 * D * PAGE_SIZE * H * pages


def gate_vs_today(fmt, s, cfg):
    """The sm_90 arm against today's Triton scorer on benchmark inputs: both are within 1e-5 * bound of
    the exact score, so within 2e-5 * bound of each other. Returns an error string or ''."""
    plan, cache = today(fmt, s, s["q"], s["k_data"], s["k_scale"], None)
    want = score_prefill_triton(plan, s["q"], cache)
    ka, sa = abs_index_k(s["k_data"], s["k_scale"])
    plan_abs, cache_abs = today(fmt, s, q_abs(s["q"]), ka, sa, None)
    bound = score_prefill_triton(plan_abs, q_abs(s["q"]), cache_abs)
    s["out"].fill_(float("nan"))
    arm_call("sm90", fmt, s, cfg)()
    got = s["out"]
    if torch.isnan(got).any():
        return "NaN in scores (or unwritten)"
    if not torch.equal(torch.isneginf(got), torch.isneginf(want)):
        return "-inf pattern differs from today's scorer"
    fin = torch.isfinite(want)
    worst = ((got[fin] - want[fin]).abs() / (2e-5 * bound[fin] + 1e-30)).max().item()
    return "" if worst <= 1.0 else f"error {worst:.3g} x tolerance against today's scorer"


def gate_vs_oracle(gen, fmt, cfg):
    """The sm_90 arm against the float64 reference at a small shape (two requests, radix prefix)."""
    new, prefix = [300, 77], [1000, 129]
    mb = 11
    k_data, k_scale = random_cache(gen, fmt, 2 * mb + 1, "cuda")
    bt = torch.randperm(2 * mb + 1, generator=gen)[: 2 * mb].int().reshape(2, mb).cuda()
    seq = torch.tensor([p + n for p, n in zip(prefix, new)], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, new[0], sum(new)], dtype=torch.int32, device="cuda")
    q = make_q(gen, sum(new), H, torch.bfloat16, "cuda")
    got = triton_sm90.score_prefill_sm90(q, k_data, k_scale, FORMATS[fmt], bt, seq, cu, SM_SCALE, mb, **(cfg or {}))
    kc, ks = k_data.cpu(), (k_scale.cpu() if k_scale is not None else None)
    args = (bt.cpu(), seq.cpu(), cu.cpu(), SM_SCALE, mb)
    try:
        assert_scores_close(got, score_prefill_ref(q.cpu(), kc, ks, *args),
                            score_prefill_ref(q_abs(q.cpu()), *abs_index_k(kc, ks), *args))
    except AssertionError as e:
        return f"against the float64 reference: {e}"
    return ""


def sweep(gen, args):
    """Time the sm_90 launch settings; returns the fastest per format."""
    configs = [dict(tn=128, num_stages=3, pp=64, maxnreg=None), dict(tn=64, num_stages=3, pp=32, maxnreg=128),
               dict(tn=64, num_stages=4, pp=32, maxnreg=128), dict(tn=64, num_stages=3, pp=64, maxnreg=128),
               dict(tn=64, num_stages=3, pp=32, maxnreg=128, mx_join=True),
               dict(tn=128, num_stages=3, pp=64, maxnreg=None, mx_join=True)]
    best, rows = {}, []
    for fmt in FORMATS:
        totals = {i: 0.0 for i in range(len(configs))}
        for ctx in (32768, 131072):
            sets = make_inputs(gen, fmt, ctx, args.chunk, args.sets)
            for i, cfg in enumerate(configs):
                try:
                    ms = graph_ms([arm_call("sm90", fmt, s, cfg) for s in sets], args.replays)
                except Exception as e:  # a setting that does not compile or launch is skipped, said so
                    log(f"sweep {fmt} ctx={ctx} {cfg}: failed: {type(e).__name__}: {str(e)[:200]}")
                    totals[i] = float("inf")
                    continue
                totals[i] += ms
                rows.append(dict(fmt=fmt, ctx=ctx, **cfg, ms=ms, tflops=flops(ctx, args.chunk) / ms / 1e9))
                log(f"sweep {fmt:6s} ctx={ctx:6d} {cfg}: {ms:8.3f} ms {rows[-1]['tflops']:6.0f} TFLOP/s")
            del sets
            torch.cuda.empty_cache()
        best[fmt] = configs[min(totals, key=totals.get)]
        log(f"sweep: {fmt} best {best[fmt]}")
    return best, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--ctx", default="8192,16384,32768,65536,131072")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--sets", type=int, default=2, help="independent input sets per graph")
    ap.add_argument("--replays", type=int, default=15)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    assert args.replays >= 10
    gen = torch.Generator().manual_seed(int(os.environ.get("M3_BENCH_SEED", "1234")))
    dev = torch.cuda.get_device_name()
    log(f"device: {dev}, torch {torch.__version__}, chunk {args.chunk}, H={H}, sets {args.sets}, replays {args.replays}")
    failed = []
    cfgs = {fmt: None for fmt in FORMATS}
    for fmt in FORMATS:
        err = gate_vs_oracle(gen, fmt, None)
        if err:
            failed.append(f"sm90 {fmt} (oracle): {err}")
            log(f"GATE FAILED: sm90 {fmt}: {err}")
    sweep_rows = []
    if args.sweep:
        cfgs, sweep_rows = sweep(gen, args)
        for fmt in FORMATS:
            err = gate_vs_oracle(gen, fmt, cfgs[fmt])
            if err:
                failed.append(f"sm90 {fmt} {cfgs[fmt]} (oracle): {err}")
                log(f"GATE FAILED: sm90 {fmt} {cfgs[fmt]}: {err}")
    results = []
    for ctx in [int(c) for c in args.ctx.split(",")]:
        chunk = min(args.chunk, ctx)
        inputs = {fmt: make_inputs(gen, fmt, ctx, chunk, args.sets) for fmt in FORMATS}
        for fmt in FORMATS:
            err = gate_vs_today(fmt, inputs[fmt][0], cfgs[fmt])
            if err:
                failed.append(f"sm90 {fmt} ctx={ctx}: {err}")
                log(f"GATE FAILED: sm90 {fmt} ctx={ctx}: {err}")
        arms = [("today", "fp8"), ("today", "mxfp4"), ("sm90", "fp8"), ("sm90", "mxfp4")]
        ms = {a: [] for a in arms}
        for a in arms + arms[::-1]:
            kind, fmt = a
            ms[a].append(graph_ms([arm_call(kind, fmt, s, cfgs[fmt]) for s in inputs[fmt]], args.replays))
        fl = flops(ctx, chunk)
        row = dict(ctx=ctx, chunk=chunk)
        for (kind, fmt), v in ms.items():
            row[f"{kind}_{fmt}_ms"] = sum(v) / 2
            row[f"{kind}_{fmt}_rounds_ms"] = v
            row[f"{kind}_{fmt}_tflops"] = fl / (sum(v) / 2) / 1e9
        results.append(row)
        log(f"ctx {ctx}: " + ", ".join(f"{k}_{f} {sum(v) / 2:.3f} ms" for (k, f), v in ms.items()))
        del inputs
        torch.cuda.empty_cache()

    lines = [f"Prefill scorer, chunk {args.chunk} new tokens (batch 1, H={H}, dim 128), {dev}; ms = median graph "
             f"replay / {args.sets} calls, mean of A-B-B-A rounds; TFLOP/s = 2*128*128 per (query vector, visible page)",
             "",
             "| ctx | today fp8 ms | today MXFP4 ms | sm90 fp8 ms | sm90 MXFP4 ms | sm90 fp8 TFLOP/s | sm90 MXFP4 TFLOP/s "
             "| today fp8 TFLOP/s | MXFP4/fp8 (sm90) | MXFP4/fp8 (today) | sm90/today fp8 speed-up | sm90/today MXFP4 speed-up |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(
            f"| {r['ctx']} | {r['today_fp8_ms']:.3f} | {r['today_mxfp4_ms']:.3f} | {r['sm90_fp8_ms']:.3f} | "
            f"{r['sm90_mxfp4_ms']:.3f} | {r['sm90_fp8_tflops']:.0f} | {r['sm90_mxfp4_tflops']:.0f} | "
            f"{r['today_fp8_tflops']:.0f} | {r['sm90_mxfp4_ms'] / r['sm90_fp8_ms']:.2f} | "
            f"{r['today_mxfp4_ms'] / r['today_fp8_ms']:.2f} | {r['today_fp8_ms'] / r['sm90_fp8_ms']:.2f} | "
            f"{r['today_mxfp4_ms'] / r['sm90_mxfp4_ms']:.2f} |")
    if failed:
        lines.append("")
        lines += [f"GATE FAILED: {f}" for f in failed]
    table = "\n".join(lines)
    log("\n" + table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_prefill.md"), "w") as fh:
            fh.write(table + "\n")
        with open(os.path.join(args.out, "bench_prefill.json"), "w") as fh:
            json.dump(dict(device=dev, torch=torch.__version__, chunk=args.chunk, H=H, sets=args.sets,
                           replays=args.replays, date=time.strftime("%Y-%m-%d"), configs=cfgs, sweep=sweep_rows,
                           results=results, gate_failed=failed), fh, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
