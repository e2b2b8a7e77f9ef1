"""``IndexKCache``: one layer's cache as one value, checked once when made."""

import pytest
import torch

from m3_kernels.formats import (
    FP8_DTYPE,
    MXFP4_PAGE_BYTES,
    PAGE_SIZE,
    IndexKCache,
    IndexKFormat,
    ScaleRule,
    alloc_index_k_cache,
    check_index_k_cache,
    mxfp4_page_views,
    rotate,
)


@pytest.mark.parametrize("fmt", list(IndexKFormat))
def test_new_holds_the_format_the_views_and_the_geometry(fmt):
    cache = IndexKCache.new(3, fmt, scale_rule="floor", sign_seed=5)
    assert cache.fmt is IndexKFormat(fmt) and cache.scale_rule is ScaleRule.FLOOR and cache.sign_seed == 5
    assert (cache.num_pages, cache.page_size, cache.head_dim, cache.capacity) == (3, PAGE_SIZE, 128, 3 * PAGE_SIZE)
    assert cache.device == torch.device("cpu")
    data, scale = cache.views()
    assert data is cache.data and scale is cache.scale_e8m0
    assert (scale is not None) == cache.fmt.is_mxfp4
    assert cache.storage is (IndexKFormat.MXFP4 if cache.fmt.is_mxfp4 else cache.fmt)
    if cache.fmt.is_mxfp4:  # single-region pages by default
        assert data.untyped_storage().data_ptr() == scale.untyped_storage().data_ptr()
        assert data.stride(0) == MXFP4_PAGE_BYTES


def test_of_reads_the_storage_format_off_the_views():
    for fmt in ("bf16", "fp8", "mxfp4"):
        assert IndexKCache.of(*alloc_index_k_cache(1, fmt)).fmt is IndexKFormat(fmt)
    rot = IndexKCache.of(*alloc_index_k_cache(1, "mxfp4"), fmt="mxfp4_rot", sign_seed=3)
    assert rot.fmt is IndexKFormat.MXFP4_ROT and rot.storage is IndexKFormat.MXFP4 and rot.sign_seed == 3


def _views(name):
    """(data, scale) with one planted defect; each is refused by ``check_index_k_cache`` with the message below."""
    data, scale = alloc_index_k_cache(4, "mxfp4", single_region=False)
    if name == "scale_misaligned":
        scale = torch.zeros(4 * 128 * 4 + 1, dtype=torch.uint8)[1:].view(4, 128, 4)
    elif name == "views_overlap":
        scale = data.as_strided((4, 128, 4), (data.stride(0), 4, 1))
    elif name == "data_strided":
        data = torch.zeros(4, 128, 128, dtype=torch.uint8)[:, :, :64]
    elif name == "page_counts":
        scale = scale[:3]
    elif name == "data_dtype":
        data, scale = torch.zeros(4, 128, 128, dtype=torch.float16), None
    elif name == "scale_in_data_page":  # the single region with the scale block moved into the data bytes
        pages = torch.zeros(4, MXFP4_PAGE_BYTES, dtype=torch.uint8)
        data, _ = mxfp4_page_views(pages)
        scale = pages.as_strided((4, 128, 4), (MXFP4_PAGE_BYTES, 4, 1), 16)
    return data, scale


BAD_VIEWS = {
    "scale_misaligned": "k_scale base address and page stride must be 16-byte aligned",
    "views_overlap": "k_data and k_scale overlap",
    "data_strided": r"k_data must be row-contiguous within a page",
    "page_counts": "k_data and k_scale must have the same page count, got 4 and 3",
    "data_dtype": "k_cache must be bfloat16 or float8_e4m3fn",
    "scale_in_data_page": "k_data and k_scale overlap",
}


@pytest.mark.parametrize("name", list(BAD_VIEWS))
def test_a_planted_bad_view_is_refused_when_the_cache_is_made(name):
    """Today's messages (``check_index_k_cache``), raised by the constructor: a cache that exists is valid."""
    data, scale = _views(name)
    with pytest.raises(ValueError, match=BAD_VIEWS[name]):
        check_index_k_cache(data, scale)
    with pytest.raises(ValueError, match=BAD_VIEWS[name]):
        IndexKCache(IndexKFormat.MXFP4 if scale is not None else IndexKFormat.BF16, data, scale)
    with pytest.raises(ValueError, match=BAD_VIEWS[name]):
        IndexKCache.of(data, scale)


@pytest.mark.parametrize("fmt,views", [("fp8", "mxfp4"), ("mxfp4", "fp8"), ("bf16", "fp8"), ("mxfp4_rot", "bf16")])
def test_a_format_that_does_not_match_the_storage_is_refused(fmt, views):
    with pytest.raises(ValueError, match=f"fmt '{fmt}' does not match the cache's storage"):
        IndexKCache(fmt, *alloc_index_k_cache(1, views))


def test_bad_names_are_refused_with_the_choices():
    data, scale = alloc_index_k_cache(1, "mxfp4")
    with pytest.raises(ValueError, match=r"index_k_format must be one of \[bf16, fp8, mxfp4, mxfp4_rot\], got 'int4'"):
        IndexKCache("int4", data, scale)
    with pytest.raises(ValueError, match=r"scale_rule must be one of \[rceil, floor\], got 'round'"):
        IndexKCache("mxfp4", data, scale, "round")


def test_the_cache_is_frozen():
    cache = IndexKCache.new(1, "fp8")
    with pytest.raises(AttributeError):
        cache.data = torch.zeros(1, 128, 128, dtype=FP8_DTYPE)


@pytest.mark.parametrize("fmt", list(IndexKFormat))
def test_prepare_q_is_the_formats_q_side_transform(gen, fmt):
    """mxfp4_rot rotates Q by the keys' rotation (its sign seed); every other format passes Q through."""
    cache = IndexKCache.new(1, fmt, sign_seed=11 if fmt == "mxfp4_rot" else None)
    q = torch.randn(3, 2, 128, generator=gen).bfloat16()
    got = cache.prepare_q(q)
    if cache.fmt.is_rotated:
        assert torch.equal(got, rotate(q.float(), 11).bfloat16())
        with pytest.raises(ValueError, match="bfloat16 or float32 for 'mxfp4_rot'"):
            cache.prepare_q(q.to(FP8_DTYPE))
    else:
        assert got is q
