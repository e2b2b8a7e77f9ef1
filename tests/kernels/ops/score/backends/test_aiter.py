"""aiter's MXFP4 scorer as a backend: our call binds to its signature, without a GPU.

With aiter installed (and exposing ``score_flydsl_fp4``) the call is bound to the installed
function, so a version mismatch fails here rather than at the first decode. Without aiter
(every CPU machine: it is not on PyPI) it is bound to the signature documented by the pull
request (``backends/aiter/signature.py``), which only checks that our call matches that
document. The test reports which one it checked.
"""

import dataclasses
import inspect
import math

import pytest
import torch

from m3_kernels.formats import PAGE_SIZE, IndexKCache, alloc_index_k_cache
from m3_kernels.ops.score import DecodeBatch, plan_decode
from m3_kernels.ops.score.common import new_out
from m3_kernels.ops.score.backends import aiter as aiter_backend
from m3_kernels.ops.score.backends.aiter import signature
from m3_kernels.testing import fill_random_index_k, score_decode_views


def mxfp4_call(S=4, H=1, batch=3, num_pages=4, q_dtype=torch.bfloat16, fmt="mxfp4"):
    k_cache, k_scale = alloc_index_k_cache(num_pages, fmt)
    fill_random_index_k(torch.Generator().manual_seed(0), k_cache, k_scale)  # nonzero scores to compare
    q = torch.randn(batch * S, H, 128).to(q_dtype)
    block_table = torch.randint(0, num_pages, (batch, num_pages), dtype=torch.int32)
    seq_lens = torch.tensor([1, PAGE_SIZE + 1, 3 * PAGE_SIZE][:batch], dtype=torch.int32)
    return q, k_cache, k_scale, block_table, seq_lens, S, 0.125


def aiter_plan(q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, cp_rank=0, cp_world=1):
    """``(plan, q, cache, out)`` of a call planned for aiter on any machine: the batch planned (the shared
    rules), then aiter's own rules (``check_plan``), without asking for a ROCm GPU."""
    cache = IndexKCache.of(k_cache, k_scale)
    batch = DecodeBatch(block_table, seq_lens, S, q.shape[1], sm_scale, cp_rank=cp_rank, cp_world=cp_world)
    plan = dataclasses.replace(plan_decode(cache, batch, backend="torch"), backend="aiter", run=aiter_backend.run)
    aiter_backend.check_plan(plan, batch)
    return plan, q, cache, new_out(plan)


def decode_call(*call, **cp):
    plan, q, cache, out = aiter_plan(*call, **cp)
    args, kwargs = aiter_backend.decode_call(plan, q, cache, out)
    return args, kwargs, out


def target():
    """(function to bind against, what it is)."""
    fn = aiter_backend.find_scorer()
    if fn is not None:
        return fn, f"installed aiter {getattr(fn, '__module__', '?')}.{fn.__name__}"
    return signature.score_flydsl_fp4, f"signature documented in {signature.PR} (aiter not installed)"


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_call_binds_to_aiter_signature(q_dtype, record_property):
    fn, what = target()
    record_property("aiter_signature_checked", what)
    print(f"bound against: {what}")
    args, kwargs, out = decode_call(*mxfp4_call(q_dtype=q_dtype))
    bound = inspect.signature(fn).bind(*args, **kwargs)
    q, k_data, k_scale = args[:3]
    names = list(bound.arguments)
    # The two cache views and the scale land in the parameters that take them, by position.
    assert bound.arguments[names[1]] is k_data and bound.arguments[names[2]] is k_scale
    assert bound.arguments["out"] is out
    assert bound.arguments["S"] == 4 and bound.arguments["H"] == 1


