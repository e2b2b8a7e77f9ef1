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
    with pytest.raises(ValueError, match=r"loc values must lie in \[0, 128\)"):  # not wrapped to the last slot
        write_index_k_ref(k, torch.tensor([3, -1]), k_cache, k_scale, "mxfp4")
    with pytest.raises(ValueError, match="loc must be int32/int64"):
        write_index_k_ref(k, torch.tensor([3.0, 4.0]), k_cache, k_scale, "mxfp4")
    with pytest.raises(ValueError, match="does not match the cache"):
        write_index_k_ref(k, torch.tensor([3, 4]), k_cache, k_scale, "fp8")
    assert torch.equal(before[0], k_cache) and torch.equal(before[1], k_scale)


def test_a_format_that_does_not_match_the_cache_is_refused(gen):
    """bf16 rows into an fp8 cache would be cast silently by torch: refused, the cache unchanged."""
    k_cache, _ = alloc_index_k_cache(1, "fp8")
    k_cache.view(torch.uint8).fill_(0xA5)
    with pytest.raises(ValueError, match="does not match the cache"):
        write_index_k_ref(torch.randn(2, 128, generator=gen), torch.tensor([3, 4]), k_cache, None, "bf16")
    assert (k_cache.view(torch.uint8) == 0xA5).all()


@pytest.mark.parametrize("fmt,scale_rule,sign_seed", [("mxfp4", "floor", None), ("mxfp4_rot", "rceil", 7),
                                                      ("mxfp4_rot", "floor", 123)])
def test_the_writer_keeps_its_scale_rule_and_sign_seed(gen, fmt, scale_rule, sign_seed):
    """What the CPU server writes: the rows of quantize_index_k under the same rule and seed (inputs wide
    enough that floor and rceil pick different scales, so a rule dropped on the way shows)."""
    k = torch.randn(PAGE_SIZE, 128, generator=gen) * torch.logspace(-3, 3, 128)
    k_cache, k_scale = alloc_index_k_cache(1, fmt)
    write_index_k_ref(k, torch.arange(PAGE_SIZE), k_cache, k_scale, fmt, scale_rule, sign_seed)
    rows, scales = quantize_index_k(k, fmt, scale_rule, sign_seed)
    default_rows, default_scales = quantize_index_k(k, fmt)
    assert not (torch.equal(rows, default_rows) and torch.equal(scales, default_scales))
    assert torch.equal(k_cache[0], rows) and torch.equal(k_scale[0], scales)


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


@pytest.mark.parametrize("fmt,scale_rule,sign_seed", [("bf16", "rceil", None), ("fp8", "rceil", None),
                                                      ("mxfp4", "floor", None), ("mxfp4_rot", "floor", 123)])
def test_the_dispatcher_writes_in_the_caches_own_format_rule_and_seed(gen, fmt, scale_rule, sign_seed):
    """``write_index_k(cache, k, loc)`` on the CPU: the reference's rows under the cache's format, scale rule
    and sign seed (nothing passed loose), at the slots only."""
    from m3_kernels.formats import IndexKCache
    from m3_kernels.ops.write import write_index_k

    cache = IndexKCache.new(2, fmt, scale_rule=scale_rule, sign_seed=sign_seed)
    data, scale = cache.views()
    data.view(torch.uint8).fill_(0xA5)
    if scale is not None:
        scale.fill_(0xA5)
    k = torch.randn(130, 128, generator=gen) * torch.logspace(-3, 3, 128)
    loc = torch.randperm(2 * PAGE_SIZE, generator=gen)[:130]
    write_index_k(cache, k, loc)
    want_data, want_scale = alloc_index_k_cache(2, fmt)
    want_data.view(torch.uint8).fill_(0xA5)
    if want_scale is not None:
        want_scale.fill_(0xA5)
    write_index_k_ref(k, loc, want_data, want_scale, fmt, scale_rule, sign_seed)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
    if scale is not None:
        assert torch.equal(scale, want_scale)


