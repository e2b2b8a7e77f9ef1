"""Decode scorer + top-16 benchmark on one GPU: fp8 (Triton) vs MXFP4 index caches (the CUDA kernel
and the portable Triton one) against SGLang 0.5.16's own MiniMax-M3 decode scorer + top-k (bf16
index K), plus index-cache writer throughput.

    python tests/benchmarks/bench_score.py [--out DIR] [--quick] [--no-peer] [--baseline-cuh FILE]

``--baseline-cuh`` builds a second CUDA module from another revision of ``decode_mxfp4.cuh`` (e.g.
``git show REV:kernels/m3_kernels/ops/score/backends/cuda/decode_mxfp4.cuh > build/base.cuh``) and
times it beside the current one, A-B-B-A, in the columns "MXFP4 base".

Method: every arm is captured once in a CUDA graph holding R calls over R disjoint regions of a
page pool far larger than the L2 (R up to 8, fewer when a call's pages fill the pool); the graph
is replayed at least 25 times and the median replay time divided by R is reported. fp8 and MXFP4
(CUDA) run in the order A-B-B-A and the mean of the two rounds is reported. Bandwidth is the cache
bytes one call must read (pages x 128 x bytes per token), and "% copy" compares it with a
device-to-device copy measured in the same process (bytes read + written over time; the best of
several graph-timed rounds after a warm-up, at the start and again at the end of the run). Every
arm's scores for one request are checked against the torch reference before any number is printed.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
import types

import torch

from m3_kernels.formats import (
    FP8_DTYPE,
    INDEX_DIM,
    MXFP4_PAGE_BYTES,
    PAGE_SIZE,
    TOPK_BLOCKS,
    IndexKCache,
    IndexKFormat,
    mxfp4_page_views,
)
from m3_kernels.ops.score import DecodeBatch, plan_decode
from m3_kernels.ops.score.backends import cuda as cuda_backend
from m3_kernels.ops.score.backends import triton as triton_backend
from m3_kernels.ops.score.naive import score_decode_ref
from m3_kernels.ops.select.triton import select_blocks_triton
from m3_kernels.ops.write.triton import write_index_k_triton

POOL_PAGES = 300_000  # 2.6 GB MXFP4, 4.9 GB fp8, 9.8 GB bf16: far past the 60 MB L2
MAX_REGIONS = 8
REPLAYS = 25
SEED_CELLS = [(4, 1, b, c) for b in (8, 16, 32) for c in (32768, 100000, 131072)]
EXTRA_CELLS = [(4, 1, b, c) for b in (64, 128) for c in (32768, 100000, 131072)] + [
    (1, 4, b, c) for b in (8, 32, 128) for c in (32768, 131072)
]


def log(*a):
    print(*a, flush=True)


def graph_time_us(fns, replays=REPLAYS):
    """Median over ``replays`` of one graph replay holding every call in ``fns``, per call (us)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(fns))
    del graph
    return statistics.median(times)


