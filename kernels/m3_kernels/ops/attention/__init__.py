"""Main-head attention over MSA-selected blocks, CPU path (CUDA uses SGLang's own Triton kernels).

``cpu.py`` holds the serving kernels, ``naive.py`` the masked whole-context reference they follow.
"""

from .cpu import (  # noqa: F401
    dense_attention_decode_cpu,
    dense_attention_extend_cpu,
    sparse_attention_decode_cpu,
    sparse_attention_extend_cpu,
)
