"""The one resolver's decisions: device x format x op x ``M3_SCORE_BACKEND``, on the CPU with GPUs faked.

A fake device is a ``torch.device("cuda", i)`` whose kind the backends' own availability answers are
patched to report: index 0 an NVIDIA sm_90 on which the CUDA kernel builds (and the sm_90 prefill scorer runs),
1 an NVIDIA GPU on which neither can (an older GPU, or no nvcc), 2 a ROCm gfx950 with FlyDSL installed."""

import logging

import pytest
import torch

from m3_kernels.ops.score import resolve
from m3_kernels.ops.score.backends import cuda as cuda_backend
from m3_kernels.ops.score.backends import flydsl as flydsl_backend

CPU, SM90, OLD_NVIDIA, GFX950 = "cpu", "sm90", "old_nvidia", "gfx950"
DEVICES = {CPU: torch.device("cpu"), SM90: torch.device("cuda", 0), OLD_NVIDIA: torch.device("cuda", 1),
           GFX950: torch.device("cuda", 2)}
FORMATS = ("bf16", "fp8", "mxfp4", "mxfp4_rot")


@pytest.fixture
def fake_gpus(monkeypatch):
    monkeypatch.delenv(resolve.ENV_BACKEND, raising=False)
    monkeypatch.setattr(flydsl_backend, "is_available", lambda device: torch.device(device) == DEVICES[GFX950])
    monkeypatch.setattr(cuda_backend, "ensure_built", lambda device: torch.device(device) == DEVICES[SM90])
    monkeypatch.setattr(cuda_backend, "availability",
                        lambda device=None: (True, "") if torch.device(device) == DEVICES[SM90]
                        else (False, "the CUDA scorer needs sm_90 or newer (bulk copies), this GPU is sm_80"))
    monkeypatch.setattr(resolve, "_sm90_prefill_available",
                        lambda device: (True, "") if torch.device(device) == DEVICES[SM90]
                        else (False, "the sm_90 prefill scorer needs compute capability 9.x (Hopper)"))


def _auto_decode(device, fmt):
    if device == CPU:
        return "torch"
    if device == GFX950:
        return "flydsl"
    if device == SM90 and fmt.startswith("mxfp4"):
        return "cuda"
    return "triton"


def _auto_prefill(device):
    return {CPU: "torch", SM90: "triton_sm90"}.get(device, "triton")


TABLE = [(d, f, "decode", _auto_decode(d, f)) for d in DEVICES for f in FORMATS] + [
    (d, f, "prefill", _auto_prefill(d)) for d in DEVICES for f in FORMATS]


@pytest.mark.parametrize("device,fmt,op,want", TABLE)
def test_auto(fake_gpus, device, fmt, op, want):
    assert resolve.resolve_backend(DEVICES[device], fmt, op) == want


@pytest.mark.parametrize("forced", ["torch", "triton", "cuda", "flydsl", "aiter"])
@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_forced_by_the_environment(fake_gpus, monkeypatch, forced, device, fmt):
    """A forced backend is taken as is for decode (the plan then checks whether it can run); prefill has no
    FlyDSL, aiter or CUDA scorer, so those resolve as auto there."""
    monkeypatch.setenv(resolve.ENV_BACKEND, forced)
    assert resolve.resolve_backend(DEVICES[device], fmt, "decode") == forced
    want = _auto_prefill(device) if forced in ("cuda", "flydsl", "aiter") else forced
    assert resolve.resolve_backend(DEVICES[device], fmt, "prefill") == want


@pytest.mark.parametrize("fmt", FORMATS)
def test_forced_sm90_prefill(fake_gpus, monkeypatch, fmt):
    """``triton_sm90`` scores prefill only: forced, decode resolves as auto; prefill takes it on Hopper and
    refuses it, naming why, anywhere else."""
    monkeypatch.setenv(resolve.ENV_BACKEND, "triton_sm90")
    for device in DEVICES:
        assert resolve.resolve_backend(DEVICES[device], fmt, "decode") == _auto_decode(device, fmt)
    assert resolve.resolve_backend(DEVICES[SM90], fmt, "prefill") == "triton_sm90"
    for device in (CPU, OLD_NVIDIA, GFX950):
        with pytest.raises(NotImplementedError, match="score backend 'triton_sm90' cannot run here: "):
            resolve.resolve_backend(DEVICES[device], fmt, "prefill")


def test_the_argument_wins_over_the_environment(fake_gpus, monkeypatch):
    monkeypatch.setenv(resolve.ENV_BACKEND, "torch")
    assert resolve.resolve_backend(DEVICES[SM90], "mxfp4", backend="triton") == "triton"
    choice = resolve.choose_backend(DEVICES[SM90], "mxfp4", backend="triton")
    assert choice.reason == "forced by the backend argument"
    assert resolve.choose_backend(DEVICES[SM90], "mxfp4").reason == f"forced by {resolve.ENV_BACKEND}"


def test_the_cuda_kernels_query_vector_limit(fake_gpus):
    """S * H above the kernel's 32 keeps an MXFP4 decode on Triton; unknown (None) is assumed to fit."""
    dev = DEVICES[SM90]
    assert resolve.resolve_backend(dev, "mxfp4", query_vectors=cuda_backend.MAX_QUERY_VECTORS) == "cuda"
    assert resolve.resolve_backend(dev, "mxfp4", query_vectors=cuda_backend.MAX_QUERY_VECTORS + 1) == "triton"
    assert resolve.resolve_backend(dev, "mxfp4", query_vectors=None) == "cuda"


@pytest.mark.parametrize("bad", ["bogus", "Triton"])
def test_unknown_names_are_refused(fake_gpus, monkeypatch, bad):
    monkeypatch.setenv(resolve.ENV_BACKEND, bad)
    with pytest.raises(ValueError, match=rf"M3_SCORE_BACKEND / backend must be one of .*got '{bad}'"):
        resolve.resolve_backend(DEVICES[CPU], "fp8")
    with pytest.raises(ValueError, match="op must be one of"):
        resolve.resolve_backend(DEVICES[CPU], "fp8", op="select", backend="torch")
    with pytest.raises(ValueError, match="index_k_format must be one of"):
        resolve.resolve_backend(DEVICES[CPU], "int4", backend="torch")


def test_one_log_line_per_distinct_choice(fake_gpus, monkeypatch, caplog):
    monkeypatch.setattr(resolve, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger=resolve.__name__):
        for _ in range(3):
            resolve.resolve_backend(DEVICES[SM90], "mxfp4")
            resolve.resolve_backend(DEVICES[OLD_NVIDIA], "mxfp4")
    lines = [r.getMessage() for r in caplog.records if r.name == resolve.__name__]
    assert len(lines) == 2, lines
    assert "cuda:0 for a mxfp4 cache: cuda (auto: MXFP4 decode on NVIDIA sm_90+)" in lines[0]
    assert "cuda:1 for a mxfp4 cache: triton (auto: the CUDA kernel cannot run here (" in lines[1]
    assert "sm_80" in lines[1]
