"""MiniMax-M3.1 for SGLang: SGLang's MiniMax-M3 model with the index-K cache chosen by config.

The layers are SGLang's own (``sglang.srt.models.minimax_m3``); what differs lives elsewhere in
this package (pool, backend). This class adds what serving on a CPU needs, scoped to its own
construction and modules:

- rotary: off CUDA, SGLang's rotary layer imports ``vllm._custom_ops`` unless its module thinks it
  runs on the CPU engine; construction flips that module flag for the duration, so the layer
  keeps its pure-torch forward;
- router: the bf16 router GEMM (``torch.mm(..., out_dtype=float32)``) has no CPU kernel, so the
  router runs as an fp32 linear;
- routed scale: SGLang's torch top-k cannot scale the routed weights itself, so the routing
  weights are multiplied by ``routed_scaling_factor`` right after top-k (same result);
- per-head norms: SGLang's ``GemmaRMSNorm`` (q, k and index q/k norms) makes five full-size fp32 passes
  off CUDA; off CUDA their forward is ``m3_kernels.ops.norm.gemma_rms_norm_cpu``, the same arithmetic over
  cache-sized chunks of rows (bit for bit; at a 4k prefill a sixth of the time went there);
- norm + RoPE: the per-head q/k norms and RoPE after them (main and index heads) run as one chunked pass,
  ``m3_kernels.ops.norm.gemma_rms_norm_rope_cpu``, bit for bit SGLang's norm then its ``forward_native`` RoPE
  (taken only where that is the RoPE SGLang would run: a plain ``RotaryEmbedding`` dispatching to it);
- activations: SGLang's ``swigluoai`` for the dense MLP and the interleaved one its torch MoE path
  calls are ``torch.compile`` functions, which on a CPU compile C++ at the first prefill and again
  at the first decode (tens of seconds on a 2-core box, paid by the first request); off CUDA the
  same formulas run eagerly (the MoE one by replacing the name in ``fused_moe_native``, the module
  that calls it, when this model is built);
- vocab-parallel embedding (TP > 1): SGLang masks the ids outside a rank's vocab shard with a
  ``torch.compile`` function, compiled in every rank at the first request (20-45 s on a 2-core box);
  off CUDA its undecorated original (``__wrapped__``) runs instead.

On ROCm, SGLang's fused norm + RoPE + cache-store kernel writes bf16 index keys into the cache
itself; with a quantized index cache the pool's writer must do it, so that fusion is switched
off. Its switch also gates ROCm's fused norm + RoPE kernel (no cache store), so that one goes
too: Q/K and index Q/K then take SGLang's separate norm and RoPE layers.

The architecture name stays ``MiniMaxM3SparseForCausalLM``: SGLang keys its M3 pool, backend and
server defaults on it.
"""

import contextlib
import functools
import logging

import torch
from torch import nn

from m3_kernels.ops.norm import gemma_rms_norm_cpu, gemma_rms_norm_rope_cpu
from sglang.srt.layers.layernorm import GemmaRMSNorm
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.models.minimax_m3 import MiniMaxM3Attention, MiniMaxM3MLP, MiniMaxM3MoE
from sglang.srt.models.minimax_m3 import MiniMaxM3SparseForCausalLM as _UpstreamM3

from ..config import index_k_settings

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _torch_rotary_off_cuda():
    """While active (and only off CUDA), SGLang's rotary layer picks its torch path at init."""
    from sglang.srt.layers.rotary_embedding import base as rotary_base

    if torch.cuda.is_available():
        yield
        return
    saved = rotary_base._is_cpu
    rotary_base._is_cpu = True
    try:
        yield
    finally:
        rotary_base._is_cpu = saved


class _ScaledTopK(nn.Module):
    """SGLang's ``TopK`` whose routed weights are multiplied by ``routed_scaling_factor`` after
    selection (for top-k paths that cannot apply the scale themselves)."""

    def __init__(self, topk: nn.Module, routed_scaling_factor: float):
        super().__init__()
        self.inner = topk
        self.routed_scaling_factor = routed_scaling_factor
        topk.topk_config.apply_routed_scaling_factor_on_output = False

    def forward(self, hidden_states, router_logits, **kwargs):
        out = self.inner(hidden_states, router_logits, **kwargs)
        return out._replace(topk_weights=out.topk_weights * self.routed_scaling_factor)

    def empty_topk_output(self, *args, **kwargs):
        return self.inner.empty_topk_output(*args, **kwargs)


