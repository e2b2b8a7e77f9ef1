"""SmolLM2-135M with an MSA indexer retrofitted: the frozen Llama forward, plus index heads that pick
the top-16 128-token blocks each query attends to on the sparse layers.

Base model: SmolLM2-135M-Instruct (30 Llama layers, hidden 576, 9 query heads, 3 KV heads of dim
64, NeoX RoPE with theta 1e5 over all 64 dims, trained to 8,192 positions), loaded as
``accuracy.fidelity.load_smollm2`` does. ``RetrofitLM`` reuses its weights and recomputes its forward
(checked against transformers' logits in ``lab/tests/retrofit``)::

    h = h + o_proj(attn(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))  with x = rmsnorm(h) * w
    h = h + down_proj(silu(gate_proj(x)) * up_proj(x))                  with x = rmsnorm(h) * w

Index branch, as MiniMax-M3's (``lab/training/model.py``), on the layers M3 would make sparse
(M3 keeps its first 3 of 60 layers dense; here layers ``DENSE_LAYERS`` = 0-2 stay dense, 3-29 are
sparse): one index-query head per KV head (M3: 4 KV heads, 4 index heads; here 3 and 3), each
``index_q_proj`` head and the one shared ``index_k_proj`` key 128-dim, read from the layer's input
(after ``input_layernorm``), per-head Gemma RMSNorm (``x * (1 + w)``), then NeoX RoPE on the first
64 of the 128 dims (M3's partial rotary: ``rotary_dim`` 64 of 128) with the base model's theta.
Block score of index head h at query i: ``max over visible tokens t of block p of q[i, h] . k[t] /
sqrt(128)``; selection is the product's ``select_blocks`` (top 16 with the local block forced);
query head j (KV head ``j // 3``) attends to the causally visible tokens of the blocks its KV head's
index head selected (``lab/training/model.py``'s masked / flex sparse attention).

Index-K formats: the scores a server would compute, with q rounded to bf16 and k written through the
format (``training.model._served_index_qk``: the product's ``quantize_index_k`` /
``dequantize_index_k`` / ``prepare_index_q``), or ``nvfp4`` (``retrofit.nvfp4``, format-only).

Training: only the index heads, with the dense warm-up KL of ``lab/training``: at rows ``kl_rows``,
``KL(p || softmax(s))`` where ``p`` is the frozen model's causal attention mass per block averaged over
the KV head's query heads and ``s`` the index head's block scores over the visible blocks.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from m3_kernels.formats import INDEX_DIM, LOCAL_BLOCKS, PAGE_SIZE, TOPK_BLOCKS, INIT_BLOCKS
from m3_kernels.ops.select import visible_blocks
from training.model import (
    RMSNorm,
    apply_rope,
    block_kl,
    block_max_scores,
    dense_attention,
    row_block_attention,
    row_block_scores,
    rope_cos_sin,
    select_from_scores,
    selection_mask,
    sparse_attention,
    _served_index_qk,
)

from .nvfp4 import nvfp4_roundtrip

DENSE_LAYERS = 3  # M3.1: sparse_attention_freq starts with three 0s
INDEX_ROTARY_DIM = 64  # M3.1: rotary_dim 64 of the 128-dim index head
FORMATS = ("bf16", "fp8", "mxfp4", "mxfp4_rot", "nvfp4")


@dataclass(frozen=True)
class SelectConfig:
    """What ``training.model.select_from_scores`` reads."""

    block_size: int = PAGE_SIZE
    topk_blocks: int = TOPK_BLOCKS
    local_blocks: int = LOCAL_BLOCKS
    init_blocks: int = INIT_BLOCKS


class IndexHeads(nn.Module):
    """One sparse layer's index branch: ``heads`` query heads and one key, 128-dim, normed, partial RoPE."""

    def __init__(self, hidden: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.index_q_proj = nn.Linear(hidden, heads * INDEX_DIM, bias=False)
        self.index_k_proj = nn.Linear(hidden, INDEX_DIM, bias=False)
        self.index_q_norm = RMSNorm(INDEX_DIM, eps, gemma=True)
        self.index_k_norm = RMSNorm(INDEX_DIM, eps, gemma=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [B, T, hidden]`` -> ``(q fp32 [B, T, heads, 128], k fp32 [B, T, 128])``; cos/sin of
        ``rope_cos_sin(positions, INDEX_ROTARY_DIM, theta)``."""
        B, T, _ = x.shape
        q = self.index_q_norm(self.index_q_proj(x).float().view(B, T, self.heads, INDEX_DIM))
        k = self.index_k_norm(self.index_k_proj(x).float().view(B, T, 1, INDEX_DIM))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)[:, :, 0]


def served_index_qk(iq: torch.Tensor, ik: torch.Tensor, fmt: str | None):
    """Index q/k as scored with an index-K cache of ``fmt`` (``FORMATS``), or unchanged for None."""
    if fmt == "nvfp4":
        B, T, D = ik.shape
        k = nvfp4_roundtrip(ik.reshape(B * T, D).to(torch.bfloat16)).view(B, T, D)
        return iq.to(torch.bfloat16).float(), k
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"index_k_format must be one of {FORMATS} or None, got {fmt!r}")
    return _served_index_qk(iq, ik, fmt)


class RetrofitLM(nn.Module):
    """A frozen transformers ``LlamaForCausalLM`` (``hf``) run by this module's own forward, with
    ``IndexHeads`` on layers ``DENSE_LAYERS ..``; only ``self.index`` has trainable parameters."""

    def __init__(self, hf, dense_layers: int = DENSE_LAYERS, seed: int = 0):
        super().__init__()
        cfg = hf.config
        if cfg.model_type != "llama" or cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            raise ValueError(f"expected a Llama config with head_dim * heads == hidden, got {cfg.model_type}")
        self.hf = hf.eval()
        for p in self.hf.parameters():
            p.requires_grad_(False)
        self.n_layers = cfg.num_hidden_layers
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta = float(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None)
                           else cfg.rope_theta)
        self.eps = cfg.rms_norm_eps
        self.max_positions = cfg.max_position_embeddings
        self.sparse_ids = list(range(dense_layers, self.n_layers))
        self.index = nn.ModuleDict({str(i): IndexHeads(cfg.hidden_size, self.hkv, self.eps) for i in self.sparse_ids})
        self.select_cfg = SelectConfig()
        self.sparse_backend = "auto"
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.index.named_parameters():
                if name.endswith("proj.weight"):
                    p.copy_(torch.randn(p.shape, generator=gen) * cfg.hidden_size**-0.5)

    def index_state_dict(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self.index.state_dict().items()}

    def _norm(self, module, x):
        """The base model's (Llama) RMSNorm: fp32 ``x * rsqrt(mean(x^2) + eps) * w``."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)) * module.weight

    def forward(self, input_ids: torch.Tensor, attention: str = "dense", index_k_format: str | None = None,
                kl_rows: torch.Tensor | None = None, logit_rows: torch.Tensor | None = None,
                probe_rows: torch.Tensor | None = None, probe_formats=(), layer_hook=None):
        """Logits and auxiliaries.

        Args:
            input_ids: int64 ``[B, T]`` (positions 0..T-1, T <= the base model's max positions).
            attention: ``dense`` (the base model) or ``sparse`` (MSA on layers ``sparse_ids``).
            index_k_format: selection scored as with this index-K cache (``FORMATS``), None = fp32.
            kl_rows: int64 ``[B, R]``: compute the indexer KL there (dense attention mass as target).
            logit_rows: int64 ``[B, R']``: logits only there (None: every position).
            probe_rows: int64 ``[R'']`` (same for every batch row): per sparse layer, also select with
                each of ``probe_formats`` from this run's own index q/k, and report the overlap with
                this run's selection (``aux["probe"][layer][fmt]`` = (hits, total) over rows and heads)
                and the dense attention mass the selection keeps (``aux["kept"][layer]``).
            layer_hook: called as ``layer_hook(i, x, q, k)`` on each sparse layer with its input ``x`` and
                its RoPE'd ``q [B, Hq, T, d]``, ``k [B, Hkv, T, d]`` (training caches them).
        Returns:
            ``(logits fp32, aux)`` with ``aux["index_kl"]`` (mean over sparse layers, or None),
            ``aux["kl"]`` per layer, ``aux["probe"]``, ``aux["kept"]``.
        """
        if attention not in ("dense", "sparse"):
            raise ValueError(f"attention must be 'dense' or 'sparse', got {attention!r}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if T > self.max_positions:
            raise ValueError(f"input_ids has {T} positions, the base model has {self.max_positions}")
        dev = input_ids.device
        pos = torch.arange(T, device=dev)
        cos, sin = rope_cos_sin(pos, self.d, self.theta)
        icos, isin = rope_cos_sin(pos, INDEX_ROTARY_DIM, self.theta)
        m = self.hf.model
        h = m.embed_tokens(input_ids).float()
        kls, probe, kept = {}, {}, {}
        scale = self.d**-0.5
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            x = self._norm(layer.input_layernorm, h).to(attn.q_proj.weight.dtype)
            q = apply_rope(attn.q_proj(x).float().view(B, T, self.hq, self.d), cos, sin)
            k = apply_rope(attn.k_proj(x).float().view(B, T, self.hkv, self.d), cos, sin)
            v = attn.v_proj(x).view(B, T, self.hkv, self.d)
            q, k, v = (t.to(v.dtype).transpose(1, 2) for t in (q, k, v))
            sparse_layer = str(i) in self.index
            if sparse_layer and layer_hook is not None:
                layer_hook(i, x, q, k)
            need_index = sparse_layer and (attention == "sparse" or kl_rows is not None)
            if need_index:
                with torch.set_grad_enabled(torch.is_grad_enabled() and kl_rows is not None):
                    heads = self.index[str(i)]
                    iq, ik = heads(x.detach().to(heads.index_q_proj.weight.dtype), icos, isin)
            if need_index and kl_rows is not None:
                kls[i] = self._kl(q.detach(), k.detach(), iq, ik, kl_rows.long(), scale)
            if sparse_layer and attention == "sparse":
                with torch.no_grad():
                    sq, sk = served_index_qk(iq.detach(), ik.detach(), index_k_format)
                    scores = block_max_scores(sq, sk, PAGE_SIZE, INDEX_DIM**-0.5)
                    selected = select_from_scores(scores, self.select_cfg)
                    sel = selection_mask(selected, scores.shape[-1])
                    if probe_rows is not None:
                        probe[i], kept[i] = self._probe(q, k, iq.detach(), ik.detach(), sel, probe_rows, probe_formats,
                                                        scale)
                o = sparse_attention(q, k, v, sel, scale, PAGE_SIZE, self.sparse_backend)
            else:
                o = dense_attention(q, k, v, scale)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(B, T, self.hq * self.d).to(v.dtype)).float()
            x = self._norm(layer.post_attention_layernorm, h).to(v.dtype)
            mlp = layer.mlp
            h = h + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)).float()
        if logit_rows is not None:
            h = h.gather(1, logit_rows.long()[:, :, None].expand(-1, -1, h.shape[-1]))
        h = self._norm(m.norm, h).to(self.hf.lm_head.weight.dtype)
        logits = self.hf.lm_head(h).float()
        aux = {"kl": kls, "index_kl": torch.stack(list(kls.values())).mean() if kls else None,
               "probe": probe, "kept": kept}
        return logits, aux

    def _kl(self, q, k, iq, ik, rows, scale):
        """Dense warm-up KL at ``rows [B, R]``: target = attention mass per block, averaged over each KV
        head's query heads; index distribution over the visible blocks (``training.model``'s terms)."""
        s = row_block_scores(iq, ik, rows, PAGE_SIZE, INDEX_DIM**-0.5)  # [B, Hkv, R, nb], grad
        with torch.no_grad():
            mass = row_block_attention(q, k, rows, PAGE_SIZE, scale)  # [B, Hq, R, nb]
            B, _, R, nb = mass.shape
            target = mass.view(B, self.hkv, self.hq // self.hkv, R, nb).mean(2)
            n_vis = visible_blocks(rows, PAGE_SIZE)
            allowed = (torch.arange(nb, device=rows.device)[None, None] < n_vis[:, :, None])[:, None]
        return block_kl(target, s, allowed)

    def _probe(self, q, k, iq, ik, sel, rows, formats, scale):
        """Selection overlap of each format with ``sel`` at ``rows``, and the dense mass ``sel`` keeps."""
        B = q.shape[0]
        out = {}
        r = rows.to(q.device)
        sub_q, nb = iq[:, : int(r.max()) + 1], sel.shape[-1]
        ref = sel[:, :, r]  # [B, H, R, nb]
        for fmt in formats:
            fq, fk = served_index_qk(sub_q, ik[:, : sub_q.shape[1]], fmt)
            s = row_block_scores(fq, fk, r.expand(B, -1), PAGE_SIZE, INDEX_DIM**-0.5)
            s = F.pad(s, (0, nb - s.shape[-1]), value=float("-inf"))
            mine = selection_mask(select_from_scores(s, self.select_cfg, positions=r.expand(B, -1)), nb)
            out[fmt] = (int((mine & ref).sum()), int(ref.sum()))
        mass = row_block_attention(q, k, r.expand(B, -1), PAGE_SIZE, scale)
        mass = mass.view(B, self.hkv, self.hq // self.hkv, r.numel(), -1)
        kept = float((mass * ref[:, :, None, :, : mass.shape[-1]]).sum(-1).mean())
        return out, kept
