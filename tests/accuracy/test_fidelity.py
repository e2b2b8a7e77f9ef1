"""Selection-fidelity study: metrics on known cases and a small synthetic run (no model download)."""

import pytest
import torch

from accuracy import fidelity
from m3_kernels.formats import PAGE_SIZE, TOPK_BLOCKS
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
