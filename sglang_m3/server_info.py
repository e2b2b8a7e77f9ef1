"""SGLang's server and model info of a MiniMax-M3.1 index-K server say what cache it serves.

SGLang's answer holds ``model_path`` and ``json_model_override_args`` but not the format a model's own
``config.json`` names. For a served config with an index-K format (``config.index_k_settings``) this module adds
``m3_index_k`` to ``/server_info`` and ``/model_info`` (and to ``/get_server_info`` and ``/get_model_info``, the
names SGLang keeps for them, logged as deprecated)::

    {"format": "mxfp4", "scale_rule": "rceil", "sign_seed": null,
     "sparse_layers": 3, "sparse_topk_blocks": 16, "sglang_m3_version": "0.1.0"}

``sparse_layers``: layers with ``sparse_attention_freq`` 1 (0: every layer dense, the accuracy runner's dense
control); ``sparse_topk_blocks``: blocks each sparse row attends. For any other model the answers are SGLang's,
unchanged. ``accuracy.run`` checks every deployment against its label with it before any prompt is sent.

Two hooks: one around each of ``http_server.server_info`` and ``http_server.model_info`` (``add_index_k_info``),
which the deprecated routes await by name; and, on an M3.1 index-K launch, one before ``http_server.launch_server``
(``route_index_k_info``) that points ``/server_info`` and ``/model_info`` at those hooked functions, since SGLang
bound those two routes to the unwrapped functions when its module was imported (SGLang 0.5.16 through 0.5.23).
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
    """Around ``http_server.server_info`` and ``http_server.model_info``: adds ``M3_INDEX_K`` for an index-K
    model, else returns SGLang's answer as it is."""
    info = await original(*args, **kwargs)
    from sglang.srt.entrypoints.http_server import _global_state

    manager = getattr(_global_state, "tokenizer_manager", None)
    entry = index_k_info(manager.model_config.hf_config) if manager is not None else None
    if entry is not None and isinstance(info, dict):
        info = {**info, M3_INDEX_K: entry}
    return info


INFO_ROUTES = {"/server_info": "server_info", "/model_info": "model_info"}  # route -> http_server function


def _through_module(module, name: str, endpoint):
    """An endpoint that awaits ``module.<name>`` as it is when called (hooks included), dressed as ``endpoint``."""
    import functools

    @functools.wraps(endpoint)
    async def through(*args, **kwargs):
        return await getattr(module, name)(*args, **kwargs)

    return through


def rebind_info_routes(app, module) -> list[str]:
    """Point ``app``'s GET routes of ``INFO_ROUTES`` at ``module``'s functions of those names, looked up at each
    call; returns the paths rebound. Each route keeps its path, methods, name and dependencies."""
    from fastapi.routing import APIRoute

    rebound = []
    for i, route in enumerate(app.router.routes):
        name = INFO_ROUTES.get(getattr(route, "path", None))
        if name is None or not isinstance(route, APIRoute) or "GET" not in route.methods:
            continue
        app.router.routes[i] = APIRoute(route.path, _through_module(module, name, route.endpoint),
                                        methods=sorted(route.methods), name=route.name,
                                        dependencies=route.dependencies)
        rebound.append(route.path)
    return rebound


def route_index_k_info(server_args, *args, **kwargs):
    """Before ``http_server.launch_server``: on a MiniMax-M3.1 index-K launch, ``/server_info`` and ``/model_info``
    answer through the hooked functions (``add_index_k_info``); any other launch is left as it is."""
    from .scope import is_index_k_launch

    if is_index_k_launch(server_args):
        from sglang.srt.entrypoints import http_server

        rebind_info_routes(http_server.app, http_server)
    return None
