"""CUDA C++ MXFP4 decode scorer for NVIDIA Hopper (sm_90), built at first use by SGLang's JIT loader.

The kernel (``decode_mxfp4.cuh``, beside this file) has an explicit register layout: dims permuted
so that a thread's ``mma.sync`` fragment of a token row is one whole MX group, e2m1 decoded to fp16
with shifts, masks and byte permutes, one exact fp16 multiply per pair for the group scale, and a
per-warp ring of page buffers filled by bulk copies. Its docstring states the numerics.

``load_jit`` (TVM-FFI + nvcc; ``sglang.jit_kernel.utils`` in 0.5.16, ``sglang.kernels.jit.utils``
in newer releases) compiles it for the current GPU on the first
call and caches the module on disk. Importing this package imports neither SGLang nor TVM-FFI;
where either, nvcc or a Hopper GPU is missing, ``availability`` says why and the dispatcher keeps
the Triton kernel (one log line).
"""

import functools
import importlib.util
import logging
import os
import pathlib
import shutil
import sys

import torch

from .....formats import IndexKFormat
from ....pdl import use_pdl
from ...common import aligned_q

NAME = "cuda"
SOURCE = pathlib.Path(__file__).with_name("decode_mxfp4.cuh")
MIN_CAPABILITY = (9, 0)  # bulk copies on mbarriers (cp.async.bulk) are sm_90+
MAX_QUERY_VECTORS = 32  # S * H: 4 tiles of 8 MMA columns

logger = logging.getLogger(__name__)
_build_error: str | None = None  # set when the JIT build failed once: this backend is then unavailable


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def availability(device=None) -> tuple[bool, str]:
    """``(True, "")`` if this backend can run on ``device`` (default: the current GPU), else
    ``(False, reason)``. Cached per device."""
    device = torch.device(default_device() if device is None else device)
    return _availability(device.type, device.index)


@functools.lru_cache(maxsize=None)
def _availability(device_type: str, index: int | None) -> tuple[bool, str]:
    if device_type != "cuda" or getattr(torch.version, "hip", None):
        return False, "the CUDA scorer needs an NVIDIA GPU"
    cap = torch.cuda.get_device_capability(index)
    if cap < MIN_CAPABILITY:
        return False, f"the CUDA scorer needs sm_90 or newer (bulk copies), this GPU is sm_{cap[0]}{cap[1]}"
    if not (_importable("sglang") and _importable("tvm_ffi")):
        return False, "SGLang's JIT loader (sglang.jit_kernel, apache-tvm-ffi) is not installed"
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    if shutil.which("nvcc") is None and not (pathlib.Path(cuda_home) / "bin" / "nvcc").exists():
        return False, "nvcc is not on PATH or in $CUDA_HOME/bin (the kernel is compiled at first use)"
    if _build_error is not None:
        return False, f"the JIT build failed: {_build_error}"
    return True, ""


def _importable(name: str) -> bool:
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def is_available(device=None) -> bool:
    return availability(device)[0]


def check_plan(plan, batch) -> None:
    """This kernel's rules on a decode batch (``plan_decode`` calls it once): an MXFP4 cache and
    ``S * H <= 32`` query vectors per request; ValueError otherwise. (Q's 16-byte alignment is met at
    run time: ``run`` copies a misaligned Q once, the kernel reads it in 16-byte vectors.)"""
    if plan.fmt is not IndexKFormat.MXFP4:
        raise ValueError(f"the CUDA scorer reads MXFP4 caches only, got a {plan.fmt.value} cache")
    if plan.S * plan.H > MAX_QUERY_VECTORS:
        raise ValueError(f"the CUDA scorer takes S * H <= {MAX_QUERY_VECTORS} query vectors, got S={plan.S}, "
                         f"H={plan.H}")


def load_module(source=SOURCE, name="m3_score_decode_mxfp4"):
    """The TVM-FFI module compiled from ``source`` (built, or loaded from SGLang's JIT cache) under
    ``name``, for ``run(plan, q, cache, out, module=)``. The benchmark passes an earlier revision of
    the source to time it beside this one."""
    try:
        from sglang.jit_kernel.utils import load_jit  # SGLang 0.5.16
    except ImportError:
        from sglang.kernels.jit.utils import load_jit  # newer releases (0.5.23)

    return load_jit(name, cuda_files=[str(pathlib.Path(source).resolve())],  # SGLang resolves relative paths elsewhere
                    cuda_wrappers=[("score_decode_mxfp4", "m3_mxfp4::score_decode_mxfp4")])


@functools.lru_cache(maxsize=None)
def _module():
    """This source's module, built once per process."""
    return load_module()


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def build(device=None) -> None:
    """Compile (or load) the kernel now, e.g. before CUDA-graph capture; RuntimeError if it cannot run.
    A failed build is remembered: ``availability`` then says why, and auto dispatch keeps Triton."""
    global _build_error
    ok, why = availability(device)
    if not ok:
        raise RuntimeError(f"CUDA scorer unavailable: {why}")
    try:
        _module()
    except Exception as e:  # a compiler or loader failure, not a caller's mistake
        _build_error = f"{type(e).__name__}: {e}"[:1000]
        _availability.cache_clear()
        raise RuntimeError(f"CUDA scorer build failed: {_build_error}") from e


def ensure_built(device=None) -> bool:
    """``build`` without raising: True when the kernel is ready, False (the reason in ``availability``)."""
    try:
        build(device)
    except RuntimeError:
        return False
    return True


def run(plan, q, cache, out, module=None, pdl=None):
    """Decode block scores of ``plan`` (``ops.score.plan_decode``, which checked the batch, this kernel's rules
    and its availability) for ``q [batch*S, H, 128]`` bf16 | e4m3 over the MXFP4 ``cache`` into ``out``
    (``ops.score.score_decode`` checked all three), written up to each request's last visible page.
    ``module``: another build of the kernel with the same launcher signature (``load_module``; the
    benchmark's baseline), else this source's. ``pdl``: programmatic dependent launch (default
    ``ops.pdl.use_pdl``).

    A page id outside the cache is read as page 0 inside the kernel and scores -inf (``naive.py``'s rule).
    """
    if plan.batch == 0 or plan.max_block == 0:
        return out
    q = aligned_q(q)  # a view at an odd offset: copied once (the kernel reads Q in 16-byte vectors)
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    (module or _module()).score_decode_mxfp4(q.view(torch.uint8), cache.data, cache.scale_e8m0, plan.block_table,
                                             plan.seq_lens, out, int(q.dtype != torch.bfloat16), plan.S,
                                             plan.max_block, plan.cp_rank, plan.cp_world, plan.sm_scale,
                                             _num_sms(index), int(use_pdl(q.device) if pdl is None else pdl))
    return out
