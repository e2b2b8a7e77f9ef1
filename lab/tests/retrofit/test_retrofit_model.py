"""retrofit.model on a tiny random Llama: the dense forward is transformers', the index heads have M3's
shapes, sparse attention over <= 16 blocks is dense attention, selection binds past 16 blocks, the
recall probe and the KL train only the index heads."""

import pytest
import torch

from m3_kernels.formats import PAGE_SIZE, TOPK_BLOCKS
from retrofit.model import FORMATS, IndexHeads, RetrofitLM, served_index_qk
from retrofit.tasks import Prompts, TASKS


def tiny_llama(seed: int, layers: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      rope_theta=10000.0, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def seed(gen):
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


def test_dense_forward_is_transformers(seed, gen):
    hf = tiny_llama(seed)
    model = RetrofitLM(hf, dense_layers=1, seed=seed)
    ids = torch.randint(0, 97, (2, 300), generator=gen)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got, aux = model(ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert aux["index_kl"] is None and not aux["probe"]


def test_index_heads_shapes_and_trainable_set(seed, gen):
    hf = tiny_llama(seed)
    model = RetrofitLM(hf, dense_layers=1, seed=seed)
    assert model.sparse_ids == [1, 2]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("index.") for n in trainable)
    heads = model.index["1"]
    assert heads.index_q_proj.weight.shape == (2 * 128, 64) and heads.index_k_proj.weight.shape == (128, 64)
    assert torch.all(heads.index_q_norm.weight == 0)  # Gemma norm: weight stored as the offset from 1
    from training.model import rope_cos_sin

    cos, sin = rope_cos_sin(torch.arange(5), 64, 1e4)
    q, k = heads(torch.randn(3, 5, 64, generator=gen), cos, sin)
    assert q.shape == (3, 5, 2, 128) and k.shape == (3, 5, 128)
    # RMS-normed before RoPE; RoPE keeps norms: every head vector has norm sqrt(128).
    torch.testing.assert_close(k.norm(dim=-1), torch.full((3, 5), 128**0.5), rtol=1e-4, atol=1e-4)
    # Partial RoPE: the last 64 dims are not rotated (position 0 and 4 agree there for the same input).
    x = torch.randn(1, 1, 64, generator=gen).expand(1, 5, 64)
    _, k2 = heads(x, cos, sin)
    torch.testing.assert_close(k2[0, 0, 64:], k2[0, 4, 64:])
    assert not torch.allclose(k2[0, 0, :64], k2[0, 4, :64])


def test_sparse_is_dense_within_16_blocks(seed, gen):
    model = RetrofitLM(tiny_llama(seed), dense_layers=1, seed=seed)
    ids = torch.randint(0, 97, (1, TOPK_BLOCKS * PAGE_SIZE), generator=gen)
    with torch.no_grad():
        dense, _ = model(ids)
        for fmt in ("bf16", "mxfp4", "nvfp4"):
            sparse, _ = model(ids, "sparse", index_k_format=fmt)
            torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-4)


