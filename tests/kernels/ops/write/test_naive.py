import pytest
import torch

from m3_kernels.formats import PAGE_SIZE, alloc_index_k_cache, quantize_index_k
from m3_kernels.ops.write.naive import write_index_k_ref


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4", "mxfp4_rot"])
def test_rows_land_at_their_slots(gen, fmt):
    pages = 3
    k_cache, k_scale = alloc_index_k_cache(pages, fmt)
    k_cache.view(torch.uint8).fill_(0xA5)  # poison
    if k_scale is not None:
        k_scale.fill_(0xA5)
    k = torch.randn(129, 128, generator=gen)
    loc = torch.randperm(pages * PAGE_SIZE, generator=gen)[:129]
    write_index_k_ref(k, loc, k_cache, k_scale, fmt)
    rows, scales = quantize_index_k(k, fmt)
    page, row = loc // PAGE_SIZE, loc % PAGE_SIZE
    assert torch.equal(k_cache[page, row].view(torch.uint8), rows.view(torch.uint8))
    if k_scale is not None:
        assert torch.equal(k_scale[page, row], scales)
    untouched = torch.ones(pages * PAGE_SIZE, dtype=torch.bool)
    untouched[loc] = False
    assert (k_cache.reshape(pages * PAGE_SIZE, -1).view(torch.uint8)[untouched] == 0xA5).all()
    if k_scale is not None:
        assert (k_scale.reshape(pages * PAGE_SIZE, -1)[untouched] == 0xA5).all()


def test_bad_loc_leaves_cache_untouched(gen):
    k_cache, k_scale = alloc_index_k_cache(1, "mxfp4")
    before = (k_cache.clone(), k_scale.clone())
    k = torch.randn(2, 128, generator=gen)
    with pytest.raises(ValueError, match=r"loc values must lie in \[0, 128\)"):
        write_index_k_ref(k, torch.tensor([3, 128]), k_cache, k_scale, "mxfp4")
    with pytest.raises(ValueError, match="loc must be int32/int64"):
        write_index_k_ref(k, torch.tensor([3.0, 4.0]), k_cache, k_scale, "mxfp4")
    with pytest.raises(ValueError, match="does not match the cache"):
        write_index_k_ref(k, torch.tensor([3, 4]), k_cache, k_scale, "fp8")
    assert torch.equal(before[0], k_cache) and torch.equal(before[1], k_scale)


def test_empty_write_is_a_no_op():
    k_cache, k_scale = alloc_index_k_cache(1, "fp8")
    write_index_k_ref(torch.zeros(0, 128), torch.zeros(0, dtype=torch.int64), k_cache, k_scale, "fp8")
    assert (k_cache.view(torch.uint8) == 0).all()


def test_rejects_tensors_on_different_devices(gen):
    k_cache, k_scale = alloc_index_k_cache(1, "mxfp4")
    k = torch.randn(2, 128, generator=gen)
    with pytest.raises(ValueError, match="one device"):
        write_index_k_ref(k, torch.tensor([3, 4], device="meta"), k_cache, k_scale, "mxfp4")
    with pytest.raises(ValueError, match="one device"):
        write_index_k_ref(k.to("meta"), torch.tensor([3, 4]), k_cache, k_scale, "mxfp4")
    assert (k_cache == 0).all() and (k_scale == 0).all()
