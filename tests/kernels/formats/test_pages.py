import pytest
import torch

from m3_kernels.formats import (
    MXFP4_PAGE_BYTES,
    alloc_index_k_cache,
    check_index_k_cache,
    check_mxfp4_views,
    mxfp4_page_views,
    parse_format,
)
from m3_kernels.ops.write.naive import write_index_k_ref


def test_single_region_views_layout():
    pages = torch.arange(3 * MXFP4_PAGE_BYTES, dtype=torch.int64).remainder(251).to(torch.uint8).view(3, MXFP4_PAGE_BYTES)
    k_data, k_scale = mxfp4_page_views(pages)
    assert k_data.shape == (3, 128, 64) and k_scale.shape == (3, 128, 4)
    assert torch.equal(k_data[1, 2], pages[1, 2 * 64 : 3 * 64])
    assert torch.equal(k_scale[2, 5], pages[2, 8192 + 5 * 4 : 8192 + 6 * 4])
    check_mxfp4_views(k_data, k_scale)


@pytest.mark.parametrize("layout", ["sliced", "padded"])
def test_views_follow_the_buffer_offset_and_page_stride(layout):
    """A pool's pages as a slice of a larger buffer (non-zero storage offset) or with rows padded past
    MXFP4_PAGE_BYTES (page stride > 8704): both views address page p at the buffer's own page p."""
    width = MXFP4_PAGE_BYTES + (16 if layout == "padded" else 0)
    raw = torch.arange(4 * width, dtype=torch.int64).remainder(251).to(torch.uint8).view(4, width)
    pages = raw[1:, :MXFP4_PAGE_BYTES] if layout == "sliced" else raw[:, :MXFP4_PAGE_BYTES]
    k_data, k_scale = mxfp4_page_views(pages)
    for p in range(pages.shape[0]):
        for row in (0, 5, 127):
            assert torch.equal(k_data[p, row], pages[p, row * 64 : (row + 1) * 64])
            assert torch.equal(k_scale[p, row], pages[p, 8192 + row * 4 : 8192 + (row + 1) * 4])
    check_mxfp4_views(k_data, k_scale)


def test_split_and_single_region_agree_bitwise(gen):
    k = torch.randn(3 * 128 - 5, 128, generator=gen)
    loc = torch.randperm(3 * 128, generator=gen)[: k.shape[0]]
    single = alloc_index_k_cache(3, "mxfp4", single_region=True)
    split = alloc_index_k_cache(3, "mxfp4", single_region=False)
    write_index_k_ref(k, loc, *single, "mxfp4")
    write_index_k_ref(k, loc, *split, "mxfp4")
    assert torch.equal(single[0], split[0]) and torch.equal(single[1], split[1])


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_alloc_matches_check(fmt):
    k_cache, k_scale = alloc_index_k_cache(2, fmt)
    assert check_index_k_cache(k_cache, k_scale) is parse_format(fmt)


def test_rejections():
    k_data, k_scale = alloc_index_k_cache(4, "mxfp4", single_region=False)
    with pytest.raises(ValueError, match="k_data must be torch.uint8"):
        check_mxfp4_views(k_data.view(torch.int8), k_scale)
    with pytest.raises(ValueError, match=r"k_scale must be \[pages, 128, 4\]"):
        check_mxfp4_views(k_data, torch.zeros(4, 128, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="same page count"):
        check_mxfp4_views(k_data, k_scale[:3])
    with pytest.raises(ValueError, match="16-byte aligned"):
        raw = torch.zeros(4 * 8192 + 1, dtype=torch.uint8)
        check_mxfp4_views(raw[1:].view(4, 128, 64), k_scale)
    with pytest.raises(ValueError, match="16-byte aligned"):  # aligned base, page stride 8200 not a multiple of 16
        check_mxfp4_views(torch.zeros(4 * 8200, dtype=torch.uint8).as_strided((4, 128, 64), (8200, 64, 1)), k_scale)
    with pytest.raises(ValueError, match="row-contiguous"):
        check_mxfp4_views(torch.zeros(4, 64, 128, dtype=torch.uint8).transpose(1, 2), k_scale)
    # Overlapping views in one buffer: scale block inside the data region.
    pages = torch.zeros(4, MXFP4_PAGE_BYTES, dtype=torch.uint8)
    d, _ = mxfp4_page_views(pages)
    bad_scale = pages.as_strided((4, 128, 4), (MXFP4_PAGE_BYTES, 4, 1), 4096)
    with pytest.raises(ValueError, match="overlap"):
        check_mxfp4_views(d, bad_scale)
    # A scale block that starts inside its page but runs into the next page's data.
    pages = torch.zeros(5, MXFP4_PAGE_BYTES, dtype=torch.uint8)
    d, _ = mxfp4_page_views(pages[:4])
    with pytest.raises(ValueError, match="overlap"):
        check_mxfp4_views(d, pages.as_strided((4, 128, 4), (MXFP4_PAGE_BYTES, 4, 1), MXFP4_PAGE_BYTES - 256))
    with pytest.raises(ValueError, match="pages overlap"):
        check_mxfp4_views(k_data.as_strided((4, 128, 64), (64, 64, 1)), k_scale)
    with pytest.raises(ValueError, match="bfloat16 or float8_e4m3fn"):
        check_index_k_cache(torch.zeros(2, 128, 128), None)
    with pytest.raises(ValueError, match=r"index_k_format must be one of \[bf16, fp8, mxfp4, mxfp4_rot\], got 'int4'"):
        alloc_index_k_cache(2, "int4")
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_page_views(torch.zeros(2, MXFP4_PAGE_BYTES, dtype=torch.int8))
