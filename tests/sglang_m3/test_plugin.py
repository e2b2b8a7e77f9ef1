"""Plugin hooks that can be called without a server."""

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_m3.config import MiniMaxM31Config
from sglang_m3.compat import RESOLUTION_PIPELINE, at_least, setting
from sglang_m3.plugin import (
    _build_index_k_pool,
    _check_input_ids_in_vocab,
    _dense_decode_cpu,
    _dense_extend_cpu,
    _no_prefill_cuda_graph,
    _no_prefill_cuda_graph_declared,
    _validate_index_k_settings,
)

TINY_MODEL = Path(__file__).resolve().parents[2] / "configs" / "minimax-m3.1-tiny"


def _unreachable(*args, **kwargs):
    raise AssertionError("SGLang's own pool builder must not run for an index-K config")


@pytest.mark.parametrize("flags,message", [
    ({"enable_hisparse": True}, "enable_hisparse: .*launch without --enable-hisparse"),
    ({"enable_hierarchical_cache": True, "device": "cpu"}, "--enable-hierarchical-cache with --device cpu"),
    ({"enable_hierarchical_cache": True, "device": "cuda", "hicache_storage_backend": "nixl"},
     "--hicache-storage-backend nixl"),
])
def test_host_cache_launches_the_host_tier_does_not_cover_are_refused_before_any_pool_is_built(flags, message):
    hf_config = MiniMaxM31Config(sparse_attention_config={"sparse_index_dim": 128}, index_k_format="mxfp4")
    kvc = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config),
                          server_args=SimpleNamespace(**flags, page_size=128))
    with pytest.raises(NotImplementedError, match=message) as e:
        _build_index_k_pool(_unreachable, kvc, max_total_num_tokens=1024)
    assert "\n" not in str(e.value)


def test_the_pool_hook_builds_the_k_only_index_pool_of_the_tiny_config(monkeypatch):
    import json

    import sglang.srt.runtime_context as runtime_context
    import torch

    from sglang_m3.pool import MiniMaxM31SparseKVPool

    monkeypatch.setattr(runtime_context, "get_parallel", lambda: SimpleNamespace(attn_tp_size=1))
    hf_config = MiniMaxM31Config(**json.loads((TINY_MODEL / "config.json").read_text()))
    kvc = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config, head_dim=128, get_num_kv_heads=lambda tp: 4),
        server_args=SimpleNamespace(page_size=128, enable_memory_saver=False),
        kv_cache_dtype=torch.bfloat16, device="cpu", layer_info=SimpleNamespace(start_layer=0, end_layer=4))
    pool = _build_index_k_pool(_unreachable, kvc, max_total_num_tokens=1024)
    assert isinstance(pool, MiniMaxM31SparseKVPool)
    assert pool.index_k_layer_id_mapping == {1: 0, 2: 1, 3: 2}


def test_one_page_a_block_is_the_default_page_size_not_a_forced_one():
    from m3_kernels.formats import PAGE_SIZE
    from sglang_m3.plugin import _page_size_default

    hf_config = MiniMaxM31Config(sparse_attention_config={"sparse_index_dim": 128}, index_k_format="fp8")
    assert _page_size_default(SimpleNamespace(page_size=None), hf_config) == {"page_size": PAGE_SIZE}
    assert _page_size_default(SimpleNamespace(page_size=64), hf_config) == {}  # the pool then names the rule


def test_the_format_flag_keeps_the_other_model_overrides():
    import json

    from sglang_m3.plugin import _fold_index_k_format_flag

    args = SimpleNamespace(index_k_format="fp8", json_model_override_args='{"index_k_debug_rows": 4}')
    _fold_index_k_format_flag(None, args)
    assert json.loads(args.json_model_override_args) == {"index_k_debug_rows": 4, "index_k_format": "fp8"}


