"""The plugin minds its own model: a non-M3 model is served as without the package, a MiniMax-M3.1 index-K
config gets every hook (``sglang_m3.scope``).

The server tests start a tiny Llama config (the tiny M3.1's tokenizer, dummy weights) on the CPU twice, with the
plugin and with it left out through SGLang's own plugin allow-list (``SGLANG_PLUGINS``), and compare the
environment of the server's processes, how they were started, the log lines, the HTTP routes and the answers of
the request paths the plugin hooks; then the tiny M3.1 once, where every one of those differs as the plugin
intends. One server at a time, each capped with ``--max-total-tokens``.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_m3.server import free_port
from sglang_m3.scope import MissingIndexKFormat, is_index_k_config, is_index_k_launch

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "configs" / "minimax-m3.1-tiny"
PLUGIN_OFF = {"SGLANG_PLUGINS": "no_such_plugin"}  # SGLang loads only the plugins named there: none
PER_RUN = {"SGLANG_RUN_ID"}  # SGLang's own per-launch id (time and random digits)
# SGLang 0.5.16's rotary layer imports vllm off CUDA unless its module flag says CPU (sglang_m3 flips it while
# building M3.1): without this, plain SGLang cannot build Llama on a CPU at all, plugin or not. Both runs get it.
ROTARY_SHIM = """try:
    from sglang.srt.layers.rotary_embedding import base as _rotary_base
    _rotary_base._is_cpu = True
except ImportError:
    pass
