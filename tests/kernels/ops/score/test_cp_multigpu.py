"""Context-parallel decode scoring across real processes (world 2 and 4): each rank scores its shard of
the index-K cache with a decode plan of ``cp_rank=r, cp_world=W``, the shards are combined with
``all_gather``, and top-16 selection runs on the combined scores.

Shard rule (``naive.score_decode_ref``): rank r stores global block ``p * W + r`` at local column
p, so the combined row is the ranks' columns interleaved: global column ``p * W + r`` = rank r's
column p. Every block is scored on exactly one rank; there are no partial scores to add.

Each rank builds the same random global cache (seeded), keeps its own blocks on pages of its own
(random page ids, unused pages and the unwritten tail of each request's last page NaN-poisoned),
scores into a NaN-filled ``out``. Rank 0 then checks the combined scores against the float64
oracle on the whole cache (``score_decode_ref``, tolerance ``1e-5 * bound`` as in
``test_triton.py``), bitwise against the same backend on the whole cache with ``cp_world=1``,
and the selection against the oracle's (blocks may swap only within twice the row's score error);
every rank must select the same blocks.

Runs as W processes of this file (``python test_cp_multigpu.py --rank r --world W ...``):

- GPU (``-m gpu``, needs W CUDA devices): NCCL, the default (Triton) backend, one GPU per rank;
- CPU (CI): gloo, the torch backend (world 4 is the layout of MiniMax-M3's TP4, one rank per index head's
  GPU; here it checks the shard rule at four ranks).
"""

import argparse
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FORMATS = ("mxfp4", "fp8", "bf16")
SEQ_LENS = [1, 127, 128, 129, 1000, 65536 + 77]  # one token, page edges, a partial last page, 64k
INDEX_HEADS = 4  # MiniMax-M3's index heads (every CP rank holds all of them)
WORLDS = (2, 4)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ---- one rank's worker (this file run as a script) -------------------------------------------

def _nan_fill(k_cache, k_scale, pages=None, rows=None):
    """Poison pages (all, or ``pages``; all rows or ``rows`` slice) with NaN codes."""
    from m3_kernels.formats import E8M0_NAN, FP8_DTYPE

    sel = (slice(None) if pages is None else pages, slice(None) if rows is None else rows)
    if k_scale is not None:
        k_scale[sel] = E8M0_NAN
        k_cache[sel] = 0x77
    elif k_cache.dtype == FP8_DTYPE:
        k_cache.view(torch.uint8)[sel] = 0x7F
    else:
        k_cache[sel] = float("nan")


def _random_cache(gen, fmt, pages):
    """Random cache bytes (``m3_kernels.testing.fill_random_index_k``: scales 122..127)."""
    from m3_kernels.formats import alloc_index_k_cache
    from m3_kernels.testing import fill_random_index_k

    k_cache, k_scale = alloc_index_k_cache(pages, fmt)
    fill_random_index_k(gen, k_cache, k_scale)
    return k_cache, k_scale


def _to(device, k_cache, k_scale):
    """The cache on ``device`` (MXFP4: single-region pages, so the views stay one allocation)."""
    from m3_kernels.formats import MXFP4_PAGE_BYTES, mxfp4_page_views

    if k_scale is None:
        return k_cache.to(device), None
    region = k_cache.as_strided((k_cache.shape[0], MXFP4_PAGE_BYTES), (k_cache.stride(0), 1))
    return mxfp4_page_views(region.to(device))


def build_case(seed: int, fmt: str, S: int):
    """The global problem every rank builds identically: cache, block table, lengths, q."""
    from m3_kernels.formats import PAGE_SIZE

    gen = torch.Generator().manual_seed(seed)
    seq_lens = [max(n, S) for n in SEQ_LENS]
    n_blocks = [math.ceil(n / PAGE_SIZE) for n in seq_lens]
    pages = sum(n_blocks) + 3
    k_cache, k_scale = _random_cache(gen, fmt, pages)
    max_block = max(n_blocks)
    table = torch.full((len(seq_lens), max_block), -1, dtype=torch.int32)
    perm = torch.randperm(pages, generator=gen)
    used = 0
    for b, n in enumerate(n_blocks):
        table[b, :n] = perm[used: used + n].int()
        used += n
        tail = seq_lens[b] % PAGE_SIZE
        if tail:  # the last page's unwritten slots
            _nan_fill(k_cache, k_scale, int(table[b, n - 1]), slice(tail, None))
    q = (torch.randn(len(seq_lens) * S, INDEX_HEADS, 128, generator=gen)).to(torch.bfloat16)
    return dict(k_cache=k_cache, k_scale=k_scale, table=table, seq_lens=seq_lens, n_blocks=n_blocks, q=q,
                max_block=max_block, S=S, sm_scale=128**-0.5)


