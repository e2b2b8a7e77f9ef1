"""FlyDSL decode scorer for AMD gfx950 (MI350/MI355X).

Importing this package imports neither FlyDSL nor the kernel: ``score_decode`` loads them on
first use, so a machine without FlyDSL (every NVIDIA or CPU box) imports ``sglang_m3`` unharmed.
The kernel has been compile-checked to gfx950 assembly on a CPU machine; it has not run on a GPU.
"""

import functools
import importlib.util

import torch

from ...common import supported

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
    ``(False, reason)``. Cached per device: the dispatcher asks on every decode call."""
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


def verify_decode(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block=None, out=None, cp_rank=0,
                  cp_world=1) -> tuple[bool, str]:
    """``(ok, reason)`` for a ``score_decode`` call: the shared argument rules, this kernel's
    alignment and 32-bit offset rules, then hardware availability. Never raises."""
    from .checks import check_flydsl_decode

    ok, reason = supported(check_flydsl_decode, q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, max_block,
                           out, cp_rank, cp_world)
    if not ok:
        return ok, reason
    return availability(q.device)


def check_plan(fmt, S, H, batch, max_block, block_table, out, cp_world) -> None:
    """The plan-time rules of this kernel (``ops.score.plan_decode``'s hook): 32-bit offsets of
    ``block_table``, ``out`` and a contiguous Q of the batch."""
    from .checks import check_flydsl_plan

    check_flydsl_plan(H, S, batch, max_block, block_table, out)


def score_decode(plan, q, cache, out=None, nt_k=None):
    """Decode block scores of ``plan`` for ``q`` over ``cache`` (contract: ``ops.score.score_decode``);
    checks nothing (the plan did). ``nt_k``: K tiles whose loads are issued ahead."""
    from .host import run

    return run(plan, q, cache, out, nt_k)
