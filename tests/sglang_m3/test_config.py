"""MiniMax-M3.1 config class and index-K settings."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from m3_kernels.formats import IndexKFormat, ScaleRule
from sglang_m3.config import MiniMaxM31Config, index_k_settings
from sglang_m3.plugin import register

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["minimax-m3.1", "minimax-m3.1-tiny"])
def test_configs_load_with_sparse_config_and_format(name):
    register()
    cfg = AutoConfig.from_pretrained(CONFIGS / name)
    assert isinstance(cfg, MiniMaxM31Config)
    assert cfg.architectures == ["MiniMaxM3SparseForCausalLM"]
    sparse = cfg.sparse_attention_config
    assert (sparse["sparse_index_dim"], sparse["sparse_num_index_heads"], sparse["sparse_block_size"],
            sparse["sparse_topk_blocks"]) == (128, 4, 128, 16)
    assert sparse["sparse_attention_freq"][0] == 0 and all(sparse["sparse_attention_freq"][3:])
    assert (cfg.num_key_value_heads, cfg.head_dim) == (4, 128)
    assert index_k_settings(cfg) == index_k_settings(SimpleNamespace(**json.loads((CONFIGS / name / "config.json")
                                                                                  .read_text())))
    assert index_k_settings(cfg).fmt is IndexKFormat.MXFP4 and index_k_settings(cfg).scale_rule is ScaleRule.RCEIL


def test_override_is_validated_and_names_the_choices():
    cfg = MiniMaxM31Config(sparse_attention_config={"sparse_index_dim": 128})
    cfg.update({"index_k_format": "fp8"})
    assert index_k_settings(cfg).fmt is IndexKFormat.FP8
    cfg.update({"index_k_format": "mxfp3"})
    with pytest.raises(ValueError, match=r"index_k_format must be one of \[bf16, fp8, mxfp4, mxfp4_rot\], got 'mxfp3'"):
        index_k_settings(cfg)
    with pytest.raises(ValueError, match="index_k_format"):
        MiniMaxM31Config(index_k_format="int4")


def test_scale_rule_override_is_read_and_validated():
    cfg = MiniMaxM31Config(sparse_attention_config={"sparse_index_dim": 128}, index_k_format="mxfp4")
    cfg.update({"index_k_scale_rule": "floor"})
    assert index_k_settings(cfg).scale_rule is ScaleRule.FLOOR
    cfg.update({"index_k_scale_rule": "ceil"})
    with pytest.raises(ValueError, match="index_k_scale_rule"):
        index_k_settings(cfg)


def test_a_format_without_a_sparse_attention_config_is_refused():
    with pytest.raises(ValueError, match="no sparse_attention_config"):
        index_k_settings(SimpleNamespace(index_k_format="fp8", sparse_attention_config=None))


def test_settings_are_read_from_a_text_config():
    """A multimodal wrapper keeps the language model's fields under text_config."""
    text = SimpleNamespace(index_k_format="fp8", sparse_attention_config={}, index_k_sign_seed=None)
    assert index_k_settings(SimpleNamespace(text_config=text)).fmt is IndexKFormat.FP8


def test_upstream_m3_config_keeps_sglang_path():
    assert index_k_settings(SimpleNamespace(sparse_attention_config={}, architectures=["X"])) is None


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.value == "sglang_m3.plugin:register"]
    assert len(eps) == 1


@pytest.mark.parametrize("bad", ["7", 7.5, True, 1 << 64, -(1 << 63) - 1])
def test_sign_seed_override_is_validated(bad):
    """A sign seed torch cannot seed with fails at start-up, not at the first index-K write."""
    cfg = MiniMaxM31Config(sparse_attention_config={"sparse_index_dim": 128}, index_k_format="mxfp4_rot")
    for good in (None, 0, 7, (1 << 64) - 1, -(1 << 63)):
        cfg.update({"index_k_sign_seed": good})
        assert index_k_settings(cfg).sign_seed == good
    cfg.update({"index_k_sign_seed": bad})
    with pytest.raises(ValueError, match=r"index_k_sign_seed must be null or an int .*got " + repr(repr(bad))[1:-1]):
        index_k_settings(cfg)
    with pytest.raises(ValueError, match="index_k_sign_seed"):
        MiniMaxM31Config(index_k_sign_seed=bad)
