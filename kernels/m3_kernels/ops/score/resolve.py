"""The one place that decides which block scorer runs (decode and prefill).

``resolve_backend`` answers from the device, the cache's storage format, the op and the request
(``backend`` argument, else ``$M3_SCORE_BACKEND``, else ``auto``), and logs one line per distinct
choice saying what it chose and why. The plans (``plan_decode``, ``plan_prefill``) call it once per
batch; nothing downstream second-guesses it. See ``docs/design.md`` (where each backend sits).

auto, decode:  torch off-GPU; FlyDSL on ROCm gfx950 (when installed); the CUDA kernel for an
               MXFP4 cache on NVIDIA sm_90+ when it builds and the batch has ``S * H <= 32`` query
               vectors per request; Triton otherwise.
auto, prefill: torch off-GPU; the sm_90 Triton scorer (``triton_sm90``: large query tiles, each page
               decoded once per tile, warpgroup MMA, a device work map) on NVIDIA Hopper; Triton on
               other GPUs.
forced:        the named backend; FlyDSL, aiter and CUDA score decode only and ``triton_sm90`` prefill
               only (forced for the other op they resolve as auto).
"""

import logging
import os
from typing import NamedTuple

import torch

from ...formats import IndexKFormat, parse_format

BACKENDS = ("auto", "torch", "triton", "triton_sm90", "cuda", "flydsl", "aiter")
ENV_BACKEND = "M3_SCORE_BACKEND"
OPS = ("decode", "prefill")

logger = logging.getLogger(__name__)
_LOGGED: set = set()


class Choice(NamedTuple):
    """A resolved backend and the reason, as logged."""

    backend: str
    reason: str


def requested_backend(backend: str | None = None) -> str:
    """``backend``, else ``$M3_SCORE_BACKEND``, else ``"auto"``; ValueError naming the choices otherwise."""
    name = backend or os.environ.get(ENV_BACKEND, "auto")
    if name not in BACKENDS:
        raise ValueError(f"{ENV_BACKEND} / backend must be one of {list(BACKENDS)}, got {name!r}")
    return name


def _sm90_prefill_available(device: torch.device) -> tuple[bool, str]:
    """Whether the sm_90 prefill scorer (``triton_sm90``) runs on ``device``: NVIDIA compute capability 9.x (or the
    CPU under ``TRITON_INTERPRET=1``, for the tests)."""
    from .backends.triton_sm90 import device_ok

    return device_ok(device)


def choose_backend(device, fmt, op: str = "decode", backend: str | None = None,
                   query_vectors: int | None = None) -> Choice:
    """``Choice(backend, reason)`` for an ``op`` (``"decode"`` | ``"prefill"``) over a cache of format ``fmt``
    on ``device``; ``query_vectors``: the decode batch's ``S * H`` (None: unknown, assumed to fit).
    Builds the CUDA kernel on its first auto choice (about 45 s the first time, then SGLang's disk cache)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {list(OPS)}, got {op!r}")
    device = torch.device(device)
    storage = IndexKFormat.MXFP4 if parse_format(fmt).is_mxfp4 else parse_format(fmt)
    requested = requested_backend(backend)
    if requested != "auto":
        if op == "prefill" and requested in ("flydsl", "aiter", "cuda"):
            return Choice(_auto(device, storage, op, query_vectors).backend,
                          f"{requested} scores decode only; prefill resolves as auto")
        if op == "decode" and requested == "triton_sm90":
            return Choice(_auto(device, storage, op, query_vectors).backend,
                          "triton_sm90 scores prefill only; decode resolves as auto")
        if requested == "triton_sm90":
            ok, why = _sm90_prefill_available(device)
            if not ok:
                raise NotImplementedError(f"score backend 'triton_sm90' cannot run here: {why}")
        return Choice(requested, f"forced by {'the backend argument' if backend else ENV_BACKEND}")
    return _auto(device, storage, op, query_vectors)


def _auto(device: torch.device, storage: IndexKFormat, op: str, query_vectors: int | None) -> Choice:
    if device.type != "cuda":
        return Choice("torch", f"auto: {device.type} is not a GPU")
    if op == "prefill":
        ok, why = _sm90_prefill_available(device)
        if ok:
            return Choice("triton_sm90", "auto: prefill on NVIDIA Hopper")
        return Choice("triton", f"auto: GPU prefill ({why})")
    from .backends import flydsl  # light: imports FlyDSL only when a kernel is launched

    if flydsl.is_available(device):
        return Choice("flydsl", "auto: ROCm gfx950 with FlyDSL installed")
    if storage is not IndexKFormat.MXFP4:
        return Choice("triton", f"auto: a {storage.value} cache (the CUDA kernel reads MXFP4 only)")
    from .backends import cuda

    if query_vectors is not None and query_vectors > cuda.MAX_QUERY_VECTORS:
        return Choice("triton", f"auto: S*H = {query_vectors} > {cuda.MAX_QUERY_VECTORS} (the CUDA kernel's limit)")
    if cuda.ensure_built(device):  # availability, then the build (once; later calls hit the cache)
        return Choice("cuda", "auto: MXFP4 decode on NVIDIA sm_90+")
    return Choice("triton", f"auto: the CUDA kernel cannot run here ({cuda.availability(device)[1]})")


def resolve_backend(device, fmt, op: str = "decode", backend: str | None = None,
                    query_vectors: int | None = None) -> str:
    """The backend name ``choose_backend`` picks; logs ``what and why`` once per distinct choice."""
    choice = choose_backend(device, fmt, op, backend, query_vectors)
    key = (str(torch.device(device)), parse_format(fmt).value, op, choice)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("index-K %s scorer on %s for a %s cache: %s (%s)", op, key[0], key[1], choice.backend,
                    choice.reason)
    return choice.backend
