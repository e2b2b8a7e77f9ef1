"""The server and model info's ``m3_index_k`` (sglang_m3.server_info): what an index-K config reports, nothing
added for any other model (the served answer is SGLang's, unchanged), and the routes that answer it."""

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_m3 import plugin, server_info
from sglang_m3.config import MiniMaxM31Config

REPO = Path(__file__).resolve().parents[2]
TARGET = "sglang.srt.entrypoints.http_server.server_info"


def _config(**overrides):
    cfg = json.loads((REPO / "configs" / "minimax-m3.1-tiny" / "config.json").read_text())
    cfg.update(overrides)
    cfg.pop("model_type", None)
    return MiniMaxM31Config(**cfg)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4", "mxfp4_rot"])
def test_an_index_k_config_reports_its_resolved_settings(fmt):
    cfg = _config(index_k_format=fmt, index_k_scale_rule="floor", index_k_sign_seed=7)
    freq = cfg.sparse_attention_config["sparse_attention_freq"]
    info = server_info.index_k_info(cfg)
    assert info == {"format": fmt, "scale_rule": "floor", "sign_seed": 7, "sparse_layers": sum(map(bool, freq)),
                    "sparse_topk_blocks": cfg.sparse_attention_config["sparse_topk_blocks"],
                    "sglang_m3_version": server_info.package_version()}


def test_every_layer_dense_reports_no_sparse_layers():
    sparse = _config().sparse_attention_config
    cfg = _config(sparse_attention_config={**sparse, "sparse_attention_freq": [0] * len(sparse["sparse_attention_freq"])})
    assert server_info.index_k_info(cfg)["sparse_layers"] == 0


def test_a_model_without_an_index_k_format_reports_nothing():
    from transformers import LlamaConfig

    assert server_info.index_k_info(LlamaConfig()) is None


class _Manager:
    def __init__(self, hf_config):
        self.model_config = type("ModelConfig", (), {"hf_config": hf_config})()


@pytest.mark.parametrize("index_k", [True, False])
def test_the_hook_adds_the_key_for_index_k_models_only(index_k, monkeypatch):
    from transformers import LlamaConfig

    from sglang.srt.entrypoints import http_server

    sglang_answer = {"model_path": "m", "version": "x"}

    async def original():
        return dict(sglang_answer)

    manager = _Manager(_config(index_k_format="fp8") if index_k else LlamaConfig())
    monkeypatch.setattr(http_server, "_global_state", SimpleNamespace(tokenizer_manager=manager))
    answer = asyncio.run(server_info.add_index_k_info(original))
    if index_k:
        assert answer == {**sglang_answer, "m3_index_k": server_info.index_k_info(_config(index_k_format="fp8"))}
    else:
        assert answer == sglang_answer


@pytest.mark.parametrize("name", ["server_info", "model_info"])
def test_the_plugin_registers_it_around_the_server_and_model_info(name):
    target = f"sglang.srt.entrypoints.http_server.{name}"
    rows = [row for row in plugin.hook_table() if row.target == target]
    assert len(rows) == 1 and rows[0].hook is server_info.add_index_k_info and rows[0].kind == "AROUND"
    from sglang.srt.entrypoints import http_server

    assert hasattr(http_server, name)  # the target exists in this SGLang


def _app():
    """A FastAPI app with SGLang's two info routes bound at import, as SGLang binds them, and a third route."""
    from fastapi import FastAPI

    app, module = FastAPI(), SimpleNamespace()

    async def server_info():
        return {"who": "sglang"}

    async def model_info():
        return {"who": "sglang model"}

    async def health():
        return {"ok": True}

    module.server_info, module.model_info = server_info, model_info
    app.get("/server_info")(server_info)
    app.get("/model_info")(model_info)
    app.get("/health")(health)
    return app, module


def test_the_info_routes_answer_through_the_hooked_functions():
    from fastapi.testclient import TestClient

    app, module = _app()
    client = TestClient(app)
    assert client.get("/server_info").json() == {"who": "sglang"}
    assert sorted(server_info.rebind_info_routes(app, module)) == ["/model_info", "/server_info"]
    originals = module.server_info, module.model_info

    async def hooked_server():
        return {**await originals[0](), "m3_index_k": {"format": "fp8"}}

    async def hooked_model():
        return {**await originals[1](), "m3_index_k": {"format": "fp8"}}

    module.server_info, module.model_info = hooked_server, hooked_model  # as SGLang's hook registry does, later
    assert client.get("/server_info").json() == {"who": "sglang", "m3_index_k": {"format": "fp8"}}
    assert client.get("/model_info").json() == {"who": "sglang model", "m3_index_k": {"format": "fp8"}}
    assert client.get("/health").json() == {"ok": True}
    assert client.post("/server_info").status_code == 405  # GET only, as before


def test_the_routes_are_rebound_for_an_index_k_launch_only(monkeypatch):
    from sglang.srt.entrypoints import http_server

    calls = []
    monkeypatch.setattr(server_info, "rebind_info_routes", lambda app, module: calls.append((app, module)))
    server_info.route_index_k_info(SimpleNamespace(model_path=str(REPO / "configs" / "msa-small")))
    assert calls == [(http_server.app, http_server)]
    server_info.route_index_k_info(SimpleNamespace(model_path=str(REPO / "configs" / "msa-small"),
                                                   index_k_format=None, json_model_override_args=None))
    assert len(calls) == 2
    calls.clear()
    server_info.route_index_k_info(SimpleNamespace(model_path=str(REPO / "tests")))  # no config.json: not ours
    assert calls == []
    rows = [row for row in plugin.hook_table() if row.target == "sglang.srt.entrypoints.http_server.launch_server"]
    assert len(rows) == 1 and rows[0].hook is server_info.route_index_k_info and rows[0].kind == "BEFORE"
