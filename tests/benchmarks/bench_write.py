"""Index-cache writer benchmark on one GPU: bf16, fp8, mxfp4 and mxfp4_rot (Triton), with the
rotated writer's launch shapes compared.

    python tests/benchmarks/bench_write.py [--out DIR] [--tokens 128,4096,32768,131072]

Method (as ``bench_score.py``): fp32 keys ``[tokens, 128]`` written to the rows of random whole
pages of the cache (8 disjoint sets of pages); every arm is captured once in a CUDA graph of 8 calls
over the 8 input sets and slot lists, the graph is replayed 25 times and the median replay time
divided by 8 is reported. mxfp4 and mxfp4_rot (default launch, plain Hadamard) run A-B-B-A, the
mean of the two rounds reported; mxfp4_rot also with random signs (``sign_seed`` 7) and at six
launch shapes (its default depends on the token count: ``_rot_launch`` in ``ops/write/triton.py``).
GB/s counts fp32 in + the int64 slot + the cache row (bytes per token: 520 plus 256 / 128 / 68).
"x mxfp4" is the time over the plain mxfp4 writer's at the same token count.

Gate, before any timing: bf16, fp8 and mxfp4 rows bitwise equal to ``quantize_index_k``; mxfp4_rot
bytes at least 99% equal to the float64-rotation reference (the rotation's error bound itself is
checked by ``tests/kernels/ops/write/test_triton.py -m gpu``). A failed gate is printed in the table
and the run exits non-zero. Takes well under a minute on an H200 (most of it Triton compiling).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

from m3_kernels.formats import INDEX_DIM, PAGE_SIZE, IndexKCache, IndexKFormat, alloc_index_k_cache, quantize_index_k
from m3_kernels.ops.write.triton import write_index_k_triton

from bench_score import graph_time_us, log  # same timing method (this script's folder is on sys.path)

SETS = 8
# mxfp4_rot arms: (launch, sign seed); launch (tokens per program, warps), None = the writer's default
ROT_ARMS = [(None, None), (None, 7), ((16, 4), None), ((16, 2), None), ((32, 2), None), ((64, 4), None),
            ((64, 8), None)]


class Inputs:
    """``SETS`` disjoint key sets and slot lists (whole random pages) for ``tokens`` tokens each."""

    def __init__(self, tokens, gen):
        pages_per_set = -(-tokens // PAGE_SIZE)
        self.pages = pages_per_set * SETS
        perm = torch.randperm(self.pages, device="cuda", generator=gen)
        o_t = torch.arange(PAGE_SIZE, device="cuda")
        self.keys = [torch.randn(tokens, INDEX_DIM, device="cuda", generator=gen) for _ in range(SETS)]
        self.locs = [(perm[i * pages_per_set : (i + 1) * pages_per_set, None] * PAGE_SIZE + o_t).flatten()[:tokens]
                     for i in range(SETS)]
        self.caches = {}

    def cache(self, fmt):
        storage = "mxfp4" if fmt.is_mxfp4 else fmt.value
        if storage not in self.caches:
            self.caches[storage] = alloc_index_k_cache(self.pages, storage, "cuda")
        return self.caches[storage]


def gate(inputs, fmt, launch, seed, n=4096):
    """The rows one call writes against ``quantize_index_k`` (see the module docstring): '' if it
    passes, else what failed."""
    k_cache, k_scale = inputs.cache(fmt)
    k, loc = inputs.keys[0][:n], inputs.locs[0][:n]
    write_index_k_triton(IndexKCache(fmt, k_cache, k_scale, "rceil", seed), k, loc, *launch_kw(launch))
    torch.cuda.synchronize()
    rows, scales = quantize_index_k(k.cpu(), fmt, sign_seed=seed)
    page, row = loc.cpu() // PAGE_SIZE, loc.cpu() % PAGE_SIZE
    got = k_cache.cpu()[page, row].view(torch.uint8)
    want = rows.view(torch.uint8)
    if fmt.is_rotated:
        agree = (got == want).float().mean().item()
        return "" if agree >= 0.99 else f"only {agree:.3f} of the bytes agree"
    ok = torch.equal(got, want) and (k_scale is None or torch.equal(k_scale.cpu()[page, row], scales))
    return "" if ok else "not bitwise equal"


def launch_kw(launch):
    """Positional tail of ``write_index_k_triton`` after the cache, keys and slots: the launch shape."""
    bt, nw = launch if launch else (None, None)
    return bt, nw


def arm(inputs, fmt, launch, seed):
    cache = IndexKCache(fmt, *inputs.cache(fmt), "rceil", seed)
    tail = launch_kw(launch)
    return [lambda i=i: write_index_k_triton(cache, inputs.keys[i], inputs.locs[i], *tail) for i in range(SETS)]


def bench(tokens, gen):
    inputs = Inputs(tokens, gen)
    arms = [(IndexKFormat.BF16, None, None), (IndexKFormat.FP8, None, None), (IndexKFormat.MXFP4, None, None)]
    arms += [(IndexKFormat.MXFP4_ROT, launch, seed) for launch, seed in ROT_ARMS]
    failed = {}
    for key in arms:
        why = gate(inputs, *key)
        if why:
            failed[key] = why
            log(f"GATE FAILED {key[0].value} launch {key[1]} sign seed {key[2]} tokens {tokens}: {why}")
    times = {}
    mx, rot = (IndexKFormat.MXFP4, None, None), (IndexKFormat.MXFP4_ROT, None, None)
    rounds = {mx: [], rot: []}
    for key in (mx, rot, rot, mx):  # A-B-B-A
        rounds[key].append(graph_time_us(arm(inputs, *key)))
    times[mx], times[rot] = statistics.mean(rounds[mx]), statistics.mean(rounds[rot])
    for key in arms:
        if key not in times:
            times[key] = graph_time_us(arm(inputs, *key))
    rows = []
    for fmt, launch, seed in arms:
        us = times[(fmt, launch, seed)]
        moved = tokens * (4 * INDEX_DIM + 8 + fmt.token_bytes)
        rows.append({"tokens": tokens, "fmt": fmt.value, "launch": launch or "default", "sign_seed": seed, "us": us,
                     "gbs": moved / (us * 1e-6) / 1e9, "x_mxfp4": us / times[mx],
                     "gate": failed.get((fmt, launch, seed), "pass"), "rounds": rounds.get((fmt, launch, seed))})
        log(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}))
    return rows


def table(rows, header):
    lines = [header, "",
             "| tokens | format | launch (tokens/program, warps) | sign seed | us | GB/s | x mxfp4 | gate |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        launch = "default" if r["launch"] == "default" else f"{r['launch'][0]}, {r['launch'][1]}"
        seed = "-" if r["sign_seed"] is None else r["sign_seed"]
        lines.append(f"| {r['tokens']} | {r['fmt']} | {launch} | {seed} | {r['us']:.1f} | {r['gbs']:.0f} | "
                     f"{r['x_mxfp4']:.2f} | {r['gate']} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tokens", default="128,4096,32768,131072")
    args = parser.parse_args(argv)
    import triton

    props = torch.cuda.get_device_properties(0)
    header = (f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
              f"triton {triton.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    log(header)
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows += bench(tokens, gen)
    text = table(rows, header)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_write.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "bench_write.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    log(text)
    log(f"total {time.time() - t0:.0f} s")
    return 1 if any(r["gate"] != "pass" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