def shard(case, fmt: str, rank: int, world: int, seed: int):
    """Rank ``rank``'s cache: its blocks ``p * world + rank`` at local column p, on pages of a
    NaN-poisoned cache of its own (random page ids)."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    n_local = [max(0, (n - rank + world - 1) // world) for n in case["n_blocks"]]
    local_max = max(1, math.ceil(case["max_block"] / world))
    pages = sum(n_local) + 2
    k_cache, k_scale = _random_cache(gen, fmt, pages)
    _nan_fill(k_cache, k_scale)
    perm = torch.randperm(pages, generator=gen)
    table = torch.zeros((len(n_local), local_max), dtype=torch.int32)  # unused columns: page 0 (never read)
    used = 0
    for b, n in enumerate(n_local):
        for p in range(n):
            dst, src = int(perm[used]), int(case["table"][b, p * world + rank])
            used += 1
            table[b, p] = dst
            k_cache[dst] = case["k_cache"][src]
            if k_scale is not None:
                k_scale[dst] = case["k_scale"][src]
    return k_cache, k_scale, table, local_max, n_local


def combine(parts: list) -> torch.Tensor:
    """Interleave the ranks' ``[H, rows, local_max]`` scores into global block order."""
    return torch.stack(parts, dim=-1).flatten(-2)


def run_rank(rank: int, world: int, device_kind: str, seed: int, out_path: str | None) -> dict:
    import torch.distributed as dist

    from m3_kernels.formats import PAGE_SIZE
    from m3_kernels.ops.score.naive import score_decode_ref
    from m3_kernels.testing import score_decode_views as score_decode
    from m3_kernels.ops.select import select_blocks, visible_blocks
    from m3_kernels.ops.select.naive import select_blocks_ref

    device = torch.device(f"cuda:{rank}") if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            device_id=device if device.type == "cuda" else None)
    backend = None if device.type == "cuda" else "torch"
    report = {"device": str(device), "cases": []}
    try:
        for fmt in FORMATS:
            for S in ((1, 2) if device.type == "cuda" else (1,)):
                case = build_case(seed + FORMATS.index(fmt) * 31 + S, fmt, S)
                k_cache, k_scale, table, local_max, n_local = shard(case, fmt, rank, world, seed)
                k_cache, k_scale = _to(device, k_cache, k_scale)
                q = case["q"].to(device)
                seq = torch.tensor(case["seq_lens"], dtype=torch.int32, device=device)
                rows = q.shape[0]
                out = torch.full((INDEX_HEADS, rows, local_max), float("nan"), device=device)
                got = score_decode(q, k_cache, k_scale, table.to(device), seq, S, case["sm_scale"], local_max, out,
                                   rank, world, backend=backend)
                assert got.data_ptr() == out.data_ptr()
                parts = [torch.empty_like(got) for _ in range(world)]
                dist.all_gather(parts, got.contiguous())
                nb = case["max_block"]
                scores = combine(parts)[:, :, :nb]
                positions = (seq.long()[:, None] - S + torch.arange(S, device=device)).flatten()
                n_vis = visible_blocks(positions, PAGE_SIZE)
                # Columns past a row's last visible block were never written (NaN); selection ignores them.
                selected = select_blocks(scores, n_vis)
                every = [torch.empty_like(selected) for _ in range(world)]
                dist.all_gather(every, selected)
                same_everywhere = all(torch.equal(e, every[0]) for e in every)
                if rank == 0:
                    report["cases"].append(check_rank0(case, scores.cpu(), selected.cpu(), n_vis.cpu(), fmt, S,
                                                       device, backend, same_everywhere, n_local,
                                                       score_decode, score_decode_ref, select_blocks_ref))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0 and out_path:
        Path(out_path).write_text(json.dumps(report, indent=1))
    return report


