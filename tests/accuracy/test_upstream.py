"""accuracy.upstream: the index-K cache SGLang's own MiniMax-M3 path keeps, by release and launch arguments
(the rules read from SGLang 0.5.16 through 0.5.23's MiniMax-M3 pool)."""

import pytest

from accuracy import upstream


@pytest.mark.parametrize("version, kv, backend, dtype, fmt", [
    ("0.5.16", "auto", "fa3", "auto", "bf16"),
    ("0.5.16", "fp8_e4m3", "trtllm_mha", "auto", "bf16"),  # 0.5.16: always the model dtype
    ("0.5.16", "auto", "triton", "float16", "fp16"),
    ("0.5.17", "fp8_e4m3", "trtllm_mha", "auto", "fp8"),
    ("0.5.22", "fp8_e4m3", "fa3", "bfloat16", "bf16"),  # before 0.5.23 Hopper keeps the model dtype
    ("0.5.22", "fp8_e5m2", "trtllm_mha", "auto", "bf16"),
    ("0.5.23", "fp8_e4m3", "trtllm_mha", "auto", "fp8"),
    ("0.5.23", "fp8_e4m3", "fa3", "auto", None),  # fp8 on Hopper, bf16 elsewhere: the info names no GPU
    ("0.5.23", "auto", "fa3", "auto", "bf16"),
    ("not-a-version", "auto", "fa3", "auto", None),
])
def test_the_index_k_format_by_release_and_arguments(version, kv, backend, dtype, fmt):
    got, why = upstream.index_k_format({"version": version, "kv_cache_dtype": kv, "attention_backend": backend,
                                        "dtype": dtype})
    assert got == fmt and why


def test_labels():
    assert upstream.parse_label("upstream-FP8", "--base-url format") == "upstream-fp8"
    with pytest.raises(ValueError, match="--formats: 'upstream-mxfp4' must be upstream-bf16 or upstream-fp8"):
        upstream.parse_label("upstream-mxfp4", "--formats")
