"""MiniMax-M3.1 model config: MiniMax-M3's text config plus the index-K cache format.

transformers' own M3 text config drops ``sparse_attention_config``, which SGLang's M3 code reads;
this class keeps every key of ``config.json`` as an attribute (``sparse_attention_config``
included) and adds three keys of its own:

- ``index_k_format``: ``bf16 | fp8 | mxfp4 | mxfp4_rot`` (``m3_kernels.formats.IndexKFormat``),
  how the sparse layers' index keys are stored in the paged cache. Required for a served model: the plugin
  refuses a ``minimax_m3_1`` config without it (``sglang_m3.scope``); the class default ``mxfp4`` applies only
  to a config built directly in Python.
- ``index_k_scale_rule``: ``rceil | floor``, the MXFP4 e8m0 scale rule. Default ``rceil``.
- ``index_k_sign_seed``: int or null, the sign seed of the ``mxfp4_rot`` rotation.

Override any of them at launch with ``--index-k-format`` or
``--json-model-override-args '{"index_k_format": "fp8"}'``.
"""

from dataclasses import dataclass

from transformers import PretrainedConfig

from m3_kernels.formats import IndexKFormat, ScaleRule, parse_format, parse_scale_rule

MODEL_TYPE = "minimax_m3_1"
ARCHITECTURE = "MiniMaxM3SparseForCausalLM"  # upstream's name: SGLang keys pools, backends and defaults on it
DEFAULT_INDEX_K_FORMAT = IndexKFormat.MXFP4


def check_sign_seed(value) -> int | None:
    """``index_k_sign_seed`` as given: None or an int ``torch.Generator.manual_seed`` takes
    (``[-2**63, 2**64)``); ValueError otherwise (a string from JSON would fail only at the first write)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < (1 << 64)):
        return value
    raise ValueError(f"index_k_sign_seed must be null or an int in [-2**63, 2**64) (the mxfp4_rot sign seed), "
                     f"got {value!r}")


class MiniMaxM31Config(PretrainedConfig):
    """Config of ``MiniMaxM3SparseForCausalLM`` for MiniMax-M3.1 (see the module docstring)."""

    model_type = MODEL_TYPE

    def __init__(
        self,
        sparse_attention_config: dict | None = None,
        index_k_format: str = DEFAULT_INDEX_K_FORMAT.value,
        index_k_scale_rule: str = ScaleRule.RCEIL.value,
        index_k_sign_seed: int | None = None,
        **kwargs,
    ):
        self.sparse_attention_config = sparse_attention_config
        self.index_k_format = parse_format(index_k_format).value
        self.index_k_scale_rule = parse_scale_rule(index_k_scale_rule, "index_k_scale_rule").value
        self.index_k_sign_seed = check_sign_seed(index_k_sign_seed)
        super().__init__(**kwargs)


@dataclass(frozen=True)
class IndexKSettings:
    """The index-K cache settings of one served model."""

    fmt: IndexKFormat
    scale_rule: ScaleRule
    sign_seed: int | None


def register_config() -> None:
    """Make ``model_type: minimax_m3_1`` known to transformers in this process (idempotent). SGLang's
    processes get it from the plugin; a client that loads a tokenizer from one of our model folders
    (the demo, the accuracy runner) calls it first, or transformers warns that it instantiates a
    model of type ''."""
    from transformers import AutoConfig

    AutoConfig.register(MODEL_TYPE, MiniMaxM31Config, exist_ok=True)


def index_k_settings(hf_config) -> IndexKSettings | None:
    """Validated index-K settings of ``hf_config``, or None for a config without ``index_k_format``
    (upstream MiniMax-M3: SGLang's own pool and backend stay in charge).

    Raises ValueError naming the choices for an unknown format or scale rule, or the rule for a
    sign seed that is not null or an int. Reads the attributes
    after ``--json-model-override-args`` was applied, so overrides are validated too.
    """
    text_config = getattr(hf_config, "text_config", None)
    for cfg in (hf_config, text_config):
        if cfg is not None and getattr(cfg, "index_k_format", None) is not None:
            if getattr(cfg, "sparse_attention_config", None) is None:
                raise ValueError("index_k_format is set but the config has no sparse_attention_config")
            return IndexKSettings(
                fmt=parse_format(cfg.index_k_format, "index_k_format"),
                scale_rule=parse_scale_rule(getattr(cfg, "index_k_scale_rule", ScaleRule.RCEIL), "index_k_scale_rule"),
                sign_seed=check_sign_seed(getattr(cfg, "index_k_sign_seed", None)),
            )
    return None
