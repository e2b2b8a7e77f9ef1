"""FlyDSL decode scorer: compile-level proof for gfx950, plus its host-side rules and dispatch.

No AMD GPU is available to these tests. Each specialisation is traced from a real, validated
decode call built on the CPU (``prepare_decode``), lowered by FlyDSL's own pipeline in
compile-only mode for gfx950, and turned into assembly with ``gpu-module-to-binary{format=isa}``
(the fatbin step needs ROCm's lld, the assembly does not). The tests then read the assembly:
the instructions that carry the design are present in the expected numbers, loads are 16 B
wide, and nothing spills to scratch. Whether the kernel computes the right scores on a GPU is
NOT tested here.
"""

import importlib.util
import math
import re

import numpy as np
import pytest
import torch

from m3_kernels.formats import FP8_DTYPE, PAGE_SIZE, alloc_index_k_cache
from m3_kernels.ops.score import resolve_backend
from m3_kernels.testing import score_decode_views, score_prefill_views
from m3_kernels.ops.score.backends import flydsl as flydsl_backend
from m3_kernels.ops.score.backends.flydsl.checks import check_flydsl_decode
from m3_kernels.ops.score.common import check_decode_args

HAS_FLYDSL = importlib.util.find_spec("flydsl") is not None
needs_flydsl = pytest.mark.skipif(
    not HAS_FLYDSL, reason="flydsl is not installed (pip install '.[amd]'; CI installs it)"
)

FORMATS = ("mxfp4", "fp8", "bf16")
Q_DTYPES = {"bf16": torch.bfloat16, "e4m3": FP8_DTYPE}
GEOMETRIES = [(S, H) for S in (1, 2, 4) for H in (1, 4)]  # M3: 1 + up to 3 draft tokens, 1 or 4 index heads
NUM_PAGES = 4


def decode_call(fmt, q_name, S, H, batch=2, q=None):
    """A valid decode call on the CPU: (args, kwargs) for score_decode."""
    k_cache, k_scale = alloc_index_k_cache(NUM_PAGES, fmt)
    if q is None:
        q = torch.randn(batch * S, H, 128).to(Q_DTYPES[q_name])
    block_table = torch.randint(0, NUM_PAGES, (batch, NUM_PAGES), dtype=torch.int32)
    seq_lens = torch.tensor([3 * PAGE_SIZE + 1, S][:batch], dtype=torch.int32)
    return (q, k_cache, k_scale, block_table, seq_lens, S, 1 / math.sqrt(128)), {}


_ISA = {}  # one lowering per specialisation per session


def lowered(fmt, q_name, S, H, nt_k=None):
    """(isa text, launcher) of one specialisation, lowered once per session."""
    from m3_kernels.ops.score.backends.flydsl.host import prepare_decode
    from m3_kernels.ops.score.backends.flydsl.isa import lower_to_isa

    key = (fmt, q_name, S, H, nt_k)
    if key not in _ISA:
        args, kwargs = decode_call(fmt, q_name, S, H)
        launcher, launch_args, _ = prepare_decode(*args, **kwargs, nt_k=nt_k)
        _ISA[key] = lower_to_isa(launcher, *launch_args, arch="gfx950"), launcher
    return _ISA[key]