def test_the_dispatcher_refuses_bad_rows_and_slots_and_writes_nothing(gen):
    from m3_kernels.formats import IndexKCache
    from m3_kernels.ops.write import write_index_k

    cache = IndexKCache.new(1, "mxfp4")
    before = [t.clone() for t in cache.views()]
    k = torch.randn(2, 128, generator=gen)
    for args, match in [((k, torch.tensor([3, 128])), r"loc values must lie in \[0, 128\)"),
                        ((k, torch.tensor([3.0, 4.0])), "loc must be int32/int64"),
                        ((k.half(), torch.tensor([3, 4])), "k must be float32 or bfloat16"),
                        ((k[:, :64], torch.tensor([3, 4])), r"k must be float32 or bfloat16 \[tokens, 128\]"),
                        ((k, torch.tensor([3, 4], device="meta")), "one device")]:
        with pytest.raises(ValueError, match=match):
            write_index_k(cache, *args)
    assert all(torch.equal(a, b) for a, b in zip(cache.views(), before))


def test_a_plan_checks_the_slots_once_and_each_layer_against_it(gen):
    """``plan_write`` once per batch (slots in range), ``write_planned`` per layer: the one-call result; a cache
    of another format or capacity, and a ``k`` of other rows, are refused before anything is written."""
    from m3_kernels.formats import IndexKCache
    from m3_kernels.ops.write import plan_write, write_index_k, write_planned

    loc = torch.tensor([3, 130, 255], dtype=torch.int32)
    caches = [IndexKCache.new(2, "mxfp4") for _ in range(3)]
    plan = plan_write(caches[0], loc)
    for cache in caches:
        k = torch.randn(3, 128, generator=gen)
        want = IndexKCache.new(2, "mxfp4")
        write_index_k(want, k, loc)
        write_planned(plan, cache, k)
        assert torch.equal(cache.data, want.data) and torch.equal(cache.scale_e8m0, want.scale_e8m0)
    with pytest.raises(ValueError, match="loc values must lie in"):
        plan_write(caches[0], torch.tensor([256], dtype=torch.int32))
    for other in (IndexKCache.new(2, "fp8"), IndexKCache.new(3, "mxfp4")):
        with pytest.raises(ValueError, match="cache must be a mxfp4 cache of 256 slots"):
            write_planned(plan, other, torch.zeros(3, 128))
        assert not other.data.view(torch.uint8).any()
    with pytest.raises(ValueError, match="loc must be int32/int64 .tokens=4., got torch.int32 .3,."):
        write_planned(plan, caches[0], torch.zeros(4, 128))


def test_a_plans_first_slots_write_what_the_one_call_writer_writes_there(gen):
    """``WritePlan.first(n)``: the plan of the first ``n`` of its slots (a padded batch stores its real tokens),
    checked with the rest; ``n`` outside ``[0, slots]`` is refused."""
    from m3_kernels.formats import IndexKCache
    from m3_kernels.ops.write import plan_write, write_index_k, write_planned

    loc = torch.tensor([3, 130, 255, 0], dtype=torch.int64)
    plan = plan_write(IndexKCache.new(2, "mxfp4"), loc)
    for n in (0, 1, 3, 4):
        k = torch.randn(n, 128, generator=gen)
        got, want = IndexKCache.new(2, "mxfp4"), IndexKCache.new(2, "mxfp4")
        write_planned(plan.first(n), got, k)
        write_index_k(want, k, loc[:n])
        assert torch.equal(got.data, want.data) and torch.equal(got.scale_e8m0, want.scale_e8m0)
        assert plan.first(n).loc.shape == (n,) and plan.first(n).run is plan.run
    for bad in (-1, 5, 2.0, True):
        with pytest.raises(ValueError, match=r"n must be an int in \[0, 4\] \(the plan's slots\)"):
            plan.first(bad)
