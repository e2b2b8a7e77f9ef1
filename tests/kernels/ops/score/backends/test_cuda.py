"""CUDA C++ MXFP4 decode scorer (``backends/cuda``) against the float64 torch reference.

CPU (CI, where nvcc is installed): the kernel is compiled for sm_90a and its SASS checked
(registers, no spills or local memory, the bulk-copy pipeline and the MMA count the design implies).
GPU (``-m gpu``, sm_90+): the full matrix of Q dtypes, geometries, lengths (1, 127, 128, 129, empty
requests, the last partial page), scale-byte ranges (one-pass and multi-pass pages), context-parallel
shards, split and single-region views, poisoned preallocated buffers, CUDA-graph capture and
replay, the dispatcher's choice and the rejections. Tolerance as in ``test_triton.py``:
``|got - ref| <= 1e-5 * bound`` with ``bound`` the score of ``|q|`` and ``|K|``.
"""

import pathlib
import re
import shutil
import subprocess

import pytest
import torch

from m3_kernels.formats import (
    E8M0_EXPONENT_BIAS,
    FP8_DTYPE,
    MXFP4_DATA_BYTES,
    MXFP4_PAGE_DATA_BYTES,
    MXFP4_SCALE_BYTES,
    PAGE_SIZE,
    IndexKCache,
)
from m3_kernels.ops.score import DecodeBatch, plan_decode, resolve_backend, score_decode
from m3_kernels.ops.score.backends import cuda as cuda_backend
from m3_kernels.ops.score.naive import score_decode_ref
from m3_kernels.testing import (
    abs_index_k,
    assert_scores_close,
    capture_graph,
    make_q,
    q_abs,
    random_cache,
    score_decode_views,
)

SOURCE = cuda_backend.SOURCE
INSTANCES = [(nt, e4m3) for nt in (1, 2, 3, 4) for e4m3 in (False, True)]


def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs an sm_90+ GPU")
    ok, why = cuda_backend.availability()
    if not ok:
        pytest.skip(why)


# ---------------------------------------------------------------- CPU: the source against the formats module


def test_kernel_constants_match_the_formats_module():
    """The C++ source restates the page layout; the formats module owns it."""
    text = SOURCE.read_text()
    consts = {name: int(val) for name, val in re.findall(r"constexpr int (k\w+) = (\d+);", text)}
    assert consts["kPageTokens"] == PAGE_SIZE
    assert consts["kDataRowBytes"] == MXFP4_DATA_BYTES
    assert consts["kScaleRowBytes"] == MXFP4_SCALE_BYTES
    assert consts["kPageTokens"] * consts["kDataRowBytes"] == MXFP4_PAGE_DATA_BYTES
    assert consts["kE8m0Bias"] == E8M0_EXPONENT_BIAS


# ---------------------------------------------------------------- CPU: SASS facts


def _tool(name):
    """nvcc from PATH; cuobjdump from PATH or the copy Triton ships."""
    found = shutil.which(name)
    if found:
        return found
    import triton

    path = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else None


