"""Tensor-parallel checks for the sglang-m3 plugin: a random checkpoint every TP size loads the
same way, readers of the block-selection records, and TP1-vs-TPn comparisons.

Why a checkpoint: SGLang's ``--load-format dummy`` seeds one generator per parameter *shard*
(``initialize_dummy_weights``: values depend only on the shard's size and dtype), so a TP2 rank
holds the first half of the stream, not half of TP1's tensor: TP1 and TP2 would serve different
models. ``write_random_checkpoint`` writes full tensors under MiniMax-M3's checkpoint names
(``q_proj``/``k_proj``/``v_proj``, ``index_q_proj``/``index_k_proj``, ``block_sparse_moe.experts.<e>.w1/w2/w3``,
...), which SGLang's ``load_weights`` shards per rank.

Selection records come from ``sglang_m3.debug.SelectionRecorder`` (``index_k_debug_record``): one
file per run, or one per attention-TP rank (``<path>.rank<r>``) holding that rank's index heads.
``read_records`` merges rank files into one-rank entries (heads concatenated in id order).

Used by ``lab/gpu/sglang_tp2.py`` (an H200 pair) and ``tests/sglang_m3/test_tp.py`` (CPU).
"""

import json
import re
import zlib
from pathlib import Path

import torch

CHECKPOINT_FILE = "model.safetensors"


# ---- checkpoint ------------------------------------------------------------------------------

