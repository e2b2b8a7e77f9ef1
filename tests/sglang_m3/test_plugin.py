"""Plugin hooks that can be called without a server."""

import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_m3.config import MiniMaxM31Config
from sglang_m3.plugin import _build_index_k_pool, _check_input_ids_in_vocab, _no_prefill_cuda_graph

TINY_MODEL = Path(__file__).resolve().parents[2] / "configs" / "minimax-m3.1-tiny"


def _unreachable(*args, **kwargs):
    raise AssertionError("SGLang's own pool builder must not run for an index-K config")


def test_hierarchical_cache_is_refused_before_any_pool_is_built():
    hf_config = MiniMaxM31Config(sparse_attention_config={"sparse_index_dim": 128}, index_k_format="mxfp4")
    kvc = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config),
                          server_args=SimpleNamespace(enable_hierarchical_cache=True, page_size=128))
    with pytest.raises(NotImplementedError, match="--enable-hierarchical-cache"):
        _build_index_k_pool(_unreachable, kvc, max_total_num_tokens=1024)


def _resolved_server_args(index_k_format, prefill_backend, explicit):
    """What ``ServerArgs._parse_cuda_graph_config`` leaves behind, for the hook to act on."""
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, Phase

    hf_config = (MiniMaxM31Config(sparse_attention_config={"sparse_index_dim": 128}, index_k_format=index_k_format)
                 if index_k_format else SimpleNamespace(sparse_attention_config={"sparse_index_dim": 128}))
    config = CudaGraphConfig()
    config.prefill.backend = prefill_backend
    return SimpleNamespace(cuda_graph_config=config, _cuda_graph_config_locked={(Phase.PREFILL, "backend")} if explicit
                           else set(), get_model_config=lambda: SimpleNamespace(hf_config=hf_config))


@pytest.mark.parametrize("backend", ["breakable", "tc_piecewise", "full"])
def test_prefill_cuda_graph_is_off_for_index_k_configs(backend):
    args = _resolved_server_args("mxfp4", backend, explicit=False)
    _no_prefill_cuda_graph(None, args)
    assert args.cuda_graph_config.prefill.backend == "disabled"
    assert args.cuda_graph_config.decode.backend == "full"  # decode graphs untouched
    with pytest.raises(ValueError, match=f"prefill backend '{backend}'.*--cuda-graph-backend-prefill disabled"):
        _no_prefill_cuda_graph(None, _resolved_server_args("fp8", backend, explicit=True))
    upstream = _resolved_server_args(None, backend, explicit=True)  # no index_k_format: SGLang's choice stands
    _no_prefill_cuda_graph(None, upstream)
    assert upstream.cuda_graph_config.prefill.backend == backend
    disabled = _resolved_server_args("mxfp4", "disabled", explicit=True)
    _no_prefill_cuda_graph(None, disabled)
    assert disabled.cuda_graph_config.prefill.backend == "disabled"


def test_prefill_cuda_graph_hook_is_wired_into_server_args():
    """The hook's target exists in SGLang 0.5.16 and runs when ServerArgs resolves its CUDA-graph config."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    with pytest.raises(ValueError, match="prefill backend 'breakable'"):
        ServerArgs(model_path=str(TINY_MODEL), device="cpu", load_format="dummy",
                   cuda_graph_backend_prefill="breakable")


@pytest.mark.parametrize("input_ids,shown", [
    ([5, 2048, -1, 2048], "-1, 2048"),
    ([1, [2, 3]], "[2, 3]"),  # unhashable: still a ValueError (HTTP 400), not a TypeError
    ([True, 4], "True"),
    ([1, 2.0], "2.0"),
])
def test_out_of_vocabulary_ids_raise_value_error(input_ids, shown):
    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=2048))
    with pytest.raises(ValueError, match=r"input_ids holds token ids outside the vocabulary \[0, 2048\): "
                                         + re.escape(shown) + "$"):
        _check_input_ids_in_vocab(manager, None, input_ids)
    assert _check_input_ids_in_vocab(manager, None, [0, 2047]) is None
    assert _check_input_ids_in_vocab(manager, None, None) is None


@pytest.mark.parametrize("device,preset,expected", [("cpu", None, "PASSIVE"), ("cpu", "ACTIVE", "ACTIVE"),
                                                    ("cuda", None, None)])
def test_cpu_servers_get_passive_openmp_waits_unless_set(monkeypatch, device, preset, expected):
    from sglang_m3.plugin import OMP_WAIT_POLICY, _cpu_omp_passive

    monkeypatch.delenv(OMP_WAIT_POLICY, raising=False)
    if preset is not None:
        monkeypatch.setenv(OMP_WAIT_POLICY, preset)
    assert _cpu_omp_passive(None, SimpleNamespace(device=device)) is None
    assert os.environ.get(OMP_WAIT_POLICY) == expected


def test_cpu_openmp_hook_runs_when_the_launcher_parses_its_flags(monkeypatch):
    import argparse

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from sglang_m3.plugin import OMP_WAIT_POLICY

    monkeypatch.delenv(OMP_WAIT_POLICY, raising=False)
    load_plugins()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", str(TINY_MODEL), "--device", "cpu", "--load-format", "dummy"])
    assert ServerArgs.from_cli_args(args).device == "cpu"
    assert os.environ.get(OMP_WAIT_POLICY) == "PASSIVE"