@pytest.fixture(scope="module")
def sm90_build(tmp_path_factory):
    nvcc, cuobjdump = _tool("nvcc"), _tool("cuobjdump")
    if nvcc is None or cuobjdump is None:
        pytest.skip("nvcc or cuobjdump not installed")
    tmp = tmp_path_factory.mktemp("cuda_sass")
    src = tmp / "instances.cu"
    lines = ["#define M3_MXFP4_DEVICE_ONLY", f'#include "{SOURCE}"']
    lines += [f"template __global__ void m3_mxfp4::score_decode_mxfp4_kernel<{nt}, {str(e).lower()}>"
              f"(const __grid_constant__ m3_mxfp4::Params);" for nt, e in INSTANCES]
    src.write_text("\n".join(lines) + "\n")
    cubin = tmp / "instances.cubin"
    res = subprocess.run([nvcc, "-std=c++17", "-O3", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o", str(cubin),
                          str(src)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, timeout=300).stdout
    return res.stderr, sass


def _ptxas_usage(log):
    """{(nt, e4m3): (registers, spill bytes, stack bytes)} from ptxas -v."""
    usage = {}
    for m in re.finditer(r"Function properties for \S*kernelILi(\d)ELb([01])E\S*\s+(\d+) bytes stack frame, "
                         r"(\d+) bytes spill stores, (\d+) bytes spill loads\s+ptxas info\s+: Used (\d+) registers",
                         log):
        nt, e, stack, st, ld, regs = (int(x) for x in m.groups())
        usage[(nt, bool(e))] = (regs, st + ld, stack)
    return usage


def _functions(sass):
    """{(nt, e4m3): list of opcodes} per kernel instantiation."""
    out, cur = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : \S*kernelILi(\d)ELb([01])E", line)
        if m:
            cur = out.setdefault((int(m.group(1)), m.group(2) == "1"), [])
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m and cur is not None:
            cur.append(m.group(1))
    return out


def test_host_launcher_compiles(tmp_path):
    """The TVM-FFI launcher (what load_jit builds) compiles against the installed apache-tvm-ffi: host code and
    the kernels' PTX."""
    nvcc = _tool("nvcc")
    try:
        import tvm_ffi.libinfo
    except ImportError:
        pytest.skip("apache-tvm-ffi not installed")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    src = tmp_path / "module.cu"
    src.write_text(f'#include "{SOURCE}"\n'
                   "TVM_FFI_DLL_EXPORT_TYPED_FUNC(score_decode_mxfp4, (m3_mxfp4::score_decode_mxfp4));\n")
    includes = [f"-I{p}" for p in tvm_ffi.libinfo.include_paths()]
    includes += [f"-I{p}/dlpack" for p in tvm_ffi.libinfo.include_paths()]
    # PTX only (no ptxas): the SASS of every instantiation is built and checked by ``sm90_build`` below.
    res = subprocess.run([nvcc, "-std=c++20", "-O3", "-gencode", "arch=compute_90a,code=compute_90a", "-c",
                          "-Xcompiler", "-fPIC", *includes,
                          "-o", str(tmp_path / "module.o"), str(src)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]


def test_sass_every_instance_builds_without_spills(sm90_build):
    usage = _ptxas_usage(sm90_build[0])
    assert set(usage) == set(INSTANCES), sorted(usage)
    for (nt, e4m3), (regs, spill, stack) in usage.items():
        budget = 65536 // (128 * (3 if nt <= 2 else 2))  # the launch bounds: 3 (2) CTAs of 128 threads per SM
        what = f"NT={nt} e4m3={e4m3}"
        assert spill == 0 and stack == 0, f"{what}: {spill} B spilled, {stack} B stack"
        assert regs <= min(255, budget), f"{what}: {regs} registers > {budget}"


def test_sass_structure(sm90_build):
    """Bulk copies on mbarriers, no local memory, 16-byte shared loads of K, and the MMA count of
    the design: per n-tile and page 8 tiles x 8 k-steps, for the fully visible page and the masked
    page, plus one multi-pass tile body."""
    funcs = _functions(sm90_build[1])
    assert set(funcs) == set(INSTANCES)
    for (nt, _), ops in funcs.items():
        names = [o.split(".")[0] for o in ops]
        assert "UBLKCP" in names, "no bulk copy (cp.async.bulk)"
        assert any(n.startswith("SYNCS") for n in names), "no mbarrier wait"
        assert not {"LDL", "STL"} & set(names), "local memory in use"
        assert "LDS.128" in ops, "K is not read with 16-byte shared loads"
        hmma = names.count("HMMA")
        print(f"NT={nt}: {len(ops)} instructions, {hmma} HMMA")
        assert hmma == nt * (2 * 64 + 8), f"NT={nt}: {hmma} HMMA, expected {nt * 136} (loops fully unrolled)"


# ---------------------------------------------------------------- GPU: against the oracle


def written_mask(ref, seq_lens, S, max_block, cp):
    """Columns a preallocated buffer receives: each request's pages up to its last visible one."""
    mask = torch.zeros_like(ref, dtype=torch.bool)
    for b, n in enumerate(seq_lens):
        n_global = (n - 1) // PAGE_SIZE + 1 if n >= 1 else 0
        n_local = min(max_block, max(0, (n_global - cp[0] + cp[1] - 1) // cp[1]))
        mask[:, b * S : (b + 1) * S, :n_local] = True
    return mask


def check(gen, q_dtype, S, H, seq_lens, max_block, cp=(0, 1), prealloc=True, single=True, scale_range=(122, 127),
          q_scale=1.0, pages=None):
    batch = len(seq_lens)
    pages = pages or batch * max_block + 1
    k_data, k_scale = random_cache(gen, "mxfp4", pages, "cuda", single, *scale_range)
    bt = torch.randperm(pages, generator=gen)[: batch * max_block].reshape(batch, max_block).int().cuda()
    seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = make_q(gen, batch * S, H, q_dtype, "cuda", q_scale)
    sm_scale = 0.125
    out = torch.full((H, batch * S, max_block), float("nan"), device="cuda") if prealloc else None
    got = score_decode_views(q, k_data, k_scale, bt, seq, S, sm_scale, max_block, out, cp[0], cp[1], backend="cuda")
    kc, ks = k_data.cpu(), k_scale.cpu()
    args = (bt.cpu(), seq.cpu(), S, sm_scale, max_block, cp[0], cp[1])
    ref = score_decode_ref(q.cpu(), kc, ks, *args)
    bound = score_decode_ref(q_abs(q.cpu()), *abs_index_k(kc, ks), *args)
    if prealloc:
        assert got.data_ptr() == out.data_ptr()
        mask = written_mask(ref, seq_lens, S, max_block, cp)
        assert torch.isnan(got.cpu()[~mask]).all(), "preallocated buffer written past a request's last page"
        got = torch.where(mask.cuda(), got, ref.cuda().float())
    assert_scores_close(got, ref, bound)
    return got


Q_DTYPES = pytest.mark.parametrize("q_dtype", [torch.bfloat16, FP8_DTYPE], ids=["q_bf16", "q_e4m3"])
GEOMETRIES = [(1, 1), (4, 1), (1, 4), (2, 3), (3, 3), (8, 1), (5, 4), (8, 4)]



@pytest.mark.gpu
@Q_DTYPES
@pytest.mark.parametrize("S,H", GEOMETRIES)
@pytest.mark.parametrize("single", [True, False], ids=["single_region", "split_views"])
def test_decode_matrix(gen, q_dtype, S, H, single):
    _sm90()
    lens = [S, 127, 128, 129, 1000, 2047, 2048, 300 + S]
    check(gen, q_dtype, S, H, [max(n, S) for n in lens], 16, single=single)


@pytest.mark.gpu
@Q_DTYPES
@pytest.mark.parametrize("S", [1, 4])
def test_lengths_one_and_empty_requests(gen, q_dtype, S):
    """Length 1 (S = 1), a request with no visible page (seq_lens 0) and requests shorter than a page."""
    _sm90()
    lens = [1, 0, 5, 0, 128, 129] if S == 1 else [4, 0, 5, 131, 0, 256]
    check(gen, q_dtype, S, 2, lens, 4)


@pytest.mark.gpu
@Q_DTYPES
@pytest.mark.parametrize("cp", [(0, 2), (1, 2), (3, 4)])
def test_context_parallel_shards(gen, q_dtype, cp):
    _sm90()
    check(gen, q_dtype, 4, 1, [4, 129, 1000, 3000, 4096, 4097], 12, cp=cp)


@pytest.mark.gpu
@Q_DTYPES
@pytest.mark.parametrize("scale_range,q_scale", [((122, 127), 1.0), ((107, 131), 1.0), ((1, 20), 1.0),
                                                 ((230, 252), 2.0**-100), ((100, 150), 1.0), ((1, 254), 2.0**-120)],
                         ids=["seed", "span24", "tiny", "huge", "span50_multipass", "full_range_multipass"])
def test_scale_ranges(gen, q_dtype, scale_range, q_scale):
    """One-pass pages (span <= 24 binades) and multi-pass pages (wider), NaN-free extremes; Q scaled
    so that every exact score fits fp32 (scale byte 254 is 2^127)."""
    _sm90()
    check(gen, q_dtype, 4, 2, [129, 1000, 2048, 700], 16, scale_range=scale_range, q_scale=q_scale)


@pytest.mark.gpu
def test_many_requests_and_uneven_lengths(gen):
    """More than 32 requests (the work map scans them in warps of 32), some empty, uneven lengths:
    every warp's run of pages crosses requests."""
    _sm90()
    lens = torch.randint(0, 3000, (77,), generator=gen).tolist()
    lens[3] = lens[40] = 0
    check(gen, torch.bfloat16, 1, 4, [max(n, 1) if i % 5 else n for i, n in enumerate(lens)], 24)


@pytest.mark.gpu
@Q_DTYPES
def test_default_buffer_reads_minus_inf_past_the_end(gen, q_dtype):
    _sm90()
    got = check(gen, q_dtype, 2, 2, [2, 130, 900], 10, prealloc=False)
    assert torch.isneginf(got[:, 0:2, 1:]).all() and torch.isneginf(got[:, 2:4, 2:]).all()


@pytest.mark.gpu
def test_split_and_single_region_agree_bitwise(gen):
    _sm90()
    pages, batch, mb = 40, 3, 12
    single = random_cache(gen, "mxfp4", pages, "cuda")
    split = (single[0].contiguous(), single[1].contiguous())
    bt = torch.randperm(pages, generator=gen)[: batch * mb].reshape(batch, mb).int().cuda()
    seq = torch.tensor([5, 700, 1536], dtype=torch.int32, device="cuda")
    q = make_q(gen, batch * 2, 2, torch.bfloat16, "cuda")
    a = score_decode_views(q, *single, bt, seq, 2, 0.3, backend="cuda")
    b = score_decode_views(q, *split, bt, seq, 2, 0.3, backend="cuda")
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(gen):
    """Captured once with preallocated buffers, replayed with other lengths, block tables and Q."""
    _sm90()
    pages, batch, mb, S, H = 64, 4, 16, 4, 1
    k_data, k_scale = random_cache(gen, "mxfp4", pages, "cuda")
    bt = torch.zeros(batch, mb, dtype=torch.int32, device="cuda")
    seq = torch.full((batch,), S, dtype=torch.int32, device="cuda")
    q = torch.zeros(batch * S, H, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(H, batch * S, mb, device="cuda")
    cache = IndexKCache.of(k_data, k_scale)
    plan = plan_decode(cache, DecodeBatch(bt, seq, S, H, 0.5, mb, out), backend="cuda")  # once, at capture

    def run():
        score_decode(plan, q, cache, out)

    graph = capture_graph(run)
    for lens in ([4, 129, 1000, 2048], [2048, 5, 300, 128], [17, 17, 17, 1900]):
        bt.copy_(torch.randperm(pages, generator=gen)[: batch * mb].reshape(batch, mb))
        seq.copy_(torch.tensor(lens))
        q.copy_(make_q(gen, batch * S, H, torch.bfloat16, "cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        args = (bt.cpu(), seq.cpu(), S, 0.5, mb)
        kc, ks = k_data.cpu(), k_scale.cpu()
        ref = score_decode_ref(q.cpu(), kc, ks, *args)
        bound = score_decode_ref(q_abs(q.cpu()), *abs_index_k(kc, ks), *args)
        mask = written_mask(ref, lens, S, mb, (0, 1))
        assert torch.isnan(out.cpu()[~mask]).all()
        assert_scores_close(torch.where(mask.cuda(), out, ref.cuda().float()), ref, bound)


@pytest.mark.gpu
def test_dispatcher_picks_cuda_for_mxfp4_on_sm90(gen, monkeypatch):
    """auto -> the CUDA kernel for MXFP4 (same numbers as forcing it), Triton for fp8 and for S*H > 32."""
    _sm90()
    monkeypatch.delenv("M3_SCORE_BACKEND", raising=False)
    calls = []
    launch = cuda_backend.run  # every CUDA-kernel run, auto or forced, ends here (bound by the plan)
    monkeypatch.setattr(cuda_backend, "run", lambda *a, **k: calls.append(1) or launch(*a, **k))
    k_data, k_scale = random_cache(gen, "mxfp4", 9, "cuda")
    cache = IndexKCache.of(k_data, k_scale)
    bt = torch.arange(8, dtype=torch.int32, device="cuda").reshape(2, 4)
    seq = torch.tensor([300, 512], dtype=torch.int32, device="cuda")
    q = make_q(gen, 2, 4, torch.bfloat16, "cuda")
    plan = plan_decode(cache, DecodeBatch(bt, seq, 1, 4, 0.2))
    assert plan.backend == "cuda"
    auto = score_decode(plan, q, cache)
    assert calls == [1]
    forced = plan_decode(cache, DecodeBatch(bt, seq, 1, 4, 0.2), backend="cuda")
    assert torch.equal(auto, score_decode(forced, q, cache))
    assert calls == [1, 1]
    fp8 = IndexKCache.new(9, "fp8", "cuda")
    assert plan_decode(fp8, DecodeBatch(bt, seq, 1, 4, 0.2)).backend == "triton"
    assert plan_decode(cache, DecodeBatch(bt, seq, 1, 33, 0.2)).backend == "triton"  # past the 32 query vectors
    score_decode(plan_decode(fp8, DecodeBatch(bt, seq, 1, 4, 0.2)), q, fp8)
    assert calls == [1, 1]  # fp8 went to Triton


@pytest.mark.gpu
def test_rejections(gen):
    """What the kernel does not take is a ValueError naming the rule (at plan time); a misaligned Q view is
    copied once by the run and scores the same."""
    _sm90()
    k_data, k_scale = random_cache(gen, "mxfp4", 9, "cuda")
    bt = torch.arange(8, dtype=torch.int32, device="cuda").reshape(2, 4)
    seq = torch.tensor([300, 512], dtype=torch.int32, device="cuda")
    q = make_q(gen, 2, 4, torch.bfloat16, "cuda")
    fp8 = torch.zeros(9, 128, 128, dtype=torch.uint8, device="cuda").view(FP8_DTYPE)
    misaligned = torch.zeros(2 * 4 * 128 + 4, dtype=torch.bfloat16, device="cuda")[4:].view(2, 4, 128)
    misaligned.copy_(q)
    assert torch.equal(score_decode_views(misaligned, k_data, k_scale, bt, seq, 1, 0.2, backend="cuda"),
                       score_decode_views(q, k_data, k_scale, bt, seq, 1, 0.2, backend="cuda"))
    cases = {
        "MXFP4 caches only": dict(k_cache=fp8, k_scale=None),
        r"S \* H <= 32": dict(q=make_q(gen, 2, 33, torch.bfloat16, "cuda")),
        "sm_scale": dict(sm_scale=float("nan")),
        "max_block": dict(max_block=5),
    }
    base = dict(q=q, k_cache=k_data, k_scale=k_scale, block_table=bt, seq_lens=seq, S=1, sm_scale=0.2)
    for match, change in cases.items():
        args = {**base, **change}
        with pytest.raises(ValueError, match=match):
            score_decode_views(**args, backend="cuda")


def test_unavailable_off_gpu_is_a_reason_not_a_crash():
    """Importing and asking never raises without a GPU; the reason names what is missing."""
    ok, why = cuda_backend.availability(torch.device("cpu"))
    assert not ok and "NVIDIA GPU" in why
    if not torch.cuda.is_available():
        cache = IndexKCache.new(1, "mxfp4")
        with pytest.raises(NotImplementedError, match="cannot run here"):
            plan_decode(cache, DecodeBatch(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1,
                                           1, 1.0), backend="cuda")


def test_resolver_names_the_auto_backend(monkeypatch):
    """A server resolves at start-up what auto decode would compile at first use; on CPU: nothing."""
    monkeypatch.delenv("M3_SCORE_BACKEND", raising=False)
    assert resolve_backend("cpu", "mxfp4") == "torch"


@pytest.mark.gpu
def test_resolver_builds_the_cuda_kernel_on_sm90(monkeypatch):
    _sm90()
    monkeypatch.delenv("M3_SCORE_BACKEND", raising=False)
    assert resolve_backend("cuda", "mxfp4") == "cuda" and resolve_backend("cuda", "mxfp4_rot") == "cuda"
    assert resolve_backend("cuda", "fp8") == "triton"
    # Prefill on Hopper is the sm_90 Triton scorer for every format; the CUDA kernel is decode only.
    assert resolve_backend("cuda", "mxfp4", op="prefill") == "triton_sm90"


def test_a_failed_build_is_remembered_and_reported(monkeypatch):
    """A compiler failure makes the backend unavailable with its reason (auto then keeps Triton)."""
    monkeypatch.setattr(cuda_backend, "_availability", _fake_ok_availability)
    monkeypatch.setattr(cuda_backend, "_build_error", None)

    def broken():
        raise OSError("nvcc exited with 1")

    monkeypatch.setattr(cuda_backend, "_module", broken)
    assert cuda_backend.ensure_built("cuda") is False
    assert cuda_backend._build_error == "OSError: nvcc exited with 1"


def _fake_ok_availability(device_type, index):
    return (False, f"the JIT build failed: {cuda_backend._build_error}") if cuda_backend._build_error else (True, "")


_fake_ok_availability.cache_clear = lambda: None