def copy_bandwidth(rounds=5):
    """Device-to-device copy bandwidth, GB/s of (bytes read + written): the best of a graph-timed
    elementwise copy kernel and an event-timed eager ``copy_``, each over ``rounds`` rounds on 1 GiB
    buffers after about a second of warm-up copies. (A ``copy_`` captured in a CUDA graph becomes a
    memcpy node that read 2.7 TB/s on an H200 whose kernels copy at 4.2-4.3 TB/s.)"""
    n = 1024**3  # bytes per buffer
    src = torch.randn(n // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    t_end = time.time() + 1.0
    while time.time() < t_end:
        for _ in range(8):
            torch.mul(src, 1.0, out=dst)
        torch.cuda.synchronize()
    kernel_us = min(graph_time_us([lambda: torch.mul(src, 1.0, out=dst)] * 4) for _ in range(rounds))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    eager_us = []
    for _ in range(rounds):
        start.record()
        for _ in range(4):
            dst.copy_(src)
        end.record()
        end.synchronize()
        eager_us.append(start.elapsed_time(end) * 1000.0 / 4)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (min(kernel_us, min(eager_us)) * 1e-6) / 1e9


def import_peer(module="sglang.kernels.ops.attention.minimax_sparse.decode.flash_with_topk_idx"):
    """SGLang's M3 indexer ``module`` (default: its decode scorer) without running sglang/__init__ (which imports
    the server)."""
    import importlib
    import importlib.util

    if "sglang" not in sys.modules:  # else SGLang, or these stand-ins from an earlier call, is there already
        spec = importlib.util.find_spec("sglang")
        if spec is None:
            raise ImportError("sglang is not installed")
        root = list(spec.submodule_search_locations)[0]
        for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention"):
            mod = types.ModuleType(name)
            mod.__path__ = [os.path.join(root, *name.split(".")[1:])]
            sys.modules[name] = mod
    return importlib.import_module(module)


class Pools:
    def __init__(self, pages, peer):
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.pages = pages
        region = torch.empty(pages, MXFP4_PAGE_BYTES, dtype=torch.uint8, device="cuda")
        region.random_(0, 256, generator=gen)
        self.mx_data, self.mx_scale = mxfp4_page_views(region)
        self.mx_scale.random_(122, 128, generator=gen)  # e8m0 in [122, 127], as the seed
        fp8 = torch.empty(pages, PAGE_SIZE, INDEX_DIM, dtype=torch.uint8, device="cuda")
        for i in range(0, pages, 16384):
            chunk = fp8[i : i + 16384].random_(0, 256, generator=gen)
            chunk.sub_(((chunk & 0x7F) == 0x7F).to(torch.uint8))  # no NaN code
        self.fp8 = fp8.view(FP8_DTYPE)
        self.bf16 = None
        if peer:
            self.bf16 = torch.empty(pages * PAGE_SIZE, 1, INDEX_DIM, dtype=torch.bfloat16, device="cuda")
            for i in range(0, pages * PAGE_SIZE, 1 << 22):
                self.bf16[i : i + (1 << 22)].normal_(generator=gen)
        self.perm = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32)
        self.caches = {IndexKFormat.MXFP4: IndexKCache("mxfp4", self.mx_data, self.mx_scale),
                       IndexKFormat.FP8: IndexKCache("fp8", self.fp8)}

    def cache(self, fmt) -> IndexKCache:
        """The ``IndexKCache`` over this pool's pages of ``fmt``'s storage (mxfp4_rot: the MXFP4 pages)."""
        if fmt.is_mxfp4:
            return IndexKCache(fmt, self.mx_data, self.mx_scale) if fmt.is_rotated else self.caches[IndexKFormat.MXFP4]
        return self.caches[fmt]


def check_against_ref(scores, q, k_cache, k_scale, bt, seq_lens, S, sm_scale, name):
    """Request 0's scores against the float64 torch reference (CPU copy of its pages)."""
    npg = bt.shape[1]
    pages = bt[0].long()
    kc = k_cache[pages].cpu()
    ks = k_scale[pages].cpu() if k_scale is not None else None
    ref = score_decode_ref(q[:S].cpu(), kc, ks, torch.arange(npg, dtype=torch.int32)[None], seq_lens[:1].cpu(), S,
                           sm_scale)
    got = scores[:, :S].double().cpu()
    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(got)):
        raise AssertionError(f"{name}: -inf pattern differs from the reference")
    err = ((got[fin] - ref[fin]).abs().max() / ref[fin].abs().max().clamp_min(1e-30)).item()
    if not err < 1e-5:
        raise AssertionError(f"{name}: relative error {err:.3g} against the reference")
    return err


