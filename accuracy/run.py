"""Does the MXFP4 index cache cost accuracy on my deployment? One command answers it.

For each index-K format the runner starts an SGLang server (model, launch arguments passed through
unchanged, the format switched by ``format_launch_args``) or uses a running deployment's URL, runs
the lm-eval tasks of ``accuracy/tasks`` against it through ``local-completions`` (or
``local-chat-completions``), and writes to ``--out``:

- ``samples/<format>/<task>.jsonl``: one line per sample (``doc_id, length, depth, target,
  response, score``);
- ``report.md``: per task and context length, accuracy of each format and paired statistics of
  each format against the baseline (``--baseline``: fp8 when it is run, else the first format;
  agreement, exact McNemar p, 95% interval of the accuracy difference: Tango's score interval for
  0/1 scores, the paired bootstrap for others, each column labelled, with its half-width);
- ``results.json``: the same numbers; ``accuracy_vs_length.png``: accuracy against context length.

Examples::

    # start one server per format (8 GPUs, tensor parallel), 1k..context, 20 samples per length
    m3-accuracy --model MiniMaxAI/MiniMax-M3.1 --formats fp8 mxfp4 --out results/m3 -- --tp 8
    # running deployments, one URL per format (the model and the formats from the servers and the labels)
    m3-accuracy --base-url fp8=http://h1:30000 mxfp4=http://h2:30000
    # beside a deployment of SGLang's own MiniMax-M3 path (accuracy.upstream)
    m3-accuracy --base-url upstream-fp8=http://h0:30000 mxfp4=http://h2:30000
    # dense control (every visible block attended) beside the three index caches
    m3-accuracy --model ckpt --formats dense bf16 fp8 mxfp4 --lengths 4096 8192 16384 32768 --out results/ckpt

Besides the index-K formats, ``--formats`` takes ``dense``, the control: exact causal attention in every
layer, served one of two ways (``--dense-via``). ``layers`` (the default) marks every layer dense
(``sparse_attention_freq`` all 0), so SGLang's own attention backend serves them all and there is no index
cache or selection; ``topk`` keeps the sparse path (bf16 index cache, scorer, selector, SGLang's sparse
kernels) with ``sparse_topk_blocks`` raised to the blocks of the longest request (``dense_topk_blocks``), so
the selector returns every visible block. The two are the same arithmetic up to the kernels' rounding;
``topk`` is what the agreement study records selections from, and it needs ``--lengths`` (on an H200 its
prefill reads each row's blocks through the sparse kernels: ~30 s for a 128k-token prompt, against ~2 s).

Before any prompt is sent, each server is asked what it serves (``/server_info`` and ``/model_info``, or
``/get_server_info`` where the SGLang release has only that: the model path and the ``m3_index_k`` entry that
sglang-m3 adds, ``sglang_m3.server_info``), and the run is refused when a label is not the served index-K format
(``dense``: bf16 with every layer dense, or a top-k covering every block; ``upstream-<fmt>``: SGLang's own
MiniMax-M3 path keeping that index-K cache, ``accuracy.upstream``), when two labels name one server, when the
servers serve different models, or when ``--model`` is not what they serve (left out, it is taken from them;
``--formats`` left out is the ``--base-url`` labels); ``results.json`` (``servers``) and the report record what
each said. Servers started here are checked the same way, and a ``--model`` that does not exist is refused
before one starts. A caller's mistake (an
unreachable URL, a URL ending in ``/v1``, an unknown task, lengths past the served context, ...) ends in one
``m3-accuracy: error:`` line naming the argument, the value and the rule, and leaves no empty ``--out``.

Everything after ``--`` goes to ``python -m sglang.launch_server`` as is (through ``sglang_m3.server``).
"""

import argparse
import json
import multiprocessing
import os
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from m3_kernels.formats import PAGE_SIZE, parse_format
from sglang_m3.server import Server

from . import report, retrieval, upstream
from .needle import GEN_TOKENS

TASKS_DIR = Path(__file__).parent / "tasks"
LONG_TASKS = retrieval.TASKS  # m3_niah_single, m3_niah_multikey, m3_kv, m3_vt, m3_kv_64, m3_vt_value
SHORT_TASKS = ("m3_short_arith",)
MIN_LENGTH = 1024
OVERRIDE_FLAG = "--json-model-override-args"
RUNNER_OWNED_FLAGS = ("--model-path", "--model", "--host", "--port")
DENSE = "dense"  # control variant: every visible block attended (see format_launch_args)
DENSE_INDEX_FORMAT = "bf16"
DENSE_VIA = ("layers", "topk")  # how the dense control is served (dense_sparse_config)
DEFAULT_BASELINE = "fp8"
DEFAULT_FORMATS = ("fp8", "mxfp4")
REPLICA_SEP = "@"  # fp8@2: a replica of fp8 (parse_variant)


# ---------------------------------------------------------------------------------------------
# The format switch (the one place that knows how a server is told its index-K format)


def parse_variant(name: str, what: str = "format") -> str:
    """``"dense"``, the canonical name of an index-K format or ``upstream-bf16`` / ``upstream-fp8`` (SGLang's own
    MiniMax-M3 path, ``accuracy.upstream``), each optionally tagged ``@<n>`` (n >= 2): a
    replica, the same server served again as an arm of its own (``fp8@2`` against ``fp8`` counts the answers
    that serving again alone flips). ValueError naming ``what`` otherwise."""
    base, sep, tag = str(name).partition(REPLICA_SEP)
    if sep:
        if not tag.isdigit() or int(tag) < 2:
            raise ValueError(f"{what}: {name!r} must end in {REPLICA_SEP}<n> with n >= 2 (a replica of {base!r})")
        return f"{parse_variant(base, what)}{REPLICA_SEP}{int(tag)}"
    if str(name).lower() == DENSE:
        return DENSE
    if upstream.is_upstream(str(name).lower()):
        return upstream.parse_label(name, what)
    try:
        return parse_format(name, what).value
    except ValueError as e:
        raise ValueError(f"{e} (or {DENSE!r}, the dense-attention control, or upstream-bf16 / upstream-fp8, a "
                         "running server of SGLang's own MiniMax-M3 path)") from None


def served_as(variant: str) -> str:
    """What a (parsed) variant's server runs: the format or ``"dense"``, without a replica tag."""
    return variant.partition(REPLICA_SEP)[0]


def is_dense(variant: str) -> bool:
    return served_as(variant) == DENSE


def is_upstream(variant: str) -> bool:
    return upstream.is_upstream(served_as(variant))


def replicas_of(formats: list[str], baseline: str) -> dict:
    """``{replica: the variant it serves again}`` for the replicas in ``formats`` of a variant other than
    ``baseline`` that ``formats`` also holds (``mxfp4@2`` -> ``mxfp4``): the report pairs each with it too.
    A replica of the baseline is already paired with it."""
    return {f: served_as(f) for f in formats
            if served_as(f) != f and served_as(f) != baseline and served_as(f) in formats}


def parse_command_line(parser: argparse.ArgumentParser, argv=None) -> tuple:
    """``(args, formats, launch_args)`` of a tool's command line: the part before ``--`` parsed by
    ``parser`` (which has ``--formats``), formats canonical and distinct, what follows ``--`` as is."""
    argv = list(sys.argv[1:] if argv is None else argv)
    launch_args = []
    if "--" in argv:
        cut = argv.index("--")
        argv, launch_args = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    formats = [parse_variant(f, "--formats") for f in args.formats or ()]
    if len(set(formats)) != len(formats):
        raise ValueError(f"--formats must not repeat, got {formats}")
    return args, formats, launch_args