def checkpoint_shapes(cfg: dict) -> dict:
    """``{checkpoint tensor name: shape}`` of a MiniMax-M3(.1) config (``config.json`` as a dict).

    Needs ``qk_norm_type == "per_head"`` (what SGLang's sparse layers accept)."""
    if cfg.get("qk_norm_type") != "per_head":
        raise ValueError(f"qk_norm_type must be 'per_head', got {cfg.get('qk_norm_type')!r}")
    n, d, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", d // hq)
    sac = cfg["sparse_attention_config"]
    sparse = sac["sparse_attention_freq"]
    no_value = sac.get("sparse_disable_index_value") or [0] * n
    hi, di = sac["sparse_num_index_heads"], sac["sparse_index_dim"]
    moe = cfg.get("moe_layer_freq") or [1] * n
    experts, inter = cfg["num_local_experts"], cfg["intermediate_size"]
    shared = cfg.get("n_shared_experts") or 0
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    for i in range(n):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        a = p + "self_attn."
        shapes.update({a + "q_proj.weight": (hq * hd, d), a + "k_proj.weight": (hkv * hd, d),
                       a + "v_proj.weight": (hkv * hd, d), a + "o_proj.weight": (d, hq * hd),
                       a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
        if sparse[i]:
            shapes.update({a + "index_q_proj.weight": (hi * di, d), a + "index_k_proj.weight": (di, d),
                           a + "index_q_norm.weight": (di,), a + "index_k_norm.weight": (di,)})
            if not no_value[i]:
                shapes.update({a + "index_v_proj.weight": (di, d), a + "index_o_proj.weight": (d, hi * di)})
        if moe[i]:
            m = p + "block_sparse_moe."
            shapes[m + "gate.weight"] = (experts, d)
            if cfg.get("use_routing_bias"):
                shapes[m + "e_score_correction_bias"] = (experts,)
            for e in range(experts):
                shapes.update({f"{m}experts.{e}.w1.weight": (inter, d), f"{m}experts.{e}.w3.weight": (inter, d),
                               f"{m}experts.{e}.w2.weight": (d, inter)})
            if shared:
                shapes.update({m + "shared_experts.gate_proj.weight": (inter * shared, d),
                               m + "shared_experts.up_proj.weight": (inter * shared, d),
                               m + "shared_experts.down_proj.weight": (d, inter * shared)})
        else:
            di_mlp = cfg["dense_intermediate_size"]
            shapes.update({p + "mlp.gate_proj.weight": (di_mlp, d), p + "mlp.up_proj.weight": (di_mlp, d),
                           p + "mlp.down_proj.weight": (d, di_mlp)})
    return shapes


def random_tensor(name: str, shape: tuple, seed: int, std: float, gemma_norm: bool) -> torch.Tensor:
    """bf16 values of one tensor, drawn from a generator seeded by ``seed`` and the name.

    Norm weights sit near identity (Gemma norms scale by ``1 + w``), the embedding is N(0, 1),
    the routing bias N(0, 0.05), every projection N(0, std)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        x = x * 0.05 + (0.0 if gemma_norm else 1.0)
    elif name == "model.embed_tokens.weight":
        pass
    elif name.endswith("e_score_correction_bias"):
        x = x * 0.05
    else:
        x = x * std
    return x.to(torch.bfloat16)


def write_random_checkpoint(model_dir, seed: int = 0, std: float = 0.02) -> Path:
    """Write ``<model_dir>/model.safetensors`` for ``<model_dir>/config.json``; returns its path."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    gemma = bool(cfg.get("use_gemma_norm", False))
    tensors = {name: random_tensor(name, shape, seed, std, gemma) for name, shape in checkpoint_shapes(cfg).items()}
    path = model_dir / CHECKPOINT_FILE
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


# ---- selection records -----------------------------------------------------------------------

def _read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rank_files(path) -> list:
    """The per-rank record files ``<path>.rank<r>``, in rank order (empty for a one-rank run)."""
    path = Path(path)
    found = [(int(m.group(1)), p) for p in path.parent.glob(path.name + ".rank*")
             if (m := re.fullmatch(re.escape(path.name) + r"\.rank(\d+)", p.name))]
    return [p for _, p in sorted(found)]


def line_counts(path) -> list:
    """Lines written so far: ``[n]`` for a one-rank run, one count per rank file otherwise."""
    files = rank_files(path) or [Path(path)]
    return [sum(1 for _ in open(p)) if p.exists() else 0 for p in files]


def merge_rank_entries(entries: list) -> dict:
    """One entry from the same forward's entries of every rank: heads in id order. Ranks that
    replicate a head (TP larger than the head count) must agree on it."""
    first = entries[0]
    for e in entries[1:]:
        for key in ("mode", "layer", "positions", "n_visible"):
            if e[key] != first[key]:
                raise ValueError(f"rank entries disagree on {key!r}: {first[key]!r:.200} vs {e[key]!r:.200}")
    by_head = {}
    for e in entries:
        for j, h in enumerate(e["heads"]):
            row = (e["selected"][j], e["scores"][j] if "scores" in e else None)
            if h in by_head and by_head[h][0] != row[0]:
                raise ValueError(f"replicas of index head {h} selected different blocks (layer {first['layer']})")
            by_head.setdefault(h, row)
    heads = sorted(by_head)
    merged = {k: first[k] for k in ("mode", "layer", "positions", "n_visible")}
    merged.update(heads=heads, selected=[by_head[h][0] for h in heads])
    if all("scores" in e for e in entries):
        merged["scores"] = [by_head[h][1] for h in heads]
    return merged


def read_records(path) -> list:
    """Entries of a run: ``path`` itself, or its rank files merged line by line."""
    files = rank_files(path)
    if not files:
        return _read_jsonl(Path(path))
    per_rank = [_read_jsonl(p) for p in files]
    if len({len(r) for r in per_rank}) != 1:
        raise ValueError(f"rank files hold different line counts: {[len(r) for r in per_rank]} ({files})")
    return [merge_rank_entries(list(es)) for es in zip(*per_rank)]


def selection_rows(entries: list) -> dict:
    """``{(mode, layer, position): {"heads", "selected" [H][topk], "n_visible", "scores" [H][nb] | None}}``
    over the entries of one request (a later entry for the same key wins)."""
    rows = {}
    for e in entries:
        for r, pos in enumerate(e["positions"]):
            rows[(e["mode"], e["layer"], pos)] = {
                "heads": e.get("heads", list(range(len(e["selected"])))),
                "selected": [h[r] for h in e["selected"]],
                "n_visible": e["n_visible"][r],
                "scores": [h[r] for h in e["scores"]] if "scores" in e else None,
            }
    return rows


# ---- comparisons -----------------------------------------------------------------------------

def _blocks(sel) -> set:
    return {b for b in sel if b >= 0}


def compare_selections(ref: dict, got: dict, topk: int, last_decode_pos: int | None = None) -> dict:
    """Per layer, how ``got``'s selected blocks agree with ``ref``'s (``selection_rows`` of one request each).

    Rows compared: keys present in both (decode rows only up to ``last_decode_pos``, the last
    position whose input token both runs share). ``choice`` rows see more than ``topk`` blocks.
    Where both rows carry scores (the first sparse layer), a differing head-row is *explained*
    when every swapped pair of blocks (a picked by one run only, b by the other only) has ``ref``
    scores within twice the row's largest score difference between the runs; otherwise it is
    *unexplained* (a selection that its own scores do not support)."""
    layers = {}
    only_ref = sum(1 for k in ref if k not in got)
    only_got = sum(1 for k in got if k not in ref)
    for key in sorted(k for k in ref if k in got):
        mode, layer, pos = key
        if mode == "decode" and last_decode_pos is not None and pos > last_decode_pos:
            continue
        a, b = ref[key], got[key]
        if a["heads"] != b["heads"] or a["n_visible"] != b["n_visible"]:
            raise ValueError(f"{key}: heads {a['heads']} / {b['heads']}, n_visible {a['n_visible']} / {b['n_visible']}")
        st = layers.setdefault(layer, {"rows": 0, "choice_rows": 0, "head_rows": 0, "choice_head_rows": 0,
                                       "equal": 0, "choice_equal": 0, "scored_head_rows": 0, "explained": 0,
                                       "unexplained": 0, "max_score_diff": 0.0, "max_score_diff_rel": 0.0,
                                       "first_unexplained": None, "modes": {}})
        st["modes"][mode] = st["modes"].get(mode, 0) + 1
        n = a["n_visible"]
        choice = n > topk
        st["rows"] += 1
        st["choice_rows"] += choice
        for h, (sa, sb) in enumerate(zip(a["selected"], b["selected"])):
            equal = _blocks(sa) == _blocks(sb)
            st["head_rows"] += 1
            st["equal"] += equal
            st["choice_head_rows"] += choice
            st["choice_equal"] += choice and equal
            if a["scores"] is None or b["scores"] is None:
                continue
            ra, rb = a["scores"][h][:n], b["scores"][h][:n]
            if any(x is None for x in ra + rb):
                continue  # a visible block without a visible token: cannot happen for valid rows
            err = max(abs(x - y) for x, y in zip(ra, rb))
            spread = max(ra) - min(ra)
            st["scored_head_rows"] += 1
            st["max_score_diff"] = max(st["max_score_diff"], err)
            if choice and spread > 0:  # relative to the spread of the scores the choice is made from
                st["max_score_diff_rel"] = max(st["max_score_diff_rel"], err / spread)
            if equal:
                continue
            ok = all(abs(ra[x] - ra[y]) <= 2 * err * (1 + 1e-6)
                     for x in _blocks(sa) - _blocks(sb) for y in _blocks(sb) - _blocks(sa))
            st["explained" if ok else "unexplained"] += 1
            if not ok and st["first_unexplained"] is None:
                st["first_unexplained"] = {"mode": mode, "position": pos, "head": a["heads"][h],
                                           "ref": sorted(_blocks(sa)), "got": sorted(_blocks(sb))}
    return {"layers": layers, "keys_only_in_ref": only_ref, "keys_only_in_got": only_got}


def head_mapping(ref: dict, got: dict, layer: int, row_stride: int = 1) -> dict:
    """Which ``ref`` head each ``got`` head's scores are closest to (mean |difference| over the
    visible blocks of the extend rows of ``layer`` both record scores for; every
    ``row_stride``-th position). A correct TP split maps every head to itself; a rank scoring
    with another rank's index-query heads does not."""
    heads = None
    dist = {}
    for key in ref:
        if key[0] != "extend" or key[1] != layer or key not in got or key[2] % row_stride:
            continue
        a, b = ref[key], got[key]
        if a["scores"] is None or b["scores"] is None:
            continue
        heads = a["heads"]
        n = a["n_visible"]
        for i, sb in enumerate(b["scores"]):
            for j, sa in enumerate(a["scores"]):
                pairs = [(x, y) for x, y in zip(sa[:n], sb[:n]) if x is not None and y is not None]
                tot, cnt = dist.get((i, j), (0.0, 0))
                dist[(i, j)] = (tot + sum(abs(x - y) for x, y in pairs), cnt + len(pairs))
    if heads is None:
        return {"heads": [], "closest": [], "ok": False, "mean_abs_diff": []}
    k = len(heads)
    mean = [[dist[(i, j)][0] / max(1, dist[(i, j)][1]) for j in range(k)] for i in range(k)]
    closest = [min(range(k), key=lambda j: mean[i][j]) for i in range(k)]
    return {"heads": heads, "closest": [heads[j] for j in closest], "ok": closest == list(range(k)),
            "mean_abs_diff": mean}


def first_divergence(a: list, b: list):
    """Index of the first differing token (or the shorter length), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _top(entry) -> dict:
    """``{token id: logprob}`` of one step's ``output_top_logprobs`` entry."""
    return {int(t[1]): float(t[0]) for t in entry or [] if t is not None and t[0] is not None}


def divergence_margin(meta: dict, own: int, other: int, step: int):
    """How much more likely this run found its own token than the other run's at ``step``
    (nats; None if the other token is outside the returned top logprobs, so the margin is at
    least ``own - last top``)."""
    tops = meta.get("output_top_logprobs") or []
    if step >= len(tops):
        return None
    top = _top(tops[step])
    if own in top and other in top:
        return top[own] - top[other]
    return None


def compare_tokens(ref_body: dict, got_body: dict) -> dict:
    """Greedy outputs and prompt logprobs of one request on two servers (``/generate`` bodies
    with ``return_logprob``)."""
    a, b = ref_body["output_ids"], got_body["output_ids"]
    j = first_divergence(a, b)
    res = {"tokens": len(a), "equal": j is None, "first_divergence": j}
    if j is not None and j < min(len(a), len(b)):
        res["margin_ref"] = divergence_margin(ref_body["meta_info"], a[j], b[j], j)
        res["margin_got"] = divergence_margin(got_body["meta_info"], b[j], a[j], j)
    la = [t[0] for t in ref_body["meta_info"].get("input_token_logprobs") or [] if t and t[0] is not None]
    lb = [t[0] for t in got_body["meta_info"].get("input_token_logprobs") or [] if t and t[0] is not None]
    if la and len(la) == len(lb):
        diffs = [abs(x - y) for x, y in zip(la, lb)]
        res["prompt_logprob_max_abs_diff"] = max(diffs)
        res["prompt_logprob_mean_abs_diff"] = sum(diffs) / len(diffs)
    return res


def tokens_verdict(cmp: dict, tie_margin: float) -> bool:
    """Equal outputs, or a first divergence where both runs rank the two tokens within
    ``tie_margin`` nats (a near tie that bf16 reduction order can flip)."""
    if cmp["equal"]:
        return True
    m = [cmp.get("margin_ref"), cmp.get("margin_got")]
    return all(x is not None and x <= tie_margin for x in m)


def summarize_layers(layers: dict) -> dict:
    """Totals over layers of ``compare_selections``' per-layer counts."""
    tot = {k: 0 for k in ("head_rows", "equal", "choice_head_rows", "choice_equal", "scored_head_rows", "explained",
                          "unexplained")}
    for st in layers.values():
        for k in tot:
            tot[k] += st[k]
    tot["max_score_diff"] = max([st["max_score_diff"] for st in layers.values()] or [0.0])
    tot["max_score_diff_rel"] = max([st["max_score_diff_rel"] for st in layers.values()] or [0.0])
    return tot


def fraction(num: int, den: int) -> str:
    return f"{num}/{den}" + (f" ({100.0 * num / den:.1f}%)" if den else "")
