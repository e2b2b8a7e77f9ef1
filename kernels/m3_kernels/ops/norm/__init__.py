"""Gemma RMSNorm (``x * rsqrt(mean(x^2) + eps) * (1 + weight)``, fp32 inside) and the norm followed by RoPE, for
the CPU serving path.

``cpu.py`` holds the serving kernels, ``naive.py`` the references they equal bit for bit.
"""

from .cpu import gemma_rms_norm_cpu, gemma_rms_norm_rope_cpu  # noqa: F401
