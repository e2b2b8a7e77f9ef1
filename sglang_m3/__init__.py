"""sglang-m3: MiniMax-M3.1 for SGLang with an MXFP4 (or fp8, bf16) sparse-attention index cache."""