def swigluoai_eager(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``[..., 2n] -> [..., n]``: gate and up halves, ``gate*sigmoid(alpha*gate)*(up+1)`` after clamping
    gate to ``<= limit`` and up to ``[-limit, limit]``; SGLang's ``swiglu_no_interleaved_with_alpha_and_limit``
    without ``torch.compile``."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def swiglu_interleaved_eager(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """As ``swigluoai_eager`` with gate and up interleaved (``x[..., ::2]``, ``x[..., 1::2]``); SGLang's
    ``swiglu_gpt_oss_sigmoid_alpha`` without ``torch.compile``."""
    gate, up = x[..., ::2], x[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


PER_HEAD_NORMS = ("q_norm", "k_norm", "index_q_norm", "index_k_norm")


def _gemma_norm_forward_cpu(norm: GemmaRMSNorm, x, residual=None, post_residual_addition=None):
    """``GemmaRMSNorm.forward`` with the chunked CPU kernel for the plain call (the per-head norms make no other)."""
    if residual is not None or x.is_cuda:
        return type(norm).forward(norm, x, residual, post_residual_addition)
    return gemma_rms_norm_cpu(x, norm.weight, norm.variance_epsilon)


def _runs_native_rope(rotary) -> bool:
    """Whether ``rotary`` is a RoPE layer whose forward is SGLang's ``RotaryEmbedding.forward_native``."""
    method = getattr(rotary, "_forward_method", None)
    return (isinstance(rotary, RotaryEmbedding) and getattr(method, "__func__", None) is RotaryEmbedding.forward_native
            and not hasattr(rotary, "sin_cos_cache"))


def _norm_rope_cpu(norm: GemmaRMSNorm, rotary, positions, x, head_dim: int):
    return gemma_rms_norm_rope_cpu(x, norm.weight, norm.variance_epsilon, positions.flatten(), rotary.cos_sin_cache,
                                   head_dim, rotary.rotary_dim, rotary.is_neox_style)


def _qk_norm_rope_cpu(attn: MiniMaxM3Attention, positions, q, k):
    """``MiniMaxM3Attention._qk_norm_rope`` (per-head Gemma norms, then RoPE) in one chunked pass per tensor."""
    if q.is_cuda or not _runs_native_rope(attn.rotary_emb):
        return type(attn)._qk_norm_rope(attn, positions, q, k)
    return tuple(_norm_rope_cpu(norm, attn.rotary_emb, positions, x, attn.head_dim)
                 for norm, x in ((attn.q_norm, q), (attn.k_norm, k)))


def _index_qk_norm_rope_cpu(attn: MiniMaxM3Attention, positions, idx_q, idx_k):
    """``MiniMaxM3Attention._index_qk_norm_rope`` likewise, for the index heads."""
    if idx_q.is_cuda or not _runs_native_rope(attn.index_rotary_emb):
        return type(attn)._index_qk_norm_rope(attn, positions, idx_q, idx_k)
    return tuple(_norm_rope_cpu(norm, attn.index_rotary_emb, positions, x, attn.idx_head_dim)
                 for norm, x in ((attn.index_q_norm, idx_q), (attn.index_k_norm, idx_k)))


def _fp32_router_logits(moe: MiniMaxM3MoE, hidden_states: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(hidden_states.float(), moe.gate.weight.float())


def _vocab_shard_mask_eager() -> None:
    """At TP > 1 SGLang's vocab-parallel embedding masks the ids outside a rank's shard with a ``torch.compile``
    function, compiled in every rank at the first request (20-45 s on a 2-core box); off CUDA its undecorated
    original runs instead (same ops)."""
    from sglang.srt.layers import vocab_parallel_embedding

    compiled = vocab_parallel_embedding.get_masked_input_and_mask
    vocab_parallel_embedding.get_masked_input_and_mask = getattr(compiled, "__wrapped__", compiled)


class MiniMaxM3SparseForCausalLM(_UpstreamM3):
    """SGLang's MiniMax-M3 model, servable on a CPU (see the module docstring)."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        with _torch_rotary_off_cuda():
            super().__init__(config, quant_config=quant_config, prefix=prefix)
        if index_k_settings(config) is not None:
            for module in self.modules():
                if isinstance(module, MiniMaxM3Attention):
                    module._can_use_rocm_sparse_qk_index_norm_rope_static = False
        if not torch.cuda.is_available():
            from sglang.srt.layers.moe import fused_moe_native

            fused_moe_native.swiglu_gpt_oss_sigmoid_alpha = swiglu_interleaved_eager
            _vocab_shard_mask_eager()
            for module in self.modules():
                if isinstance(module, MiniMaxM3Attention):
                    for name in PER_HEAD_NORMS:
                        norm = getattr(module, name, None)
                        if isinstance(norm, GemmaRMSNorm):
                            norm.forward = functools.partial(_gemma_norm_forward_cpu, norm)
                    if module.qk_norm_type == "per_head" and all(
                            isinstance(getattr(module, n, None), GemmaRMSNorm) for n in PER_HEAD_NORMS[:2]):
                        module._qk_norm_rope = functools.partial(_qk_norm_rope_cpu, module)
                    if all(isinstance(getattr(module, n, None), GemmaRMSNorm) for n in PER_HEAD_NORMS[2:]):
                        module._index_qk_norm_rope = functools.partial(_index_qk_norm_rope_cpu, module)
                if isinstance(module, MiniMaxM3MLP) and config.hidden_act == "swigluoai":
                    module.act_fn = functools.partial(swigluoai_eager, alpha=config.swiglu_alpha,
                                                      limit=config.swiglu_limit)
                if isinstance(module, MiniMaxM3MoE):
                    module._compute_router_logits = _fp32_router_logits.__get__(module)
                    module.topk = _ScaledTopK(module.topk, module.routed_scaling_factor)


EntryClass = [MiniMaxM3SparseForCausalLM]
