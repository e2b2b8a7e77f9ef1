"""Prefill block-scorer benchmark on one sm_90 GPU: the sm_90 scorer (``triton_sm90``) against today's
portable Triton scorer (``backends.triton``), fp8 and MXFP4 index caches.

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

Beside them (unless ``--no-peer``), scoring plus top-16 selection as a layer does it: SGLang's own MiniMax-M3
prefill indexer (``flash_prefill_with_topk_index``: bf16 index keys in token slots, index value off, scores and
top-k in one call, its query-block metadata made once outside) against ours (``plan_prefill`` once outside, as a
server plans once per batch; then ``score_prefill`` and ``select_blocks``) for bf16, fp8 and MXFP4, A-B-C-D-D-C-B-A.
The peer reads the same bf16 keys as our bf16 cache (its ``req_to_token`` points into our pages). Gate: every
selection passes ``m3_kernels.testing.selection_error`` against the scores it should follow (ours: the scores it
was given; the peer: our bf16 scores of the same keys, within ``2e-5 * bound``).

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

from bench_score import import_peer
from m3_kernels.formats import INIT_BLOCKS, LOCAL_BLOCKS, PAGE_SIZE, TOPK_BLOCKS, IndexKCache, IndexKFormat
from m3_kernels.ops.score import PrefillBatch, plan_prefill, score_prefill
from m3_kernels.ops.score.naive import score_prefill_ref
from m3_kernels.ops.select import select_blocks, visible_blocks
from m3_kernels.testing import (abs_index_k, assert_scores_close, capture_graph, make_q, q_abs, random_cache,
                                selection_error)

H, D = 4, 128
SM_SCALE = 0.125
FORMATS = {"fp8": IndexKFormat.FP8, "mxfp4": IndexKFormat.MXFP4}
PEER_FORMATS = {"bf16": IndexKFormat.BF16, **FORMATS}  # ours, scoring and selecting, beside the peer
PEER_MODULE = "sglang.kernels.ops.attention.minimax_sparse.prefill.flash_with_topk_idx"
PEER_UTILS = "sglang.kernels.ops.attention.minimax_sparse.common.utils"


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
        n_visible = visible_blocks(torch.arange(ctx - chunk, ctx, device="cuda"), PAGE_SIZE).int()
        out.append(dict(q=q, k_data=k_data, k_scale=k_scale, bt=bt, seq=seq, cu=cu, out=o, max_block=n_pages,
                        n_visible=n_visible))
    return out


def planned(fmt, s, k_data, k_scale, out, backend=None):
    """``(plan, cache)``: input set ``s``'s batch planned once over the cache views ``k_data``/``k_scale``;
    ``backend`` None is the auto choice (as served), ``"triton"`` today's portable scorer."""
    cache = IndexKCache(PEER_FORMATS[fmt], k_data, k_scale)
    plan = plan_prefill(cache, PrefillBatch(s["bt"], s["seq"], s["cu"], H, SM_SCALE, s["max_block"], out,
                                            cu_seqlens_host=s["cu"].tolist(), seq_lens_host=s["seq"].tolist()),
                        backend=backend)
    return plan, cache


def bound_scores(fmt, s):
    """The scores of ``|q|`` and ``|K|`` on input set ``s`` (today's Triton scorer): the error bound's scale."""
    plan, cache = planned(fmt, s, *abs_index_k(s["k_data"], s["k_scale"]), None, "triton")
    return score_prefill(plan, q_abs(s["q"]), cache)


def arm_call(kind, fmt, s, cfg=None):
    """A closure running one scorer call on input set ``s`` (plans and work maps made once, outside; the plan's
    bound run, so no host check is timed)."""
    cfg = cfg or {}
    plan, cache = planned(fmt, s, s["k_data"], s["k_scale"], s["out"], "triton" if kind == "today" else "triton_sm90")
    return lambda: plan.run(plan, s["q"], cache, s["out"], **cfg)


def ours_with_select(fmt, s):
    """Our layer step on input set ``s``: the planned scorer (auto backend, as served) then the selector."""
    plan, cache = planned(fmt, s, s["k_data"], s["k_scale"], s["out"])
    return lambda: select_blocks(score_prefill(plan, s["q"], cache, s["out"]), s["n_visible"])


