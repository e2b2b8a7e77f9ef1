"""Block scorers: one dispatcher per entry point.

Backends: ``torch`` (the reference in ``naive.py``; CPU and anything else), ``triton`` (CUDA and
ROCm), ``cuda`` (CUDA C++ MXFP4 decode scorer, NVIDIA sm_90+, built by SGLang's JIT loader),
``flydsl`` (ROCm gfx950), ``aiter`` (aiter's installed MXFP4 scorer). ``auto`` picks FlyDSL on
gfx950, for MXFP4 decode the CUDA kernel on NVIDIA sm_90+ (Triton, with one log line, where it
cannot be built), Triton on other GPUs and torch on CPU. ``M3_SCORE_BACKEND`` forces one.
"""

import logging
import os
from dataclasses import dataclass

import torch

from .common import check_decode_args, check_prefill_args, decode_supported  # noqa: F401

BACKENDS = ("auto", "torch", "triton", "cuda", "flydsl", "aiter")
ENV_BACKEND = "M3_SCORE_BACKEND"

logger = logging.getLogger(__name__)


def resolve_backend(device: torch.device, backend: str | None = None, op: str = "decode") -> str:
    """The backend a call on ``device`` uses: ``backend``, else ``$M3_SCORE_BACKEND``, else auto.

    auto: torch off-GPU; for ``op="decode"`` FlyDSL on ROCm gfx950 (when installed); else Triton.
    FlyDSL, aiter and cuda score decode only: forced for ``op="prefill"``, they resolve as auto.
    (Auto's choice of the CUDA kernel for an MXFP4 decode call is made in ``score_decode``.)
    """
    backend = backend or os.environ.get(ENV_BACKEND, "auto")
    if backend not in BACKENDS:
        raise ValueError(f"{ENV_BACKEND} / backend must be one of {list(BACKENDS)}, got {backend!r}")
    if op == "prefill" and backend in ("flydsl", "aiter", "cuda"):
        backend = "auto"
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "torch"
    from .backends import flydsl  # light: imports FlyDSL only when a kernel is launched

    if op == "decode" and flydsl.is_available(device):  # ROCm gfx950 with FlyDSL installed
        return "flydsl"
    return "triton"


def score_decode(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block=None, out=None,
                 cp_rank=0, cp_world=1, backend=None):
    """Decode block scores ``fp32 [H, batch*S, max_block]`` (contract: ``naive.score_decode_ref``).

    With ``out=None`` the result is freshly allocated and columns past a row's last visible page
    read -inf; a preallocated ``out`` is written up to each request's last page only.
    """
    name = resolve_backend(q.device, backend)
    auto = (backend or os.environ.get(ENV_BACKEND, "auto")) == "auto"
    if name == "triton" and auto and k_scale is not None and _cuda_mxfp4_available(q.device):
        from .backends import cuda

        try:  # validated once here; a call this kernel does not take goes to Triton, which checks it again
            checked = cuda.check_cuda_decode(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block,
                                             out, cp_rank, cp_world)
        except ValueError:
            checked = None
        if checked is not None:
            return cuda.score_decode_checked(checked, q, k_cache, k_scale, block_table, seq_lens, S, out, cp_rank,
                                             cp_world)
    if name == "torch":
        from .naive import score_decode_ref

        max_block = check_decode_args(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block, out, cp_rank,
                                      cp_world)[3]
        res = score_decode_ref(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block, cp_rank, cp_world,
                               dtype=torch.float32)
        if out is None:
            return res
        out.copy_(res)
        return out
    if name == "cuda":
        from .backends import cuda

        return cuda.score_decode(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block, out, cp_rank,
                                 cp_world)
    if name in ("flydsl", "aiter"):
        from .backends import get_backend

        impl = get_backend(name)
        ok, why = impl.availability(q.device)
        if not ok:
            raise NotImplementedError(f"score backend {name!r} cannot run here: {why}")
        return impl.score_decode(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block, out, cp_rank,
                                 cp_world)
    if name == "triton":
        from .triton import score_decode_triton

        fmt, batch, _, max_block, sm_scale = check_decode_args(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale,
                                                               max_block, out, cp_rank, cp_world)
        return score_decode_triton(q, k_cache, k_scale, fmt, batch, max_block, block_table, seq_lens, S, sm_scale, out,
                                   cp_rank, cp_world)
    raise NotImplementedError(f"score backend {name!r} is not available in this build")


_CUDA_FALLBACK_LOGGED = set()


def prepare_decode(device, storage_is_mxfp4: bool) -> str:
    """Build now whatever the auto decode path of ``device`` compiles at first use (the CUDA MXFP4
    kernel: about 45 s the first time, then SGLang's on-disk JIT cache), so a server pays it at
    start-up, before any CUDA graph is captured. Returns the backend auto decode will use."""
    device = torch.device(device)
    name = resolve_backend(device)
    if name == "triton" and storage_is_mxfp4 and (os.environ.get(ENV_BACKEND, "auto") == "auto") \
            and _cuda_mxfp4_available(device):
        return "cuda"
    return name