def test_upstream_nvfp4_quantization_is_refused_with_an_index_k_format():
    hf_config = MiniMaxM31Config(sparse_attention_config={"sparse_index_dim": 128}, index_k_format="fp8")
    with pytest.raises(NotImplementedError, match="quantization 'minimax_m3_nvfp4'.*index_k_format='fp8'"):
        _validate_index_k_settings(None, SimpleNamespace(hf_config=hf_config, quantization="minimax_m3_nvfp4"))
    _validate_index_k_settings(None, SimpleNamespace(hf_config=hf_config, quantization=None))
    upstream = SimpleNamespace(sparse_attention_config={"sparse_index_dim": 128})  # no index_k_format: SGLang's path
    _validate_index_k_settings(None, SimpleNamespace(hf_config=upstream, quantization="minimax_m3_nvfp4"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_float16_models_are_refused_at_start_up(dtype):
    """The index-K writers take bfloat16 / float32 keys: a float16 model would start, then fail at the
    first prefill inside the scheduler. float32 (CPU) stays allowed; an upstream config is not ours to judge."""
    import torch

    hf_config = MiniMaxM31Config(sparse_attention_config={"sparse_index_dim": 128}, index_k_format="mxfp4")
    model_config = SimpleNamespace(hf_config=hf_config, quantization=None, dtype=getattr(torch, dtype))
    if dtype == "float16":
        with pytest.raises(NotImplementedError, match=r"dtype torch.float16: .*launch with --dtype bfloat16"):
            _validate_index_k_settings(None, model_config)
    else:
        _validate_index_k_settings(None, model_config)
    upstream = SimpleNamespace(sparse_attention_config={"sparse_index_dim": 128})
    _validate_index_k_settings(None, SimpleNamespace(hf_config=upstream, quantization=None, dtype=torch.float16))


def test_float16_refusal_runs_when_sglang_builds_the_model_config():
    """The hook's target is the installed SGLang's ``ModelConfig.__init__``, which the launcher runs
    before any scheduler starts."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.plugins import load_plugins

    load_plugins()
    with pytest.raises(NotImplementedError, match="launch with --dtype bfloat16"):
        ModelConfig(str(TINY_MODEL), dtype="float16")
    assert str(ModelConfig(str(TINY_MODEL), dtype="auto").dtype) == "torch.bfloat16"


def _resolved_server_args(index_k_format, prefill_backend, explicit):
    """What SGLang's CUDA-graph resolution leaves behind, for the hook to act on: the config on
    the record before 0.5.19, declared over it (read through ``resolving_view``) from 0.5.19."""
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, Phase

    hf_config = (MiniMaxM31Config(sparse_attention_config={"sparse_index_dim": 128}, index_k_format=index_k_format)
                 if index_k_format else SimpleNamespace(sparse_attention_config={"sparse_index_dim": 128}))
    config = CudaGraphConfig()
    config.prefill.backend = prefill_backend
    model_config = SimpleNamespace(hf_config=hf_config)
    return SimpleNamespace(cuda_graph_config=config, _cuda_graph_config_locked={(Phase.PREFILL, "backend")} if explicit
                           else set(), get_model_config=lambda: model_config, _model_config=model_config,
                           _resolved_overrides=[])


def _run_prefill_hook(server_args):
    """The CUDA-graph row of the installed SGLang's hook table, run as SGLang would; the prefill backend after it."""
    hook = _no_prefill_cuda_graph_declared if at_least(RESOLUTION_PIPELINE) else _no_prefill_cuda_graph
    hook(None, server_args)
    return setting(server_args, "cuda_graph_config")


@pytest.mark.parametrize("backend", ["breakable", "tc_piecewise", "full"])
def test_prefill_cuda_graph_is_off_for_index_k_configs(backend):
    from sglang.srt.model_executor.cuda_graph_config import Phase

    args = _resolved_server_args("mxfp4", backend, explicit=False)
    config = _run_prefill_hook(args)
    assert config.prefill.backend == "disabled"
    assert config.decode.backend == "full"  # decode graphs untouched
    assert (Phase.PREFILL, "backend") in args._cuda_graph_config_locked  # later SGLang defaults leave it off
    with pytest.raises(ValueError, match=f"prefill backend '{backend}'.*--cuda-graph-backend-prefill disabled"):
        _run_prefill_hook(_resolved_server_args("fp8", backend, explicit=True))
    upstream = _resolved_server_args(None, backend, explicit=True)  # no index_k_format: SGLang's choice stands
    assert _run_prefill_hook(upstream).prefill.backend == backend
    disabled = _resolved_server_args("mxfp4", "disabled", explicit=True)
    assert _run_prefill_hook(disabled).prefill.backend == "disabled"


@pytest.mark.parametrize("explicit", [False, True])
def test_the_prefill_graph_can_be_kept_on_request_with_a_warning(explicit, monkeypatch, caplog):
    """``SGLANG_M3_PREFILL_GRAPH=1``: SGLang's prefill graph stays, asked for or not, and a warning says it is
    unverified; any other value changes nothing."""
    monkeypatch.setenv("SGLANG_M3_PREFILL_GRAPH", "1")
    with caplog.at_level("WARNING", logger="sglang_m3.plugin"):
        assert _run_prefill_hook(_resolved_server_args("mxfp4", "breakable", explicit=explicit)).prefill.backend \
            == "breakable"
    assert "prefill CUDA graph 'breakable' kept (SGLANG_M3_PREFILL_GRAPH=1); not verified on a GPU" in caplog.text
    monkeypatch.setenv("SGLANG_M3_PREFILL_GRAPH", "0")
    if explicit:
        with pytest.raises(ValueError, match="SGLANG_M3_PREFILL_GRAPH=1 to try the graph"):
            _run_prefill_hook(_resolved_server_args("mxfp4", "breakable", explicit=True))
    else:
        assert _run_prefill_hook(_resolved_server_args("mxfp4", "breakable", False)).prefill.backend == "disabled"


@pytest.mark.parametrize("backend", ["full", "tc_piecewise"])
def test_the_prefill_graph_kept_on_request_must_be_breakable(backend, monkeypatch):
    """``SGLANG_M3_PREFILL_GRAPH=1`` keeps only the ``breakable`` graph, where prefill attention runs eagerly
    between segments; a graph that would record it (``full``) or is unverified with it is refused in one line."""
    monkeypatch.setenv("SGLANG_M3_PREFILL_GRAPH", "1")
    with pytest.raises(ValueError, match=rf"prefill backend '{backend}' with SGLANG_M3_PREFILL_GRAPH=1.*'breakable'"):
        _run_prefill_hook(_resolved_server_args("mxfp4", backend, explicit=True))


def test_prefill_cuda_graph_hook_is_wired_into_server_args():
    """The hook's target exists in the installed SGLang and runs when it resolves its CUDA-graph config
    (at construction before 0.5.19, at ``resolve_once`` from then on)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    with pytest.raises(ValueError, match="prefill backend 'breakable'"):
        args = ServerArgs(model_path=str(TINY_MODEL), device="cpu", load_format="dummy",
                          cuda_graph_backend_prefill="breakable")
        if at_least(RESOLUTION_PIPELINE):
            args.resolve_once()


@pytest.mark.parametrize("input_ids,shown", [
    ([5, 2048, -1, 2048], "-1, 2048"),
    ([1, [2, 3]], "[2, 3]"),  # unhashable: still a ValueError (HTTP 400), not a TypeError
    ([True, 4], "True"),
    ([1, 2.0], "2.0"),
])
def test_out_of_vocabulary_ids_raise_value_error(input_ids, shown):
    m31 = MiniMaxM31Config(sparse_attention_config={"sparse_index_dim": 128}, index_k_format="mxfp4")
    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=2048, hf_config=m31))
    with pytest.raises(ValueError, match=r"input_ids holds token ids outside the vocabulary \[0, 2048\): "
                                         + re.escape(shown) + "$"):
        _check_input_ids_in_vocab(manager, None, input_ids)
    assert _check_input_ids_in_vocab(manager, None, [0, 2047]) is None
    assert _check_input_ids_in_vocab(manager, None, None) is None
    llama = SimpleNamespace(model_type="llama")
    other = SimpleNamespace(model_config=SimpleNamespace(vocab_size=2048, hf_config=llama))
    assert _check_input_ids_in_vocab(other, None, input_ids) is None  # another model: SGLang's own handling


def _record_call(*args, **kwargs):
    from sglang.srt.plugins.hook_registry import HookRegistry

    return args, kwargs, "sglang.srt.configs.model_config.ModelConfig.__init__" in HookRegistry._patched


def test_detokenizer_target_is_picklable_and_loads_plugins_first():
    """Before 0.5.22 the detokenizer process starts through ``_run_after_loading_plugins``: the
    target travels by pickle (spawn) and runs only after the plugins (our hooks) are loaded."""
    import pickle

    from sglang_m3.plugin import _detokenizer_loads_plugins

    seen = {}

    def launch(engine_cls, server_args, port_args, run_detokenizer_process_func):
        seen["target"] = pickle.loads(pickle.dumps(run_detokenizer_process_func))
        return "procs"

    m31_args = SimpleNamespace(model_path=str(TINY_MODEL))
    assert _detokenizer_loads_plugins(launch, object, m31_args, "ports", _record_call) == "procs"
    assert seen["target"] is not _record_call  # a new callable, which loads the plugins, then calls it
    assert seen["target"]("args", "ports") == (("args", "ports"), {}, True)


@pytest.mark.parametrize("device,preset,expected", [
    ("cpu", {}, ("PASSIVE", "3000")),
    ("cpu", {"OMP_WAIT_POLICY": "ACTIVE"}, ("ACTIVE", None)),  # the user's choice: no spin count forced on it
    ("cpu", {"GOMP_SPINCOUNT": "0"}, (None, "0")),
    ("cuda", {}, (None, None)),
])
def test_cpu_servers_get_short_openmp_waits_unless_set(monkeypatch, device, preset, expected):
    from sglang_m3.plugin import GOMP_SPINCOUNT, OMP_WAIT_POLICY, _cpu_openmp_waits

    for name in (OMP_WAIT_POLICY, GOMP_SPINCOUNT):  # set, then removed: monkeypatch restores what the hook sets
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in preset.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "1")  # the user's: a server not group-stopped keeps it
    monkeypatch.delenv("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", raising=False)
    assert _cpu_openmp_waits(None, SimpleNamespace(device=device, model_path=str(TINY_MODEL))) is None
    assert (os.environ.get(OMP_WAIT_POLICY), os.environ.get(GOMP_SPINCOUNT)) == expected
    assert os.environ["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"
    assert "SGLANG_CUDA_COREDUMP_BEFORE_CRASH" not in os.environ


def test_cpu_openmp_hook_runs_when_the_launcher_parses_its_flags(monkeypatch):
    import argparse

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from sglang_m3.plugin import GOMP_SPINCOUNT, OMP_WAIT_POLICY

    for name in (OMP_WAIT_POLICY, GOMP_SPINCOUNT):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    load_plugins()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", str(TINY_MODEL), "--device", "cpu", "--load-format", "dummy"])
    assert ServerArgs.from_cli_args(args).device == "cpu"
    assert (os.environ.get(OMP_WAIT_POLICY), os.environ.get(GOMP_SPINCOUNT)) == ("PASSIVE", "3000")


@pytest.mark.parametrize("device,initial,launched,choice,expected", [
    ("cpu", {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}, True, None, "fork"),
    ("cpu", {"GOMP_SPINCOUNT": "0"}, True, None, "fork"),  # the user's OpenMP choice, read at start
    ("cpu", {"OMP_WAIT_POLICY": "ACTIVE"}, True, "fork", "fork"),
    ("cpu", {}, True, None, "spawn"),  # OpenMP started with its 3 ms spin: only spawned children get the waits
    ("cpu", None, True, None, "spawn"),  # no /proc/self/environ: the start-up environment is unknown
    ("cpu", {"OMP_WAIT_POLICY": "PASSIVE"}, False, None, "spawn"),  # an Engine in a process that may have run torch
    ("cpu", {"OMP_WAIT_POLICY": "PASSIVE"}, True, "spawn", "spawn"),  # SGLANG_M3_CPU_START=spawn
    ("cuda", {"OMP_WAIT_POLICY": "PASSIVE"}, True, None, "spawn"),
])
def test_cpu_children_fork_only_where_safe(device, initial, launched, choice, expected):
    from sglang_m3.plugin import cpu_children_start

    assert cpu_children_start(device, initial, launched, choice) == expected


def test_launched_by_sglang_knows_both_entry_points():
    from importlib.machinery import ModuleSpec

    from sglang_m3.plugin import _launched_by_sglang

    as_module = SimpleNamespace(__spec__=ModuleSpec("sglang.launch_server", None))
    script = SimpleNamespace(__spec__=None)
    assert _launched_by_sglang(as_module, ["/x/sglang/launch_server.py", "--model-path", "m"])
    assert _launched_by_sglang(script, ["/venv/bin/sglang", "serve", "--model-path", "m"])
    assert not _launched_by_sglang(script, ["/venv/bin/sglang", "generate"])
    assert not _launched_by_sglang(SimpleNamespace(__spec__=ModuleSpec("pytest", None)), ["pytest"])
    assert not _launched_by_sglang(None, [])


def test_initial_environ_is_the_start_up_environment(monkeypatch):
    from sglang_m3.plugin import _initial_environ

    if not os.path.exists("/proc/self/environ"):
        pytest.skip("no /proc/self/environ (not Linux)")
    # os.environ only: not what the process started with (an xdist worker starts with almost nothing)
    monkeypatch.setenv("M3_SET_AFTER_START", "1")
    assert "M3_SET_AFTER_START" not in _initial_environ()
    code = "from sglang_m3.plugin import _initial_environ; print(_initial_environ()['M3_AT_START'])"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, M3_AT_START="a=b c"),
                         capture_output=True, text=True, check=True).stdout
    assert out == "a=b c\n"


@pytest.mark.parametrize("registered", [False, True])
def test_clients_loading_our_tokenizer_see_no_model_type_warning(registered):
    """A client process (demo, accuracy runner) that loads a model folder's tokenizer warns about a
    model of type '' unless it called ``register_config`` first."""
    import subprocess
    import sys

    code = ("from sglang_m3.config import register_config; register_config()\n" if registered else "")
    code += f"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained({str(TINY_MODEL)!r})\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    warned = "to instantiate a model of type" in res.stdout + res.stderr
    assert warned is not registered


def test_cpu_dense_layer_decode_equals_sglangs_torch_native_decode(gen):
    """The dense layers' CPU decode the plugin installs on SGLang's torch_native backend equals that backend's own
    per-request ``enable_gqa`` SDPA (bf16, 16 query heads on 4 KV heads, lengths 1, 129 and 300 in one batch)
    within bf16 rounding; a sliding-window call is handed to SGLang's, arguments unchanged."""
    import torch

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    def sglang_decode(*args, **kwargs):
        return TorchNativeAttnBackend._run_sdpa_forward_decode(None, *args, **kwargs)

    lens, slots = [1, 129, 300], 1200
    k_cache = torch.randn(slots, 4, 128, generator=gen).bfloat16()
    v_cache = torch.randn(slots, 4, 128, generator=gen).bfloat16()
    req_to_token = torch.randperm(slots, generator=gen)[: 4 * 300].view(4, 300).int()
    req_pool_indices, seq_lens = torch.tensor([3, 0, 2]), torch.tensor(lens)
    query = torch.randn(3, 16, 128, generator=gen).bfloat16()
    args = (k_cache, v_cache, req_to_token, req_pool_indices, seq_lens)
    want = torch.full_like(query, float("nan"))
    sglang_decode(query, want, *args, scaling=0.09, enable_gqa=True)
    got = torch.full_like(query, float("nan"))
    _dense_decode_cpu(_unreachable, query, got, *args, scaling=0.09, enable_gqa=True)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=4 * 2.0**-9 * float(v_cache.abs().max()))
    calls = []
    _dense_decode_cpu(lambda *a, **kw: calls.append((a, kw)), query, got, *args, scaling=0.09, enable_gqa=True,
                      sliding_window_size=64)
    assert len(calls) == 1 and calls[0][1]["sliding_window_size"] == 64 and calls[0][0][0] is query


def test_cpu_dense_layer_extend_equals_sglangs_torch_native_extend(gen):
    """The dense layers' CPU extend the plugin installs equals SGLang's torch_native extend (which pads each query
    to its whole sequence) within bf16 rounding: three requests in one batch (a fresh 129-token prompt, 1 row after
    127 cached tokens, 200 rows after 256), 16 query heads on 4 KV heads; a non-causal call goes to SGLang's."""
    import torch

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    def sglang_extend(*args, **kwargs):
        return TorchNativeAttnBackend._run_sdpa_forward_extend(None, *args, **kwargs)

    prefix, new = torch.tensor([0, 127, 256]), torch.tensor([129, 1, 200])
    slots = 2000
    k_cache = torch.randn(slots, 4, 128, generator=gen).bfloat16()
    v_cache = torch.randn(slots, 4, 128, generator=gen).bfloat16()
    req_to_token = torch.randperm(slots, generator=gen)[: 4 * 456].view(4, 456).int()
    args = (k_cache, v_cache, req_to_token, torch.tensor([2, 0, 3]), prefix + new, prefix, new)
    query = torch.randn(int(new.sum()), 16, 128, generator=gen).bfloat16()
    want = torch.full_like(query, float("nan"))
    sglang_extend(query, want, *args, scaling=0.09, enable_gqa=True, causal=True)
    got = torch.full_like(query, float("nan"))
    _dense_extend_cpu(_unreachable, query, got, *args, scaling=0.09, enable_gqa=True, causal=True)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=4 * 2.0**-9 * float(v_cache.abs().max()))
    calls = []
    _dense_extend_cpu(lambda *a, **kw: calls.append((a, kw)), query, got, *args, scaling=0.09, enable_gqa=True,
                      causal=False)
    assert len(calls) == 1 and calls[0][1]["causal"] is False and calls[0][0][0] is query


def test_only_the_package_refusals_become_one_line(capsys):
    """``_refusals_in_one_line`` (around ``ServerArgs.from_cli_args``): a ValueError raised in sglang_m3 or m3_kernels
    code ends the launch in one line with exit 2; one raised elsewhere (SGLang's own) passes unchanged."""
    from m3_kernels.formats import parse_format

    from sglang_m3.plugin import _refusals_in_one_line, raised_by_package

    def ours(cls, args):
        parse_format(args)  # raises in m3_kernels

    def sglangs(cls, args):
        raise ValueError("SGLang's own message")

    with pytest.raises(SystemExit) as e:
        _refusals_in_one_line(ours, None, "mxfp3")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "sglang-m3: error: index_k_format must be one of [bf16, fp8, mxfp4, " \
                                        "mxfp4_rot], got 'mxfp3'\n"
    with pytest.raises(ValueError, match="SGLang's own message") as caught:
        _refusals_in_one_line(sglangs, None, None)
    assert not raised_by_package(caught.value) and capsys.readouterr().err == ""
    assert _refusals_in_one_line(lambda cls, args: args, None, "ok") == "ok"
