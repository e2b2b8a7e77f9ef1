"""A trainable torch model with MiniMax-M3's attention geometry, numerically SGLang's M3 forward.

``MSAForCausalLM`` computes the same function as SGLang 0.5.16's ``MiniMaxM3SparseForCausalLM``
(``sglang.srt.models.minimax_m3``) for configs whose MLPs are all dense (``moe_layer_freq`` all 0;
MoE layers raise), and its ``state_dict()`` names are the checkpoint names SGLang's
``load_weights`` reads (``training.export`` writes them as safetensors). Per decoder layer::

    x = norm1(h);  h = h + attn(x);  h = h + mlp(norm2(h))        (norms: Gemma RMSNorm, x * (1 + w))
    attn: q/k/v projections; per-head RMSNorm on q and k; partial NeoX RoPE (first rotary_dim dims);
          softmax(q k^T / sqrt(head_dim)) v with GQA (query head h reads KV head h // group); o_proj
    mlp:  swigluoai  clamp(g, max=L) * sigmoid(alpha * clamp(g, max=L)) * (clamp(u, -L, L) + 1),  or silu

then the final norm and an untied ``lm_head``. Sparse layers (``sparse_attention_freq``) add the MSA
index branch, selection only (``sparse_disable_index_value``): one index-query head per KV head and
one shared index key (``index_q_proj``, ``index_k_proj``), each with its own per-head RMSNorm and the
same RoPE as the main attention. Block score of index head h for a query at position i::

    s[h, i, p] = max over tokens t <= i of block p (block_size tokens) of  q_idx[i, h] . k_idx[t] / sqrt(index_dim)

Each query attends to the causally visible tokens of its selected blocks: the best
``topk - init - local`` non-local blocks ranked by (-score, block id), the sink and local blocks
always, every visible block when it sees at most ``topk`` (``m3_kernels.ops.select.select_blocks``,
the selector SGLang serves with). ``attention="dense"`` runs full causal attention instead.
Selection is discrete: main-attention gradients flow through the selected keys only and the LM loss
never reaches the index branch.

Indexer training (MSA paper, arXiv:2606.13392, Lai et al. 2026: "a KL loss aligns the index
distribution with the group-averaged main distribution on the selected blocks"; gradient detach,
indexer warm-up, forced local block). For every sparse layer and query row ``r`` in ``kl_rows``:

- target ``p``: the layer's main-attention probabilities (softmax of q.k / sqrt(head_dim) over the
  keys the row attends to: all causal keys in dense mode, the selected blocks' in sparse mode),
  averaged over the query heads of each KV group and summed per block; detached;
- index distribution ``q``: softmax of the block scores ``s`` over the same blocks (all visible
  blocks in dense mode, the selected ones in sparse mode);
- ``loss = KL(p || q)``, averaged over rows, KV heads and batch, then over sparse layers.

The index branch reads a detached copy of its input, so the KL trains only ``index_q_proj``,
``index_k_proj``, ``index_q_norm`` and ``index_k_norm``. Warm-up (training the indexer against
dense attention before switching to sparse) is the caller's choice of ``attention`` per step.
``aux["recall"]`` is the dense attention mass that the selection keeps (1.0 = lossless).

Attention kernels: dense mode uses ``F.scaled_dot_product_attention``; sparse mode uses
``flex_attention`` (compiled once) on CUDA with a block mask built from the union of the blocks
the 128 rows of each query block select, and a chunked masked attention elsewhere. Block scores
for selection are computed over row chunks (memory ``T x n_blocks`` per head, never ``T x T``).
"""

import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from m3_kernels.formats import INDEX_DIM, PAGE_SIZE, dequantize_index_k, parse_format, prepare_index_q, quantize_index_k
from m3_kernels.ops.select import select_blocks, visible_blocks

ATTENTION_MODES = ("dense", "sparse")
SPARSE_BACKENDS = ("auto", "flex", "masked")
_CHUNK_ELEMENTS = 2**27  # fp32 elements of one [B, H, rows, keys] temporary on a GPU (512 MiB)
_CPU_CHUNK_ELEMENTS = 2**22  # on the CPU (16 MiB): cache-sized temporaries ran 2.5-3.4x faster on a 2-core box


