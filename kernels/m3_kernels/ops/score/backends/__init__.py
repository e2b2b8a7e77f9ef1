"""The block-scorer backends, each a module with the same surface:

``check_plan(plan, batch)`` (the backend's rules on a batch and its work map, returned as the plan's
``work``; called once by ``ops.score.plan_decode`` / ``plan_prefill``) and ``run(plan, q, cache, out)``
(the run a plan binds: validates nothing, ``ops.score.score_decode`` / ``score_prefill`` checked the call).
The optional ones also offer ``availability(device) -> (ok, reason)``.

- ``torch``: the fast torch scorers (CPU; any device when forced), decode and prefill.
- ``triton``: the portable Triton scorers (CUDA and ROCm), decode and prefill.
- ``triton_sm90``: the sm_90 prefill scorer (NVIDIA Hopper).
- ``cuda``: our CUDA C++ MXFP4 decode kernel for NVIDIA sm_90+ (built by SGLang's JIT loader).
- ``flydsl``: our FlyDSL decode kernel for ROCm gfx950.
- ``aiter``: aiter's installed MXFP4 decode scorer (``score_flydsl_fp4``), when present.
"""

import importlib

OPS = {"torch": ("decode", "prefill"), "triton": ("decode", "prefill"), "triton_sm90": ("prefill",),
       "cuda": ("decode",), "flydsl": ("decode",), "aiter": ("decode",)}


def get_backend(name: str, op: str | None = None):
    """The backend module ``name`` (imported at plan time, never on a layer's path); with ``op``,
    NotImplementedError where it has no scorer for that op."""
    if name not in OPS:
        raise NotImplementedError(f"score backend {name!r} is not available in this build; known: {list(OPS)}")
    if op is not None and op not in OPS[name]:
        raise NotImplementedError(f"score backend {name!r} has no {op} scorer")
    return importlib.import_module(f".{name}", __name__)


def check_available(module, device) -> None:
    """NotImplementedError where backend ``module`` cannot run on ``device`` (its ``availability``)."""
    if hasattr(module, "availability"):
        ok, why = module.availability(device)
        if not ok:
            raise NotImplementedError(f"score backend {module.NAME!r} cannot run here: {why}")
