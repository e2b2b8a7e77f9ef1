"""Compile-only lowering of a FlyDSL launcher to GPU assembly, for machines without ROCm.

FlyDSL's own pipeline ends in ``gpu-module-to-binary{format=fatbin}``, which needs ROCm's
``ld.lld``. Here the same traced module runs every pass before that step and then
``gpu-module-to-binary{format=isa}``, which LLVM's AMDGPU backend serves in-process: the result
is the real assembly of the kernel for the chosen ``gfx`` target (no object, no link, nothing run).

This uses FlyDSL 0.5.0 internals (``JitFunction._trace``, ``MlirCompiler.prepare``), pinned by
the ``amd`` extra; a FlyDSL upgrade must re-check it.
"""

import os
import re
from contextlib import contextmanager

ARCH_ENV = ("ARCH", "FLYDSL_GPU_ARCH")  # FlyDSL's compile target and its device-query override


@contextmanager
def compile_only_env(arch: str):
    """``COMPILE_ONLY=1`` and ``arch`` as target for the duration (FlyDSL reads these lazily)."""
    keys = ("COMPILE_ONLY", *ARCH_ENV, "FLYDSL_RUNTIME_ENABLE_CACHE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(COMPILE_ONLY="1", ARCH=arch, FLYDSL_GPU_ARCH=arch, FLYDSL_RUNTIME_ENABLE_CACHE="0")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def lower_to_isa(launcher, *args, arch: str = "gfx950", **kwargs) -> str:
    """Trace ``launcher(*args, **kwargs)`` (a ``@flyc.jit``) for ``arch`` and return its assembly text."""
    from flydsl._mlir import ir
    from flydsl.compiler import jit_function as jf
    from flydsl.compiler.backends import get_backend
    from flydsl.compiler.kernel_function import CompilationContext

    with compile_only_env(arch):
        launcher._ensure_sig()
        bound = launcher._sig.bind(*args, **kwargs)
        bound.apply_defaults()
        launcher._resolve_arguments(bound.arguments)
        backend = get_backend()
        hints = launcher._effective_compile_hints()
        with jf._create_mlir_context() as ctx, CompilationContext.compile_hints(hints):
            traced = launcher._trace(ctx, launcher._sig, bound, None, execute=False)
            asm, cfg = jf.MlirCompiler.prepare(traced.module, backend=backend, compile_hints=hints, link_libs=None)
            module = ir.Module.parse(asm)
            passes = [f for f in cfg.fragments if not f.strip().startswith("gpu-module-to-binary")]
            passes.append('gpu-module-to-binary{format=isa opts="" section= toolkit=}')
            jf._run_pipeline(module, passes, verifier=True, print_after_all=False)
            return jf._extract_isa_text(module.operation.get_asm(enable_debug_info=False))


_INSTR = re.compile(r"^\s+([a-z][a-z0-9_]*)\b", re.M)
_META = re.compile(r"^\s+\.([a-z_]+)\s+(\S+)", re.M)


def instruction_counts(isa: str) -> dict:
    """``{mnemonic: count}`` over the instruction lines of ``isa`` (directives excluded)."""
    counts = {}
    for name in _INSTR.findall(isa):
        counts[name] = counts.get(name, 0) + 1
    return counts


def kernel_resources(isa: str) -> dict:
    """Register and scratch usage from the kernel descriptor (``.amdhsa_*`` / ``.set`` lines)."""
    res = {}
    for key in ("private_segment_fixed_size", "next_free_vgpr", "next_free_sgpr", "accum_offset"):
        m = re.search(rf"\.amdhsa_{key}\s+(\d+)", isa)
        if m:
            res[key] = int(m.group(1))
    for key in ("num_vgpr", "num_agpr", "private_seg_size"):
        m = re.search(rf"\.set\s+\S+\.{key},\s*(\d+)", isa)
        if m:
            res[key] = int(m.group(1))
    m = re.search(r"\.vgpr_spill_count:\s+(\d+)", isa)
    if m:
        res["vgpr_spill_count"] = int(m.group(1))
    m = re.search(r"\.sgpr_spill_count:\s+(\d+)", isa)
    if m:
        res["sgpr_spill_count"] = int(m.group(1))
    return res