"""
FIRED_UP = "The server is fired up and ready to roll!"  # SGLang 0.5.16-0.5.23, after its warmup request
LOADER_LINES = re.compile(r"Available plugins for group|^\s*- \w+ -> |Loaded plugin|Executed general plugin|"
                          r"Skipping plugin")


def _tiny_config() -> dict:
    return json.loads((TINY_MODEL / "config.json").read_text())


def _model_folder(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    for f in TINY_MODEL.iterdir():
        if f.name != "config.json":
            shutil.copy(f, folder / f.name)
    return folder


def llama_folder(folder: Path) -> Path:
    """A Llama config the size of the tiny M3.1 (its tokenizer; weights come from ``--load-format dummy``)."""
    tiny = _tiny_config()
    return _model_folder(folder, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "vocab_size": tiny["vocab_size"], "hidden_size": tiny["hidden_size"], "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": tiny["num_attention_heads"],
        "num_key_value_heads": tiny["num_key_value_heads"], "head_dim": tiny["head_dim"],
        "rms_norm_eps": tiny["rms_norm_eps"], "rope_theta": tiny["rope_theta"], "max_position_embeddings": 4096,
        "bos_token_id": tiny["bos_token_id"], "eos_token_id": tiny["eos_token_id"], "tie_word_embeddings": False,
        "hidden_act": "silu",
    })


# ---- the decision, without a server ----------------------------------------------------------------------------

def test_only_minimax_m3_1_configs_that_name_a_format_are_ours(tmp_path):
    tiny = _tiny_config()
    assert is_index_k_config(tiny)
    assert is_index_k_config({"model_type": "minimax_m3_vl", "text_config": {**tiny}})  # a nested text config
    assert not is_index_k_config({"model_type": "llama", "index_k_format": "mxfp4"})  # the key alone is not enough
    assert not is_index_k_config({"model_type": "minimax_m3_vl", "text_config": {"model_type": "minimax_m3_vl_text"}})
    assert not is_index_k_config(SimpleNamespace(model_type="llama"))
    no_format = {k: v for k, v in tiny.items() if k != "index_k_format"}
    with pytest.raises(MissingIndexKFormat, match=r"names no index_k_format: .*one of bf16\|fp8\|mxfp4\|mxfp4_rot.*"
                                                  r"--index-k-format.*--json-model-override-args.*SGLang's own"):
        is_index_k_config(no_format)
    assert not is_index_k_config(no_format, strict=False)  # past start-up: SGLang's path, no second refusal


def test_a_launch_is_decided_from_its_config_json_and_overrides(tmp_path):
    tiny = _tiny_config()
    no_format = _model_folder(tmp_path / "no-format", {k: v for k, v in tiny.items() if k != "index_k_format"})
    llama = llama_folder(tmp_path / "llama")

    def args(path, overrides="{}", flag=None):
        return SimpleNamespace(model_path=str(path), json_model_override_args=overrides, index_k_format=flag)

    assert is_index_k_launch(args(TINY_MODEL))
    assert not is_index_k_launch(args(llama))
    assert not is_index_k_launch(args(llama, '{"index_k_format": "fp8"}'))
    assert not is_index_k_launch(args(tmp_path / "missing"))  # nothing to read: not ours, no download
    assert not is_index_k_launch(args("some-org/not-in-the-cache"))
    with pytest.raises(MissingIndexKFormat):
        is_index_k_launch(args(no_format))
    assert is_index_k_launch(args(no_format, '{"index_k_format": "fp8"}'))
    assert is_index_k_launch(args(no_format, flag="bf16"))
    # SGLang's ModelConfig: the overrides as a parsed dict, no index_k_format attribute
    assert is_index_k_launch(SimpleNamespace(model_path=str(no_format), model_override_args={"index_k_format": "fp8"}))


def test_the_format_flag_is_refused_for_other_models(tmp_path):
    from sglang_m3.plugin import _fold_index_k_format_flag

    llama = llama_folder(tmp_path / "llama")
    args = SimpleNamespace(model_path=str(llama), index_k_format="fp8", json_model_override_args="{}")
    with pytest.raises(ValueError, match=r"--index-k-format fp8: .*model_type 'minimax_m3_1'.*'llama': drop it"):
        _fold_index_k_format_flag(None, args)
    assert args.json_model_override_args == "{}"
    unread = SimpleNamespace(model_path="some-org/not-in-the-cache", index_k_format="fp8",
                             json_model_override_args="{}")
    _fold_index_k_format_flag(None, unread)  # nothing to judge by: folded, as before
    assert json.loads(unread.json_model_override_args) == {"index_k_format": "fp8"}


def test_a_minimax_m3_1_config_without_a_format_is_refused_when_sglang_builds_it(tmp_path):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.plugins import load_plugins

    load_plugins()
    tiny = _tiny_config()
    no_format = _model_folder(tmp_path / "no-format", {k: v for k, v in tiny.items() if k != "index_k_format"})
    with pytest.raises(MissingIndexKFormat):
        ModelConfig(str(no_format))
    chosen = ModelConfig(str(no_format), model_override_args='{"index_k_format": "bf16"}')
    assert chosen.hf_config.index_k_format == "bf16"
    assert ModelConfig(str(llama_folder(tmp_path / "llama"))).hf_config.model_type == "llama"


def test_process_hooks_leave_other_models_alone(tmp_path, monkeypatch):
    """The CPU rows (OpenMP waits, forked children) and the detokenizer row pass a non-M3 launch through."""
    import multiprocessing

    from sglang_m3 import plugin

    for name in (plugin.OMP_WAIT_POLICY, plugin.GOMP_SPINCOUNT):
        monkeypatch.delenv(name, raising=False)
    llama = llama_folder(tmp_path / "llama")
    args = SimpleNamespace(device="cpu", model_path=str(llama), json_model_override_args="{}", index_k_format=None)
    plugin._cpu_openmp_waits(None, args)
    assert plugin.OMP_WAIT_POLICY not in os.environ and plugin.GOMP_SPINCOUNT not in os.environ
    monkeypatch.setattr(plugin, "_launched_by_sglang", lambda *a: True)
    monkeypatch.setattr(plugin, "_initial_environ", lambda: {plugin.OMP_WAIT_POLICY: "PASSIVE"})
    monkeypatch.setattr(multiprocessing, "set_start_method", lambda *a, **k: pytest.fail("start method changed"))
    assert plugin._cpu_children_start("result", args) == "result"
    seen = {}

    def launch(engine_cls, server_args, port_args, run_detokenizer_process_func):
        seen["target"] = run_detokenizer_process_func

    plugin._detokenizer_loads_plugins(launch, object, args, "ports", print)
    assert seen["target"] is print


def test_request_workarounds_pass_other_models_through():
    from sglang_m3 import plugin

    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=8, hf_config=SimpleNamespace(model_type="llama")),
                              rid_to_state={"x_0": 1, "x_1": 2})
    assert plugin._check_input_ids_in_vocab(manager, None, [-1, 99]) is None
    obj = SimpleNamespace(rid=["x_0", "x_1"], batch_size=1, parallel_sample_num=2)
    plugin._release_unsent_states(manager, obj)
    assert manager.rid_to_state == {"x_0": 1, "x_1": 2}
    assert plugin._abort_unfinished_samples(lambda tm, o: ("sglang", tm, o), manager, obj) == ("sglang", manager, obj)


def test_outside_the_supported_range_other_models_load_and_m3_1_is_refused(tmp_path):
    """SGLang 0.5.24 (faked): one warning line, no hook row but the refusal, other models' configs build."""
    llama = llama_folder(tmp_path / "llama")
    script = f"""
import logging
logging.basicConfig(level=logging.WARNING)
from importlib import metadata
real = metadata.version
metadata.version = lambda name: "0.5.24" if name == "sglang" else real(name)
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
print("patched", sorted(HookRegistry._patched))
from sglang.srt.configs.model_config import ModelConfig
print("llama", ModelConfig({str(llama)!r}).hf_config.model_type)
ModelConfig({str(TINY_MODEL)!r})
print("m3.1 served")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert "llama llama" in proc.stdout, proc.stderr[-3000:]
    assert "m3.1 served" not in proc.stdout and proc.returncode != 0
    patched = re.search(r"patched (\[.*\])", proc.stdout).group(1)
    assert "TokenizerManager" not in patched and "from_cli_args" in patched and "ModelConfig.__init__" in patched
    warnings = [line for line in proc.stderr.splitlines() if "sglang-m3 is off" in line]
    assert len(warnings) == 1 and "0.5.16 through 0.5.23" in warnings[0] and "installed: 0.5.24" in warnings[0]
    assert re.search(r"UnsupportedSGLangError: MiniMax-M3.1 with an index-K cache: sglang-m3 supports SGLang "
                     r"0\.5\.16 through 0\.5\.23 .*installed: 0\.5\.24", proc.stderr)


# ---- served: a non-M3 model with and without the plugin, then the tiny M3.1 ----------------------------------

def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(_children(p))
    return found


def _proc_text(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _environ(pid: int) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def _post(url: str, payload: dict):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body or b"{}")
        except ValueError:
            return e.code, {"text": body.decode(errors="replace")}
    except (urllib.error.URLError, ConnectionError) as e:  # the server went down under the request
        return "no answer", {"error": type(e).__name__}


def _normalized(line: str) -> str:
    line = re.sub(r"^\[[^\]]*\]\s*", "", line)  # SGLang's "[date time TP0]" prefix
    line = re.sub(r"0x[0-9a-f]+", "0xH", line)
    # FastAPI's duplicate-operation warnings name one HTTP method of a route, picked by set order (a per-process hash)
    line = re.sub(r"_(get|post|put|delete|patch) for function", "_METHOD for function", line)
    return re.sub(r"-?\d+(\.\d+)?", "N", line).strip()  # signed: SGLang logs memory deltas like "-0.12 GB"


def serve(model: Path, tmp_path: Path, name: str, env_extra: dict, shim: Path) -> dict:
    """Start one CPU server, look at it, stop it: what the comparison needs, as a dict."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "SGLANG_PLUGINS") and not k.startswith("SGLANG_M3")}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(REPO), str(REPO / "kernels"), env.get("PYTHONPATH", "")])
    env.update({"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / f"{name}.log"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--load-format", "dummy",
           "--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "4096",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "info"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while True:
                assert proc.poll() is None, log_path.read_text()[-4000:]
                assert time.monotonic() < deadline, log_path.read_text()[-4000:]
                # Ready means SGLang's own warmup is over: it ends with a POST to /freeze_gc, then this line. (With
                # --skip-server-warmup, SGLang 0.5.23 posts /freeze_gc before its HTTP server listens, and whether
                # that fails is a race: the two runs' logs then differ by chance.)
                if FIRED_UP in log_path.read_text(errors="replace"):
                    break
                time.sleep(1)
            pids = _tree(proc.pid)
            seen = {
                "environ": {pid: _environ(pid) for pid in pids},
                "cmdline": sorted(_proc_text(pid, "cmdline") for pid in pids),
            }
            with urllib.request.urlopen(url + "/openapi.json", timeout=60) as r:
                seen["routes"] = sorted(json.loads(r.read())["paths"])
            sampling = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
            seen["generate"] = _post(url + "/generate", {"input_ids": [5, 6, 7], "sampling_params": sampling})[0]
            # n > 1 under a given rid, twice: SGLang 0.5.16 keeps the samples' states (W2), so the second is refused
            parallel = {"text": "a b c", "rid": "same", "sampling_params": {**sampling, "n": 2}}
            seen["parallel"] = [_post(url + "/generate", parallel) for _ in range(2)]
            seen["parallel"] = [(status, str(body.get("error", body.get("message", "")))[:200] if status != 200 else "")
                                for status, body in seen["parallel"]]
            # last: SGLang 0.5.16 itself lets an out-of-vocabulary id reach the embedding, and the server dies (W1)
            status, body = _post(url + "/generate", {"input_ids": [5, 99999], "sampling_params": sampling})
            if status in (200, 400):  # answered: alive if it still serves the next request
                alive = _post(url + "/generate", {"input_ids": [5, 6, 7], "sampling_params": sampling})[0] == 200
            else:
                try:
                    proc.wait(timeout=15)  # a dying server is gone within seconds (its scheduler's crash ends the tree)
                except subprocess.TimeoutExpired:
                    pass
                alive = proc.poll() is None
            seen["out_of_vocabulary"] = (status, str(body)[:300], alive)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    seen["log"] = log_path.read_text(errors="replace").splitlines()
    (tmp_path / f"{name}.json").write_text(json.dumps(seen, indent=1, default=str))  # for a failure's reader
    return seen


def _env_by_name(seen: dict) -> dict:
    """Each variable of the server's processes with the set of its values among them (SGLANG_PLUGINS left out:
    the run without the plugin sets it; so is ``PER_RUN``)."""
    names = {}
    for env in seen["environ"].values():
        for name, value in env.items():
            if name not in PLUGIN_OFF and name not in PER_RUN:
                names.setdefault(name, set()).add(value)
    return names


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shim")
    (folder / "sitecustomize.py").write_text(ROTARY_SHIM)
    return folder


@pytest.mark.slow
def test_a_non_m3_model_is_served_as_without_the_plugin(tmp_path, shim):
    llama = llama_folder(tmp_path / "llama")
    with_plugin = serve(llama, tmp_path, "with", {}, shim)
    without = serve(llama, tmp_path, "without", PLUGIN_OFF, shim)

    env, env_off = _env_by_name(with_plugin), _env_by_name(without)
    assert env == env_off, {k: (env.get(k), env_off.get(k)) for k in set(env) | set(env_off)
                            if env.get(k) != env_off.get(k)}
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env
    normalize_ports = lambda cmds: [re.sub(r"--port \d+", "--port P", c) for c in cmds]  # noqa: E731
    assert normalize_ports(with_plugin["cmdline"]) == normalize_ports(without["cmdline"])  # spawned alike
    assert with_plugin["routes"] == without["routes"]
    for key in ("generate", "parallel", "out_of_vocabulary"):
        assert with_plugin[key] == without[key], key
    # what the workarounds would have changed, as SGLang 0.5.16 does it (a newer SGLang may fix either)
    print("n > 1 twice under one rid:", without["parallel"], "; out-of-vocabulary id:", without["out_of_vocabulary"])

    lines = {_normalized(line) for line in with_plugin["log"] if not LOADER_LINES.search(line)}
    lines_off = {_normalized(line) for line in without["log"] if not LOADER_LINES.search(line)}
    assert not [line for line in with_plugin["log"]
                if not LOADER_LINES.search(line) and re.search(r"sglang_m3|sglang-m3|index-K|OMP_|forked", line)]
    assert lines == lines_off, (sorted(lines - lines_off), sorted(lines_off - lines))


@pytest.mark.slow
def test_a_minimax_m3_1_index_k_config_still_gets_every_hook(tmp_path, shim):
    seen = serve(TINY_MODEL, tmp_path, "m3", {}, shim)
    children = [env for env in seen["environ"].values()]
    assert any(env.get("OMP_WAIT_POLICY") == "PASSIVE" and env.get("GOMP_SPINCOUNT") == "3000" for env in children)
    log = "\n".join(seen["log"])
    assert "--device cpu: OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=3000" in log
    assert "MiniMax-M3.1 index-K cache: mxfp4" in log
    assert seen["generate"] == 200
    assert seen["parallel"] == [(200, ""), (200, "")]  # W2: the rid can be used again
    status, body, alive = seen["out_of_vocabulary"]
    assert status == 400 and "outside the vocabulary [0, 2048): 99999" in body and alive  # W1