def dense_topk_blocks(max_tokens: int) -> int:
    """``sparse_topk_blocks`` of the dense control for requests of at most ``max_tokens`` tokens:
    ``ceil(max_tokens / PAGE_SIZE)``, the blocks such a request's last row sees."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return -(-int(max_tokens) // PAGE_SIZE)


def dense_max_tokens(lengths, max_gen_toks: int | None = None) -> int:
    """Longest request the dense control must cover: the longest needle context (prompt budget plus
    ``GEN_TOKENS``), the generation past that budget (``max_gen_toks``), and one spare block for a
    BOS token or a chat template the context budget does not count."""
    extra_gen = max(0, (GEN_TOKENS if max_gen_toks is None else int(max_gen_toks)) - GEN_TOKENS)
    return max(int(n) for n in lengths) + extra_gen + PAGE_SIZE


def model_sparse_config(model: str) -> dict:
    """The ``sparse_attention_config`` dict of ``model``'s ``config.json`` (local dir or hub id).

    Raises NotImplementedError when it sits under ``text_config`` (an override would have to
    replace the whole text config) and ValueError when there is none.
    """
    path = Path(model) / "config.json"
    if not path.is_file():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(model, "config.json"))
    cfg = json.loads(path.read_text())
    if "sparse_attention_config" in cfg:
        return cfg["sparse_attention_config"]
    if "sparse_attention_config" in cfg.get("text_config", {}):
        raise NotImplementedError(f"{model}: sparse_attention_config is under text_config; the dense control "
                                  "overrides a top-level sparse_attention_config only")
    raise ValueError(f"{model}: config.json has no sparse_attention_config (not a MiniMax-M3 sparse model?)")


def dense_sparse_config(sparse_config: dict, max_tokens: int | None = None, via: str = "layers") -> dict:
    """The dense control's ``sparse_attention_config``, from the model's ``sparse_config``.

    ``via="layers"``: ``sparse_attention_freq`` set to 0 for every layer (each one served by SGLang's dense
    attention; the index projections are not loaded). ``via="topk"``: ``sparse_topk_blocks`` raised to
    ``dense_topk_blocks(max_tokens)`` (never below the model's own), the sparse layers kept.
    """
    if via not in DENSE_VIA:
        raise ValueError(f"via must be one of {DENSE_VIA}, got {via!r}")
    if via == "layers":
        freq = sparse_config.get("sparse_attention_freq")
        if not isinstance(freq, list):
            raise ValueError(f"sparse_attention_freq must be a per-layer list to mark every layer dense, got {freq!r}")
        return {**sparse_config, "sparse_attention_freq": [0] * len(freq)}
    if max_tokens is None:
        raise ValueError("the dense control via topk needs max_tokens, the longest request")
    topk = max(dense_topk_blocks(max_tokens), int(sparse_config["sparse_topk_blocks"]))
    return {**sparse_config, "sparse_topk_blocks": topk}


def _split_overrides(launch_args: list[str]) -> tuple[list[str], dict]:
    """``launch_args`` without ``--json-model-override-args``, and the merged override dicts."""
    args, overrides = [], {}
    i = 0
    while i < len(launch_args):
        arg = launch_args[i]
        if arg == OVERRIDE_FLAG:
            if i + 1 >= len(launch_args):
                raise ValueError(f"{OVERRIDE_FLAG} needs a JSON value")
            overrides.update(json.loads(launch_args[i + 1]))
            i += 2
            continue
        if arg.startswith(OVERRIDE_FLAG + "="):
            overrides.update(json.loads(arg.split("=", 1)[1]))
        else:
            args.append(arg)
        i += 1
    return args, overrides


def format_launch_args(fmt: str, launch_args: list[str], sparse_config: dict | None = None,
                       max_tokens: int | None = None, via: str = "layers") -> list[str]:
    """``launch_args`` with the index-K format set to ``fmt`` (a format or ``"dense"``).

    The sglang_m3 plugin reads ``index_k_format`` from the model config, and SGLang applies
    ``--json-model-override-args`` to it; an override dict already in ``launch_args`` is merged
    (our keys win), so other overrides pass through.

    ``"dense"`` sets the bf16 format and overrides ``sparse_attention_config`` with
    ``dense_sparse_config(sparse_config, max_tokens, via)`` (SGLang replaces the whole dict, so the model's
    ``sparse_config`` is needed): every layer dense (``via="layers"``), or ``sparse_topk_blocks =
    dense_topk_blocks(max_tokens)`` (``via="topk"``: a row sees at most that many blocks, and the selector
    returns every visible block for such rows, ``m3_kernels.ops.select``). Either way attention is exactly causal.
    """
    fmt = served_as(parse_variant(fmt))
    args, overrides = _split_overrides(launch_args)
    if fmt == DENSE:
        if sparse_config is None:
            raise ValueError("the dense control needs the model's sparse_config")
        overrides["sparse_attention_config"] = dense_sparse_config(
            {**sparse_config, **overrides.get("sparse_attention_config", {})}, max_tokens, via)
        fmt = DENSE_INDEX_FORMAT
    overrides["index_k_format"] = fmt
    return args + [OVERRIDE_FLAG, json.dumps(overrides)]


def resolve_baseline(baseline: str | None, formats: list[str]) -> str:
    """The paired statistics' baseline: ``baseline`` if given (must be run), else fp8 when it is
    among ``formats``, else the first format."""
    if baseline is None:
        return DEFAULT_BASELINE if DEFAULT_BASELINE in formats else formats[0]
    baseline = parse_variant(baseline, "--baseline")
    if baseline not in formats:
        raise ValueError(f"--baseline {baseline!r} must be one of --formats {formats}")
    return baseline


# ---------------------------------------------------------------------------------------------
# Servers


class DeploymentError(ValueError):
    """A deployment that cannot be compared as labelled (unreachable, mislabelled, another model)."""


def _get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def _where(label: str, url: str, given: bool) -> str:
    return f"--base-url {label}={url}" if given else f"the {label} server started here ({url})"


def _ask(label: str, url: str, path: str, given: bool = True):
    """The JSON a server answers at ``path``; DeploymentError naming the label and the URL otherwise."""
    if url.rstrip("/").endswith("/v1"):
        raise DeploymentError(f"{_where(label, url, given)}: give the server's root URL, without /v1 (the runner "
                              f"asks {url.rstrip('/')[:-3]}/v1/completions itself)")
    try:
        return _get_json(url.rstrip("/") + path)
    except urllib.error.HTTPError as e:
        raise DeploymentError(f"{_where(label, url, given)}: {path} answered HTTP {e.code}; the URL must be an "
                              "SGLang server's root (http://host:port)") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise DeploymentError(f"{_where(label, url, given)}: no SGLang server answers ({reason}); start it or fix "
                              "the URL") from None


SERVER_INFO_PATHS = ("/server_info", "/get_server_info")  # SGLang's name, then the one it logs as deprecated
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")


def _ask_first(label: str, url: str, paths, given: bool = True):
    """The JSON of the first of ``paths`` the server has (HTTP 404: the next); None if it has none of them."""
    for path in paths:
        try:
            return _get_json(url.rstrip("/") + path)
        except urllib.error.HTTPError as e:
            if e.code != 404:
                break
        except (urllib.error.URLError, OSError, ValueError):
            break
    else:
        return None
    return _ask(label, url, path, given)  # the same request again, for its one-line DeploymentError


def server_identity(label: str, url: str, given: bool = True) -> dict:
    """What the server at ``url`` says it serves: ``url``, ``model_path``, ``m3_index_k`` (format, scale rule,
    sign seed, sparse layers, top-k blocks, sglang-m3 version; None for a server without a MiniMax-M3.1 index-K
    cache), ``sglang_version``, ``max_model_len``, and what decides the index-K cache of SGLang's own M3 path
    (``architectures``, ``version``, ``dtype``, ``kv_cache_dtype``, ``attention_backend``: ``accuracy.upstream``).
    Read from ``/v1/models``, ``/server_info`` and ``/model_info``, or their older names where the SGLang
    release has only those."""
    models = _ask(label, url, "/v1/models", given)
    info = _ask_first(label, url, SERVER_INFO_PATHS, given)
    if info is None:
        raise DeploymentError(f"{_where(label, url, given)}: answers none of {list(SERVER_INFO_PATHS)}; the URL "
                              "must be an SGLang server's root (http://host:port)")
    model_info = _ask_first(label, url, MODEL_INFO_PATHS, given) or {}
    try:
        model = models["data"][0]
    except (KeyError, IndexError, TypeError):
        raise DeploymentError(f"{_where(label, url, given)}: /v1/models lists no model") from None
    from sglang_m3.server_info import M3_INDEX_K

    return {"url": url, "model_id": model.get("id"),
            "model_path": info.get("model_path", model_info.get("model_path", model.get("id"))),
            "m3_index_k": info.get(M3_INDEX_K, model_info.get(M3_INDEX_K)), "sglang_version": info.get("version"),
            "max_model_len": model.get("max_model_len"), "max_req_input_len": info.get("max_req_input_len"),
            "architectures": model_info.get("architectures"), "version": info.get("version"),
            "dtype": info.get("dtype"), "kv_cache_dtype": info.get("kv_cache_dtype"),
            "attention_backend": info.get("attention_backend")}


def _same_server(a: str, b: str) -> bool:
    def norm(url):
        u = urllib.parse.urlsplit(url.rstrip("/"))
        host = (u.hostname or "").lower()
        host = "127.0.0.1" if host in ("localhost", "0.0.0.0", "::1") else host
        return host, u.port or (443 if u.scheme == "https" else 80), u.path
    return norm(a) == norm(b)


def check_served(label: str, identity: dict, given: bool = True, dense_blocks: int | None = None) -> None:
    """DeploymentError unless the server of ``identity`` serves what ``label`` names: an index-K format's label
    its format with sparse layers; ``dense`` the bf16 cache with every layer dense, or (``dense_blocks``: the
    blocks of the longest request) a top-k covering every block."""
    where, served = _where(label, identity["url"], given), identity["m3_index_k"]
    if is_upstream(label):
        try:
            return upstream.check(label, identity, where)
        except ValueError as e:
            raise DeploymentError(str(e)) from None
    if served is None:
        if set(identity.get("architectures") or ()) & set(upstream.ARCHITECTURES):
            fmt, _ = upstream.index_k_format(identity)
            hint = f"upstream-{fmt}" if fmt in upstream.FORMATS else "upstream-bf16 or upstream-fp8"
            raise DeploymentError(f"{where}: the server runs SGLang's own MiniMax-M3 path (no m3_index_k in its "
                                  f"server info), not sglang-m3's index-K cache: label it {hint}")
        raise DeploymentError(f"{where}: the server reports no MiniMax-M3.1 index-K cache (no m3_index_k in "
                              "/server_info: sglang-m3 not installed there, or a model without index_k_format)")
    fmt, want = served["format"], served_as(label)
    if is_dense(label):
        covered = served.get("sparse_layers") == 0 or (
            dense_blocks is not None and (served.get("sparse_topk_blocks") or 0) >= dense_blocks)
        if fmt != DENSE_INDEX_FORMAT or not covered:
            need = "" if dense_blocks is None else f", or sparse_topk_blocks >= {dense_blocks}"
            raise DeploymentError(
                f"{where}: label {label!r} needs a dense server (index_k_format {DENSE_INDEX_FORMAT}, no sparse "
                f"layers{need}); it serves index_k_format {fmt} with {served.get('sparse_layers')} sparse layers, "
                f"top-k {served.get('sparse_topk_blocks')} blocks")
    elif fmt != want or served.get("sparse_layers") == 0:
        what = f"index_k_format {fmt}" + (" with every layer dense" if served.get("sparse_layers") == 0 else "")
        raise DeploymentError(f"{where}: label {label!r} must serve index_k_format {want} with sparse layers; the "
                              f"server says {what}")


def check_deployments(identities: dict, given: dict | None = None, earlier: dict | None = None) -> None:
    """DeploymentError for two labels on one server or servers that serve different models (SGLang's own M3 path
    serves the checkpoint from a config folder of its own: upstream arms are compared with each other; ``identities``:
    ``{label: server_identity}``; ``given``: ``{label: whether its URL was given}``; ``earlier``: identities
    of formats served in an earlier call, ``--reuse``, checked for the model only)."""
    given, earlier = given or {}, {k: v for k, v in (earlier or {}).items() if v is not None}
    labels = list(identities) + [k for k in earlier if k not in identities]
    identities = {**earlier, **identities}
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            ia, ib = identities[a], identities[b]
            wa, wb = _where(a, ia["url"], given.get(a, True)), _where(b, ib["url"], given.get(b, True))
            if a not in earlier and b not in earlier and _same_server(ia["url"], ib["url"]):
                raise DeploymentError(f"{wa} and {wb} are one server: each label needs a server of its own "
                                      "(a comparison of a server with itself reads as perfect agreement)")
            if is_upstream(a) == is_upstream(b) and ia["model_path"] != ib["model_path"]:
                raise DeploymentError(f"{wa} serves {ia['model_path']!r} but {wb} serves {ib['model_path']!r}: the "
                                      "formats must be compared on one model")


def verify_base_urls(urls: dict, lengths, max_gen_toks, earlier: dict | None = None) -> dict:
    """``{label: server_identity}`` of the given deployments, each checked against its label and together
    (``check_served``, ``check_deployments``, ``earlier`` as there), before any prompt is sent."""
    identities = {label: server_identity(label, url) for label, url in urls.items()}
    blocks = dense_topk_blocks(dense_max_tokens(lengths, max_gen_toks)) if lengths else None
    for label, identity in identities.items():
        check_served(label, identity, dense_blocks=blocks)
        check_lengths(label, identity, lengths)
    check_deployments(identities, earlier=earlier)
    return identities


def check_lengths(label: str, identity: dict, lengths, given: bool = True) -> None:
    """DeploymentError when the longest of ``lengths`` exceeds the served context (``max_model_len``) or a
    prompt of it (at least ``GEN_TOKENS`` shorter) exceeds the longest input the server takes
    (``max_req_input_len``, bounded by its ``--max-total-tokens``)."""
    if not lengths:
        return
    where, longest = _where(label, identity["url"], given), max(lengths)
    context, max_input = identity.get("max_model_len"), identity.get("max_req_input_len")
    if context is not None and longest > int(context):
        raise DeploymentError(f"--lengths {longest} exceeds the served context (max_model_len {context}) of {where}; "
                              "drop it or raise the server's --context-length")
    if max_input is not None and longest - GEN_TOKENS > int(max_input):
        raise DeploymentError(f"--lengths {longest} exceeds the longest input {where} takes (max_req_input_len "
                              f"{max_input} prompt tokens); drop it or raise the server's --max-total-tokens")


class SGLangServer(Server):
    """``sglang_m3.server.Server`` for one format: ``(model, launch_args, log_path, timeout_s=)``."""

    def __init__(self, model: str, launch_args: list[str], log_path: Path, timeout_s: float = 1800.0):
        super().__init__(model, launch_args, log_path, timeout_s=timeout_s)

    def wait_ready(self, timeout_s: float | None = None) -> "SGLangServer":
        """``Server.wait_ready``, its failure told in two lines (DeploymentError): what happened with the log's
        path, and the log's last line."""
        try:
            return super().wait_ready(timeout_s)
        except (RuntimeError, TimeoutError) as e:
            head, _, tail = str(e).partition("\n")
            last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
            raise DeploymentError(f"{self.model} with {' '.join(self.args)}: {head}\n  {last}") from None


def served_model(base_url: str) -> tuple[str, int | None]:
    """``(model id, max context or None)`` from the server's ``/v1/models``."""
    data = _get_json(base_url.rstrip("/") + "/v1/models")["data"][0]
    return data["id"], data.get("max_model_len")


def default_lengths(context: int) -> list[int]:
    """Powers of two from ``MIN_LENGTH`` up to ``context``, and ``context`` itself."""
    lengths, n = [], MIN_LENGTH
    while n < context:
        lengths.append(n)
        n *= 2
    return lengths + [context]


# ---------------------------------------------------------------------------------------------
# lm-eval


def doc_key(doc: dict, fallback):
    """A sample's id across runs: ``"<length>/<sample>"`` for the long-context tasks (their samples are
    seeded per index, ``accuracy.retrieval``), else lm-eval's ``doc_id`` (``fallback``)."""
    if doc.get("length") is not None and doc.get("sample") is not None:
        return f"{int(doc['length'])}/{int(doc['sample'])}"
    return fallback


def run_lm_eval(base_url: str, model_id: str, tokenizer: str, tasks: list[str], lengths: list[int], args,
                sample_ids=None) -> dict:
    """Per-sample rows ``{task: [{doc_id, length, depth, target, response, score}]}`` of one server:
    samples ``0 .. args.samples - 1`` of each length, or the indices ``sample_ids``; ``doc_id`` is
    ``doc_key`` (rows ordered by length, then sample). Rows of a question asked with others of its
    context carry ``context``; with ``args.served_on``, every row carries it as ``served_on``."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    chat = args.api == "chat"
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    model_args = {
        "model": model_id,
        "base_url": base_url.rstrip("/") + endpoint,
        "tokenizer": tokenizer,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": False,
        "num_concurrent": args.concurrency,
        "max_retries": 3,
        "max_length": max(lengths) + 64,
        "timeout": args.request_timeout,
    }
    metadata = {"max_seq_lengths": lengths, "num_samples": args.samples, "num_depths": args.depths,
                "seed": args.seed, "tokenizer": tokenizer, "questions": args.questions,
                "tokenized_requests": False, "max_length": model_args["max_length"]}  # what the tasks check
    if sample_ids is not None:
        metadata["sample_ids"] = [int(i) for i in sample_ids]
    # Our tasks only: indexing lm-eval's own few thousand task files costs ~20 s.
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=metadata)
    out = lm_eval.simple_evaluate(
        model="local-chat-completions" if chat else "local-completions",
        model_args=model_args,
        tasks=tasks,
        task_manager=manager,
        log_samples=True,
        limit=args.limit,
        apply_chat_template=chat,
        gen_kwargs=None if args.max_gen_toks is None else f"max_gen_toks={args.max_gen_toks}",
    )
    rows = {}
    for task in tasks:
        rows[task] = sorted(
            (
                {
                    "doc_id": doc_key(s["doc"], s["doc_id"]),
                    "length": s["doc"].get("length"),
                    "depth": s["doc"].get("depth"),
                    "target": str(s["target"]),
                    "response": s["resps"][0][0] if s["resps"] and s["resps"][0] else "",
                    "score": float(s["acc"]),
                    "_order": (s["doc"].get("length") or 0, s["doc"].get("sample", s["doc_id"])),
                    **({"context": s["doc"]["context"]} if s["doc"].get("context") is not None else {}),
                    **({"served_on": args.served_on} if args.served_on else {}),
                }
                for s in out["samples"][task]
            ),
            key=lambda r: r["_order"],
        )
        for r in rows[task]:
            del r["_order"]
    return rows


class DocPrefetch:
    """Builds the prompts of a resumable run's next round in a child process while the server answers
    this round's.

    A round's docs take the runner seconds of tokenizer work (each prompt is tokenized whole to fit its
    length: about 4 s for 64 prompts of 8k-128k tokens on a 2-core CPU box), during which the server
    would sit idle. ``submit(pieces)`` starts that work in one spawned worker, ``collect(pieces)`` puts
    what it made into ``accuracy.retrieval``'s cache, where lm-eval's own build of the round finds it.
    The docs are the same either way (a sample is a pure function of its index); a prefetch that failed
    costs nothing but its CPU, since lm-eval then makes the docs itself."""

    def __init__(self, tokenizer: str, seed: int, num_depths: int, questions: int):
        self.tokenizer, self.seed, self.num_depths, self.questions = tokenizer, seed, num_depths, questions
        self.pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        self.pending: dict = {}  # request -> Future of retrieval.docs_entries
        self.error: str | None = None

    def _requests(self, pieces):
        for tasks, lengths, ids in pieces:
            for task in tasks:
                yield (task, self.tokenizer, tuple(sorted(int(n) for n in lengths)), tuple(int(i) for i in ids),
                       self.seed, self.num_depths, retrieval.questions_for(task, self.questions))

    def submit(self, pieces) -> None:
        """Start building the docs of ``pieces`` (``plan_rounds``'s round) not cached here yet."""
        if self.error is not None:
            return
        for request in self._requests(pieces):
            if request not in self.pending and not retrieval.has_docs(*request):
                try:
                    self.pending[request] = self.pool.submit(retrieval.docs_entries, *request)
                except RuntimeError as e:  # a broken pool
                    self._fail(e)
                    return

    def collect(self, pieces) -> None:
        """Wait for the docs of ``pieces`` submitted earlier and cache them here (nothing if none were)."""
        for request in self._requests(pieces):
            future = self.pending.pop(request, None)
            if future is None:
                continue
            try:
                retrieval.adopt(future.result())
            except Exception as e:  # lm-eval builds the docs itself
                self._fail(e)

    def _fail(self, e: Exception) -> None:
        if self.error is None:
            self.error = f"{type(e).__name__}: {e}"
            print(f"[resume] building prompts ahead failed ({self.error}); lm-eval builds them in turn", flush=True)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _dense_blocks(args) -> int | None:
    """Blocks of the longest request of this run (None without ``--lengths``): a dense server by top-k covers them."""
    return dense_topk_blocks(dense_max_tokens(args.lengths, args.max_gen_toks)) if args.lengths else None


def verify_started(label: str, url: str, servers: dict, dense_blocks: int | None, lengths=None) -> None:
    """The check of ``verify_base_urls`` for a server started here; its identity joins ``servers``."""
    identity = server_identity(label, url, given=False)
    check_served(label, identity, given=False, dense_blocks=dense_blocks)
    check_lengths(label, identity, lengths, given=False)
    check_deployments({label: identity}, given=dict.fromkeys([*servers, label], False), earlier=servers)
    servers[label] = identity


def write_server(out: Path, fmt: str, identity: dict | None) -> None:
    """``samples/<fmt>/server.json``: what ``fmt``'s server said it serves (``server_identity``)."""
    if identity is not None:
        folder = out / "samples" / fmt
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / "server.json", json.dumps(identity))


