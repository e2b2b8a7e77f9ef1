"""Main-head attention over MSA-selected blocks, CPU path (CUDA uses SGLang's own Triton kernels).

``cpu.py`` holds the serving kernels, ``naive.py`` the masked whole-context reference they follow.
"""

from .cpu import dense_attention_decode_cpu, sparse_attention_decode_cpu, sparse_attention_extend_cpu  # noqa: F401