def _chunk_elements(device: torch.device) -> int:
    """Elements of one chunked temporary on ``device``."""
    return _CHUNK_ELEMENTS if device.type == "cuda" else _CPU_CHUNK_ELEMENTS


# ---- config ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MSAConfig:
    """The HF ``config.json`` keys SGLang's MiniMax-M3 model reads, validated for dense MLPs."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    use_gemma_norm: bool
    hidden_act: str
    swiglu_alpha: float
    swiglu_limit: float
    dense_intermediate_size: int
    sparse_layers: tuple  # bool per layer
    index_dim: int
    num_index_heads: int
    topk_blocks: int
    block_size: int
    local_blocks: int
    init_blocks: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def sparse_layer_ids(self) -> list:
        return [i for i, s in enumerate(self.sparse_layers) if s]

    @classmethod
    def from_json(cls, path) -> "MSAConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, d: dict) -> "MSAConfig":
        """Validate ``d`` (a MiniMax-M3 ``config.json``) against what this model and SGLang's support.

        Raises ValueError naming the key for MoE layers, tied embeddings, RoPE scaling, index
        values, a norm type other than ``per_head`` or a geometry the served kernels reject.
        """
        if "text_config" in d:
            raise ValueError("config has a text_config: pass the text config (MiniMaxM3SparseForCausalLM) itself")
        L = _need(d, "num_hidden_layers")
        hidden = _need(d, "hidden_size")
        n_heads = _need(d, "num_attention_heads")
        n_kv = _need(d, "num_key_value_heads")
        head_dim = d.get("head_dim") or hidden // n_heads
        moe = d.get("moe_layer_freq")
        if moe is None or len(moe) != L:
            raise ValueError(f"moe_layer_freq must list {L} layers (SGLang makes every layer MoE without it), got {moe}")
        if any(f != 0 for f in moe):
            raise ValueError(f"moe_layer_freq has MoE layers {[i for i, f in enumerate(moe) if f]}: this model has "
                             "dense MLPs only (dense_intermediate_size); set moe_layer_freq to all 0")
        if "num_local_experts" not in d:
            raise ValueError("num_local_experts is missing: SGLang's load_weights reads it even with no MoE layer")
        if d.get("tie_word_embeddings", False):
            raise ValueError("tie_word_embeddings must be false: SGLang's M3 loads lm_head.weight and never ties it")
        if d.get("rope_parameters") is not None:
            raise ValueError("rope_parameters is not read by this model: give rope_theta (and no rope_scaling)")
        if d.get("rope_scaling") is not None:
            raise ValueError(f"rope_scaling must be null (plain RoPE), got {d['rope_scaling']}")
        if d.get("qk_norm_type", "per_layer") != "per_head":
            raise ValueError(f"qk_norm_type must be 'per_head' (SGLang's sparse layers need it), got {d.get('qk_norm_type')!r}")
        act = d.get("hidden_act", "silu")
        if act not in ("swigluoai", "silu"):
            raise ValueError(f"hidden_act must be 'swigluoai' or 'silu', got {act!r}")
        if n_heads % n_kv:
            raise ValueError(f"num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv})")
        rotary_dim = d.get("rotary_dim", head_dim)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        sc = d.get("sparse_attention_config")
        if not sc or not sc.get("use_sparse_attention", True):
            raise ValueError("sparse_attention_config with use_sparse_attention true is required")
        freq = sc.get("sparse_attention_freq")
        if freq is None or len(freq) != L:
            raise ValueError(f"sparse_attention_freq must list {L} layers, got {freq}")
        sparse = tuple(f != 0 for f in freq)
        no_value = sc.get("sparse_disable_index_value") or []
        with_value = [i for i in range(L) if sparse[i] and not (i < len(no_value) and no_value[i])]
        if with_value:
            raise ValueError(f"sparse_disable_index_value must be 1 on every sparse layer (selection-only index "
                             f"branch, as MiniMax-M3); layers {with_value} would need index_v_proj/index_o_proj")
        if sc.get("sparse_score_type", "max") != "max":
            raise ValueError(f"sparse_score_type must be 'max', got {sc.get('sparse_score_type')!r}")
        if sc.get("sparse_block_size") != PAGE_SIZE:
            raise ValueError(f"sparse_block_size must be {PAGE_SIZE} (one index-cache page), got {sc.get('sparse_block_size')}")
        if sc.get("sparse_index_dim") != INDEX_DIM:
            raise ValueError(f"sparse_index_dim must be {INDEX_DIM}, got {sc.get('sparse_index_dim')}")
        if sc.get("sparse_num_index_heads") != n_kv:
            raise ValueError(f"sparse_num_index_heads must equal num_key_value_heads ({n_kv}): one index head per KV "
                             f"head, got {sc.get('sparse_num_index_heads')}")
        return cls(
            vocab_size=_need(d, "vocab_size"), hidden_size=hidden, num_hidden_layers=L, num_attention_heads=n_heads,
            num_key_value_heads=n_kv, head_dim=head_dim, rotary_dim=rotary_dim,
            rope_theta=float(d.get("rope_theta", 10000.0)), rms_norm_eps=float(_need(d, "rms_norm_eps")),
            use_gemma_norm=bool(d.get("use_gemma_norm", False)), hidden_act=act,
            swiglu_alpha=float(d.get("swiglu_alpha", 1.702)), swiglu_limit=float(d.get("swiglu_limit", 7.0)),
            dense_intermediate_size=_need(d, "dense_intermediate_size"), sparse_layers=sparse,
            index_dim=sc["sparse_index_dim"], num_index_heads=sc["sparse_num_index_heads"],
            topk_blocks=_need(sc, "sparse_topk_blocks"), block_size=sc["sparse_block_size"],
            local_blocks=_need(sc, "sparse_local_block"), init_blocks=sc.get("sparse_init_block", 0),
        )


def _need(d: dict, key: str):
    if d.get(key) is None:
        raise ValueError(f"config key {key!r} is required")
    return d[key]


# ---- layers ------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """RMSNorm over the last dim in fp32; ``x * (1 + w)`` (Gemma, weight stored as the offset) or ``x * w``."""

    def __init__(self, dim: int, eps: float, gemma: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.eps = eps
        self.gemma = gemma

    def reset(self):
        nn.init.zeros_(self.weight) if self.gemma else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` -> ``[..., dim]`` in x's dtype (computed in fp32)."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        return (x * (1.0 + w if self.gemma else w)).to(dtype)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float):
    """fp32 ``(cos, sin)`` of shape ``[T, rotary_dim // 2]``, SGLang's ``RotaryEmbedding`` table."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE on the first ``2 * cos.shape[-1]`` features of ``x [B, T, H, D]`` (fp32)."""
    half = cos.shape[-1]
    cos, sin = cos[None, :, None], sin[None, :, None]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class MSAMLP(nn.Module):
    def __init__(self, cfg: MSAConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.dense_intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.dense_intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.dense_intermediate_size, cfg.hidden_size, bias=False)
        self.act, self.alpha, self.limit = cfg.hidden_act, cfg.swiglu_alpha, cfg.swiglu_limit

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.act == "swigluoai":
            gate = gate.clamp(max=self.limit)
            return self.down_proj(gate * torch.sigmoid(gate * self.alpha) * (up.clamp(-self.limit, self.limit) + 1))
        return self.down_proj(F.silu(gate) * up)


@dataclass
class _LayerIndex:
    """What a sparse layer's attention hands back: selection and (with kl_rows) loss terms."""

    selected: torch.Tensor | None = None  # int32 [B, Hkv, T, topk]
    scores: torch.Tensor | None = None  # fp32 [B, Hkv, T, n_blocks]
    kl: torch.Tensor | None = None  # scalar
    recall: torch.Tensor | None = None  # scalar


class MSAAttention(nn.Module):
    """Main attention (dense or MSA-sparse) plus, on sparse layers, the index branch."""

    def __init__(self, cfg: MSAConfig, sparse: bool):
        super().__init__()
        self.cfg, self.sparse = cfg, sparse
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, hq * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.use_gemma_norm)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.use_gemma_norm)
        if sparse:
            self.index_q_proj = nn.Linear(cfg.hidden_size, cfg.num_index_heads * cfg.index_dim, bias=False)
            self.index_k_proj = nn.Linear(cfg.hidden_size, cfg.index_dim, bias=False)
            self.index_q_norm = RMSNorm(cfg.index_dim, cfg.rms_norm_eps, cfg.use_gemma_norm)
            self.index_k_norm = RMSNorm(cfg.index_dim, cfg.rms_norm_eps, cfg.use_gemma_norm)

    def index_qk(self, x: torch.Tensor, cos, sin):
        """Index q ``fp32 [B, T, H_idx, D_idx]`` and k ``fp32 [B, T, D_idx]`` from ``x`` (detached here)."""
        cfg = self.cfg
        x = x.detach()
        B, T, _ = x.shape
        iq = self.index_q_norm(self.index_q_proj(x).float().view(B, T, cfg.num_index_heads, cfg.index_dim))
        ik = self.index_k_norm(self.index_k_proj(x).float().view(B, T, 1, cfg.index_dim))
        return apply_rope(iq, cos, sin), apply_rope(ik, cos, sin)[:, :, 0]

    def forward(self, x, cos, sin, attention: str, kl_rows=None, index_k_format=None, sparse_backend="auto",
                keep_selection=False):
        """``x [B, T, hidden]`` -> ``([B, T, hidden], _LayerIndex | None)``."""
        cfg = self.cfg
        B, T, _ = x.shape
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = apply_rope(self.q_norm(self.q_proj(x).float().view(B, T, hq, d)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).float().view(B, T, hkv, d)), cos, sin)
        v = self.v_proj(x).view(B, T, hkv, d)
        q, k, v = (t.to(v.dtype).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        scale = d**-0.5
        info = None
        sel = None
        if self.sparse and (attention == "sparse" or kl_rows is not None):
            with torch.set_grad_enabled(torch.is_grad_enabled() and kl_rows is not None):
                iq, ik = self.index_qk(x, cos, sin)
            info = _LayerIndex()
            if attention == "sparse":
                with torch.no_grad():
                    sq, sk = _served_index_qk(iq, ik, index_k_format)
                    scores = block_max_scores(sq, sk, cfg.block_size, cfg.index_dim**-0.5)
                    selected = select_from_scores(scores, cfg)
                    sel = selection_mask(selected, scores.shape[-1])
                if keep_selection:
                    info.selected, info.scores = selected, scores
            if kl_rows is not None:
                info.kl, info.recall = self._index_kl(q, k, iq, ik, kl_rows, sel, scale)
        if attention == "dense" or not self.sparse:
            o = dense_attention(q, k, v, scale)
        else:
            o = sparse_attention(q, k, v, sel, scale, cfg.block_size, sparse_backend)
        o = o.transpose(1, 2).reshape(B, T, hq * d)
        return self.o_proj(o), info

    def _index_kl(self, q, k, iq, ik, kl_rows, sel, scale):
        """Indexer KL and recall at rows ``kl_rows [B, R]`` (see the module docstring)."""
        cfg = self.cfg
        rows = kl_rows.long()
        with torch.autocast(q.device.type, enabled=False):
            s = row_block_scores(iq, ik, rows, cfg.block_size, cfg.index_dim**-0.5)  # [B, H, R, nb], grad
            with torch.no_grad():
                mass = row_block_attention(q.detach(), k.detach(), rows, cfg.block_size, scale)  # [B, Hq, R, nb]
                if sel is not None:
                    chosen = sel.gather(2, rows[:, None, :, None].expand(-1, sel.shape[1], -1, sel.shape[3]))
                else:
                    rsel = select_from_scores(s.detach(), cfg, positions=rows)
                    chosen = selection_mask(rsel, s.shape[-1])
                B, _, R, nb = mass.shape
                mass = mass.view(B, cfg.num_key_value_heads, cfg.group, R, nb)
                kept = (mass * chosen[:, :, None]).sum(-1)  # [B, Hkv, G, R]
                recall = kept.mean()
                if sel is not None:  # the sparse forward's own distribution: per head, renormalised
                    target = (mass * chosen[:, :, None] / kept[..., None].clamp_min(1e-30)).mean(2)
                    allowed = chosen
                else:
                    target = mass.mean(2)
                    n_vis = visible_blocks(rows, cfg.block_size)
                    allowed = (torch.arange(nb, device=rows.device)[None, None] < n_vis[:, :, None])[:, None]
            kl = block_kl(target, s, allowed)
        return kl, recall


def _served_index_qk(iq, ik, index_k_format):
    """Index q/k as a server with ``index_k_format`` scores them (q in bf16, k through its cache format)."""
    if index_k_format is None:
        return iq, ik
    fmt = parse_format(index_k_format)
    B, T, D = ik.shape
    rows, scale_rows = quantize_index_k(ik.reshape(B * T, D).to(torch.bfloat16), fmt)
    ik = dequantize_index_k(rows, scale_rows, torch.float32).view(B, T, D)
    iq = prepare_index_q(iq.to(torch.bfloat16), fmt).float()
    return iq, ik


class MSADecoderLayer(nn.Module):
    def __init__(self, cfg: MSAConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.use_gemma_norm)
        self.self_attn = MSAAttention(cfg, cfg.sparse_layers[layer_id])
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.use_gemma_norm)
        self.mlp = MSAMLP(cfg)

    def forward(self, h, cos, sin, **kw):
        a, info = self.self_attn(self.input_layernorm(h), cos, sin, **kw)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), info


