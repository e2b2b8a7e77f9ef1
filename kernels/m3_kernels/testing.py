"""Test support (the serving path never imports this)."""

import importlib
import os


def triton_module(name: str, kernel: str):
    """Module ``name`` whose ``@triton.jit`` function ``kernel`` runs in Triton's interpreter when
    ``TRITON_INTERPRET=1``: a module imported before the variable was set holds compiled kernels,
    so it is reloaded once. Without the variable the module is returned as imported."""
    mod = importlib.import_module(name)
    if os.environ.get("TRITON_INTERPRET") != "1":
        return mod
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(getattr(mod, kernel), InterpretedFunction):
        mod = importlib.reload(mod)
    return mod


def capture_graph(fn, warmup=None):
    """A ``torch.cuda.CUDAGraph`` of ``fn()``, captured after one call of ``warmup`` (default ``fn``) on a side
    stream (compiles kernels and settles allocations outside the capture, as CUDA-graph capture requires)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        (warmup or fn)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def fill_random_index_k(gen, k_cache, k_scale, scale_lo: int = 122, scale_hi: int = 127):
    """Fill an index-K cache (from ``alloc_index_k_cache``) with random contents, in place: MXFP4
    every e2m1 code and e8m0 scale bytes in ``[scale_lo, scale_hi]``; fp8 random e4m3 bytes without
    the NaN code; bf16 standard normals. ``gen``: a ``torch.Generator``."""
    import torch

    from .formats import FP8_DTYPE

    if k_scale is not None:
        k_cache.copy_(torch.randint(0, 256, k_cache.shape, generator=gen, dtype=torch.uint8))
        k_scale.copy_(torch.randint(scale_lo, scale_hi + 1, k_scale.shape, generator=gen, dtype=torch.uint8))
    elif k_cache.dtype == FP8_DTYPE:
        b = torch.randint(0, 256, k_cache.shape, generator=gen, dtype=torch.uint8)
        b -= ((b & 0x7F) == 0x7F).to(torch.uint8)
        k_cache.view(torch.uint8).copy_(b)
    else:
        k_cache.copy_(torch.randn(k_cache.shape, generator=gen))


def abs_index_k(k_cache, k_scale):
    """The cache of |K| (sign bits cleared), for the scorers' error bound."""
    import torch

    from .formats import FP8_DTYPE

    if k_scale is not None:
        return k_cache & 0x77, k_scale
    if k_cache.dtype == FP8_DTYPE:
        return (k_cache.view(torch.uint8) & 0x7F).view(FP8_DTYPE), None
    return k_cache.abs(), None


def random_cache(gen, fmt, pages, device, single_region=True, scale_lo=122, scale_hi=127):
    """A cache (``alloc_index_k_cache``) of ``pages`` with random contents (``fill_random_index_k``)
    on ``device``; an MXFP4 single region stays one region there (``mxfp4_page_views``)."""
    from .formats import alloc_index_k_cache, mxfp4_page_views

    storage = "mxfp4" if fmt.startswith("mxfp4") else fmt
    k_cache, k_scale = alloc_index_k_cache(pages, storage, single_region=single_region)
    fill_random_index_k(gen, k_cache, k_scale, scale_lo, scale_hi)
    if device != "cpu":
        if k_scale is not None and single_region:
            base = k_cache.as_strided((pages, k_cache.stride(0)), (k_cache.stride(0), 1))
            return mxfp4_page_views(base.to(device))
        return k_cache.to(device), (k_scale.to(device) if k_scale is not None else None)
    return k_cache, k_scale


