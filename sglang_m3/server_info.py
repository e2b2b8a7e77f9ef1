"""``/get_server_info`` of a MiniMax-M3.1 index-K server says what cache it serves.

SGLang's answer holds ``model_path`` and ``json_model_override_args`` but not the format a model's own
``config.json`` names. For a served config with an index-K format (``config.index_k_settings``) this hook adds
``m3_index_k``::

    {"format": "mxfp4", "scale_rule": "rceil", "sign_seed": null,
     "sparse_layers": 3, "sparse_topk_blocks": 16, "sglang_m3_version": "0.1.0"}

``sparse_layers``: layers with ``sparse_attention_freq`` 1 (0: every layer dense, the accuracy runner's dense
control); ``sparse_topk_blocks``: blocks each sparse row attends. For any other model the answer is SGLang's,
unchanged. ``accuracy.run`` checks every deployment against its label with it before any prompt is sent.

The hook wraps ``http_server.server_info``, the function that ``/get_server_info`` awaits by name; the newer
``/server_info`` route was bound to the unwrapped function when SGLang's module was imported (SGLang 0.5.16),
so it answers without ``m3_index_k``.
"""

M3_INDEX_K = "m3_index_k"
PACKAGE = "sglang-m3"


def package_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return None


def index_k_info(hf_config) -> dict | None:
    """What ``m3_index_k`` reports for a served ``hf_config`` (after overrides); None without an index-K format."""
    from .config import index_k_settings
    from .scope import is_index_k_config

    if not is_index_k_config(hf_config, strict=False):  # the plugin's one scope rule (sglang_m3.scope)
        return None
    settings = index_k_settings(hf_config)
    cfg = hf_config if getattr(hf_config, "index_k_format", None) is not None else hf_config.text_config
    sparse = dict(getattr(cfg, "sparse_attention_config", None) or {})
    freq = sparse.get("sparse_attention_freq")
    return {
        "format": settings.fmt.value,
        "scale_rule": settings.scale_rule.value,
        "sign_seed": settings.sign_seed,
        "sparse_layers": sum(1 for f in freq if f) if isinstance(freq, list) else None,
        "sparse_topk_blocks": sparse.get("sparse_topk_blocks"),
        "sglang_m3_version": package_version(),
    }


async def add_index_k_info(original, *args, **kwargs):
    """Around ``http_server.server_info`` (what ``/get_server_info`` awaits): adds ``M3_INDEX_K`` for an index-K
    model, else returns SGLang's answer as it is."""
    info = await original(*args, **kwargs)
    from sglang.srt.entrypoints.http_server import _global_state

    manager = getattr(_global_state, "tokenizer_manager", None)
    entry = index_k_info(manager.model_config.hf_config) if manager is not None else None
    if entry is not None and isinstance(info, dict):
        info = {**info, M3_INDEX_K: entry}
    return info