def read_server(out: Path, fmt: str) -> dict | None:
    path = out / "samples" / fmt / "server.json"
    return json.loads(path.read_text()) if path.is_file() else None


def write_samples(out: Path, fmt: str, rows: dict, settings: dict | None = None):
    """``samples/<fmt>/<task>.jsonl``, and ``samples/<fmt>/run.json`` holding ``settings``."""
    folder = out / "samples" / fmt
    folder.mkdir(parents=True, exist_ok=True)
    for task, samples in rows.items():
        with (folder / f"{task}.jsonl").open("w") as f:
            for s in samples:
                f.write(json.dumps(s) + "\n")
    if settings is not None:
        (folder / "run.json").write_text(json.dumps(settings))


def _holds_resumable_samples(out: Path, fmt: str) -> bool:
    """Whether ``samples/<fmt>/`` under ``out`` was written by a ``--resume`` run (its run.json, written by
    ``SampleLog``, has no ``tasks``: a plain run's, by ``write_samples``, has)."""
    meta = out / "samples" / fmt / "run.json"
    return meta.is_file() and "tasks" not in json.loads(meta.read_text())


def read_samples(out: Path, fmt: str, settings: dict) -> tuple[dict, list[int]] | None:
    """``(rows, lengths)`` written by ``write_samples`` for ``fmt``, or None if absent. ``settings``
    must match the saved ones (its ``lengths`` may be None: any); ValueError otherwise."""
    folder = out / "samples" / fmt
    if not (folder / "run.json").is_file():
        return None
    saved = json.loads((folder / "run.json").read_text())
    differ = [k for k, v in settings.items() if saved.get(k) != v and not (k == "lengths" and v is None)]
    if differ:
        raise ValueError(f"{folder} was run with other {differ}; use another --out or drop --reuse")
    rows = {task: [json.loads(line) for line in (folder / f"{task}.jsonl").read_text().splitlines()]
            for task in saved["tasks"]}
    return rows, saved["lengths"]