def make_q(gen, rows, H, q_dtype, device, scale=1.0, octaves=0):
    """Gaussian Q ``[rows, H, 128]`` times ``scale``. ``octaves`` > 0: each element further multiplied
    by a random 2^-k, k in [0, octaves] (rows with a wide dynamic range); ``octaves`` < 0: each query
    vector as a whole by 2^-k, k in [0, -octaves] (vectors of very different sizes in one tile)."""
    import torch

    from .formats import FP8_DTYPE

    q = torch.randn(rows, H, 128, generator=gen) * scale
    if octaves:
        shape = q.shape if octaves > 0 else (rows, H, 1)
        q = q * torch.exp2(-torch.randint(0, abs(octaves) + 1, shape, generator=gen).float())
    if q_dtype == FP8_DTYPE:
        q = q.clamp(-448, 448)
    return q.to(q_dtype).to(device)


def q_abs(q):
    """|q| in q's dtype, for the scorers' error bound."""
    return q.float().abs().to(q.dtype)


def assert_scores_close(got, ref, bound):
    """Block scores against the float64 reference: same shape and -inf pattern, no NaN, and
    ``|got - ref| <= 1e-5 * bound`` (``bound``: the score of ``|q|`` and ``|K|``) where finite."""
    import torch

    assert got.shape == ref.shape, (got.shape, ref.shape)
    got, ref, bound = got.double().cpu(), ref.double().cpu(), bound.double().cpu()
    assert not torch.isnan(got).any(), "NaN in scores"
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), "-inf pattern differs from the reference"
    fin = torch.isfinite(ref)
    assert torch.isfinite(got[fin]).all()
    err = (got[fin] - ref[fin]).abs()
    tol = 1e-5 * bound[fin] + 1e-30
    worst = (err / tol).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"error {worst:.3g} x tolerance"


def selection_error(picked, scores, n_visible, tol, topk, local_blocks, init_blocks) -> str:
    """'' when ``picked`` is an MSA top-k selection of ``scores`` up to near-ties, else what is wrong.

    ``picked int [H, rows, topk]`` block ids in any order, -1 for unused slots (any selector: ours, a
    peer's); ``scores [H, rows, nb]``; ``n_visible int [rows]``; ``tol``: how far below the row's
    ``m``-th best score a chosen block may be (a scalar or ``[H, rows, nb]``, e.g. ``2e-5 * bound``).
    Every row must hold ``m = min(topk, n_visible)`` distinct visible blocks, all forced blocks (the
    first ``init_blocks`` and the last ``local_blocks`` visible ones) when ``n_visible > topk``, and no
    other block scoring below the ``m``-th best by more than ``tol``. The contract itself is
    ``ops.select.naive.select_blocks_ref``; this accepts any tie order, so it can check a peer.
    """
    import torch

    H, rows, nb = scores.shape
    if picked.shape != (H, rows, topk):
        return f"picked has shape {tuple(picked.shape)}, want {(H, rows, topk)}"
    ids = torch.arange(nb, device=scores.device)
    n = n_visible.to(device=scores.device, dtype=torch.long)[None, :, None]  # [1, rows, 1]
    p = picked.to(device=scores.device, dtype=torch.long)
    used = p >= 0
    m = torch.clamp(n, max=topk)
    if not torch.equal(used.sum(-1, keepdim=True), m.expand(H, rows, 1)):
        return "a row does not hold min(topk, visible) blocks"
    if (p >= n).any():
        return "a block past the row's visible blocks"
    chosen = torch.zeros(H, rows, nb + 1, dtype=torch.int32, device=scores.device)
    chosen.scatter_add_(-1, torch.where(used, p, nb), torch.ones_like(p, dtype=torch.int32))
    if (chosen[..., :nb] > 1).any():
        return "a block chosen twice in one row"
    forced = ((ids < init_blocks) | (ids >= n - local_blocks)) & (ids < n) & (n > topk)  # [1, rows, nb]
    if ((chosen[..., :nb] == 0) & forced).any():
        return "a forced block (init or local) left out"
    s = torch.where((ids < n) & ~forced, scores.double(), float("-inf"))
    ranked = (m - forced.sum(-1, keepdim=True)).expand(H, rows, 1)  # blocks chosen by score
    kth = torch.sort(s, dim=-1, descending=True).values.gather(-1, (ranked - 1).clamp(min=0))  # [H, rows, 1]
    slack = torch.as_tensor(tol, dtype=torch.float64, device=scores.device)
    short = (chosen[..., :nb] > 0) & ~forced & (s < kth - slack) & (ranked > 0)
    if short.any():
        h, r, b = (int(x) for x in short.nonzero()[0])
        return (f"head {h} row {r}: block {b} scores {s[h, r, b].item():.6g}, below the row's best {int(ranked[h, r])} "
                f"(cut {kth[h, r, 0].item():.6g}) by more than the tolerance")
    return ""


