"""The CPU fixes of the MiniMax-M3.1 model class that run without a server."""

import pytest
import torch

from sglang_m3.models.minimax_m3_1 import swiglu_interleaved_eager, swigluoai_eager


def test_eager_swigluoai_equals_sglangs_compiled_function_bitwise(gen):
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import swiglu_no_interleaved_with_alpha_and_limit

    reference = swiglu_no_interleaved_with_alpha_and_limit._torchdynamo_orig_callable  # the function torch.compile wraps
    x = (torch.randn(37, 2 * 24, generator=gen) * 6).to(torch.bfloat16)  # values past the +-7 clamp included
    x[0, :3] = torch.tensor([-100.0, 7.0, 100.0])
    x[0, 24:27] = torch.tensor([-100.0, -7.0, 100.0])
    got = swigluoai_eager(x, alpha=1.702, limit=7.0)
    assert got.shape == (37, 24) and got.dtype == torch.bfloat16
    assert torch.equal(got, reference(x, 1.702, 7.0))


def test_eager_interleaved_swiglu_equals_sglangs_compiled_function_bitwise(gen):
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import swiglu_gpt_oss_sigmoid_alpha

    reference = swiglu_gpt_oss_sigmoid_alpha._torchdynamo_orig_callable
    x = (torch.randn(5, 3, 2 * 16, generator=gen) * 6).to(torch.bfloat16)
    x[0, 0, :4] = torch.tensor([100.0, -100.0, -100.0, 100.0])
    got = swiglu_interleaved_eager(x, alpha=1.702, limit=7.0)
    assert got.shape == (5, 3, 16)
    assert torch.equal(got, reference(x, 1.702, 7.0))


def test_cpu_per_head_norm_equals_sglangs_gemma_norm_bitwise(gen):
    """The forward the model installs on its per-head norms off CUDA equals SGLang's ``GemmaRMSNorm`` (its native
    path, what a CPU runs) bit for bit, on q-shaped input with more rows than one chunk; calls with a residual
    keep SGLang's own path."""
    import functools

    from sglang.srt.layers.layernorm import GemmaRMSNorm

    from sglang_m3.models.minimax_m3_1 import _gemma_norm_forward_cpu

    norm = GemmaRMSNorm(128, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(128, generator=gen) * 0.3)
    x = (torch.randn(3000, 16 * 128, generator=gen) * 2).to(torch.bfloat16).view(-1, 128)
    want = norm.forward_native(x)
    norm.forward = functools.partial(_gemma_norm_forward_cpu, norm)
    got = norm(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    residual = torch.randn_like(x)
    out, res = norm(x, residual)
    want_out, want_res = norm.forward_native(x, residual)
    assert torch.equal(out, want_out) and torch.equal(res, want_res)


def test_cpu_norm_rope_equals_sglangs_norm_then_rope_bitwise(gen, monkeypatch):
    """The ``_qk_norm_rope`` / ``_index_qk_norm_rope`` the model installs off CUDA equal SGLang's methods (per-head
    ``GemmaRMSNorm``, then its RoPE layer, which on a CPU runs ``forward_native``) bit for bit, on M3's geometry
    (16 q heads, 4 KV heads, 4 index heads, head 128, partial NeoX RoPE over 64 dims, bf16) at positions up to 4k."""
    import functools
    import types

    from sglang.srt.layers.layernorm import GemmaRMSNorm
    from sglang.srt.layers.rotary_embedding import base as rotary_base
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.srt.models.minimax_m3 import MiniMaxM3Attention

    from sglang_m3.models.minimax_m3_1 import (_index_qk_norm_rope_cpu, _qk_norm_rope_cpu, _runs_native_rope,
                                               _torch_rotary_off_cuda)

    # 0.5.16 reads the server args in the RoPE layer (absent in a unit test); later releases do not.
    monkeypatch.setattr(rotary_base, "get_server_args", lambda: types.SimpleNamespace(rl_on_policy_target=None),
                        raising=False)
    with _torch_rotary_off_cuda():
        rotary = get_rope(128, rotary_dim=64, max_position=4096, base=5e6).to(torch.bfloat16)
    if not _runs_native_rope(rotary):  # e.g. 0.5.23's fused-op RoPE layer: the model then keeps SGLang's methods
        pytest.skip("this SGLang's RoPE layer does not dispatch to forward_native; the fused CPU pass is not installed")
    assert rotary.is_neox_style
    norms = {}
    for name in ("q_norm", "k_norm", "index_q_norm", "index_k_norm"):
        norms[name] = GemmaRMSNorm(128, eps=1e-6)
        with torch.no_grad():
            norms[name].weight.copy_(torch.randn(128, generator=gen) * 0.3)
    attn = types.SimpleNamespace(rotary_emb=rotary, index_rotary_emb=rotary, head_dim=128, idx_head_dim=128,
                                 qk_norm_type="per_head", **norms)
    for fn in ("_qk_norm", "_index_qk_norm", "_qk_norm_rope", "_index_qk_norm_rope"):
        setattr(attn, fn, functools.partial(getattr(MiniMaxM3Attention, fn), attn))
    attn._can_use_rocm_qk_norm_rope = lambda *args: False
    attn._can_use_rocm_index_qk_norm_rope_static = False
    tokens = 700
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    q, k, idx_q, idx_k = ((torch.randn(tokens, h * 128, generator=gen) * 2).to(torch.bfloat16) for h in (16, 4, 4, 1))
    for mine, sglangs, a, b in ((_qk_norm_rope_cpu, attn._qk_norm_rope, q, k),
                                (_index_qk_norm_rope_cpu, attn._index_qk_norm_rope, idx_q, idx_k)):
        want = sglangs(positions, a, b)
        got = mine(attn, positions, a, b)
        for g, w in zip(got, want):
            assert g.dtype == torch.bfloat16 and g.shape == w.shape and torch.equal(g, w)


def test_vocab_shard_mask_runs_eagerly_off_cuda(monkeypatch):
    """At TP > 1 the embedding's id mask is SGLang's ``torch.compile`` function; the CPU fix swaps in its
    undecorated original, which gives the same ids and mask (a rank holding ids 1000..1999 of 4000)."""
    from sglang.srt.layers import vocab_parallel_embedding

    from sglang_m3.models.minimax_m3_1 import _vocab_shard_mask_eager

    compiled = vocab_parallel_embedding.get_masked_input_and_mask
    assert hasattr(compiled, "_torchdynamo_orig_callable")  # what SGLang ships: a compiled wrapper
    monkeypatch.setattr(vocab_parallel_embedding, "get_masked_input_and_mask", compiled)
    _vocab_shard_mask_eager()
    eager = vocab_parallel_embedding.get_masked_input_and_mask
    assert not hasattr(eager, "_torchdynamo_orig_callable") and eager is compiled._torchdynamo_orig_callable
    ids = torch.tensor([0, 999, 1000, 1500, 1999, 2000, 3999])
    got_ids, got_mask = eager(ids, 1000, 2000, 0, 4000, 4000)
    assert got_ids.tolist() == [0, 0, 0, 500, 999, 0, 0]
    assert got_mask.tolist() == [True, True, False, False, False, True, True]
