"""Training a small model with MiniMax-M3's sparse-attention geometry (see ``training.train``)."""
