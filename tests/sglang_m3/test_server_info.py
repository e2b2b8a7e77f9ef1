"""``/get_server_info``'s ``m3_index_k`` (sglang_m3.server_info): what an index-K config reports, and nothing
added for any other model (the served answer is SGLang's, unchanged)."""

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


def test_the_plugin_registers_it_around_what_get_server_info_awaits():
    rows = [row for row in plugin.hook_table() if row.target == TARGET]
    assert len(rows) == 1 and rows[0].hook is server_info.add_index_k_info and rows[0].kind == "AROUND"
    from sglang.srt.entrypoints import http_server

    assert hasattr(http_server, "server_info")  # the target exists in this SGLang
