"""The CPU fixes of the MiniMax-M3.1 model class that run without a server."""

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
