import pytest
import torch

from m3_kernels.formats import FP8_DTYPE, IndexKFormat, dequantize_index_k, prepare_index_q, quantize_index_k


@pytest.mark.parametrize("fmt", [f.value for f in IndexKFormat])
def test_every_format_rejects_the_same_bad_keys(fmt):
    """One rule for every format: ``k`` is float32 or bfloat16 with last dim 128."""
    with pytest.raises(ValueError, match="k must be float32 or bfloat16"):
        quantize_index_k(torch.zeros(2, 128, dtype=torch.float16), fmt)
    with pytest.raises(ValueError, match="k must be float32 or bfloat16"):
        quantize_index_k(torch.zeros(2, 64), fmt)


def test_dequantize_rejects_uint8_rows_without_their_scales():
    """uint8 rows are MXFP4 codes: without scale rows they used to come back as fp8 values (3 -> 3.0)."""
    with pytest.raises(ValueError, match="without scale_rows, rows must be bfloat16 or float8_e4m3fn.*uint8"):
        dequantize_index_k(torch.full((1, 128), 3, dtype=torch.uint8), None)
    for bad in (torch.zeros(2, 128), torch.zeros(2, 128, dtype=torch.float16), torch.zeros(2, 64).bfloat16()):
        with pytest.raises(ValueError, match="without scale_rows, rows must be"):
            dequantize_index_k(bad, None)


def test_dequantize_with_scales_takes_mxfp4_rows_only():
    rows, scales = quantize_index_k(torch.randn(3, 128), "mxfp4")
    assert dequantize_index_k(rows, scales).shape == (3, 128)
    bad = {"bf16 rows": (torch.zeros(3, 128).bfloat16(), scales),
           "fp8 rows": (torch.zeros(3, 128).to(FP8_DTYPE), scales),
           "float scales": (rows, scales.float()), "scales of other rows": (rows, scales[:2])}
    for name, (r, s) in bad.items():
        with pytest.raises(ValueError, match=r"with scale_rows \(MXFP4\), rows must be uint8"):
            dequantize_index_k(r, s)


@pytest.mark.parametrize("fmt", [f.value for f in IndexKFormat])
def test_dequantize_round_trips_every_format(fmt, gen):
    k = torch.randn(5, 128, generator=gen)
    rows, scales = quantize_index_k(k, fmt)
    assert dequantize_index_k(rows, scales).shape == (5, 128)


def test_rotated_format_refuses_an_fp8_index_q():
    """Rotating an e4m3 Q and casting back would round twice and turn |Rq| > 448 into NaN."""
    q = torch.full((1, 128), 400.0)
    with pytest.raises(ValueError, match=r"q \(the index Q\) must be bfloat16 or float32 for 'mxfp4_rot'.*float8"):
        prepare_index_q(q.to(FP8_DTYPE), "mxfp4_rot")
    with pytest.raises(ValueError, match="must be bfloat16 or float32"):
        prepare_index_q(q.half(), "mxfp4_rot")
    rotated = prepare_index_q(q.bfloat16(), "mxfp4_rot")
    assert rotated.dtype == torch.bfloat16 and torch.isfinite(rotated).all()
    for fmt in ("bf16", "fp8", "mxfp4"):  # unrotated formats pass Q through, e4m3 included
        fp8_q = q.to(FP8_DTYPE)
        assert prepare_index_q(fp8_q, fmt) is fp8_q
