"""Gemma RMSNorm (``x * rsqrt(mean(x^2) + eps) * (1 + weight)``, fp32 inside) for the CPU serving path.

``cpu.py`` holds the serving kernel, ``naive.py`` the reference it equals bit for bit.
"""

from .cpu import gemma_rms_norm_cpu  # noqa: F401
