"""Programmatic dependent launch (PDL) for the decode scorers and the block selector.

A kernel launched with PDL may start while the kernel before it in the stream is still running. It
must wait (``griddepcontrol.wait``; Triton's ``gdc_wait``) before it touches memory an earlier kernel
writes or reads, and it lets the next PDL kernel start once each of its programs has called
``griddepcontrol.launch_dependents`` (or exited). Every PDL kernel here does both, in that order, as
its first statements: it only takes the launch latency off the critical path, never reads early.
Inside a CUDA graph the edge to such a kernel becomes a programmatic edge. Kernels without the
attribute, before or after ours, are unaffected (they wait for full completion as usual).

Off by default: on an H200 (2026-12-01, docs/perf.md) it took 0-3% off a scorer call but made the
scorer + selector pair up to 3 us slower at 100k-128k tokens, so ``M3_PDL=1`` opts in (NVIDIA sm_90+
only: Triton's launcher and the CUDA scorer); never on ROCm, the CPU or the Triton interpreter.
"""

import functools
import os

import torch

ENV = "M3_PDL"
MIN_CAPABILITY = (9, 0)



def use_pdl(device) -> bool:
    """True if kernels on ``device`` are launched with PDL: ``M3_PDL=1``, CUDA sm_90+, not ROCm, not
    the Triton interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or getattr(torch.version, "hip", None):
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or os.environ.get(ENV, "0") != "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= MIN_CAPABILITY


def triton_launch_kwargs(pdl: bool) -> dict:
    """Extra launch arguments for a Triton kernel that takes a ``USE_PDL`` constexpr."""
    pdl = bool(pdl) and have_triton_gdc()
    return {"USE_PDL": pdl, "launch_pdl": True} if pdl else {"USE_PDL": False}


@functools.lru_cache(maxsize=None)
def have_triton_gdc() -> bool:
    """Triton's grid-dependency ops (``tl.extra.cuda.gdc_*``; absent from some builds: PDL off there).
    Looked up at the first launch, not at import: importing Triton early would keep the kernel tests
    from switching it to the interpreter."""
    try:
        import triton.language.extra.cuda as triton_cuda
    except ImportError:  # pragma: no cover - depends on the Triton build
        return False
    return hasattr(triton_cuda, "gdc_wait") and hasattr(triton_cuda, "gdc_launch_dependents")


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


__all__ = ["ENV", "have_triton_gdc", "triton_launch_kwargs", "use_pdl"]