def test_spec_matches_the_fp8_entry_point_shape():
    """The spec is the fp8 signature with ``cache`` split into two views: our call must NOT bind
    to the fp8 entry point (an aiter without the MXFP4 PR), or this test could not catch one."""

    def score_flydsl(idx_q, cache, block_table, seq_lens, S, H, sm_scale, max_block, out=None, cfg=None,
                     work_map=None, **cfg_kwargs):
        """The fp8 scorer's documented signature."""

    args, kwargs, _ = decode_call(*mxfp4_call())
    with pytest.raises(TypeError):
        inspect.signature(score_flydsl).bind(*args, **kwargs)
    params = list(signature.SPEC.parameters)
    assert params[:3] == ["idx_q", "k_data", "k_scale"]
    assert params[3:] == [p for p in inspect.signature(score_flydsl).parameters if p not in ("idx_q", "cache")]


def test_scale_is_converted_from_log2_domain():
    """aiter stores max * sm_scale * log2(e); we hand it sm_scale / log2(e)."""
    call = mxfp4_call()
    args, _, _ = decode_call(*call)
    passed = args[7]
    assert math.isclose(passed * math.log2(math.e), call[6], rel_tol=1e-15)


def test_rejections():
    call = list(mxfp4_call())
    with pytest.raises(ValueError, match="MXFP4"):
        decode_call(*mxfp4_call(fmt="fp8"))
    with pytest.raises(ValueError, match="cp_world"):
        decode_call(*call, cp_rank=0, cp_world=2)
    bad = list(call)
    bad[6] = float("nan")
    with pytest.raises(ValueError, match="sm_scale"):
        decode_call(*bad)


def test_default_out_reads_minus_inf():
    args, kwargs, out = decode_call(*mxfp4_call(S=2, H=4, batch=2))
    assert out.shape == (4, 4, 4) and out.dtype == torch.float32 and torch.isneginf(out).all()


def test_unavailable_without_aiter_on_rocm():
    if aiter_backend.find_scorer() is not None and torch.cuda.is_available():
        pytest.skip("aiter and a GPU are present")
    ok, reason = aiter_backend.availability(torch.device("cpu"))
    assert not ok and reason
    with pytest.raises(NotImplementedError, match="aiter"):
        score_decode_views(*mxfp4_call(), backend="aiter")


def test_dispatch_calls_the_scorer_with_our_call(monkeypatch):
    """A decode plan for backend "aiter" and its run end to end on the CPU, with a stand-in module in place of aiter
    (same documented signature; it records the call and scores with the torch reference)."""
    import importlib.machinery
    import sys
    import types

    from m3_kernels.ops.score.naive import score_decode_ref

    calls = []

    def score_flydsl_fp4(idx_q, k_data, k_scale, block_table, seq_lens, S, H, sm_scale, max_block, out=None, cfg=None,
                         work_map=None, **cfg_kwargs):
        calls.append((idx_q, k_data, k_scale, S, H, sm_scale, max_block, out))
        ref = score_decode_ref(idx_q, k_data, k_scale, block_table, seq_lens, S, sm_scale * math.log2(math.e),
                               max_block)
        out.copy_(ref)
        return out

    names = ["aiter", "aiter.ops", "aiter.ops.flydsl", "aiter.ops.flydsl.kernels",
             "aiter.ops.flydsl.kernels.minimax_m3_index_score"]
    for name in names:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules[names[-1]].score_flydsl_fp4 = score_flydsl_fp4
    assert aiter_backend.find_scorer() is score_flydsl_fp4
    ok, reason = aiter_backend.availability(torch.device("cpu"))
    assert not ok and "ROCm" in reason
    monkeypatch.setattr(aiter_backend, "availability", lambda device=None: (True, ""))

    call = mxfp4_call(S=2, H=4)
    got = score_decode_views(*call, backend="aiter")
    (q, k_data, k_scale, S, H, sm, max_block, out), = calls
    assert q is call[0] and k_data is call[1] and k_scale is call[2] and (S, H, max_block) == (2, 4, 4)
    assert got is out
    want = score_decode_ref(*call)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite].double(), want[finite], rtol=1e-6)