def peer_call(peer, utils, s):
    """SGLang's indexer on input set ``s`` (bf16): its keys are our bf16 pages read through ``req_to_token``."""
    chunk, ctx = s["q"].shape[0], int(s["seq"][0])
    t = torch.arange(ctx, device="cuda")
    req_to_token = (s["bt"][0, t // PAGE_SIZE].long() * PAGE_SIZE + t % PAGE_SIZE).int().reshape(1, ctx)
    k_slots = s["k_data"].view(-1, 1, D)
    cu_blocks, max_blocks_q, all_blocks_q, *_ = utils.get_cu_seqblocks(s["cu"], chunk, 1, PAGE_SIZE)
    slot_ids = torch.zeros(1, dtype=torch.int32, device="cuda")
    prefix = s["seq"] - chunk
    return lambda: peer.flash_prefill_with_topk_index(
        q=s["q"], k_cache=k_slots, v_cache=None, sink=None, req_to_token=req_to_token, slot_ids=slot_ids,
        cu_seqlens=s["cu"], seq_lens=s["seq"], prefix_lens=prefix, max_seqlen_q=chunk, max_seqlen_k=ctx,
        block_size_q=1, block_size_k=PAGE_SIZE, topk=TOPK_BLOCKS, init_blocks=INIT_BLOCKS,
        local_blocks=LOCAL_BLOCKS, sm_scale=SM_SCALE, disable_index_value=True, cu_seqblocks_q=cu_blocks,
        max_seqblock_q=max_blocks_q, all_seqblock_q=all_blocks_q)[1]


def gate_selections(peer, utils, inputs):
    """Every arm's top-16 on the first input set (module docstring). Returns error strings."""
    errors, rule = [], (TOPK_BLOCKS, LOCAL_BLOCKS, INIT_BLOCKS)
    for fmt in PEER_FORMATS:
        s = inputs[fmt][0]
        picked = ours_with_select(fmt, s)()
        err = selection_error(picked, s["out"], s["n_visible"], 0.0, *rule)
        if err:
            errors.append(f"ours {fmt} + select: {err}")
    s = inputs["bf16"][0]
    want = s["out"].clone()  # our bf16 scores of the peer's keys (the loop above left them there)
    bound = bound_scores("bf16", s)
    call = peer_call(peer, utils, s)
    call()  # autotune outside any graph
    err = selection_error(call(), want, s["n_visible"], 2e-5 * bound, *rule)
    if err:
        errors.append(f"SGLang bf16: {err}")
    return errors


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
    plan, cache = planned(fmt, s, s["k_data"], s["k_scale"], None, "triton")
    want = score_prefill(plan, s["q"], cache)
    bound = bound_scores(fmt, s)
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
    cache = IndexKCache(FORMATS[fmt], k_data, k_scale)
    plan = plan_prefill(cache, PrefillBatch(bt, seq, cu, H, SM_SCALE, mb), backend="triton_sm90")
    got = plan.run(plan, q, cache, torch.empty(H, sum(new), mb, device="cuda"), **(cfg or {}))
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
    ap.add_argument("--no-peer", action="store_true", help="leave SGLang's prefill indexer out")
    args = ap.parse_args()
    assert args.replays >= 10
    gen = torch.Generator().manual_seed(int(os.environ.get("M3_BENCH_SEED", "1234")))
    dev = torch.cuda.get_device_name()
    log(f"device: {dev}, torch {torch.__version__}, chunk {args.chunk}, H={H}, sets {args.sets}, replays {args.replays}")
    peer = utils = None
    if not args.no_peer:
        try:
            peer, utils = import_peer(PEER_MODULE), import_peer(PEER_UTILS)
        except Exception as e:
            log(f"SGLang prefill indexer unavailable: {type(e).__name__}: {e}")
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
        inputs = {fmt: make_inputs(gen, fmt, ctx, chunk, args.sets) for fmt in (PEER_FORMATS if peer else FORMATS)}
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
        if peer is not None:
            for err in gate_selections(peer, utils, inputs):
                failed.append(f"ctx={ctx}: {err}")
                log(f"GATE FAILED: ctx={ctx}: {err}")
            calls = {("sglang", "bf16"): lambda s: peer_call(peer, utils, s)}
            calls.update({("sel", fmt): (lambda s, fmt=fmt: ours_with_select(fmt, s)) for fmt in PEER_FORMATS})
            pms = {a: [] for a in calls}
            for a in list(calls) + list(calls)[::-1]:
                pms[a].append(graph_ms([calls[a](s) for s in inputs[a[1]]], args.replays))
            for (kind, fmt), v in pms.items():
                row[f"{kind}_{fmt}_ms"] = sum(v) / 2
                row[f"{kind}_{fmt}_rounds_ms"] = v
            log(f"ctx {ctx}: " + ", ".join(f"{k}_{f} {sum(v) / 2:.3f} ms" for (k, f), v in pms.items()))
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
    if peer is not None:
        lines += ["", f"Scores plus top-{TOPK_BLOCKS} selection, same shapes: SGLang's M3 prefill indexer (bf16 keys) "
                  "against ours (planned scorer, auto backend, + selector); ms as above",
                  "",
                  "| ctx | SGLang bf16 ms | ours bf16 ms | ours fp8 ms | ours MXFP4 ms | SGLang / ours bf16 "
                  "| SGLang / ours fp8 | SGLang / ours MXFP4 |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in results:
            lines.append(f"| {r['ctx']} | {r['sglang_bf16_ms']:.3f} | {r['sel_bf16_ms']:.3f} | {r['sel_fp8_ms']:.3f} | "
                         f"{r['sel_mxfp4_ms']:.3f} | " + " | ".join(f"{r['sglang_bf16_ms'] / r[f'sel_{f}_ms']:.2f}x"
                                                               for f in PEER_FORMATS) + " |")
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
