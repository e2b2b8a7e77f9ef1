"""Whether a launch is this package's to change: a MiniMax-M3.1 config with an index-K format.

Every plugin hook that changes SGLang's behaviour asks here first and, for any other model, passes
SGLang's call through unchanged. A config is ours when its ``model_type`` (or its ``text_config``'s)
is ``minimax_m3_1`` and it names ``index_k_format`` (in ``config.json``, ``--json-model-override-args``
or ``--index-k-format``). A ``minimax_m3_1`` config that names no format is refused with a ValueError
naming the choices (``MissingIndexKFormat``): serving MXFP4 by default hid the choice.

Hooks that run before SGLang has built its model config (argument parsing, process start) read the
launch's ``config.json`` themselves (``is_index_k_launch``): from a local model folder, or from the
Hugging Face cache for a hub id (never downloaded here; a hub model not yet cached counts as not
ours at that point, which only costs a CPU server its OpenMP defaults). Hooks that see SGLang's
``hf_config`` ask ``is_index_k_config`` directly.
"""

import functools
import json
import os
from collections.abc import Mapping

from m3_kernels.formats import IndexKFormat

from .config import MODEL_TYPE

FORMAT_CHOICES = "|".join(f.value for f in IndexKFormat)


class MissingIndexKFormat(ValueError):
    """A ``minimax_m3_1`` config without ``index_k_format``."""

    def __init__(self):
        super().__init__(
            f"model_type {MODEL_TYPE!r} (sglang-m3's MiniMax-M3.1) names no index_k_format: choose the index-K cache "
            f"format, one of {FORMAT_CHOICES}, in config.json (\"index_k_format\"), with --index-k-format or with "
            "--json-model-override-args '{\"index_k_format\": \"mxfp4\"}'; to serve SGLang's own MiniMax-M3 path "
            f"instead, use the checkpoint's upstream config (a model_type other than {MODEL_TYPE!r})"
        )


def _get(config, name: str):
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def is_index_k_config(config, strict: bool = True) -> bool:
    """Whether ``config`` (a ``config.json`` mapping with its overrides applied, or SGLang's ``hf_config``)
    is MiniMax-M3.1 with an index-K format: ``model_type`` ``minimax_m3_1`` at the top or in ``text_config``,
    and ``index_k_format`` set.

    A ``minimax_m3_1`` config without ``index_k_format`` raises ``MissingIndexKFormat`` (a ValueError
    naming the choices), or is not ours with ``strict=False``: what the hooks past start-up pass, where
    the launch was checked already (SGLang's ``hf_config`` of that type is this package's config class,
    which fills in a default; ``is_index_k_launch`` reads ``config.json`` as given, and refuses first).
    """
    for cfg in (config, _get(config, "text_config")):
        if cfg is not None and _get(cfg, "model_type") == MODEL_TYPE:
            if _get(cfg, "index_k_format") is None:
                if strict:
                    raise MissingIndexKFormat()
                return False
            return True
    return False


def model_config_dict(model_path: str, revision: str | None = None) -> dict | None:
    """``config.json`` of a local model folder, or of a hub id already in the Hugging Face cache;
    None where it cannot be read without a download."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isdir(model_path):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model_path, "config.json", revision=revision)
        except Exception:  # not a repo id (a file, a URL, ...): nothing to read
            return None
        if not isinstance(cached, str):
            return None
        path = cached
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


@functools.lru_cache(maxsize=16)
def _launch_is_index_k(model_path: str, revision: str | None, overrides: str, flag_format: str | None) -> bool:
    config = model_config_dict(model_path, revision)
    if config is None:
        return False
    merged = {**config, **json.loads(overrides or "{}")}
    if flag_format is not None:
        merged["index_k_format"] = flag_format
    return is_index_k_config(merged)


def is_index_k_launch(server_args) -> bool:
    """Whether the launch described by ``server_args`` (SGLang's ``ServerArgs``, its parsed CLI namespace,
    or ``ModelConfig``) serves MiniMax-M3.1 with an index-K format: ``is_index_k_config`` of its
    ``config.json`` after ``json_model_override_args`` (``model_override_args``) and ``--index-k-format``.

    Raises ``MissingIndexKFormat`` for a ``minimax_m3_1`` config that names no format."""
    model_path = getattr(server_args, "model_path", None)
    if not model_path:
        return False
    overrides = getattr(server_args, "json_model_override_args", None)
    if overrides is None:
        overrides = getattr(server_args, "model_override_args", None)
    if isinstance(overrides, Mapping):
        overrides = json.dumps(dict(overrides), sort_keys=True)
    return _launch_is_index_k(str(model_path), getattr(server_args, "revision", None), overrides or "{}",
                              getattr(server_args, "index_k_format", None))
