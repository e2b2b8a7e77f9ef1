"""Index-cache writer: quantize index K on insert and store it at token slots."""

from ...formats import ScaleRule


def write_index_k(k, loc, k_cache, k_scale, fmt, scale_rule=ScaleRule.RCEIL, sign_seed=None):
    """Store ``k [tokens, 128]`` (fp32/bf16) at slots ``loc [tokens]`` (contract: ``naive.write_index_k_ref``)."""
    from .naive import write_index_k_ref

    write_index_k_ref(k, loc, k_cache, k_scale, fmt, scale_rule, sign_seed)