# ---------------------------------------------------------------------------------------------
# Resumable runs (--resume): per-sample rows appended as they come, skipped when run again


RESUME_IDENTITY = ("model", "tokenizer", "depths", "seed", "max_gen_toks", "api", "dense_topk_blocks",
                   "dense_via", "docs_version", "questions", "launch_args")
ADOPTED_IF_MISSING = ("launch_args",)  # recorded since 2026-12-03: a run.json without it takes the current one


def _format_identity(args, tokenizer: str, fmt: str, dense_topk) -> dict:
    """The ``RESUME_IDENTITY`` settings of ``fmt``'s samples in this run (``--questions`` 1 and ``--dense-via topk``
    saved as None, so runs from before those options still match)."""
    return {"model": args.model, "tokenizer": tokenizer, "depths": args.depths, "seed": args.seed,
            "max_gen_toks": args.max_gen_toks, "api": args.api,
            "dense_topk_blocks": dense_topk if is_dense(fmt) else None,
            "dense_via": args.dense_via if is_dense(fmt) and args.dense_via != "topk" else None,
            "docs_version": retrieval.DOCS_VERSION, "questions": None if args.questions == 1 else args.questions}


def write_atomic(path: Path, data: str | bytes) -> None:
    """``path`` holds ``data`` (text is written as UTF-8) or what it held before, never a part: a run killed at its
    budget's end (SIGTERM) may be killed in a write, and an emptied run.json or rates.json would stop every later
    ``--resume``; a landing cut short must leave files the next one can read."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class SampleLog:
    """``samples/<fmt>/<task>.jsonl`` of a resumable run: rows appended after each evaluated piece,
    read back by ``doc_id`` (the last row of an id wins). ``samples/<fmt>/run.json`` holds the settings
    that define the prompts and the server (``RESUME_IDENTITY``); a run with other ones raises
    ValueError. A line cut short by a killed write is dropped when the file is next opened."""

    def __init__(self, out: Path, fmt: str, identity: dict):
        self.folder = out / "samples" / fmt
        self.folder.mkdir(parents=True, exist_ok=True)
        meta = self.folder / "run.json"
        if meta.is_file():
            saved = json.loads(meta.read_text())
            adopted = [k for k in ADOPTED_IF_MISSING if k not in saved]
            differ = [k for k in RESUME_IDENTITY if k not in adopted and saved.get(k) != identity.get(k)]
            if differ:
                raise ValueError(f"{self.folder} was run with other {differ} ({[saved.get(k) for k in differ]} "
                                 f"against {[identity.get(k) for k in differ]}); use another --out")
            if adopted:
                write_atomic(meta, json.dumps({**saved, **{k: identity.get(k) for k in adopted}}))
        else:
            write_atomic(meta, json.dumps({k: identity.get(k) for k in RESUME_IDENTITY}))
        self.rows: dict[str, dict] = {}
        for path in sorted(self.folder.glob("*.jsonl")):
            self.rows[path.stem] = self._read(path)

    @staticmethod
    def _read(path: Path) -> dict:
        text = path.read_text()
        if text and not text.endswith("\n"):  # a torn last line: cut it off
            text = text[: text.rfind("\n") + 1]
            write_atomic(path, text)
        rows = {}
        for line in text.splitlines():
            row = json.loads(line)
            rows[row["doc_id"]] = row
        return rows

    def done(self, task: str) -> set:
        return set(self.rows.get(task, {}))

    def append(self, task: str, rows: list[dict]) -> None:
        with (self.folder / f"{task}.jsonl").open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())
        self.rows.setdefault(task, {}).update((r["doc_id"], r) for r in rows)

    def select(self, tasks, lengths, n: int | None = None) -> dict:
        """``{task: rows}`` of ``tasks`` at ``lengths`` (samples ``< n`` if given), by length then sample."""
        out = {}
        for task in tasks:
            keep = []
            for row in self.rows.get(task, {}).values():
                length, _, sample = str(row["doc_id"]).partition("/")
                if row["length"] in lengths and (n is None or int(sample) < n):
                    keep.append(row)
            out[task] = sorted(keep, key=lambda r: (r["length"], int(str(r["doc_id"]).partition("/")[2])))
        return out


def plan_rounds(tasks, lengths, n: int, chunk: int, done: dict) -> list[list[tuple]]:
    """What is left of ``n`` samples per (task, length), in rounds: round ``r`` holds samples
    ``[r * chunk, (r + 1) * chunk)`` of every (task, length) not in ``done[task]`` (doc ids). A round is
    a list of pieces ``(tasks, lengths, sample_ids)``, one lm-eval call each: cells missing the same
    samples at the same lengths share one."""
    rounds = []
    for r0 in range(0, n, chunk):
        ids = range(r0, min(n, r0 + chunk))
        by_missing: dict[tuple, list] = {}
        for length in lengths:
            for task in tasks:
                missing = tuple(i for i in ids if f"{length}/{i}" not in done.get(task, set()))
                if missing:
                    by_missing.setdefault(missing, []).append((task, length))
        pieces = []
        for missing, cells in by_missing.items():
            by_lengths: dict[tuple, list] = {}
            for task in dict.fromkeys(t for t, _ in cells):
                by_lengths.setdefault(tuple(sorted(L for t, L in cells if t == task)), []).append(task)
            pieces += [(tuple(ts), ls, missing) for ls, ts in by_lengths.items()]
        if pieces:
            rounds.append(pieces)
    return rounds


def round_tokens(pieces) -> int:
    """Context tokens a round asks for (the measure its time is predicted by)."""
    return sum(len(ts) * sum(ls) * len(ids) for ts, ls, ids in pieces)


def round_prompts(pieces) -> int:
    """Prompts a round asks for."""
    return sum(len(ts) * len(ls) * len(ids) for ts, ls, ids in pieces)


def parse_format_samples(values: list[str] | None, formats: list[str], default: int) -> dict[str, int]:
    """``{fmt: samples per (task, length)}``: ``default``, or ``fmt=N`` from ``--format-samples``."""
    out = dict.fromkeys(formats, default)
    for value in values or []:
        fmt, sep, n = value.partition("=")
        if not sep or not n.strip().isdigit() or int(n) < 1:
            raise ValueError(f"--format-samples entries are fmt=N with N >= 1, got {value!r}")
        fmt = parse_variant(fmt, "--format-samples format")
        if fmt not in formats:
            raise ValueError(f"--format-samples names {fmt}, which is not among --formats {formats}")
        out[fmt] = int(n)
    return out


def _run_resumable(args, formats, launch_args, urls, dense, tokenizer, targets, identity, servers) -> tuple:
    """Serve each format's missing samples in rounds until done or out of ``--budget-s``; returns
    ``({fmt: SampleLog}, {fmt: error})`` (a format that fails is reported and the next one served).
    With a budget, each format not yet complete gets an equal share of what is left when its turn
    comes (a format that finishes early leaves its time to the next); a share below
    ``--min-format-s`` is not served this time; a round is started only if its predicted time (from
    the last rounds' seconds per context token, kept in ``<out>/rates.json`` across runs) fits the
    share, or, for a server's first round, the whole budget (its start-up is paid by then).
    ``--max-formats N`` serves only the N formats furthest from their targets (fraction of samples
    done; ties in ``--formats`` order), so that every format progresses at the same relative pace over
    many short runs. Each round's prompts are built ahead in a child process (``DocPrefetch``; off with
    ``--no-prefetch``)."""
    lengths = sorted(args.lengths)
    deadline = None if args.budget_s is None else time.time() + args.budget_s
    logs = {fmt: SampleLog(args.out, fmt, identity(fmt)) for fmt in formats}
    plans = {fmt: plan_rounds(args.tasks, lengths, targets[fmt], args.chunk,
                              {t: logs[fmt].done(t) for t in args.tasks}) for fmt in formats}
    rates_path = args.out / "rates.json"  # seconds per context token, per format and "any", kept across runs
    rate: dict[str, float] = json.loads(rates_path.read_text()) if rates_path.is_file() else {}
    errors: dict[str, str] = {}
    todo = [f for f in formats if plans[f]]
    if args.max_formats is not None and len(todo) > args.max_formats:
        cells = len(args.tasks) * len(lengths)
        done = {f: sum(len(log_rows) for log_rows in logs[f].select(args.tasks, lengths, targets[f]).values())
                / (cells * targets[f]) for f in todo}
        chosen = set(sorted(todo, key=lambda f: (done[f], formats.index(f)))[: args.max_formats])
        for f in todo:
            if f not in chosen:
                print(f"[resume] {f}: {100 * done[f]:.0f}% done, further along than the {args.max_formats} served "
                      "this time (--max-formats)", flush=True)
        plans = {f: (plans[f] if f in chosen else []) for f in formats}
    prefetch = (DocPrefetch(tokenizer, args.seed, args.depths, args.questions)
                if args.prefetch and any(plans.values()) else None)
    try:
        for k, fmt in enumerate(formats):
            if not plans[fmt]:
                if fmt not in todo:
                    print(f"[resume] {fmt}: all {targets[fmt]} samples per task and length done", flush=True)
                continue
            share_end = None
            if deadline is not None:
                waiting = sum(1 for f in formats[k:] if plans[f])
                share = (deadline - time.time()) / waiting
                if share < args.min_format_s:
                    print(f"[resume] {fmt}: {share:.0f} s left for it (< --min-format-s {args.min_format_s:g}): "
                          "not served this time", flush=True)
                    continue
                share_end = time.time() + share
            left = sum(round_prompts(rnd) for rnd in plans[fmt])
            print(f"[resume] {fmt}: {left} prompts to go in {len(plans[fmt])} rounds"
                  + ("" if share_end is None else f", {share_end - time.time():.0f} s for it"), flush=True)

            def serve(base_url, fmt=fmt, share_end=share_end):
                model_id, context = served_model(base_url)
                if context is not None and max(lengths) > int(context):
                    raise ValueError(f"--lengths {max(lengths)} exceeds the served context "
                                     f"(max_model_len {context})")
                served = 0
                for r, pieces in enumerate(plans[fmt]):
                    est = round_tokens(pieces) * rate.get(fmt, rate.get("any", 0.0))
                    # The server's start is paid: its first round may use the whole budget, later ones its
                    # share.
                    limit, what = (share_end, "its share") if r else (deadline, "the budget")
                    if limit is not None and time.time() + est > limit:
                        print(f"[resume] {fmt}: next round predicted at {est:.0f} s, past {what}: stopping",
                              flush=True)
                        break
                    t0 = time.time()
                    if prefetch is not None:  # this round's prompts, built during the last one; the next round's
                        prefetch.collect(pieces)
                        if r + 1 < len(plans[fmt]):
                            prefetch.submit(plans[fmt][r + 1])
                    for ts, ls, ids in pieces:
                        rows = run_lm_eval(base_url, model_id, tokenizer, list(ts), list(ls), args,
                                           sample_ids=ids)
                        for task, task_rows in rows.items():
                            logs[fmt].append(task, task_rows)
                            served += len(task_rows)
                    spent = time.time() - t0
                    rate[fmt] = rate["any"] = spent / max(1, round_tokens(pieces))
                    write_atomic(rates_path, json.dumps(rate))
                    print(f"[resume] {fmt}: round of {round_prompts(pieces)} prompts in {spent:.1f} s "
                          f"({served} this time)", flush=True)
                return served

            if prefetch is not None and fmt not in urls:  # the first round's prompts, built while the server starts
                prefetch.submit(plans[fmt][0])
            try:
                if fmt in urls:
                    write_server(args.out, fmt, servers.get(fmt))
                    serve(urls[fmt])
                else:
                    launch = format_launch_args(fmt, launch_args, **(dense if is_dense(fmt) else {}))
                    server = SGLangServer(args.model, launch, args.out / f"server-{fmt}.log",
                                          timeout_s=args.launch_timeout)
                    with server:
                        verify_started(fmt, server.base_url, servers, _dense_blocks(args), args.lengths)
                        write_server(args.out, fmt, servers[fmt])
                        serve(server.base_url)
            except Exception as e:  # one format's failure (a server that does not start, requests that fail) is
                errors[fmt] = f"{type(e).__name__}: {e}"  # reported; the other formats still run
                print(f"[resume] {fmt} failed: {errors[fmt]}", flush=True)
    finally:
        if prefetch is not None:
            prefetch.close()
    return logs, errors


def coverage(logs: dict, tasks, lengths, targets: dict) -> dict:
    """``{fmt: {task: {length: [done, target]}}}`` of a resumable run."""
    out = {}
    for fmt, log in logs.items():
        rows = log.select(tasks, lengths, targets[fmt])
        out[fmt] = {t: {str(L): [sum(1 for r in rows[t] if r["length"] == L), targets[fmt]] for L in lengths}
                    for t in tasks}
    return out


# ---------------------------------------------------------------------------------------------
# CLI


def _parse_base_urls(values: list[str] | None, formats: list[str]) -> dict[str, str]:
    """``{label: URL}`` of ``--base-url`` (``formats``: the parsed ``--formats``, empty when not given)."""
    if not values:
        return {}
    if len(values) == 1 and "=" not in values[0]:
        if len(formats) != 1:
            raise ValueError(f"--base-url without fmt= names one deployment; give it a label (fmt=URL) or --formats "
                             f"one format, got --formats {formats or 'not given'}")
        return {formats[0]: values[0]}
    urls = {}
    for value in values:
        fmt, sep, url = value.partition("=")
        if not sep:
            raise ValueError(f"--base-url entries must be fmt=URL when there are several, got {value!r}")
        fmt = parse_variant(fmt, "--base-url format")
        if fmt in urls:
            raise ValueError(f"--base-url names {fmt} twice ({urls[fmt]!r} and {url!r}); give one URL per format")
        urls[fmt] = url
    return urls


def _same_model(a: str, b: str) -> bool:
    """Whether two model paths or hub ids name one model (local folders compared by their real paths)."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def model_of_servers(model: str | None, servers: dict) -> str:
    """The model a ``--base-url`` run compares: ``model`` (``--model``) when every sglang-m3 arm serves it, else
    what they serve when ``model`` is None (SGLang's own M3 arms count only when there is no other);
    DeploymentError naming both when an arm serves another."""
    ours = {label: i for label, i in servers.items() if i is not None and not is_upstream(label)}
    arms = ours or {label: i for label, i in servers.items() if i is not None}
    if model is None:
        if not arms:  # --reuse of runs that kept no server.json
            raise ValueError("--model is needed: no server of this run said what it serves")
        return next(iter(arms.values()))["model_path"]
    for label, identity in arms.items():
        if not _same_model(model, str(identity["model_path"])):
            raise DeploymentError(f"--model {model} but --base-url {label}={identity['url']} serves "
                                  f"{identity['model_path']!r}: drop --model or name the served one")
    return model