def bench_cell(pools, peer, S, H, B, ctx, copy_gbs, sm_scale=0.088, peer_max_batch=32, base=None):
    npg = math.ceil(ctx / PAGE_SIZE)
    need = B * npg
    regions = max(1, min(MAX_REGIONS, pools.pages // need))
    gen = torch.Generator(device="cuda").manual_seed(B * 7 + ctx)
    bts = [pools.perm[r * need : (r + 1) * need].reshape(B, npg).contiguous() for r in range(regions)]
    seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(B * S, H, INDEX_DIM, device="cuda", generator=gen).to(torch.bfloat16)
    q8 = q.float().clamp(-448, 448).to(FP8_DTYPE)
    outs = [torch.empty(H, B * S, npg, dtype=torch.float32, device="cuda") for _ in range(regions)]
    sel = [torch.empty(H, B * S, TOPK_BLOCKS, dtype=torch.int32, device="cuda") for _ in range(regions)]
    pos = (seq.long()[:, None] - S + torch.arange(S, device="cuda")).flatten()
    nvis = (pos // PAGE_SIZE + 1).to(torch.int32)

    plans = {}

    def scorer(fmt, qq, r, with_select=False, kernel="triton", pdl=None, sel_warps=None):
        """One call (scorer, then the selector if asked) on region r; ``pdl`` None = the default (M3_PDL)."""
        cache = pools.cache(fmt)
        backend = "cuda" if kernel in ("cuda", "base") else "triton"
        if kernel != "none" and (r, fmt, backend) not in plans:  # planned (validated) once, outside the graph
            plans[r, fmt, backend] = plan_decode(cache, DecodeBatch(bts[r], seq, S, H, sm_scale, npg, outs[r]),
                                                 backend=backend)

        def f():
            if kernel in ("cuda", "base"):  # the baseline build is launched as the current one is
                cuda_backend.run(plans[r, fmt, backend], qq, cache, outs[r], module=base if kernel == "base" else None,
                                 pdl=pdl)
            elif kernel == "triton":
                triton_backend.run(plans[r, fmt, backend], qq, cache, outs[r], pdl=pdl)
            if with_select:
                select_blocks_triton(outs[r], nvis, TOPK_BLOCKS, 1, 0, out=sel[r], pdl=pdl, num_warps=sel_warps)

        return f

    def timed(fmt, qq=q, **kw):
        return graph_time_us([scorer(fmt, qq, r, **kw) for r in range(regions)])

    res = {"S": S, "H": H, "B": B, "ctx": ctx, "regions": regions, "gate": "pass"}
    # Correctness gate on request 0 of region 0 for each of our arms.
    arms = [(IndexKFormat.FP8, q, "fp8", "triton"), (IndexKFormat.MXFP4, q, "mxfp4_triton", "triton"),
            (IndexKFormat.MXFP4, q, "mxfp4", "cuda"), (IndexKFormat.MXFP4, q8, "mxfp4_e4m3q", "cuda")]
    if base is not None:
        arms.append((IndexKFormat.MXFP4, q, "mxfp4_base", "base"))
    for fmt, qq, name, kernel in arms:
        outs[0].fill_(float("nan"))
        scorer(fmt, qq, 0, kernel=kernel)()
        kc, ks = pools.cache(fmt).views()
        try:
            res[f"{name}_err"] = check_against_ref(outs[0], qq, kc, ks, bts[0], seq, S, sm_scale, name)
        except AssertionError as e:
            log(f"GATE FAILED S{S} H{H} B{B} ctx{ctx}: {e}")
            res["gate"] = f"FAILED {name}"
    order = ("fp8", "mxfp4", "mxfp4_base", "mxfp4_base", "mxfp4", "fp8") if base is not None else (
        "fp8", "mxfp4", "mxfp4", "fp8")  # A-B-B-A (A-B-C-C-B-A)
    kernels = {"fp8": (IndexKFormat.FP8, "triton"), "mxfp4": (IndexKFormat.MXFP4, "cuda"),
               "mxfp4_base": (IndexKFormat.MXFP4, "base")}
    rounds = {name: [] for name in order}
    for name in order:
        fmt, kernel = kernels[name]
        rounds[name].append(timed(fmt, kernel=kernel))
    for name in rounds:
        res[f"{name}_us"] = statistics.mean(rounds[name])
    res["spread"] = max(abs(a - b) / min(a, b) for a, b in rounds.values())
    res["mxfp4_triton_us"] = timed(IndexKFormat.MXFP4)
    res["mxfp4_e4m3q_us"] = timed(IndexKFormat.MXFP4, q8, kernel="cuda")
    res["fp8_sel_us"] = timed(IndexKFormat.FP8, with_select=True)
    res["mxfp4_sel_us"] = timed(IndexKFormat.MXFP4, with_select=True, kernel="cuda")
    # The same launches with programmatic dependent launch (ops.pdl, opt-in), for the record.
    res["fp8_pdl_us"] = timed(IndexKFormat.FP8, pdl=True)
    res["mxfp4_pdl_us"] = timed(IndexKFormat.MXFP4, kernel="cuda", pdl=True)
    res["mxfp4_sel_pdl_us"] = timed(IndexKFormat.MXFP4, with_select=True, kernel="cuda", pdl=True)
    for name, warps in (("select", None), ("select_1w", 1), ("select_4w", 4)):
        res[f"{name}_us"] = timed(IndexKFormat.MXFP4, with_select=True, kernel="none", sel_warps=warps)
    tokens = B * npg * PAGE_SIZE
    for name, tb in (("fp8", IndexKFormat.FP8.token_bytes), ("mxfp4", IndexKFormat.MXFP4.token_bytes)):
        res[f"{name}_gbs"] = tokens * tb / (res[f"{name}_us"] * 1e-6) / 1e9
        res[f"{name}_pct"] = 100 * res[f"{name}_gbs"] / copy_gbs
        res[f"{name}_floor_us"] = tokens * tb / (copy_gbs * 1e9) * 1e6
    res["ratio"] = res["mxfp4_us"] / res["fp8_us"]
    if base is not None:
        res["vs_base"] = res["mxfp4_us"] / res["mxfp4_base_us"]
    mx_bytes = tokens * IndexKFormat.MXFP4.token_bytes
    res["mxfp4_triton_pct"] = 100 * mx_bytes / (res["mxfp4_triton_us"] * 1e-6) / 1e9 / copy_gbs
    if peer is not None and B <= peer_max_batch:
        try:
            res.update(bench_peer(peer, pools, bts, q, B, S, H, ctx, sm_scale))
        except Exception as e:
            if os.environ.get("SGLANG_OPT_USE_MINIMAX_DECODE_TOPK_RADIX") == "0":
                raise
            log(f"SGLang JIT top-k failed ({type(e).__name__}: {e}); using its Triton top-k from here on"[:400])
            os.environ["SGLANG_OPT_USE_MINIMAX_DECODE_TOPK_RADIX"] = "0"
            res.update(bench_peer(peer, pools, bts, q, B, S, H, ctx, sm_scale))
        res["peer_topk"] = "jit" if os.environ.get("SGLANG_OPT_USE_MINIMAX_DECODE_TOPK_RADIX") != "0" else "triton"
    if "peer_us" in res:
        res["peer_pct"] = 100 * tokens * IndexKFormat.BF16.token_bytes / (res["peer_us"] * 1e-6) / 1e9 / copy_gbs
        res["speedup_mxfp4_sel"] = res["peer_us"] / res["mxfp4_sel_us"]
    return res


def bench_peer(peer, pools, bts, q, B, S, H, ctx, sm_scale):
    """SGLang's flash_decode_with_topk_idx (score + top-16, bf16 K): the S*H query vectors of a
    request are its index heads over one shared K head (gqa group S*H)."""
    qp = q.reshape(B, S * H, INDEX_DIM).contiguous()
    slot_ids = torch.arange(B, dtype=torch.int32, device="cuda")
    seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    o_t = torch.arange(PAGE_SIZE, dtype=torch.int32, device="cuda")
    r2ts = [(bt[:, :, None] * PAGE_SIZE + o_t).reshape(B, -1)[:, :ctx].contiguous() for bt in bts]

    def call(r):
        return lambda: peer.flash_decode_with_topk_idx(
            qp, None, pools.bf16, None, r2ts[r], seq, ctx, slot_ids, PAGE_SIZE, TOPK_BLOCKS, 0, 1,
            sm_scale=sm_scale, disable_index_value=True)

    t0 = time.time()
    call(0)()  # autotune outside the graph
    torch.cuda.synchronize()
    return {"peer_us": graph_time_us([call(r) for r in range(len(bts))]), "peer_tune_s": time.time() - t0}


def bench_writer(pools, copy_gbs, tokens=32768, sets=8):
    """Index-cache writer: fp32 K [tokens, 128] to random slots; graph of ``sets`` disjoint inputs."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    ks = [torch.randn(tokens, INDEX_DIM, device="cuda", generator=gen) for _ in range(sets)]
    slots = pools.perm[: tokens * sets // PAGE_SIZE + 1].long()
    locs = [(slots[i * tokens // PAGE_SIZE : (i + 1) * tokens // PAGE_SIZE, None] * PAGE_SIZE
             + torch.arange(PAGE_SIZE, device="cuda")).flatten()[:tokens] for i in range(sets)]
    rows = []
    bf16_cache = pools.bf16.view(pools.pages, PAGE_SIZE, INDEX_DIM) if pools.bf16 is not None else None
    for fmt in (IndexKFormat.BF16, IndexKFormat.FP8, IndexKFormat.MXFP4, IndexKFormat.MXFP4_ROT):
        if fmt is IndexKFormat.BF16:
            if bf16_cache is None:
                continue
            cache = IndexKCache(fmt, bf16_cache)
        else:
            cache = pools.cache(fmt)
        t = graph_time_us([lambda i=i: write_index_k_triton(cache, ks[i], locs[i]) for i in range(sets)])
        moved = tokens * (4 * INDEX_DIM + 8 + fmt.token_bytes)
        rows.append({"fmt": fmt.value, "us": t, "mtok_s": tokens / t, "gbs": moved / (t * 1e-6) / 1e9,
                     "pct": 100 * moved / (t * 1e-6) / 1e9 / copy_gbs})
    return rows


COLUMNS = [  # (header, format of one result row)
    ("shape", lambda r: f"S{r['S']} H{r['H']}" + ("" if r["gate"] == "pass" else f" (gate {r['gate']})")),
    ("B", lambda r: f"{r['B']}"), ("ctx", lambda r: f"{r['ctx']}"),
    ("fp8 us", lambda r: f"{r['fp8_us']:.1f}"), ("fp8 % copy", lambda r: f"{r['fp8_pct']:.0f}%"),
    ("MXFP4 us", lambda r: f"{r['mxfp4_us']:.1f}"), ("MXFP4 % copy", lambda r: f"{r['mxfp4_pct']:.0f}%"),
    ("MXFP4 floor us", lambda r: f"{r['mxfp4_floor_us']:.1f}"), ("MXFP4/fp8", lambda r: f"{r['ratio']:.2f}"),
    ("fp8 PDL us", lambda r: f"{r['fp8_pdl_us']:.1f}"), ("MXFP4 PDL us", lambda r: f"{r['mxfp4_pdl_us']:.1f}"),
    ("MXFP4/fp8 PDL", lambda r: f"{r['mxfp4_pdl_us'] / r['fp8_pdl_us']:.2f}"),
    ("MXFP4 Triton us", lambda r: f"{r['mxfp4_triton_us']:.1f}"),
    ("MXFP4 e4m3-Q us", lambda r: f"{r['mxfp4_e4m3q_us']:.1f}"),
    ("select us", lambda r: f"{r['select_us']:.1f}"), ("select 1-warp us", lambda r: f"{r['select_1w_us']:.1f}"),
    ("select 4-warp us", lambda r: f"{r['select_4w_us']:.1f}"), ("fp8+sel us", lambda r: f"{r['fp8_sel_us']:.1f}"),
    ("MXFP4+sel us", lambda r: f"{r['mxfp4_sel_us']:.1f}"),
    ("MXFP4+sel PDL us", lambda r: f"{r['mxfp4_sel_pdl_us']:.1f}"),
    ("SGLang us", lambda r: f"{r['peer_us']:.1f}" if "peer_us" in r else "-"),
    ("SGLang / MXFP4+sel", lambda r: f"{r['speedup_mxfp4_sel']:.2f}x" if "peer_us" in r else "-"),
    ("MXFP4 base us", lambda r: f"{r['mxfp4_base_us']:.1f}" if "vs_base" in r else "-"),
    ("MXFP4/base", lambda r: f"{r['vs_base']:.3f}" if "vs_base" in r else "-"),
]


def table(results, writer, copy_gbs, header, copy_note=""):
    lines = [header, "", f"Copy bandwidth measured in this run: {copy_gbs / 1000:.2f} TB/s (read + write){copy_note}.",
             "", "MXFP4 = the CUDA kernel (backends/cuda); MXFP4 Triton = the portable fallback; fp8 = Triton. "
             "+sel: with the MSA top-16 selection (Triton) in the same graph. PDL columns: launched with programmatic "
             "dependent launch (ops.pdl, opt-in), the others as served by default; select: the selector alone "
             "(default warps, 1, 4).", ""]
    lines.append("| " + " | ".join(h for h, _ in COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    for r in results:
        lines.append("| " + " | ".join(fmt(r) for _, fmt in COLUMNS) + " |")
    if writer:
        lines += ["", "Index-cache writer, 32768 fp32 tokens to random slots (bytes: fp32 in + slot + cache row):", "",
                  "| format | us | M tokens/s | GB/s | % copy |", "|---|---|---|---|---|"]
        for w in writer:
            lines.append(f"| {w['fmt']} | {w['us']:.1f} | {w['mtok_s']:.0f} | {w['gbs']:.0f} | {w['pct']:.0f}% |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="the 9 seed cells only")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--baseline-cuh", default=None, help="another revision of decode_mxfp4.cuh to time beside")
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    props = torch.cuda.get_device_properties(0)
    header = (f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
              f"triton {triton.__version__}; "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    log(header)
    peer = None
    if not args.no_peer:
        try:
            peer = import_peer()
        except Exception as e:
            log(f"SGLang scorer unavailable: {type(e).__name__}: {e}")
    if peer is not None:
        try:
            import sglang.jit_kernel.minimax_decode_topk  # noqa: F401  # SGLang's default top-k path
            log("SGLang top-k: JIT radix select (its default)")
        except Exception as e:
            os.environ["SGLANG_OPT_USE_MINIMAX_DECODE_TOPK_RADIX"] = "0"
            log(f"SGLang top-k: Triton two-stage fallback (JIT radix select unavailable: "
                f"{type(e).__name__}: {e})"[:400])
    cuda_backend.build()  # compile (or load) the CUDA kernel before anything is timed
    base = cuda_backend.load_module(args.baseline_cuh, "m3_score_decode_mxfp4_base") if args.baseline_cuh else None
    copy_start = copy_bandwidth()
    log(f"copy bandwidth {copy_start:.0f} GB/s")
    copy_gbs = copy_start
    pools = Pools(POOL_PAGES, peer is not None)
    cells = SEED_CELLS + ([] if args.quick else EXTRA_CELLS)
    results = []
    for S, H, B, ctx in cells:
        try:
            r = bench_cell(pools, peer, S, H, B, ctx, copy_gbs, base=base)
        except Exception as e:
            log(f"cell S{S} H{H} B{B} ctx{ctx} failed: {type(e).__name__}: {e}"[:500])
            raise
        results.append(r)
        log(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}))
    writer = bench_writer(pools, copy_gbs)
    del pools
    torch.cuda.empty_cache()
    copy_end = copy_bandwidth()
    note = f"; {copy_start / 1000:.2f} at the start, {copy_end / 1000:.2f} at the end; the start value is used"
    text = table(results, writer, copy_gbs, header, note)
    with open(os.path.join(args.out, "bench_score.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "bench_score.json"), "w") as f:
        json.dump({"copy_gbs": copy_gbs, "copy_gbs_end": copy_end, "cells": results, "writer": writer,
                   "header": header}, f, indent=1)
    log(text)


if __name__ == "__main__":
    main()