def compile_sm90(module: str, kernel: str, signature: dict, constants: dict, num_warps: int = 4) -> dict:
    """Compile the ``@triton.jit`` function ``module.kernel`` for sm_90 with Triton's own ptxas (no GPU
    needed) and return ``{"seconds": compile time, "sass_bytes": size of the cubin}``. ``signature`` maps the
    runtime arguments to Triton types (``"*fp32"``, ``"i32"``), ``constants`` the constexpr ones to values.
    Runs in a subprocess without ``TRITON_INTERPRET``, so it works from tests that interpret kernels."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys, time\n"
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "import importlib\n"
        "a = json.loads(sys.argv[1])\n"
        "fn = getattr(importlib.import_module(a['module']), a['kernel'])\n"
        "sig = {name: a['signature'].get(name, 'constexpr') for name in fn.arg_names}\n"
        "t0 = time.perf_counter()\n"
        "k = triton.compile(ASTSource(fn, sig, a['constants']), target=GPUTarget('cuda', 90, 32),\n"
        "                   options=dict(num_warps=a['num_warps']))\n"
        "print(json.dumps({'seconds': time.perf_counter() - t0, 'sass_bytes': len(k.asm['cubin'])}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = json.dumps(dict(module=module, kernel=kernel, signature=signature, constants=constants,
                           num_warps=num_warps))
    proc = subprocess.run([sys.executable, "-c", code, args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {module}.{kernel} for sm_90 failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worker_threads(cpus: int, workers: int) -> int:
    """torch threads for the tests a pytest-xdist worker runs in its own process: the workers share the
    cores instead of each spinning up one thread per core (on a 2-core box two workers of two threads each
    oversubscribe it whenever both compute). Servers and other subprocesses keep their own settings;
    ``OMP_NUM_THREADS`` set by the user wins."""
    return max(1, cpus // max(1, workers))


def score_decode_views(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block=None, out=None, cp_rank=0,
                       cp_world=1, backend=None):
    """``ops.score.plan_decode`` and ``score_decode`` in one call over loose views (``IndexKCache.of(k_cache,
    k_scale)``, the storage format; ``H`` read off ``q``): the tests' and benchmarks' one-call form, in the
    references' argument order. A server plans once per batch instead."""
    from .formats import IndexKCache
    from .ops.score import DecodeBatch, plan_decode, score_decode

    cache = IndexKCache.of(k_cache, k_scale)
    H = q.shape[1] if q.dim() == 3 else 1  # a q of another rank is refused by the run's check
    plan = plan_decode(cache, DecodeBatch(block_table, seq_lens, S, H, sm_scale, max_block, out, cp_rank, cp_world),
                       backend)
    return score_decode(plan, q, cache)


def score_prefill_views(q, k_cache, k_scale, block_table, seq_lens, cu_seqlens_q, sm_scale, max_block=None, out=None,
                        backend=None):
    """``ops.score.plan_prefill`` and ``score_prefill`` in one call over loose views (lengths read back: one
    sync each), as ``score_decode_views``."""
    from .formats import IndexKCache
    from .ops.score import PrefillBatch, plan_prefill, score_prefill

    cache = IndexKCache.of(k_cache, k_scale)
    H = q.shape[1] if q.dim() == 3 else 1
    plan = plan_prefill(cache, PrefillBatch(block_table, seq_lens, cu_seqlens_q, H, sm_scale, max_block, out),
                        backend)
    return score_prefill(plan, q, cache)
