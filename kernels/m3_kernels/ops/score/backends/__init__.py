"""Optional decode-scorer backends, each a lazily imported module with the same surface:

``NAME``, ``availability(device) -> (ok, reason)``, ``is_available(device)``,
``check_plan(fmt, S, H, batch, max_block, block_table, out, cp_world)`` (the backend's rules on a batch,
called once by ``ops.score.plan_decode``), ``score_decode(plan, q, cache, out)`` (the run), and
``verify_decode(<a call as loose tensors>) -> (ok, reason)``.

- ``cuda``: our CUDA C++ MXFP4 kernel for NVIDIA sm_90+ (built by SGLang's JIT loader).
- ``flydsl``: our FlyDSL kernel for ROCm gfx950.
- ``aiter``: aiter's installed MXFP4 scorer (``score_flydsl_fp4``), when present.
"""

import importlib

NAMES = ("cuda", "flydsl", "aiter")


def get_backend(name: str):
    """The backend module ``name`` (imports only that module; its kernel loads on first call)."""
    if name not in NAMES:
        raise ValueError(f"score backend must be one of {list(NAMES)}, got {name!r}")
    return importlib.import_module(f".{name}", __name__)
