"""FlyDSL decode scorer for AMD gfx950 (MI350/MI355X).

Importing this package imports neither FlyDSL nor the kernel: ``run`` loads them on
first use, so a machine without FlyDSL (every NVIDIA or CPU box) imports ``sglang_m3`` unharmed.
The kernel has been compile-checked to gfx950 assembly on a CPU machine; it has not run on a GPU.
"""

import functools
import importlib.util

import torch

from ...common import run_guarded

TARGET_ARCH = "gfx950"
NAME = "flydsl"


def is_installed() -> bool:
    """FlyDSL importable (the ``amd`` extra)."""
    return importlib.util.find_spec("flydsl") is not None


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def device_arch(device) -> str | None:
    """``gfxNNN`` of a ROCm device, None for CPU or CUDA devices."""
    device = torch.device(device)
    if device.type != "cuda" or not getattr(torch.version, "hip", None):
        return None
    return torch.cuda.get_device_properties(device).gcnArchName.split(":", 1)[0]


def availability(device=None) -> tuple[bool, str]:
    """``(True, "")`` if this backend can run on ``device`` (default: the current GPU), else
    ``(False, reason)``. Cached per device (a plan asks once per batch)."""
    device = torch.device(default_device() if device is None else device)
    return _availability(device.type, device.index)


@functools.lru_cache(maxsize=None)
def _availability(device_type: str, index: int | None) -> tuple[bool, str]:
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    if not is_installed():
        return False, "flydsl is not installed (pip install 'sglang-m3[amd]')"
    arch = device_arch(device)
    if arch != TARGET_ARCH:
        what = arch or "not a ROCm GPU"
        return False, f"the FlyDSL scorer targets ROCm {TARGET_ARCH}; {torch.device(device)} is {what}"
    return True, ""


def is_available(device=None) -> bool:
    """``device`` defaults to the current GPU (or the CPU when there is none)."""
    return availability(device)[0]


def check_plan(plan, batch) -> None:
    """The plan-time rules of this kernel (``ops.score.plan_decode`` calls it once): 32-bit offsets of
    ``block_table``, ``out`` and a contiguous Q of the batch."""
    from .checks import check_flydsl_plan

    check_flydsl_plan(plan.H, plan.S, plan.batch, plan.max_block, plan.block_table, plan.out)


def run(plan, q, cache, out, nt_k=None):
    """Decode block scores of ``plan`` for ``q`` over ``cache`` into ``out`` (contract: ``ops.score.score_decode``,
    which checked the call). ``nt_k``: K tiles whose loads are issued ahead. The kernel takes page ids as given
    and does not look for NaN / Inf in q: it runs under ``common.run_guarded`` (ids outside the cache score
    -inf and are never handed to it; a non-finite query vector scores NaN), a few small device ops per layer."""
    return run_guarded(plan, q, cache, out, functools.partial(_launch, nt_k=nt_k))


def _launch(plan, q, cache, out, nt_k=None):
    """The FlyDSL launch of a planned batch (``host.run``; FlyDSL is imported on first use)."""
    from .host import run as launch

    return launch(plan, q, cache, out, nt_k)
