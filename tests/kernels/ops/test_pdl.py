"""Programmatic dependent launch (``ops.pdl``): when it is used, and (GPU) that a PDL chain in a
CUDA graph reads only what the kernel before it finished writing.

PDL is opt-in (``M3_PDL=1``); the GPU test turns it on. The GPU chain: plain kernels stage the inputs and poison the score buffer with NaN, then the scorer
(PDL, it releases its dependents at its start) and the selector (PDL) run, then a plain copy reads the
selection. A selector that did not wait would see the poison or a partial buffer; the selection and
the scores must equal an eager run with PDL off, bit for bit, on every replay.
"""

import os
import pathlib

import pytest
import torch

if not torch.cuda.is_available():  # as the other kernel tests: Triton imported here runs interpreted
    os.environ["TRITON_INTERPRET"] = "1"

from m3_kernels.formats import PAGE_SIZE, IndexKCache  # noqa: E402
from m3_kernels.ops import pdl  # noqa: E402
from m3_kernels.ops.score import plan_decode, score_decode  # noqa: E402
from m3_kernels.ops.score.backends import cuda as cuda_backend  # noqa: E402
from m3_kernels.ops.score.naive import score_decode_ref  # noqa: E402
from m3_kernels.ops.select import select_blocks, visible_blocks  # noqa: E402
from m3_kernels.ops.select.naive import select_blocks_ref  # noqa: E402
from m3_kernels.testing import abs_index_k, assert_scores_close, capture_graph, make_q, q_abs, random_cache  # noqa: E402


def test_off_by_default_on_the_cpu_and_in_the_interpreter(monkeypatch):
    monkeypatch.delenv(pdl.ENV, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not pdl.use_pdl("cuda")  # opt-in: decided before any CUDA query
    monkeypatch.setenv(pdl.ENV, "1")
    assert not pdl.use_pdl("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.use_pdl("cuda")


def test_triton_launch_kwargs():
    assert pdl.triton_launch_kwargs(False) == {"USE_PDL": False}
    want = {"USE_PDL": True, "launch_pdl": True} if pdl.have_triton_gdc() else {"USE_PDL": False}
    assert pdl.triton_launch_kwargs(True) == want


def test_cuda_scorer_waits_before_its_first_global_read():
    """In the kernel body the grid-dependency wait comes before seq_lens, the block table or Q is read."""
    src = cuda_backend.SOURCE.read_text()
    body = src[src.index("score_decode_mxfp4_kernel(const __grid_constant__ Params p) {"):]
    wait = body.index("griddepcontrol.wait")
    for first_read in ("total_pages(p", "p.block_table[", "load_q<", "p.seq_lens["):
        assert wait < body.index(first_read), first_read


def test_triton_kernels_wait_first():
    """Each Triton kernel launched with PDL waits before anything else it does."""
    root = pathlib.Path(pdl.__file__).parent
    for rel in ("score/backends/triton.py", "select/triton.py"):
        src = (root / rel).read_text()
        assert src.count("if USE_PDL:\n        tl.extra.cuda.gdc_wait()\n        tl.extra.cuda.gdc_launch_dependents()") == 1, rel


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,backend", [("mxfp4", "cuda"), ("mxfp4", "triton"), ("fp8", "triton")])
def test_pdl_chain_in_a_graph(gen, monkeypatch, fmt, backend):
    monkeypatch.setenv(pdl.ENV, "1")
    if not torch.cuda.is_available() or not pdl.use_pdl("cuda"):
        pytest.skip("needs an sm_90+ GPU with PDL")
    if backend == "cuda" and not cuda_backend.is_available():
        pytest.skip(cuda_backend.availability()[1])
    pages, batch, mb, S, H = 600, 4, 128, 4, 1
    k_data, k_scale = random_cache(gen, fmt, pages, "cuda")
    q = torch.zeros(batch * S, H, 128, dtype=torch.bfloat16, device="cuda")
    bt = torch.zeros(batch, mb, dtype=torch.int32, device="cuda")
    seq = torch.ones(batch, dtype=torch.int32, device="cuda")
    stage = {"q": q.clone(), "bt": bt.clone(), "seq": seq.clone()}
    scores = torch.empty(H, batch * S, mb, device="cuda")
    picked = torch.empty(H, batch * S, 16, dtype=torch.int32, device="cuda")
    offs = torch.arange(S, device="cuda")
    cache = IndexKCache.of(k_data, k_scale)
    plan = plan_decode(cache, bt, seq, S, H, 0.25, mb, scores, backend=backend)  # once: the graph replays its run

    def step():
        q.copy_(stage["q"])
        bt.copy_(stage["bt"])
        seq.copy_(stage["seq"])
        nvis = visible_blocks((seq[:, None] - S + offs).flatten(), PAGE_SIZE).int()
        scores.fill_(float("nan"))
        score_decode(plan, q, cache, scores)
        return select_blocks(scores, nvis)

    graph = capture_graph(lambda: picked.copy_(step()))
    for lens in ([1, 127, 128, 129], [16384, 2049, 16000, 5], [16384] * 4):
        stage["q"].copy_(make_q(gen, batch * S, H, torch.bfloat16, "cuda"))
        stage["bt"].copy_(torch.randperm(pages, generator=gen)[: batch * mb].reshape(batch, mb))
        stage["seq"].copy_(torch.tensor(lens))
        graph.replay()
        torch.cuda.synchronize()
        got_scores, got_picked = scores.clone(), picked.clone()
        monkeypatch.setenv(pdl.ENV, "0")  # the eager reference run: no PDL anywhere
        want_picked = step()
        torch.cuda.synchronize()
        monkeypatch.setenv(pdl.ENV, "1")
        written = ~torch.isnan(scores)
        assert torch.equal(written, ~torch.isnan(got_scores))
        assert torch.equal(got_scores[written], scores[written]), "scores differ from the eager run"
        assert torch.equal(got_picked, want_picked), "selection differs from the eager run"
        nvis = visible_blocks((torch.tensor(lens)[:, None] - S + torch.arange(S)).flatten(), PAGE_SIZE)
        assert torch.equal(want_picked.cpu(), select_blocks_ref(scores.cpu(), nvis))
        kc, ks = k_data.cpu(), (k_scale.cpu() if k_scale is not None else None)
        args = (bt.cpu(), seq.cpu(), S, 0.25, mb)
        ref = score_decode_ref(q.cpu(), kc, ks, *args)
        bound = score_decode_ref(q_abs(q.cpu()), *abs_index_k(kc, ks), *args)
        assert_scores_close(torch.where(written, scores, ref.cuda().float()), ref, bound)