def expected(fmt, q_name, S, H, launcher):
    """Instruction counts the design implies for one specialisation."""
    tiles = launcher.pages_per_wave * PAGE_SIZE // 16  # K tiles per wave (pages unrolled)
    nf = -(-S * H // 16)  # 16-feature n-tiles
    scaled = q_name == "e4m3" and fmt != "bf16"
    k_x4 = {"mxfp4": 1, "fp8": 2, "bf16": 4}[fmt]  # 16-byte loads per lane per tile
    q_x4 = nf * (2 if q_name == "e4m3" else 4)
    want = {
        "buffer_load_dwordx4": tiles * k_x4 + q_x4,
        # MXFP4 scales: two dwords per lane per page (512 B), then one cross-lane read per tile.
        "buffer_load_dword": 2 * launcher.pages_per_wave if fmt == "mxfp4" else 0,
        "ds_bpermute_b32": tiles if fmt == "mxfp4" else 0,
        "v_mfma_scale_f32_16x16x128_f8f6f4": tiles * nf if scaled else 0,
        "v_mfma_f32_16x16x32_bf16": 0 if scaled else tiles * nf * 4,
        "v_cvt_scalef32_pk_bf16_fp4": tiles * 16 if fmt == "mxfp4" and not scaled else 0,
        "v_cvt_scalef32_pk_bf16_fp8": (tiles * 16 if fmt == "fp8" and not scaled else 0)
        + (nf * 16 if fmt == "bf16" and q_name == "e4m3" else 0),
        "buffer_store_dword": launcher.pages_per_wave * nf,
    }
    return want


# Every M3 specialisation, plus S*H = 32 (two 16-feature n-tiles) for MXFP4.
SPECIALISATIONS = [(f, q, S, H) for f in FORMATS for q in Q_DTYPES for S, H in GEOMETRIES]
SPECIALISATIONS += [("mxfp4", q, 8, 4) for q in Q_DTYPES]


@needs_flydsl
@pytest.mark.parametrize("fmt,q_name,S,H", SPECIALISATIONS, ids=[f"{f}-{q}-S{S}H{H}" for f, q, S, H in SPECIALISATIONS])
def test_specialisation_lowers_to_gfx950_isa(fmt, q_name, S, H):
    from m3_kernels.ops.score.backends.flydsl.isa import instruction_counts, kernel_resources

    isa, launcher = lowered(fmt, q_name, S, H)
    assert re.search(r"\.amdgcn_target \"amdgcn-amd-amdhsa-[a-z]*-gfx950\"", isa)
    counts = instruction_counts(isa)
    got = {name: counts.get(name, 0) for name in expected(fmt, q_name, S, H, launcher)}
    assert got == expected(fmt, q_name, S, H, launcher)
    # K and Q only through 16-byte vector loads (the counts above): nothing split into narrower pieces.
    assert not any(counts.get(n) for n in ("buffer_load_ubyte", "buffer_load_dwordx2", "buffer_load_dwordx3"))
    assert not any(n.startswith(("global_load", "flat_load")) for n in counts)
    # The scaled MFMA reads K as e2m1 (cbsz:4) for MXFP4 and as e4m3 (no format modifier) for fp8.
    scaled_lines = [line for line in isa.splitlines() if "v_mfma_scale_f32_16x16x128_f8f6f4" in line]
    assert all(("cbsz:4" in line) == (fmt == "mxfp4") for line in scaled_lines)
    # No scratch: no private segment, no spills, no scratch instructions.
    res = kernel_resources(isa)
    assert res["private_segment_fixed_size"] == 0 and res["private_seg_size"] == 0
    assert res["vgpr_spill_count"] == 0 and res["sgpr_spill_count"] == 0
    assert not any(n.startswith("scratch_") for n in counts)
    assert res["num_vgpr"] <= 128, res  # leaves room for 4 waves per SIMD (512 VGPRs each)


@needs_flydsl
@pytest.mark.parametrize("nt_k", [1, 3, 6, 8])
def test_k_tiles_in_flight(nt_k):
    """Before the first MFMA the kernel has issued Q and exactly nt_k + 1 K tiles (tile 0 and the
    nt_k tiles whose loads run while it is multiplied)."""
    isa, _ = lowered("mxfp4", "bf16", 4, 1, nt_k=nt_k)
    body = [line.split()[0] for line in isa.splitlines() if line.startswith("\t") and not line.startswith("\t.")]
    first_mfma = next(i for i, name in enumerate(body) if name.startswith("v_mfma"))
    q_loads = 4
    assert body[:first_mfma].count("buffer_load_dwordx4") == q_loads + min(nt_k + 1, PAGE_SIZE // 16)


@needs_flydsl
def test_default_nt_k_is_six_for_mxfp4():
    from m3_kernels.ops.score.backends.flydsl.host import prepare_decode

    args, kwargs = decode_call("mxfp4", "bf16", 4, 1)
    launcher, *_ = prepare_decode(*args, **kwargs)
    launcher6, *_ = prepare_decode(*args, **kwargs, nt_k=6)
    assert launcher is launcher6


# Lane-level CPU model of the kernel. It runs the kernel's own index functions (decode.py) lane by
# lane over the real cache bytes, with the documented gfx950 MFMA operand layouts and nibble order,
# and must reproduce the reference. It checks the kernel's address, lane and mask arithmetic; it
# cannot check the hardware assumptions themselves.


def _storage_bytes(t):
    """(all bytes of t's storage as uint8, t's byte offset in it)."""
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return raw, t.storage_offset() * t.element_size()


def _lane_values(raw, offsets, nbytes, kind, scale_bytes=None):
    """[64, n] float64 values each lane holds, read from byte ``offsets[lane]`` on."""
    from m3_kernels.formats import e2m1_decode, e8m0_to_float

    idx = torch.as_tensor(offsets, dtype=torch.long)[:, None] + torch.arange(nbytes)
    b = raw[idx]
    if kind == "e2m1":  # element 2i in the low nibble of byte i
        codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(1)
        return e2m1_decode(codes, torch.float64) * e8m0_to_float(scale_bytes, torch.float64)[:, None]
    dtype = {"e4m3": FP8_DTYPE, "bf16": torch.bfloat16}[kind]
    return b.contiguous().view(dtype).double()


def _mfma_model(a_lanes, b_lanes):
    """16x16xK MFMA with A[i][k] in lane i + 16 (k // w), B[k][n] in lane n + 16 (k // w) (w values per
    lane); returns [64, 4]: lane l holds D[4 (l // 16) + r][l % 16]."""
    w = a_lanes.shape[1]
    A = torch.stack([torch.cat([a_lanes[i + 16 * g] for g in range(4)]) for i in range(16)])  # [16, 4w]
    B = torch.stack([torch.cat([b_lanes[n + 16 * g] for g in range(4)]) for n in range(16)]).T
    D = A @ B
    assert w * 4 == A.shape[1]
    return torch.stack([D[4 * (lane // 16) : 4 * (lane // 16) + 4, lane % 16] for lane in range(64)])


def model_decode(launcher, fmt, q, k_cache, k_scale, block_table, seq_lens, S, sm_scale, out, cp_rank, cp_world):
    """Run the kernel's lane arithmetic on the CPU, writing ``out`` like the kernel would."""
    from m3_kernels.ops.score.backends.flydsl import decode as kd

    H, F = q.shape[1], S * q.shape[1]
    nf, waves, ppw = -(-F // 16), launcher.pages_per_cta // launcher.pages_per_wave, launcher.pages_per_wave
    q_kind = "e4m3" if q.dtype == FP8_DTYPE else "bf16"
    k_token_bytes = {"mxfp4": 64, "fp8": 128, "bf16": 256}[fmt]
    lanes = torch.arange(64)
    n_col, grp = lanes % 16, lanes // 16
    q_raw, q_base = _storage_bytes(q)
    k_raw, k_base = _storage_bytes(k_cache)
    if fmt == "mxfp4":
        s_raw, s_base = _storage_bytes(k_scale)
    batch, max_block = block_table.shape[0], out.shape[2]
    grid_y = -(-max_block // launcher.pages_per_cta)
    for b in range(batch):
        seq_len = int(seq_lens[b])
        n_local = max(0, min(max_block, (-(-seq_len // PAGE_SIZE) - cp_rank + cp_world - 1) // cp_world))
        feats = [torch.clamp(n_col + 16 * j, max=F - 1) for j in range(nf)]
        toks, heads = [f // H for f in feats], [f % H for f in feats]
        es = q.element_size()
        q_lanes = []
        for j in range(nf):
            offs = [q_base + kd.q_lane_offset(b, int(toks[j][ln]), int(heads[j][ln]), int(grp[ln]), S,
                                              q.stride(0) * es, q.stride(1) * es, es) for ln in range(64)]
            q_lanes.append(_lane_values(q_raw, offs, 32 * es, q_kind))
        for chunk in range(grid_y):
            for wave in range(waves):
                for jp in range(ppw):
                    p = kd.local_page(chunk, jp, wave, waves, ppw)
                    if p >= n_local:
                        continue
                    gp, page = p * cp_world + cp_rank, int(block_table[b, p])
                    best = [torch.full((64,), -math.inf, dtype=torch.float64) for _ in range(nf)]
                    for t in range(kd.TILES_PER_PAGE):
                        offs = [k_base + page * k_cache.stride(0) * k_cache.element_size()
                                + kd.k_lane_offset(t, int(n_col[ln]), int(grp[ln]), k_token_bytes) for ln in range(64)]
                        if fmt == "mxfp4":
                            s_page = s_base + page * k_scale.stride(0)
                            words = [[int.from_bytes(bytes(s_raw[s_page + kd.scale_word_offset(h, ln) + np.arange(4)]
                                                           .tolist()), "little") for ln in range(64)] for h in range(2)]
                            scale = []
                            for ln in range(64):
                                half, src = kd.scale_source(t, int(n_col[ln]))
                                scale.append((words[half][src] >> (8 * int(grp[ln]))) & 0xFF)
                            k_lanes = _lane_values(k_raw, offs, 16, "e2m1", torch.tensor(scale, dtype=torch.uint8))
                        else:
                            k_lanes = _lane_values(k_raw, offs, k_token_bytes // 4, "e4m3" if fmt == "fp8" else "bf16")
                        for j in range(nf):
                            acc = _mfma_model(k_lanes, q_lanes[j])
                            for i in range(4):
                                row = kd.acc_row(t, grp, i)
                                limit = kd.visible_limit(seq_len, S, toks[j], gp)
                                best[j] = torch.maximum(best[j], torch.where(row <= limit, acc[:, i], -math.inf))
                    for j in range(nf):
                        m = best[j].view(4, 16).amax(0).repeat(4)  # the xor-16 and xor-32 shuffles
                        for ln in range(16):  # lanes of group 0 store their column
                            if ln + 16 * j < F:
                                off = kd.out_offset(int(heads[j][ln]), int(toks[j][ln]), b, p, S, out.stride(0),
                                                    out.stride(1))
                                out.view(-1)[off] = m[ln] * sm_scale
    return out


MODEL_CASES = [  # (fmt, q, S, H, seq_lens, cp_rank, cp_world)
    ("mxfp4", "bf16", 1, 4, [0, 1, 127, 128, 129, 300], 0, 1),
    ("mxfp4", "e4m3", 4, 1, [4, 257], 0, 1),
    ("mxfp4", "bf16", 8, 4, [130, 9], 0, 1),  # two n-tiles
    ("mxfp4", "e4m3", 2, 4, [700, 260], 1, 2),  # context parallel
    ("fp8", "bf16", 2, 1, [129, 2], 0, 1),
    ("fp8", "e4m3", 4, 4, [1, 383], 0, 1),
    ("bf16", "bf16", 1, 1, [128, 200], 0, 1),
    ("bf16", "e4m3", 2, 4, [3, 130], 0, 1),
]


@needs_flydsl
@pytest.mark.parametrize("fmt,q_name,S,H,seq,cp_rank,cp_world", MODEL_CASES)
def test_lane_model_matches_reference(gen, fmt, q_name, S, H, seq, cp_rank, cp_world):
    from m3_kernels.ops.score.backends.flydsl.host import prepare_decode
    from m3_kernels.ops.score.naive import score_decode_ref
    from m3_kernels.ops.write.naive import write_index_k_ref

    batch = len(seq)
    max_block = -(-(-(-max(seq) // PAGE_SIZE)) // cp_world)
    num_pages = batch * max_block + 2
    k_cache, k_scale = alloc_index_k_cache(num_pages, fmt, single_region=(cp_world == 1))
    k = torch.randn(num_pages * PAGE_SIZE, 128, generator=gen) * torch.rand(1, 128, generator=gen).mul(8).exp2()
    write_index_k_ref(k, torch.arange(k.shape[0]), k_cache, k_scale, fmt)
    block_table = torch.randperm(num_pages, generator=gen)[: batch * max_block].view(batch, max_block).int()
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    q_store = torch.randn(batch * S, H + 1, 128, generator=gen).to(Q_DTYPES[q_name])
    q = q_store[:, 1:]  # strided heads: row stride != H * 128
    sm = 0.0883
    launcher, args, out = prepare_decode(q, k_cache, k_scale, block_table, seq_lens, S, sm, max_block,
                                         torch.full((H, batch * S, max_block), math.nan), cp_rank, cp_world)
    got = model_decode(launcher, fmt, q, k_cache, k_scale, block_table, seq_lens, S, sm, out, cp_rank, cp_world)
    want = score_decode_ref(q, k_cache, k_scale, block_table, seq_lens, S, sm, max_block, cp_rank, cp_world)
    written = ~torch.isnan(got)
    assert torch.equal(torch.isneginf(got[written]), torch.isneginf(want[written]))
    assert torch.allclose(got[written].double(), want[written], rtol=2**-23, atol=0)  # out is fp32
    # Unwritten slots are exactly the pages past each request's last visible page.
    for b, n in enumerate(seq):
        n_local = max(0, min(max_block, (-(-n // PAGE_SIZE) - cp_rank + cp_world - 1) // cp_world))
        assert written[:, b * S : (b + 1) * S, :n_local].all() and not written[:, b * S : (b + 1) * S, n_local:].any()


# Host-side rules and dispatch: no FlyDSL needed.


def test_shares_the_decode_rules():
    args, _ = decode_call("mxfp4", "bf16", 2, 4)
    assert check_flydsl_decode(*args) == check_decode_args(*args)
    bad = list(args)
    bad[6] = -1.0
    with pytest.raises(ValueError, match="sm_scale"):
        check_flydsl_decode(*bad)


def test_rejects_misaligned_q():
    store = torch.zeros(2 * 4 * 128 + 8, dtype=torch.bfloat16)
    q = store[8:].view(2, 4, 128)  # 16 B past the base: aligned; 8 elements = 16 B
    args, _ = decode_call("mxfp4", "bf16", 1, 4, q=q)
    check_flydsl_decode(*args)
    q = store[4 : 4 + 2 * 4 * 128].view(2, 4, 128)  # 8 B past the base
    args, _ = decode_call("mxfp4", "bf16", 1, 4, q=q)
    check_decode_args(*args)  # the shared rules accept it ...
    with pytest.raises(ValueError, match="16-byte aligned"):  # ... this kernel does not
        check_flydsl_decode(*args)


def test_not_available_off_rocm():
    ok, reason = flydsl_backend.availability(torch.device("cpu"))
    assert not ok and ("gfx950" in reason or "not installed" in reason)
    args, _ = decode_call("mxfp4", "bf16", 1, 1)
    with pytest.raises(NotImplementedError, match="flydsl"):
        score_decode_views(*args, backend="flydsl")


def test_resolve_backend(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv("M3_SCORE_BACKEND", raising=False)
    assert resolve_backend(cpu, "fp8") == "torch"
    monkeypatch.setattr(flydsl_backend, "is_available", lambda device: True)  # as on ROCm gfx950
    assert resolve_backend(gpu, "fp8") == "flydsl" and resolve_backend(gpu, "mxfp4") == "flydsl"
    assert resolve_backend(gpu, "fp8", op="prefill") == "triton"  # no FlyDSL prefill
    monkeypatch.setattr(flydsl_backend, "is_available", lambda device: False)  # NVIDIA, other AMD
    assert resolve_backend(gpu, "fp8") == "triton"
    for forced in ("torch", "triton", "cuda", "flydsl", "aiter"):
        monkeypatch.setenv("M3_SCORE_BACKEND", forced)
        assert resolve_backend(gpu, "fp8") == forced and resolve_backend(cpu, "fp8") == forced
        # Decode-only backends: a forced one leaves prefill on its auto choice (never the torch
        # reference on a GPU).
        want_gpu = "triton" if forced in ("cuda", "flydsl", "aiter") else forced
        want_cpu = "torch" if forced in ("cuda", "flydsl", "aiter") else forced
        assert resolve_backend(gpu, "fp8", op="prefill") == want_gpu
        assert resolve_backend(cpu, "fp8", op="prefill") == want_cpu
    monkeypatch.setenv("M3_SCORE_BACKEND", "bogus")
    with pytest.raises(ValueError, match="M3_SCORE_BACKEND"):
        resolve_backend(gpu, "fp8")


def test_prefill_ignores_forced_flydsl_on_cpu(monkeypatch):
    """Forcing flydsl for decode must not break prefill, which has no FlyDSL path."""
    monkeypatch.setenv("M3_SCORE_BACKEND", "flydsl")
    k_cache, k_scale = alloc_index_k_cache(2, "mxfp4")
    q = torch.randn(3, 1, 128).to(torch.bfloat16)
    out = score_prefill_views(q, k_cache, k_scale, torch.tensor([[0, 1]], dtype=torch.int32),
                              torch.tensor([3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 0.1)
    assert out.shape == (1, 3, 2)


@needs_flydsl
def test_prepare_allocates_minus_inf_and_skips_empty_launch():
    from m3_kernels.ops.score.backends.flydsl.host import prepare_decode

    args, _ = decode_call("fp8", "bf16", 2, 1)
    launcher, launch_args, out = prepare_decode(*args)
    assert launcher is not None and out.shape == (1, 4, NUM_PAGES) and torch.isneginf(out).all()
    q, k_cache, k_scale, bt, sl, S, sm = args
    launcher, launch_args, out = prepare_decode(q[:0], k_cache, k_scale, bt[:0], sl[:0], S, sm)
    assert launcher is None and out.shape == (1, 0, NUM_PAGES)


@needs_flydsl
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_planned_run_marshals_the_launch_of_the_checked_call(fmt):
    """The run of a plan (no checks) builds the very launch the checked loose call builds; a misaligned Q
    view is copied once instead of refused."""
    from m3_kernels.formats import IndexKCache
    from m3_kernels.ops.score import DecodeBatch, plan_decode
    from m3_kernels.ops.score.backends.flydsl.host import prepare_decode, prepare_run

    (q, k_cache, k_scale, bt, sl, S, sm), _ = decode_call(fmt, "bf16", 2, 4)
    cache = IndexKCache.of(k_cache, k_scale)
    want_launcher, want, _ = prepare_decode(q, k_cache, k_scale, bt, sl, S, sm)
    plan = plan_decode(cache, DecodeBatch(bt, sl, S, 4, sm), backend="torch")  # the plan's fields; FlyDSL's launch
    launcher, got, out = prepare_run(plan, q, cache, None)
    assert launcher is want_launcher and len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is b or torch.equal(a, b)) if isinstance(a, torch.Tensor) else a == b
    store = torch.zeros(q.numel() + 4, dtype=q.dtype)
    shifted = store[4:].view_as(q)
    shifted.copy_(q)
    launcher, got, _ = prepare_run(plan, shifted, cache, None)
    assert got[0].data_ptr() % 16 == 0 and torch.equal(got[0], want[0])


# On a ROCm gfx950 GPU only (written for MI350/MI355X; never run: no such GPU was available).

ON_GFX950 = torch.cuda.is_available() and flydsl_backend.is_available(torch.device("cuda", 0))
GPU_CASES = [  # (seq_lens, S, H, cp_rank, cp_world)
    ([0, 1, 127, 128, 129, 1000], 1, 4, 0, 1),
    ([4, 300, 257, 4096], 4, 1, 0, 1),
    ([2, 129, 640], 2, 4, 0, 1),
    ([1000, 513, 130], 4, 4, 1, 2),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GFX950, reason="needs a ROCm gfx950 GPU with flydsl installed")
@pytest.mark.parametrize("seq,S,H,cp_rank,cp_world", GPU_CASES)
@pytest.mark.parametrize("q_name", list(Q_DTYPES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_reference_on_gfx950(gen, fmt, q_name, seq, S, H, cp_rank, cp_world):
    from m3_kernels.ops.score.naive import score_decode_ref
    from m3_kernels.ops.write.naive import write_index_k_ref

    dev = torch.device("cuda", 0)
    batch, max_block = len(seq), -(-max(seq) // PAGE_SIZE)
    num_pages = batch * max_block + 3
    k_cache, k_scale = alloc_index_k_cache(num_pages, fmt)
    k = torch.randn(num_pages * PAGE_SIZE, 128, generator=gen) * torch.rand(1, 128, generator=gen) * 4
    write_index_k_ref(k, torch.arange(k.shape[0]), k_cache, k_scale, fmt)
    block_table = torch.randperm(num_pages, generator=gen)[: batch * max_block].view(batch, max_block).int()
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    q = (torch.randn(batch * S, H, 128, generator=gen) * 0.5).to(Q_DTYPES[q_name])
    sm = 1 / math.sqrt(128)
    want = score_decode_ref(q, k_cache, k_scale, block_table, seq_lens, S, sm, max_block, cp_rank, cp_world)
    to = lambda t: None if t is None else t.to(dev)  # noqa: E731
    args = [to(q), to(k_cache), to(k_scale), to(block_table), to(seq_lens), S, sm, max_block]
    got = score_decode_views(*args, cp_rank=cp_rank, cp_world=cp_world, backend="flydsl").cpu()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite].double(), want[finite], rtol=1e-5, atol=1e-5)
    # A preallocated out is written on visible pages only: poison it and check the rest is untouched.
    out = torch.full_like(got, float("nan")).to(dev)
    score_decode_views(*args, out=out, cp_rank=cp_rank, cp_world=cp_world, backend="flydsl")
    out = out.cpu()
    visible = torch.zeros_like(want, dtype=torch.bool)
    for b, n in enumerate(seq):
        n_local = max(0, min(max_block, (-(-n // PAGE_SIZE) - cp_rank + cp_world - 1) // cp_world))
        visible[:, b * S : (b + 1) * S, :n_local] = True
    assert torch.isnan(out[~visible]).all()
    assert torch.equal(out[visible].nan_to_num(), got[visible].nan_to_num())