def check_model(model: str) -> None:
    """ValueError, before a server is started, for a ``--model`` that is neither a local model folder (one holding
    ``config.json``) nor a hub id whose config is in the Hugging Face cache or on the hub (asked through
    ``huggingface_hub`` for up to ``HUB_TIMEOUT_S``, with the user's token)."""
    from sglang_m3.scope import model_config_dict

    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {model}: the folder holds no config.json (a model folder or hub id is needed)")
        return
    if model_config_dict(model) is not None:
        return
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ValueError(f"--model {model}: no such model folder (and not a hub id of the form org/name)")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        reason = "HF_HUB_OFFLINE is set"
    else:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

        try:
            HfApi().model_info(model, timeout=HUB_TIMEOUT_S)  # the user's token, if any, as SGLang's download
            return
        except GatedRepoError:  # there, behind an access request: SGLang's download says what it needs
            return
        except RepositoryNotFoundError:
            reason = "the hub has no such model (or it is private and no token can read it)"
        except Exception as e:  # no answer: connection refused, a timeout, a proxy's error page
            reason = f"the hub does not answer ({type(e).__name__})"
    raise ValueError(f"--model {model}: no such model folder, not in the Hugging Face cache, and {reason}")


HUB_TIMEOUT_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="m3-accuracy", description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- go to `python -m sglang.launch_server` unchanged "
                                       "(e.g. -- --tp 8).")
    p.add_argument("--model", default=None,
                   help="model path or hub id given to --model-path; with --base-url, checked against what the "
                        "servers serve (default: what they serve)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path or id (default: --model)")
    p.add_argument("--formats", nargs="+", default=None,
                   help="index-K formats (bf16 fp8 mxfp4 mxfp4_rot) and/or dense, the dense-attention control "
                        f"(see --dense-via) (default: the --base-url labels, else {' '.join(DEFAULT_FORMATS)})")
    p.add_argument("--dense-via", choices=DENSE_VIA, default="layers",
                   help="how dense is served: layers = every layer dense (SGLang's attention backend, no selection); "
                        "topk = the sparse path with top-k = every block of the longest request (needs --lengths; "
                        "slow prefill at long context)")
    p.add_argument("--baseline", default=None,
                   help="format the paired statistics compare against (default: fp8 if run, else the first format)")
    p.add_argument("--base-url", nargs="+", default=None,
                   help="running deployments instead of starting servers: fmt=URL per format (or one URL for one "
                        "format); upstream-bf16=URL / upstream-fp8=URL: a server of SGLang's own MiniMax-M3 path")
    p.add_argument("--tasks", nargs="+", default=[*LONG_TASKS, *SHORT_TASKS])
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="context lengths in tokens (default: powers of two from 1024 to the served context)")
    p.add_argument("--samples", type=int, default=20, help="needle samples per length")
    p.add_argument("--depths", type=int, default=10, help="needle depths spread evenly over 0..100%%")
    p.add_argument("--questions", type=int, default=1,
                   help="questions per context, for the tasks that take several (m3_niah_multikey up to 4, m3_kv 4, "
                        "m3_kv_64 16; the others 1): a server's prefix cache prefills each context once, and the "
                        "paired intervals treat a context's questions as one cluster (Rao-Scott)"),
    p.add_argument("--limit", type=int, default=None, help="lm-eval --limit (samples per task, for smoke runs)")
    p.add_argument("--max-gen-toks", type=int, default=None,
                   help="cap on generated tokens for every task (default: each task's own: 24 needle, 16 arithmetic)")
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--concurrency", type=int, default=8, help="parallel requests")
    p.add_argument("--request-timeout", type=int, default=1800)
    p.add_argument("--launch-timeout", type=float, default=1800.0)
    p.add_argument("--bootstrap", type=int, default=10000,
                   help="paired-bootstrap resamples (used only for tasks whose scores are not all 0/1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/accuracy"))
    p.add_argument("--served-on", default=None, metavar="LABEL",
                   help="where this run's servers run (say, the GPU's name): stamped on every sample row as served_on, "
                        "so that the report can count pairs whose two answers came from different machines")
    p.add_argument("--reuse", action="store_true",
                   help="load formats already evaluated into --out/samples (same settings) instead of running them "
                        "again: one format per call, then all of them for the report")
    g = p.add_argument_group("resumable runs (long-context tasks only; needs --lengths)")
    g.add_argument("--resume", action="store_true",
                   help="append each sample's row to --out/samples/<fmt>/<task>.jsonl as soon as its round is done and "
                        "skip the samples already there: run the same command again to continue")
    g.add_argument("--format-samples", nargs="+", default=None, metavar="FMT=N",
                   help="samples per (task, length) for some formats (the others take --samples), e.g. dense=100")
    g.add_argument("--chunk", type=int, default=8,
                   help="samples per (task, length) in one round (one lm-eval call for all tasks and lengths)")
    g.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget: no round is started that is predicted to end past it (each format not yet "
                        "done gets an equal share of what is left); the report is written either way")
    g.add_argument("--min-format-s", type=float, default=60.0,
                   help="a format whose share of --budget-s is below this is not served this time")
    g.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="build each round's prompts in turn instead of in a child process during the round before "
                        "(and during the server's start)")
    g.add_argument("--max-formats", type=int, default=None,
                   help="serve at most this many formats this time: those furthest from their targets (fraction "
                        "done), so that short runs spread the formats' server starts")
    return p


