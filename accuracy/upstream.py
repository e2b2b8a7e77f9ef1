"""What SGLang's own MiniMax-M3 path serves, read from its server info: the arm ``upstream-<format>`` of a
comparison (``m3-accuracy --base-url upstream-fp8=URL ...``) is a deployment a user already runs, without
sglang-m3's index-K cache.

SGLang's M3 path stores the index keys in a dtype that no endpoint names; it follows from the release and the
launch arguments, which ``/server_info`` (``/get_server_info`` before) reports (``index_k_format``):

| SGLang | index-K cache |
|---|---|
| 0.5.16 | the model dtype (``MiniMaxSparseKVPool``'s ``index_dtype=model_dtype``) |
| 0.5.17-0.5.22 | fp8 with ``--kv-cache-dtype fp8_e4m3`` and ``--attention-backend trtllm_mha`` (its fp8 attention GEMMs, on SM100), else the model dtype |
| 0.5.23 | as 0.5.22, and fp8 with ``--kv-cache-dtype fp8_e4m3`` on Hopper (sm_90) |

Two inputs of those rules are in no endpoint: the GPU (0.5.23, fp8 KV cache, a backend other than
``trtllm_mha``: fp8 on Hopper, the model dtype elsewhere) and two environment switches
(``SGLANG_DISABLE_M3_FP8_ATTN_GEMM``; ``SGLANG_OPT_MINIMAX_M3_FP8_INDEX_CACHE`` on gfx95, from 0.5.21). Where the
GPU decides, ``index_k_format`` says it cannot tell, and the runner refuses the label; the switches are assumed
at their defaults (off).
"""

from packaging.version import InvalidVersion, Version

PREFIX = "upstream-"
FORMATS = ("bf16", "fp8")  # what SGLang's own M3 path stores (with bf16 models)
ARCHITECTURES = ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration")
FP8_ATTN_GEMM_SINCE = Version("0.5.17")  # m3_fp8_attn_gemm_enabled: fp8 index K with trtllm_mha + fp8_e4m3 KV
HOPPER_FP8_INDEX_SINCE = Version("0.5.23")  # get_minimax_sparse_index_dtype: fp8_e4m3 KV on sm_90 too
FP8_KV = "fp8_e4m3"
MODEL_DTYPES = {"auto": "bf16", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                "float": "fp32"}  # --dtype auto: M3's checkpoints are bfloat16


def is_upstream(label: str) -> bool:
    return str(label).startswith(PREFIX)


def parse_label(name: str, what: str) -> str:
    """``upstream-<format>`` with a format of ``FORMATS`` (case-insensitive); ValueError naming ``what``."""
    fmt = str(name)[len(PREFIX):].lower()
    if fmt not in FORMATS:
        raise ValueError(f"{what}: {name!r} must be {' or '.join(PREFIX + f for f in FORMATS)} (SGLang's own "
                         "MiniMax-M3 path, by the index-K cache it keeps)")
    return PREFIX + fmt


def index_k_format(info: dict) -> tuple[str | None, str]:
    """``(format, why)``: the index-K cache an SGLang server of MiniMax-M3 keeps, from its server info (``version``,
    ``kv_cache_dtype``, ``attention_backend``, ``dtype``); format None where the info cannot tell, ``why`` saying
    what decides it."""
    raw = str(info.get("version") or "")
    try:
        version = Version(raw)
    except InvalidVersion:
        return None, f"SGLang version {raw or 'unknown'} (its index-K dtype rules are known for 0.5.16-0.5.23)"
    model = MODEL_DTYPES.get(str(info.get("dtype") or "auto").lower(), str(info.get("dtype")))
    kv, backend = str(info.get("kv_cache_dtype") or "auto"), str(info.get("attention_backend") or "")
    setting = f"SGLang {version}, --kv-cache-dtype {kv}, --attention-backend {backend or 'default'}"
    if kv == FP8_KV and version >= FP8_ATTN_GEMM_SINCE and backend == "trtllm_mha":
        return "fp8", f"{setting}: fp8 attention GEMMs, index K in fp8"
    if kv == FP8_KV and version >= HOPPER_FP8_INDEX_SINCE:
        return None, (f"{setting}: index K in fp8 on Hopper (sm_90) and in the model dtype elsewhere, and the "
                      "server info names no GPU")
    return model, f"{setting}, --dtype {info.get('dtype') or 'auto'}: index K in the model dtype ({model})"


def check(label: str, identity: dict, where: str) -> None:
    """ValueError unless the server of ``identity`` (``accuracy.run.server_identity``) is SGLang's own MiniMax-M3
    path keeping the index-K cache ``label`` names; ``where`` names the deployment in the message."""
    want = label.partition("@")[0][len(PREFIX):]
    ours = identity.get("m3_index_k")
    if ours is not None:
        raise ValueError(f"{where}: label {label!r} names SGLang's own MiniMax-M3 path, but the server runs "
                         f"sglang-m3's index-K cache (index_k_format {ours.get('format')}): label it "
                         f"{ours.get('format')}")
    archs = identity.get("architectures")
    if not archs or not set(archs) & set(ARCHITECTURES):
        raise ValueError(f"{where}: label {label!r} needs a MiniMax-M3 server ({ARCHITECTURES[0]}); its model info "
                         f"names architectures {archs}")
    fmt, why = index_k_format(identity)
    if fmt is None:
        raise ValueError(f"{where}: label {label!r}: cannot tell its index-K cache from the server info ({why})")
    if fmt != want:
        raise ValueError(f"{where}: label {label!r} must keep the index-K cache in {want}; the server keeps it in "
                         f"{fmt} ({why})")