def test_selection_binds_past_16_blocks_and_probe_is_consistent(seed, gen):
    model = RetrofitLM(tiny_llama(seed), dense_layers=1, seed=seed)
    T = (TOPK_BLOCKS + 4) * PAGE_SIZE + 5
    ids = torch.randint(0, 97, (1, T), generator=gen)
    rows = torch.tensor([TOPK_BLOCKS * PAGE_SIZE - 1, TOPK_BLOCKS * PAGE_SIZE + 200, T - 1])
    with torch.no_grad():
        dense, _ = model(ids)
        sparse, aux = model(ids, "sparse", index_k_format="bf16", probe_rows=rows, probe_formats=("bf16", "mxfp4"))
    # Rows that see <= 16 blocks attend densely; later rows lose blocks on the sparse layers.
    first = TOPK_BLOCKS * PAGE_SIZE
    torch.testing.assert_close(sparse[:, :first], dense[:, :first], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(sparse[:, first:], dense[:, first:], atol=1e-3)
    for layer in model.sparse_ids:
        hit, total = aux["probe"][layer]["bf16"]
        # bf16 against itself: everything; 16 blocks x 2 heads for the 2 binding rows + all 16 for the first.
        assert hit == total == 2 * 16 * 3
        hit, total = aux["probe"][layer]["mxfp4"]
        assert 0 < hit <= total
        assert 0 < aux["kept"][layer] <= 1 + 1e-5


def test_kl_trains_only_index_heads_and_falls(seed, gen):
    model = RetrofitLM(tiny_llama(seed), dense_layers=1, seed=seed)
    ids = torch.randint(0, 97, (1, 4 * PAGE_SIZE), generator=gen)
    rows = torch.arange(PAGE_SIZE, 4 * PAGE_SIZE, 17)[None]
    opt = torch.optim.Adam(model.index.parameters(), lr=3e-3)
    base = {n: p.clone() for n, p in model.hf.named_parameters()}
    kls = []
    for _ in range(15):
        _, aux = model(ids, kl_rows=rows, logit_rows=rows)
        opt.zero_grad()
        aux["index_kl"].backward()
        opt.step()
        kls.append(aux["index_kl"].item())
    assert all(torch.equal(p, base[n]) for n, p in model.hf.named_parameters())
    assert kls[-1] < 0.8 * kls[0]


def test_formats_and_bad_format():
    iq, ik = torch.randn(1, 130, 2, 128), torch.randn(1, 130, 128)
    for fmt in FORMATS:
        q, k = served_index_qk(iq, ik, fmt)
        assert q.shape == iq.shape and k.shape == ik.shape and k.dtype == torch.float32
    with pytest.raises(ValueError, match="index_k_format"):
        served_index_qk(iq, ik, "fp4")


def test_too_long_input_refused(seed):
    model = RetrofitLM(tiny_llama(seed, layers=2), dense_layers=1, seed=seed)
    with pytest.raises(ValueError, match="max positions|positions"):
        model(torch.zeros(1, 4097, dtype=torch.long))


def test_task_prompts_score_the_answer_digits():
    from transformers import AutoTokenizer  # noqa: F401  (tokenizers is what Prompts reads)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(
        ["[UNK]"] + [chr(i) for i in range(32, 127)] + ["\n"])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    prompts = Prompts(tok, evaluation=True)
    import random

    for task in TASKS:
        s = prompts.sample(task, random.Random(task), 1500)
        rows = prompts.answer_rows(s)
        answer = "".join(tok.id_to_token(s.input_ids[r + 1]) for r in rows)
        assert len(s.input_ids) <= 1500 and rows[-1] + 3 == len(s.input_ids)  # the final "." is not scored
        assert answer.strip() and not answer.endswith(".")


def test_cached_training_loss_is_the_forward_kl(seed, gen):
    from retrofit.train import collect, index_loss

    model = RetrofitLM(tiny_llama(seed), dense_layers=1, seed=seed)
    T = (TOPK_BLOCKS + 2) * PAGE_SIZE
    ids = torch.randint(0, 97, (1, T), generator=gen)
    rows = torch.tensor([[PAGE_SIZE, TOPK_BLOCKS * PAGE_SIZE + 3, T - 1]])
    with torch.no_grad():
        _, aux = model(ids, kl_rows=rows, logit_rows=rows)
        cached = collect(model, ids, rows)
        loss, kept = index_loss(model, cached, rows)
    assert sorted(cached) == model.sparse_ids
    # The cache holds the layer inputs in bf16: close to the forward's fp32 KL, not bit-equal.
    torch.testing.assert_close(loss, aux["index_kl"], rtol=0.05, atol=1e-3)
    assert 0 < kept <= 1 + 1e-5  # two rows see more than 16 blocks


def test_bf16_base_runs_every_mode(seed, gen):
    model = RetrofitLM(tiny_llama(seed).to(torch.bfloat16), dense_layers=1, seed=seed)
    T = (TOPK_BLOCKS + 1) * PAGE_SIZE
    ids = torch.randint(0, 97, (1, T), generator=gen)
    rows = torch.tensor([[T - 1]])
    with torch.no_grad():
        dense, _ = model(ids, logit_rows=rows)
        sparse, aux = model(ids, "sparse", index_k_format="mxfp4_rot", logit_rows=rows, probe_rows=rows[0],
                            probe_formats=("nvfp4",))
    _, aux_kl = model(ids, kl_rows=rows, logit_rows=rows)
    aux_kl["index_kl"].backward()
    assert dense.dtype == sparse.dtype == torch.float32 and torch.isfinite(sparse).all()
    assert model.index["1"].index_k_proj.weight.grad is not None
