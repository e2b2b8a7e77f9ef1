"""m3_kernels: MiniMax-M3 index-K cache formats and kernels (writer, block scorers, selector)."""