def check_rank0(case, scores, selected, n_vis, fmt, S, device, backend, same_everywhere, n_local,
                score_decode, score_decode_ref, select_blocks_ref) -> dict:
    """Combined scores vs the float64 oracle and vs one-rank scoring; selection vs the oracle's."""
    from m3_kernels.testing import abs_index_k

    kc, ks, table = case["k_cache"], case["k_scale"], case["table"]
    seq = torch.tensor(case["seq_lens"], dtype=torch.int32)
    nb, q, sm = case["max_block"], case["q"], case["sm_scale"]
    name = f"{fmt} S={S}"
    ref = score_decode_ref(q, kc, ks, table.clamp(min=0), seq, S, sm, nb)
    bound = score_decode_ref(q.float().abs().to(q.dtype), *abs_index_k(kc, ks), table.clamp(min=0), seq, S, sm, nb)
    visible = torch.arange(nb)[None, None, :] < n_vis[None, :, None]
    got = scores.double()
    assert not torch.isnan(got[visible.expand_as(got)]).any(), f"{name}: NaN in a visible column (poison read)"
    got = torch.where(visible, got, torch.tensor(float("-inf"), dtype=torch.float64))
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), f"{name}: -inf pattern differs from the oracle"
    fin = torch.isfinite(ref)
    err = (got - ref).abs().where(fin, torch.zeros((), dtype=torch.float64))
    worst = float((err / (1e-5 * bound.where(fin, torch.ones((), dtype=torch.float64)) + 1e-30)).max())
    assert worst <= 1.0, f"{name}: combined scores err {worst:.3g} x tolerance vs the float64 oracle"
    # Same backend, whole cache on one rank: a block's score must not depend on the split.
    one = score_decode(q.to(device), *_to(device, kc, ks), table.clamp(min=0).to(device), seq.to(device), S, sm, nb,
                       backend=backend).cpu()
    one = torch.where(visible, one, torch.tensor(float("-inf")))
    bitwise = torch.equal(torch.where(visible, scores, torch.tensor(float("-inf"))), one)
    assert bitwise, f"{name}: CP-combined scores differ from cp_world=1 scores of the same backend"
    # Selection: the oracle's top-16, except swaps within twice the row's score error.
    sel_ref = select_blocks_ref(ref, n_vis)
    swaps = 0
    for h in range(sel_ref.shape[0]):
        for r in range(sel_ref.shape[1]):
            a, b = set(selected[h, r].tolist()) - {-1}, set(sel_ref[h, r].tolist()) - {-1}
            if a == b:
                continue
            row_err = float(err[h, r].max())
            for x in a - b:
                for y in b - a:
                    assert abs(float(ref[h, r, x]) - float(ref[h, r, y])) <= 2 * row_err * (1 + 1e-6), \
                        f"{name}: head {h} row {r} picked block {x} over {y} beyond the score error"
            swaps += 1
    assert same_everywhere, f"{name}: ranks selected different blocks from the same combined scores"
    return {"case": name, "rows": int(n_vis.numel()), "blocks": nb, "local_blocks_rank0": n_local,
            "max_err_over_tol": worst, "bitwise_equal_to_cp1": bitwise, "selection_swaps_within_error": swaps}


def _main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    run_rank(args.rank, args.world, args.device, args.seed, args.out)


# ---- pytest: launch the ranks ----------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(device: str, tmp_path, seed: int, timeout_s: float, world: int) -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), **NCCL_ENV)
    out = tmp_path / "report.json"
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--device", device,
                               "--seed", str(seed), "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log[-6000:]}"
    report = json.loads(out.read_text())
    for c in report["cases"]:
        print(c)
    return report


def _seed() -> int:
    import random

    seed = int(os.environ.get("M3_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"M3_TEST_SEED={seed}")
    return seed


@pytest.mark.parametrize("world", WORLDS)
def test_cp_cpu_gloo(tmp_path, world):
    report = _launch("cpu", tmp_path, _seed(), timeout_s=300, world=world)
    assert [c["case"] for c in report["cases"]] == [f"{f} S=1" for f in FORMATS]


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
def test_cp_gpus_nccl(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices, found {torch.cuda.device_count()}")
    report = _launch("cuda", tmp_path, _seed(), timeout_s=600, world=world)
    assert len(report["cases"]) == 2 * len(FORMATS)


if __name__ == "__main__":
    _main()
