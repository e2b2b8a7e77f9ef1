"""MXFP4 decode-scorer modes against the fp8 scorer on one GPU (the benchmark's nine seed cells).

    python tests/benchmarks/bench_mx_modes.py [--out DIR] [--modes split,e4m3] [--cells N]

Same method as ``bench_score.py`` (whose pools, graph timing and reference check it uses): each arm
is one CUDA graph of R calls over R disjoint page regions, median of 25 replays / R. Arms per cell:
fp8 and every MXFP4 mode with a bf16 Q, run A-B-...-...-B-A (mean of two rounds), then every MXFP4
mode with an e4m3 Q (one round). The mode is read when a graph is captured (``M3_TRITON_MX_MODE``).
With ``--terms``, on two cells the ``e4m3`` mode is also timed with its bf16-Q parts setting at 0
and 4 (``_Q_E4M3_TERMS``). Every arm's scores for one request are checked against the float64 reference
before timing.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_score as bs  # noqa: E402
from m3_kernels.formats import FP8_DTYPE, INDEX_DIM, PAGE_SIZE, IndexKFormat  # noqa: E402
from m3_kernels.ops.score import triton as score_triton  # noqa: E402
from m3_kernels.ops.score.triton import score_decode_triton  # noqa: E402

TERMS_CELLS = [(4, 1, 8, 32768), (4, 1, 32, 131072)]


def run_cell(pools, S, H, B, ctx, modes, terms_arms=False, sm_scale=0.088):
    npg = math.ceil(ctx / PAGE_SIZE)
    need = B * npg
    regions = max(1, min(bs.MAX_REGIONS, pools.pages // need))
    gen = torch.Generator(device="cuda").manual_seed(B * 7 + ctx)
    bts = [pools.perm[r * need : (r + 1) * need].reshape(B, npg).contiguous() for r in range(regions)]
    seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(B * S, H, INDEX_DIM, device="cuda", generator=gen).to(torch.bfloat16)
    q8 = q.float().clamp(-448, 448).to(FP8_DTYPE)
    outs = [torch.empty(H, B * S, npg, dtype=torch.float32, device="cuda") for _ in range(regions)]

    def arm(fmt, qq, mode, terms=None, check=True):
        def timed():
            os.environ["M3_TRITON_MX_MODE"] = mode
            saved = score_triton._Q_E4M3_TERMS
            if terms is not None:
                score_triton._Q_E4M3_TERMS = terms
            try:
                kc, ks = pools.cache(fmt)
                fns = [lambda r=r: score_decode_triton(qq, kc, ks, fmt, B, npg, bts[r], seq, S, sm_scale, outs[r])
                       for r in range(regions)]
                if check:
                    fns[0]()
                    try:
                        bs.check_against_ref(outs[0], qq, kc, ks, bts[0], seq, S, sm_scale, f"{fmt.value}/{mode}")
                    except AssertionError as e:  # recorded, and the cell's timings are not a claim
                        bs.log(f"GATE FAILED S{S} H{H} B{B} ctx{ctx}: {e}")
                        res["gate"] = f"FAILED {fmt.value}/{mode}"
                return bs.graph_time_us(fns)
            finally:
                score_triton._Q_E4M3_TERMS = saved
                os.environ["M3_TRITON_MX_MODE"] = "split"

        return timed

    res = {"S": S, "H": H, "B": B, "ctx": ctx, "regions": regions, "gate": "pass"}
    names = ["fp8"] + [f"mx_{m}" for m in modes]
    rounds = {n: [] for n in names}
    for i, n in enumerate(names + names[::-1]):
        fmt = IndexKFormat.FP8 if n == "fp8" else IndexKFormat.MXFP4
        rounds[n].append(arm(fmt, q, n[3:] if n != "fp8" else "split", check=i < len(names))())
    for n in names:
        res[f"{n}_us"] = statistics.mean(rounds[n])
        res[f"{n}_spread"] = abs(rounds[n][0] - rounds[n][1]) / min(rounds[n])
    for m in modes:
        res[f"mx_{m}_e4m3q_us"] = arm(IndexKFormat.MXFP4, q8, m)()
        res[f"mx_{m}_ratio"] = res[f"mx_{m}_us"] / res["fp8_us"]
    if terms_arms and (S, H, B, ctx) in TERMS_CELLS and "e4m3" in modes:
        for terms in (0, 4):
            res[f"mx_e4m3_t{terms}_us"] = arm(IndexKFormat.MXFP4, q, "e4m3", terms)()
    tokens = B * npg * PAGE_SIZE
    res["mx_floor_us"] = tokens * IndexKFormat.MXFP4.token_bytes / 4.27e12 * 1e6
    return res


def table(results, modes, header):
    """Markdown table of ``run_cell`` results."""
    cols = ["fp8_us"] + [f"mx_{m}_{k}" for m in modes for k in ("us", "ratio", "e4m3q_us")]
    lines = [header, "", "| shape | B | ctx | " + " | ".join(cols) + " | MXFP4 floor us |",
             "|" + "---|" * (len(cols) + 4)]
    for r in sorted(results, key=lambda r: (r["S"], r["H"], r["B"], r["ctx"])):
        gate = "" if r.get("gate", "pass") == "pass" else f" (gate {r['gate']})"
        lines.append(f"| S{r['S']} H{r['H']}{gate} | {r['B']} | {r['ctx']} | "
                     + " | ".join(f"{r[c]:.2f}" for c in cols) + f" | {r['mx_floor_us']:.1f} |")
    extra = [r for r in results if "mx_e4m3_t0_us" in r]
    if extra:
        lines += ["", "| cell | e4m3 (2 parts) us | e4m3 fp16-only us | e4m3 4 parts us |", "|---|---|---|---|"]
        for r in extra:
            lines.append(f"| B{r['B']} ctx{r['ctx']} | {r['mx_e4m3_us']:.2f} | {r['mx_e4m3_t0_us']:.2f} | "
                         f"{r['mx_e4m3_t4_us']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--modes", default="split,tile16")
    parser.add_argument("--cells", type=int, default=len(bs.SEED_CELLS))
    parser.add_argument("--terms", action="store_true", help="also time e4m3 with 0 and 4 bf16-Q parts")
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    props = torch.cuda.get_device_properties(0)
    header = (f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
              f"triton {triton.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    bs.log(header)
    modes = args.modes.split(",")
    pools = bs.Pools(bs.POOL_PAGES, False)
    results = []
    # The two cells of the launch-parameter sweep first (a time limit cuts the others).
    cells = sorted(bs.SEED_CELLS, key=lambda c: (c not in TERMS_CELLS, bs.SEED_CELLS.index(c)))
    for S, H, B, ctx in cells[: args.cells]:
        r = run_cell(pools, S, H, B, ctx, modes, args.terms)
        results.append(r)
        bs.log(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}))
        with open(os.path.join(args.out, "bench_mx_modes.json"), "w") as f:
            json.dump({"header": header, "cells": results}, f, indent=1)
    text = table(results, modes, header)
    with open(os.path.join(args.out, "bench_mx_modes.md"), "w") as f:
        f.write(text + "\n")
    bs.log(text)


if __name__ == "__main__":
    main()
