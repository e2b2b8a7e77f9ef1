"""Selection-fidelity study: metrics on known cases and a small synthetic run (no model download)."""

import cmath
import math

import pytest
import torch

from accuracy import fidelity
from m3_kernels.formats import INDEX_DIM, MX_GROUP_SIZE, PAGE_SIZE, TOPK_BLOCKS
from m3_kernels.ops.select.naive import visible_blocks


def test_identical_scores_give_full_recall_and_no_error(gen):
    scores = torch.randn(2, 3, 40, generator=gen, dtype=torch.float64)
    n_visible = torch.tensor([40, 30, 10])
    fid = fidelity.compare(scores, scores.clone(), n_visible)
    assert (fid.recall16, fid.recall15_ranked, fid.score_err, fid.rows) == (1.0, 1.0, 0.0, 6)


def test_one_swapped_pick_costs_one_ranked_block():
    # One row sees 40 blocks; scores rise with the block id, so bf16 picks 24..38 + own block 39.
    ref = torch.arange(40, dtype=torch.float64).view(1, 1, 40)
    moved = ref.clone()
    moved[0, 0, 24] = -1.0  # block 24 drops out, block 23 comes in
    fid = fidelity.compare(ref, moved, torch.tensor([40]))
    assert fid.recall16 == pytest.approx(15 / 16)
    assert fid.recall15_ranked == pytest.approx(14 / 15)
    spread = (ref - ref.mean()).pow(2).sum().sqrt()
    assert fid.score_err == pytest.approx(25.0 / spread.item())


def test_bf16_against_itself_through_the_cache(gen):
    seed = int(torch.randint(0, 1000, (1,), generator=gen))
    k, q = fidelity.synthetic_index_vectors(20 * PAGE_SIZE, 2, 4, 8.0, seed=seed)
    qq = q[-8:]
    ref = fidelity.scores_for(k, qq, "bf16", None)
    n_visible = visible_blocks(torch.arange(k.shape[0] - 8, k.shape[0]), PAGE_SIZE)
    assert fidelity.compare(ref, fidelity.scores_for(k, qq, "bf16", None), n_visible).recall16 == 1.0


