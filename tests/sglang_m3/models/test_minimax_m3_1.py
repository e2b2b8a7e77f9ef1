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