def _cuda_mxfp4_available(device) -> bool:
    """Whether auto may use the CUDA MXFP4 kernel on ``device`` (building it on first use); logs once
    per device why not on NVIDIA sm_90+ GPUs, where it was expected (older GPUs and ROCm use Triton
    without a word). A failed build falls back the same way."""
    from .backends import cuda

    ok = cuda.ensure_built(device)  # availability, then the build (once; later calls hit the cache)
    if not ok and device not in _CUDA_FALLBACK_LOGGED and not getattr(torch.version, "hip", None) \
            and torch.cuda.get_device_capability(device) >= cuda.MIN_CAPABILITY:
        _CUDA_FALLBACK_LOGGED.add(device)
        logger.warning("MXFP4 decode scorer: using Triton on %s (%s)", device, cuda.availability(device)[1])
    return ok


def score_and_select_decode(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block=None, out=None,
                            cp_rank=0, cp_world=1, topk=None, backend=None):
    """Decode scores and the MSA top-k blocks of each row: ``(scores, int32 [H, batch*S, topk])``.

    Scores as ``score_decode``; blocks as ``select.select_blocks`` on them with each row's visible
    block count (``visible_blocks(seq_len - S + tok, 128)``). Without context parallelism only
    (``cp_world == 1``): a CP shard holds a subset of the blocks, so selection needs every rank.
    No host synchronisation on the GPU path.
    """
    from ...formats import PAGE_SIZE, TOPK_BLOCKS
    from ..select import select_blocks, visible_blocks

    if cp_world != 1:
        raise ValueError(f"score_and_select_decode needs cp_world == 1 (selection sees every block), got {cp_world}")
    scores = score_decode(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block, out, cp_rank, cp_world,
                          backend)
    positions = (seq_lens.long()[:, None] - S + torch.arange(S, device=q.device)).flatten()
    n_visible = visible_blocks(positions, PAGE_SIZE).clamp(max=scores.shape[2])
    return scores, select_blocks(scores, n_visible, TOPK_BLOCKS if topk is None else topk)


@dataclass(frozen=True)
class PrefillPlan:
    """One prefill batch's plan, made on the host once and reused by every layer's ``score_prefill``:
    the Triton path's work map (``tiles`` int32 ``[n_tiles, 2]`` on the device, ``rows`` per tile)
    for ``H`` heads, built from lengths the caller already holds on the host, so no layer reads
    lengths back from the device. Other backends ignore it."""

    tiles: torch.Tensor
    rows: int
    H: int
    batch: int
    num_tokens: int


def plan_prefill(cu_seqlens_q: list[int], seq_lens: list[int], H: int, device) -> PrefillPlan:
    """``PrefillPlan`` of a batch from host lists: ``cu_seqlens_q`` (``batch + 1`` offsets of the new
    tokens) and ``seq_lens`` (``batch`` total lengths); ValueError as ``score_prefill``'s checks."""
    from .common import check_prefill_offsets
    from .triton import prefill_tiles

    cu, lens = [int(x) for x in cu_seqlens_q], [int(x) for x in seq_lens]
    check_prefill_offsets(cu, lens, cu[-1] if cu else 0)
    tiles, rows = prefill_tiles(cu, H, device)
    return PrefillPlan(tiles, rows, H, len(lens), cu[-1])


def score_prefill(q, k_cache, k_scale, block_table, seq_lens, cu_seqlens_q, sm_scale, max_block=None, out=None,
                  backend=None, plan: PrefillPlan | None = None):
    """Prefill block scores ``fp32 [H, total_new_tokens, max_block]`` (contract: ``naive.score_prefill_ref``).

    ``plan``: ``plan_prefill`` of the same lengths (the caller's promise), which spares the Triton
    path its host reads of ``cu_seqlens_q`` and ``seq_lens``; without it they cost one sync each."""
    name = resolve_backend(q.device, backend, op="prefill")
    if name == "triton":
        from .common import check_prefill_lengths
        from .triton import score_prefill_triton

        fmt, batch, H, max_block, sm_scale = check_prefill_args(q, k_cache, k_scale, block_table, seq_lens,
                                                                cu_seqlens_q, sm_scale, max_block, out)
        if plan is None:
            check_prefill_lengths(q, seq_lens, cu_seqlens_q)
        elif (plan.H, plan.batch, plan.num_tokens, plan.tiles.device) != (H, batch, q.shape[0], q.device):
            raise ValueError(f"plan was made for H={plan.H}, batch={plan.batch}, {plan.num_tokens} new tokens on "
                             f"{plan.tiles.device}; this call has H={H}, batch={batch}, {q.shape[0]} on {q.device}")
        tiles = None if plan is None else (plan.tiles, plan.rows)
        return score_prefill_triton(q, k_cache, k_scale, fmt, max_block, block_table, seq_lens, cu_seqlens_q, sm_scale,
                                    out, tiles)
    if name == "torch":
        from .naive import score_prefill_ref

        max_block = check_prefill_args(q, k_cache, k_scale, block_table, seq_lens, cu_seqlens_q, sm_scale, max_block,
                                       out)[3]
        res = score_prefill_ref(q, k_cache, k_scale, block_table, seq_lens, cu_seqlens_q, sm_scale, max_block,
                                dtype=torch.float32)
        if out is None:
            return res
        out.copy_(res)
        return out
    raise NotImplementedError(f"score backend {name!r} is not available in this build")