class MSAModel(nn.Module):
    def __init__(self, cfg: MSAConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MSADecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.use_gemma_norm)


class MSAForCausalLM(nn.Module):
    """MiniMax-M3 geometry with dense MLPs; see the module docstring.

    Example::

        cfg = MSAConfig.from_json("config.json")
        model = MSAForCausalLM(cfg); model.init_weights(0)
        logits, aux = model(ids, attention="sparse", kl_rows=rows)   # ids [B, T], rows [B, R]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()) + aux["index_kl"]
    """

    def __init__(self, cfg: MSAConfig):
        super().__init__()
        self.config = cfg
        self.model = MSAModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.sparse_backend = "auto"  # "flex" (CUDA default), "masked" (default elsewhere)

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Normal(0, std) linears and embedding (output projections std / sqrt(2 layers)); norms at identity.

        Drawn on the CPU from ``seed``, so the result does not depend on the device.
        """
        gen = torch.Generator().manual_seed(seed)
        out_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            p.copy_(torch.randn(p.shape, generator=gen) * s)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.reset()

    def forward(self, input_ids: torch.Tensor, attention: str = "dense", kl_rows: torch.Tensor | None = None,
                logit_rows: torch.Tensor | None = None, index_k_format: str | None = None,
                return_selection: bool = False):
        """Logits and auxiliary losses.

        Args:
            input_ids: int64 ``[B, T]``, each row one sequence starting at position 0.
            attention: ``"dense"`` (full causal attention on every layer) or ``"sparse"`` (MSA top-k
                blocks on the sparse layers).
            kl_rows: int64 ``[B, R]`` positions (in ``[0, T)``) where the indexer KL is computed, or None.
            logit_rows: int64 ``[B, R']`` positions whose logits are returned, or None for all.
            index_k_format: score selection as a server with this index-K cache format would
                (``bf16 | fp8 | mxfp4 | mxfp4_rot``: q rounded to bf16, k through the format), or None
                (training: fp32 scores of the model's own q and k).
            return_selection: also return per sparse layer the selected blocks and block scores.
        Returns:
            ``(logits fp32 [B, T or R', V], aux)``, ``aux["index_kl"]``: scalar (mean over sparse layers)
            or None without kl_rows; ``aux["recall"]``: detached scalar dense-attention mass kept by the
            selection (or None); with ``return_selection``: ``aux["selected"][layer]`` int32
            ``[B, Hkv, T, topk]`` and ``aux["index_scores"][layer]`` fp32 ``[B, Hkv, T, n_blocks]``.
        """
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        if self.sparse_backend not in SPARSE_BACKENDS:
            raise ValueError(f"sparse_backend must be one of {SPARSE_BACKENDS}, got {self.sparse_backend!r}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        for name, rows in (("kl_rows", kl_rows), ("logit_rows", logit_rows)):
            if rows is not None and (rows.dim() != 2 or rows.shape[0] != B or rows.dtype not in (torch.int32, torch.int64)):
                raise ValueError(f"{name} must be int [B={B}, R], got {rows.dtype} {tuple(rows.shape)}")
        cfg = self.config
        cos, sin = rope_cos_sin(torch.arange(T, device=input_ids.device), cfg.rotary_dim, cfg.rope_theta)
        h = self.model.embed_tokens(input_ids)
        kls, recalls, selected, scores = [], [], {}, {}
        for layer in self.model.layers:
            h, info = layer(h, cos, sin, attention=attention, kl_rows=kl_rows, index_k_format=index_k_format,
                            sparse_backend=self.sparse_backend, keep_selection=return_selection)
            if info is None:
                continue
            if info.kl is not None:
                kls.append(info.kl)
                recalls.append(info.recall)
            if info.selected is not None:
                selected[layer.layer_id], scores[layer.layer_id] = info.selected, info.scores
        if logit_rows is not None:
            h = h.gather(1, logit_rows.long()[:, :, None].expand(-1, -1, h.shape[-1]))
        logits = self.lm_head(self.model.norm(h).to(self.lm_head.weight.dtype)).float()
        aux = {
            "index_kl": torch.stack(kls).mean() if kls else None,
            "recall": torch.stack(recalls).mean() if recalls else None,
        }
        if return_selection:
            aux["selected"], aux["index_scores"] = selected, scores
        return logits, aux


# ---- index scores, selection, KL ---------------------------------------------------------------

def _block_max(q: torch.Tensor, ik: torch.Tensor, row_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Unscaled block-max dots of query rows against keys ``0 .. L-1``: fp32 ``[B, H, R, ceil(L / block_size)]``,
    -inf where a block has no visible token. ``q [B, R, H, D]``, ``ik [B, L, D]`` (fp32), ``row_pos``
    ``[B or 1, R]``: row ``r`` sees tokens ``t <= row_pos[:, r]``."""
    B, R, H, _ = q.shape
    L = ik.shape[1]
    nkb = -(-L // block_size)
    dots = torch.einsum("brhd,bld->bhrl", q, ik)
    dots.masked_fill_(torch.arange(L, device=ik.device) > row_pos[:, None, :, None], float("-inf"))
    dots = F.pad(dots, (0, nkb * block_size - L), value=float("-inf"))
    return dots.view(B, H, R, nkb, block_size).amax(-1)


def block_max_scores(iq: torch.Tensor, ik: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """Block scores of every row: fp32 ``[B, H, T, n_blocks]``, -inf where a block has no visible token.

    ``iq [B, T, H, D]``, ``ik [B, T, D]``; row ``i`` sees tokens ``t <= i``. Rows are processed in
    chunks, each against the keys up to the end of its last block only (no ``T x T`` tensor).
    """
    B, T, H, _ = iq.shape
    nb = -(-T // block_size)
    out = torch.full((B, H, T, nb), float("-inf"), dtype=torch.float32, device=iq.device)
    chunk = max(block_size, _chunk_elements(iq.device) // max(1, B * H * T) // block_size * block_size)
    pos = torch.arange(T, device=iq.device)
    with torch.autocast(iq.device.type, enabled=False):
        for r0 in range(0, T, chunk):
            r1 = min(T, r0 + chunk)
            L = min(T, -(-r1 // block_size) * block_size)
            part = _block_max(iq[:, r0:r1].float(), ik[:, :L].float(), pos[None, r0:r1], block_size)
            out[:, :, r0:r1, : part.shape[-1]] = part
    return out * scale


def row_block_scores(iq, ik, rows, block_size: int, scale: float) -> torch.Tensor:
    """``block_max_scores`` at rows ``rows [B, R]`` only, differentiable: fp32 ``[B, H, R, n_blocks]``."""
    H, D = iq.shape[2:]
    q = iq.float().gather(1, rows[:, :, None, None].expand(-1, -1, H, D))
    return _block_max(q, ik.float(), rows, block_size) * scale


def row_block_attention(q, k, rows, block_size: int, scale: float) -> torch.Tensor:
    """Dense causal attention probabilities of rows ``rows [B, R]`` summed per block: fp32 ``[B, Hq, R, nb]``.

    ``q [B, Hq, T, D]``, ``k [B, Hkv, T, D]`` (query head h reads KV head h // group). Chunked over rows.
    """
    B, hq, T, D = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    nb = -(-T // block_size)
    R = rows.shape[1]
    out = torch.empty(B, hq, R, nb, dtype=torch.float32, device=q.device)
    chunk = max(1, _chunk_elements(q.device) // max(1, B * hq * T))
    kf = k.float()
    for r0 in range(0, R, chunk):
        r = rows[:, r0 : r0 + chunk]
        qr = q.gather(2, r[:, None, :, None].expand(-1, hq, -1, D)).float().view(B, hkv, g, r.shape[1], D)
        logits = torch.einsum("bkgrd,bktd->bkgrt", qr, kf) * scale
        logits.masked_fill_(torch.arange(T, device=q.device) > r[:, None, None, :, None], float("-inf"))
        p = F.pad(torch.softmax(logits, -1), (0, nb * block_size - T))
        out[:, :, r0 : r0 + chunk] = p.view(B, hq, r.shape[1], nb, block_size).sum(-1)
    return out


def select_from_scores(scores: torch.Tensor, cfg: MSAConfig, positions: torch.Tensor | None = None) -> torch.Tensor:
    """MSA top-k (``m3_kernels.ops.select.select_blocks``) of ``scores [B, H, R, nb]`` -> int32 ``[B, H, R, topk]``.

    ``positions [B, R]`` of the rows (default ``0 .. R-1`` for every batch row).
    """
    B, H, R, nb = scores.shape
    if positions is None:
        positions = torch.arange(R, device=scores.device).expand(B, R)
    n_vis = visible_blocks(positions.reshape(-1), cfg.block_size)
    flat = scores.permute(1, 0, 2, 3).reshape(H, B * R, nb).contiguous()
    sel = select_blocks(flat, n_vis, cfg.topk_blocks, cfg.local_blocks, cfg.init_blocks)
    return sel.view(H, B, R, -1).permute(1, 0, 2, 3)


def selection_mask(selected: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """bool ``[..., n_blocks]``: which blocks ``selected [..., topk]`` (-1 padded) names."""
    ids = selected.long()
    ids = torch.where(ids < 0, n_blocks, ids)
    mask = torch.zeros(*ids.shape[:-1], n_blocks + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(-1, ids, True)[..., :n_blocks]


def block_kl(target: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``KL(target || softmax(scores over allowed blocks))``.

    ``target [..., nb]`` (rows sum to 1 over ``allowed``, zero elsewhere), ``scores [..., nb]``,
    ``allowed`` bool broadcastable to them. Returns a scalar; differentiable in ``scores`` only.
    """
    logq = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    logq = logq.masked_fill(~allowed, 0.0)
    target = target.detach()
    terms = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - logq), torch.zeros_like(logq))
    return terms.sum(-1).mean()


# ---- attention kernels -------------------------------------------------------------------------

def dense_attention(q, k, v, scale: float) -> torch.Tensor:
    """Causal GQA attention ``q [B, Hq, T, D]``, ``k, v [B, Hkv, T, D]`` -> ``[B, Hq, T, D]``."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def sparse_attention(q, k, v, sel, scale: float, block_size: int, backend: str = "auto") -> torch.Tensor:
    """Each row attends to the causally visible tokens of its selected blocks.

    ``sel`` bool ``[B, Hkv, T, nb]``; ``backend``: ``flex`` (``flex_attention``, compiled on CUDA),
    ``masked`` (chunked torch), ``auto`` = flex on CUDA, masked elsewhere.
    """
    if backend == "auto":
        backend = "flex" if q.is_cuda else "masked"
    if backend == "flex":
        return flex_sparse_attention(q, k, v, sel, scale, block_size)
    return masked_sparse_attention(q, k, v, sel, scale, block_size)


def masked_sparse_attention(q, k, v, sel, scale: float, block_size: int) -> torch.Tensor:
    """The clear version: chunks of rows, logits over their causal keys, non-selected blocks masked."""
    B, hq, T, D = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.empty_like(q)
    token_block = torch.arange(T, device=q.device) // block_size
    chunk = max(block_size, _chunk_elements(q.device) // max(1, B * hq * T))
    for r0 in range(0, T, chunk):
        r1 = min(T, r0 + chunk)
        qc = q[:, :, r0:r1].reshape(B, hkv, g, r1 - r0, D)
        logits = torch.einsum("bkgrd,bktd->bkgrt", qc, k[:, :, :r1]).float() * scale
        allowed = sel[:, :, r0:r1][..., token_block[:r1]]  # [B, Hkv, R, r1]
        allowed = allowed & (torch.arange(r1, device=q.device)[None] <= torch.arange(r0, r1, device=q.device)[:, None])
        logits = logits.masked_fill(~allowed[:, :, None], float("-inf"))
        o = torch.einsum("bkgrt,bktd->bkgrd", torch.softmax(logits, -1).to(v.dtype), v[:, :, :r1])
        out[:, :, r0:r1] = o.reshape(B, hq, r1 - r0, D)
    return out


_compiled_flex = None


def _flex():
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False) if torch.cuda.is_available() else flex_attention
    return _compiled_flex


def sparse_block_mask(sel: torch.Tensor, T: int, group: int, block_size: int):
    """``BlockMask`` for ``flex_attention`` from the per-row selection ``sel [B, Hkv, T, nb]``.

    A (query block, key block) pair is listed when any row of the query block selects the key
    block; it is *full* (no mask_mod call) when every row selects it and it lies before the query
    block. ``mask_mod`` re-checks selection and causality per element. Heads are query heads.
    """
    from torch.nn.attention.flex_attention import BlockMask

    B, hkv, _, nb = sel.shape
    nqb = nb
    pad = nqb * block_size - T
    selp = F.pad(sel, (0, 0, 0, pad))  # padded rows select nothing
    rows = selp.view(B, hkv, nqb, block_size, nb)
    any_row = rows.any(3)
    valid = (torch.arange(nqb * block_size, device=sel.device) < T).view(nqb, block_size)
    every_row = (rows | ~valid[None, None, :, :, None]).all(3)
    before = torch.arange(nb, device=sel.device)[None, :] < torch.arange(nqb, device=sel.device)[:, None]
    full = any_row & every_row & before
    partial = any_row & ~full

    def listing(m):
        m = m.repeat_interleave(group, dim=1)
        num = m.sum(-1, dtype=torch.int32)
        idx = torch.sort((~m).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return num.contiguous(), idx.contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return selp[b, h // group, q_idx, kv_idx // block_size] & (kv_idx <= q_idx)

    kv_num, kv_idx = listing(partial)
    full_num, full_idx = listing(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(T, T))


def flex_sparse_attention(q, k, v, sel, scale: float, block_size: int) -> torch.Tensor:
    """``flex_attention`` over the selected blocks (compiled on CUDA; eager elsewhere, for tests)."""
    T = q.shape[2]
    mask = sparse_block_mask(sel, T, q.shape[1] // k.shape[1], block_size)
    return _flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