def test_rms_normalize_and_rope_keep_norms(gen):
    x = torch.randn(5, 3, 64, generator=gen) * 7
    y = fidelity.rms_normalize(x)
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(5, 3), atol=1e-5)
    r = fidelity.rope_neox(x, torch.arange(5) * 1000, 1e5)
    assert torch.allclose(r.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.equal(fidelity.rope_neox(x, torch.zeros(5, dtype=torch.long), 1e5), x)


def test_synthetic_study_orders_formats():
    rows = fidelity.main(["--no-real", "--lengths", "4096", "--queries", "16", "--seed", "0", "--sign-seeds", "5"])
    by = {r["format"]: r for r in rows}
    assert set(by) == {fidelity.variant_name(*v) for v in fidelity.VARIANTS} | {"mxfp4_rot/rceil/signs5"}
    # Outlier channels crush plain MXFP4 groups; the rotation spreads them (module doc).
    assert by["mxfp4_rot/rceil"]["recall16"] > by["mxfp4/rceil"]["recall16"]
    assert by["mxfp4_rot/rceil"]["score_err"] < by["mxfp4/rceil"]["score_err"]
    for r in rows:
        assert 1 / TOPK_BLOCKS <= r["recall16"] <= 1.0


def test_variants_select_and_order_rows():
    only = ["mxfp4_rot/rceil", "fp8"]
    rows = fidelity.main(["--no-real", "--lengths", "4096", "--queries", "8", "--variants", *only])
    assert [r["format"] for r in rows] == only
    with pytest.raises(ValueError, match=r"--variants: \['mxfp4/even'\] not among"):
        fidelity.main(["--no-real", "--lengths", "4096", "--variants", "mxfp4/even"])


def test_lengths_are_validated():
    with pytest.raises(ValueError, match="--lengths"):
        fidelity.main(["--no-real", "--lengths", "1000"])
    with pytest.raises(ValueError, match="--queries"):  # no query rows: was a ZeroDivisionError in compare
        fidelity.main(["--no-real", "--lengths", "4096", "--queries", "0"])


def _score_err_float64(ref, scores, n_visible):
    """``rms(s - s_ref) / rms(s_ref - rowmean(s_ref))`` over visible blocks, by loops."""
    err = spread = 0.0
    for h in range(ref.shape[0]):
        for r, n in enumerate(n_visible.tolist()):
            row = [float(v) for v in ref[h, r, :n]]
            mean = sum(row) / n
            spread += sum((v - mean) ** 2 for v in row)
            err += sum((float(scores[h, r, b]) - row[b]) ** 2 for b in range(n))
    return (err / spread) ** 0.5


def _recall_by_sets(ref, scores, n_visible):
    """Top-16 recall and ranked-15 recall from explicit block sets (distinct scores, one local block)."""
    hits = total = hits_ranked = total_ranked = 0
    for h in range(ref.shape[0]):
        for r, n in enumerate(n_visible.tolist()):
            def pick(s):
                ranked = sorted(range(n - 1), key=lambda b: -float(s[h, r, b]))[: TOPK_BLOCKS - 1]
                return set(ranked) | {n - 1}
            a, b = pick(ref), pick(scores)
            hits, total = hits + len(a & b), total + len(a)
            hits_ranked += len((a & b) - {n - 1})
            total_ranked += len(a - {n - 1})
    return hits / total, hits_ranked / total_ranked


def test_compare_against_brute_force_ignores_invisible_blocks(gen):
    """Recall and score error match set/loop oracles; scores past a row's visible blocks never count."""
    ref = torch.randn(2, 4, 40, generator=gen, dtype=torch.float64)
    scores = ref + 0.5 * torch.randn(2, 4, 40, generator=gen, dtype=torch.float64)
    n_visible = torch.tensor([40, 33, 20, 17])
    invisible = torch.arange(40)[None, None] >= n_visible[None, :, None]
    ref = torch.where(invisible, 1e6, ref)  # garbage past the causal edge, different in each
    scores = torch.where(invisible, -3e6, scores)
    fid = fidelity.compare(ref, scores, n_visible)
    recall16, recall15 = _recall_by_sets(ref, scores, n_visible)
    assert fid.recall16 == pytest.approx(recall16) and fid.recall15_ranked == pytest.approx(recall15)
    assert fid.score_err == pytest.approx(_score_err_float64(ref, scores, n_visible), rel=1e-9)
    assert fid.rows == 8


def test_scores_for_has_one_column_per_page():
    k, q = fidelity.synthetic_index_vectors(20 * PAGE_SIZE, 2, 4, 8.0, seed=1)
    assert fidelity.scores_for(k, q[-3:], "bf16", None).shape == (2, 3, 20)
    assert fidelity.scores_for(k[:-5], q[-8:-5], "bf16", None).shape == (2, 3, 20)


def test_study_source_reads_only_the_last_query_rows_and_prefix_keys():
    """Keys past ``length`` and queries before its last ``queries`` rows are NaN: nothing may read them."""
    length, queries = 20 * PAGE_SIZE, 6
    k, q = fidelity.synthetic_index_vectors(length + PAGE_SIZE, 2, 4, 8.0, seed=3)
    k[length:] = float("nan")
    q[: length - queries] = float("nan")
    q[length:] = float("nan")
    (row,) = fidelity.study_source("synthetic", k, q, [length], queries, only=["fp8"])
    assert row["rows"] == 2 * queries and math.isfinite(row["score_err"]) and 0 < row["recall16"] <= 1


def test_synthetic_outliers_scale_one_channel_per_group_in_k_and_q():
    k1, q1 = fidelity.synthetic_index_vectors(64, 3, 4, 1.0, seed=7)
    k, q = fidelity.synthetic_index_vectors(64, 3, 4, 8.0, seed=7)
    scaled = [c for c in range(INDEX_DIM) if not torch.equal(k[:, c], k1[:, c])]
    assert sorted(c // MX_GROUP_SIZE for c in scaled) == list(range(INDEX_DIM // MX_GROUP_SIZE))
    assert torch.equal(k[:, scaled], 8.0 * k1[:, scaled]) and torch.equal(q[..., scaled], 8.0 * q1[..., scaled])
    rest = [c for c in range(INDEX_DIM) if c not in scaled]
    assert torch.equal(k[:, rest], k1[:, rest]) and torch.equal(q[..., rest], q1[..., rest])


def test_rope_neox_matches_complex_rotation(gen):
    """Pair ``(x_i, x_{i+D/2})`` is multiplied by ``exp(1j * pos * theta^(-2i/D))``, in float64."""
    d, theta = 16, 1e4
    x = torch.randn(4, 2, d, generator=gen)
    positions = torch.tensor([0, 1, 37, 5000])
    got = fidelity.rope_neox(x, positions, theta)
    for t, pos in enumerate(positions.tolist()):
        for h in range(2):
            for i in range(d // 2):
                z = complex(float(x[t, h, i]), float(x[t, h, i + d // 2])) * cmath.exp(1j * pos * theta ** (-2 * i / d))
                assert float(got[t, h, i]) == pytest.approx(z.real, abs=1e-4)
                assert float(got[t, h, i + d // 2]) == pytest.approx(z.imag, abs=1e-4)


def test_summarize_weights_by_rows_and_pools_real_layers():
    rows = [{"source": "real:L3", "format": "fp8", "length": 4096, "rows": 10, "recall16": 1.0,
             "recall15_ranked": 0.5, "score_err": 0.1},
            {"source": "real:L10", "format": "fp8", "length": 4096, "rows": 30, "recall16": 0.6,
             "recall15_ranked": 0.1, "score_err": 0.5},
            {"source": "synthetic", "format": "fp8", "length": 4096, "rows": 5, "recall16": 0.2,
             "recall15_ranked": 0.0, "score_err": 2.0}]
    out = fidelity.summarize(rows)
    assert set(out) == {("real", "fp8", 4096), ("synthetic", "fp8", 4096)}
    assert out[("real", "fp8", 4096)] == pytest.approx({"recall16": 0.7, "recall15_ranked": 0.2, "score_err": 0.4})
    assert out[("synthetic", "fp8", 4096)] == pytest.approx({"recall16": 0.2, "recall15_ranked": 0.0,
                                                             "score_err": 2.0})


def test_lengths_need_more_than_topk_blocks_and_may_come_unsorted():
    with pytest.raises(ValueError, match="--lengths"):  # exactly top-k blocks: nothing to rank
        fidelity.main(["--no-real", "--lengths", str(TOPK_BLOCKS * PAGE_SIZE)])
    rows = fidelity.main(["--no-real", "--lengths", "4096", "2560", "--queries", "4", "--variants", "fp8"])
    assert [r["length"] for r in rows] == [2560, 4096] and all(math.isfinite(r["score_err"]) for r in rows)


def test_real_index_vectors_pair_query_heads_with_kv_heads_0_and_1(monkeypatch, gen):
    """A tiny random SmolLM2-shaped Llama stands in for the GGUF: k = rmsnorm(kv heads 0, 1), index head
    ``h`` = rmsnorm(q heads h, 3 + h), each rotated at its global position across the chunks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    cfg = LlamaConfig(head_dim=64, hidden_size=72, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=2,
                      intermediate_size=32, vocab_size=50, rope_theta=1e4)
    model = LlamaForCausalLM(cfg).eval()
    tokens, chunk = 40, 16
    ids = torch.randint(0, 50, (1, tokens), generator=gen)

    class Tok:
        def __call__(self, text, return_tensors=None):
            return type("Enc", (), {"input_ids": ids})()

    monkeypatch.setattr(fidelity, "load_smollm2", lambda: (model, Tok()))
    raw = {"k": [], "q": []}
    attn = model.model.layers[1].self_attn

    def keep(name):  # the model's own batched calls only (the study calls the projections again)
        return lambda m, a, out: raw[name].append(out[0]) if out.dim() == 3 else None

    hooks = [attn.k_proj.register_forward_hook(keep("k")), attn.q_proj.register_forward_hook(keep("q"))]
    try:
        k_idx, q_idx = fidelity.real_index_vectors(tokens, [1], chunk)[1]
    finally:
        for h in hooks:
            h.remove()
    k = torch.cat(raw["k"]).double().view(tokens, 3, 64)
    q = torch.cat(raw["q"]).double().view(tokens, 9, 64)
    pos = torch.arange(tokens)

    def norm(x):
        return x / x.pow(2).mean(-1, keepdim=True).sqrt()

    k, q = fidelity.rope_neox(k, pos, 1e4).double(), fidelity.rope_neox(q, pos, 1e4).double()
    assert k_idx.shape == (tokens, INDEX_DIM) and q_idx.shape == (tokens, 3, INDEX_DIM)
    assert torch.allclose(k_idx.double(), norm(torch.cat([k[:, 0], k[:, 1]], -1)), atol=1e-4)
    for h in range(3):
        assert torch.allclose(q_idx[:, h].double(), norm(torch.cat([q[:, h], q[:, 3 + h]], -1)), atol=1e-4)