def _check_counts(args) -> None:
    """ValueError for counts that would only fail after the servers ran (or, for --bootstrap, after
    every format was evaluated)."""
    for flag, value in (("--samples", args.samples), ("--depths", args.depths), ("--bootstrap", args.bootstrap),
                        ("--questions", args.questions),
                        ("--concurrency", args.concurrency), ("--limit", args.limit),
                        ("--max-gen-toks", args.max_gen_toks), ("--chunk", args.chunk),
                        ("--max-formats", args.max_formats)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    short = [n for n in args.lengths or [] if n <= GEN_TOKENS]
    if short:
        raise ValueError(f"--lengths must exceed the {GEN_TOKENS} generated tokens of a needle sample, got {short}")
    if args.resume:
        if args.reuse or args.limit is not None:
            raise ValueError("--resume skips what is done by itself: drop --reuse and --limit")
        if not args.lengths:
            raise ValueError("--resume needs --lengths")
        if any(t not in LONG_TASKS for t in args.tasks):
            raise ValueError(f"--resume runs the long-context tasks {list(LONG_TASKS)} only, got --tasks {args.tasks}")
        if args.budget_s is not None and args.budget_s < 0:
            raise ValueError(f"--budget-s must be >= 0, got {args.budget_s}")
    elif args.budget_s is not None or args.format_samples or args.max_formats is not None:
        raise ValueError("--budget-s, --format-samples and --max-formats need --resume")


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit in the main thread, so that servers started here are stopped on the
    way out (they run in process groups of their own, which a ``timeout`` around us does not reach)."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


USER_ERRORS = (ValueError, NotImplementedError)  # a caller's mistake or an unsupported combination


def _out_of(argv) -> Path | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = argv[: argv.index("--")] if "--" in argv else argv
    for i, a in enumerate(argv):
        if a == "--out" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if a.startswith("--out="):
            return Path(a.split("=", 1)[1])
    return build_parser().get_default("out")


def _remove_if_empty(folder: Path) -> None:
    """Remove ``folder`` and its empty subfolders if no file is left in it."""
    if not folder.is_dir() or any(p.is_file() for p in folder.rglob("*")):
        return
    for sub in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        sub.rmdir()
    folder.rmdir()


def main(argv=None) -> None:
    """Console entry point (``m3-accuracy``): a caller's mistake ends in one ``m3-accuracy: error:`` line (exit
    status 2, no traceback), and an ``--out`` folder this call made is not left behind empty."""
    exit_on_sigterm()
    out = _out_of(argv)
    existed = out is not None and out.exists()
    try:
        compare_formats(argv)
    except USER_ERRORS as e:
        if out is not None and not existed:
            _remove_if_empty(out)
        print(f"m3-accuracy: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def compare_formats(argv=None) -> dict:
    """Run the comparison for command-line ``argv``; returns the summary written to results.json."""
    retrieval.register_m3_config()  # lm-eval loads the model folder's tokenizer in this process
    args, formats, launch_args = parse_command_line(build_parser(), argv)
    _check_counts(args)
    urls = _parse_base_urls(args.base_url, formats)
    formats = formats or list(urls) or list(DEFAULT_FORMATS)
    baseline = resolve_baseline(args.baseline, formats)
    if urls and set(urls) != set(formats):
        raise ValueError(f"--base-url names formats {sorted(urls)} but --formats is {formats}")
    started = [f for f in formats if f not in urls]
    if any(is_upstream(f) for f in started):
        f = next(f for f in started if is_upstream(f))
        raise ValueError(f"--formats {f}: SGLang's own MiniMax-M3 path is compared as a running server: pass it "
                         f"with --base-url {f}=URL")
    if started and args.model is None:
        raise ValueError(f"--model is needed to start the servers of {started} (or pass --base-url for each)")
    unknown = [t for t in args.tasks if t not in (*LONG_TASKS, *SHORT_TASKS)]
    if unknown:
        raise ValueError(f"--tasks must be among {[*LONG_TASKS, *SHORT_TASKS]}, got {unknown}")
    owned = [a for a in launch_args if a.split("=")[0] in RUNNER_OWNED_FLAGS]
    if owned:
        raise ValueError(f"launch arguments {owned} are set by the runner (one free local port per server); "
                         "drop them, or start the servers yourself and pass --base-url")
    dense = {}
    if any(is_dense(f) and f not in urls for f in formats):
        if args.dense_via == "topk" and not args.lengths:
            raise ValueError("--formats dense with --dense-via topk needs --lengths (its top-k covers the longest "
                             "evaluated context)")
        dense = {"sparse_config": model_sparse_config(args.model), "via": args.dense_via}
        if args.dense_via == "topk":
            dense["max_tokens"] = dense_max_tokens(args.lengths, args.max_gen_toks)
    targets = parse_format_samples(args.format_samples, formats, args.samples)
    # --reuse: formats evaluated in an earlier call keep what their server said then (samples/<fmt>/server.json)
    earlier = {f: read_server(args.out, f) for f in formats
               if args.reuse and (args.out / "samples" / f / "run.json").is_file()}
    urls_now = {f: u for f, u in urls.items() if f not in earlier}
    if any(f not in earlier for f in started):
        check_model(args.model)
    servers = {**earlier, **verify_base_urls(urls_now, args.lengths, args.max_gen_toks, earlier)} if urls else {}
    if urls:
        args.model = model_of_servers(args.model, {f: servers.get(f) for f in urls})
    tokenizer = args.tokenizer or args.model
    args.out.mkdir(parents=True, exist_ok=True)
    dense_topk = dense_sparse_config(**dense)["sparse_topk_blocks"] if dense and dense["via"] == "topk" else None
    if args.resume:
        return _compare_resumable(args, formats, launch_args, urls, dense, tokenizer, targets, baseline, dense_topk,
                                  servers)

    resumable = [f for f in formats if _holds_resumable_samples(args.out, f)]
    if resumable:  # a plain run rewrites samples/<fmt>/ whole: it would drop every row those runs kept
        raise ValueError(f"--out {args.out} holds the samples of a --resume run for {resumable}; add --resume to "
                         "go on with it, or pass another --out")
    from tqdm import tqdm

    per_format, lengths = {}, args.lengths
    for fmt in tqdm(formats, desc="formats", unit="fmt"):
        settings = {**_format_identity(args, tokenizer, fmt, dense_topk), "tasks": args.tasks, "lengths": lengths,
                    "samples": args.samples, "limit": args.limit}
        saved = read_samples(args.out, fmt, settings) if args.reuse else None
        if saved is not None:
            per_format[fmt], lengths = saved
            servers.setdefault(fmt, read_server(args.out, fmt))
            continue
        if fmt in urls:
            per_format[fmt], lengths = _evaluate(urls[fmt], tokenizer, lengths, args)
        else:
            server = SGLangServer(args.model, format_launch_args(fmt, launch_args, **(dense if is_dense(fmt) else {})),
                                  args.out / f"server-{fmt}.log", timeout_s=args.launch_timeout)
            with server:
                verify_started(fmt, server.base_url, servers, _dense_blocks(args), args.lengths)
                per_format[fmt], lengths = _evaluate(server.base_url, tokenizer, lengths, args)
        write_samples(args.out, fmt, per_format[fmt], {**settings, "lengths": lengths})
        write_server(args.out, fmt, servers.get(fmt))
    summary = report.build(per_format, formats, n_boot=args.bootstrap, seed=args.seed, baseline=baseline)
    replicas = replicas_of(formats, baseline)
    if replicas:
        summary["replicas"] = report.build_replicas(per_format, replicas, n_boot=args.bootstrap, seed=args.seed)
    summary["run"] = {"model": args.model, "formats": formats, "baseline": baseline, "tasks": args.tasks,
                      "lengths": lengths, "samples": args.samples, "depths": args.depths, "questions": args.questions,
                      "limit": args.limit, "api": args.api, "launch_args": launch_args, "dense_topk_blocks": dense_topk,
                      "dense_via": dense.get("via")}
    summary["servers"] = {f: servers.get(f) for f in formats}
    return _write_report(args.out, summary)


def _write_report(out: Path, summary: dict) -> dict:
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    (out / "report.md").write_text(report.markdown(summary))
    report.plot(summary, out / "accuracy_vs_length.png")
    print(report.markdown(summary))
    print(f"wrote {out}/report.md, results.json, accuracy_vs_length.png and samples/")
    return summary


def _compare_resumable(args, formats, launch_args, urls, dense, tokenizer, targets, baseline, dense_topk,
                       servers) -> dict:
    """``--resume``: serve what is missing (``_run_resumable``), then report every candidate against the
    baseline on the samples both have (``report.build_pairs``)."""
    def identity(fmt):  # the server's arguments too: a pair must not mix, say, two attention backends
        served = None if fmt in urls else launch_args
        return {**_format_identity(args, tokenizer, fmt, dense_topk), "launch_args": served}

    t0 = time.time()
    logs, errors = _run_resumable(args, formats, launch_args, urls, dense, tokenizer, targets, identity, servers)
    lengths = sorted(args.lengths)
    per_format = {fmt: log.select(args.tasks, lengths, targets[fmt]) for fmt, log in logs.items()}
    summary = report.build_pairs(per_format, formats, n_boot=args.bootstrap, seed=args.seed, baseline=baseline,
                                 replicas=replicas_of(formats, baseline))
    summary["coverage"] = coverage(logs, args.tasks, lengths, targets)
    summary["errors"] = errors
    summary["run"] = {"model": args.model, "formats": formats, "baseline": baseline, "tasks": args.tasks,
                      "lengths": lengths, "samples": targets, "depths": args.depths, "questions": args.questions,
                      "api": args.api, "launch_args": launch_args, "dense_topk_blocks": dense_topk,
                      "dense_via": dense.get("via"), "chunk": args.chunk,
                      "budget_s": args.budget_s, "seconds": round(time.time() - t0, 1), "resume": True}
    summary["servers"] = {f: servers.get(f) or read_server(args.out, f) for f in formats}
    return _write_report(args.out, summary)


def _evaluate(base_url, tokenizer, lengths, args):
    """``(rows, lengths)`` of one server; ``lengths`` default to ``default_lengths`` of its context,
    and given ones must fit it (ValueError before any request)."""
    model_id, context = served_model(base_url)
    if lengths is None:
        if context is None:
            raise ValueError("the server does not report max_model_len; pass --lengths")
        lengths = default_lengths(int(context))
    elif context is not None and max(lengths) > int(context):
        raise ValueError(f"--lengths {max(lengths)} exceeds the served context (max_model_len {context}) "
                         f"of {base_url}; drop it or raise the server's --context-length")
    return run_lm_eval(base_url, model_id, tokenizer, args.tasks, sorted(lengths), args), lengths


if __name__ == "__main__":
    main()
