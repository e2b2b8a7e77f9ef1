"""End-to-end: the installed plugin serves the tiny MiniMax-M3.1 (dummy weights) on the CPU.

One MXFP4 server is shared by most tests (module scope); the format comparison starts bf16, fp8
(through ``--index-k-format``) and mxfp4_rot servers one after another. Prompts run past 16
blocks of 128 tokens, so top-16 selection drops blocks.
"""

import concurrent.futures
import random
import sys
from pathlib import Path

import pytest

from m3_kernels.formats import PAGE_SIZE as BLOCK
from m3_kernels.formats import TOPK_BLOCKS as TOPK
import prewarm
from sglang_m3.server import cpu_args, cpu_env, free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "configs" / "minimax-m3.1-tiny"

VOCAB = 2048  # configs/minimax-m3.1-tiny
FIRST_SPARSE_LAYER = 1
POOL_TOKENS = 4096  # holds one long prompt; the exhaustion test overfills it


@pytest.fixture(scope="module")
def mxfp4(server_factory):
    return server_factory("mxfp4", record=True, max_total_tokens=POOL_TOKENS).wait_ready()


def long_prompt(seed: int, length: int = 20 * BLOCK - 37) -> list[int]:
    """Random in-vocabulary token ids; the default length runs past TOPK blocks."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def _rows(records, mode=None, layer=None):
    """{(mode, layer, position): record row} over all records (later ones win)."""
    rows = {}
    for rec in records:
        if (mode and rec["mode"] != mode) or (layer is not None and rec["layer"] != layer):
            continue
        for r, pos in enumerate(rec["positions"]):
            rows[(rec["mode"], rec["layer"], pos)] = {
                "selected": [head[r] for head in rec["selected"]],
                "n_visible": rec["n_visible"][r],
                "scores": [head[r] for head in rec["scores"]] if "scores" in rec else None,
            }
    return rows


def _new_records(server, fn):
    before = len(server.records())
    result = fn()
    return result, server.records()[before:]


def test_generate_and_completions(mxfp4):
    # ignore_eos: dummy weights can draw EOS (id 2) early at the default temperature (seen once in CI)
    body = mxfp4.post("/generate", {"text": "The quick brown fox",
                                    "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
    assert body[0] == 200 and body[1]["meta_info"]["completion_tokens"] == 6, body
    status, body = mxfp4.post("/v1/completions", {"model": "default", "prompt": "Hello", "max_tokens": 5,
                                                  "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 5, body
    assert isinstance(body["choices"][0]["text"], str)


@pytest.mark.parametrize("path", ["/server_info", "/model_info", "/get_server_info", "/get_model_info"])
def test_server_info_says_which_index_k_cache_it_serves(mxfp4, path):
    """The server and model info, under SGLang's current and deprecated names, name the format the config resolves
    to (the model's config.json, no override), which SGLang's own answers do not (sglang_m3.server_info)."""
    import json
    import urllib.request

    with urllib.request.urlopen(mxfp4.url + path, timeout=60) as r:
        info = json.loads(r.read())
    assert info["model_path"].endswith("minimax-m3.1-tiny")
    index_k = info["m3_index_k"]
    assert (index_k["format"], index_k["scale_rule"], index_k["sign_seed"]) == ("mxfp4", "rceil", None)
    assert index_k["sparse_layers"] > 0 and index_k["sparse_topk_blocks"] == TOPK


def test_start_up_log_has_no_config_class_warning(mxfp4):
    """Every server process knows ``minimax_m3_1`` (the detokenizer too), so transformers never
    falls back to its base config class, which logs "... to instantiate a model of type ``"."""
    assert mxfp4.healthy()  # all processes up (the detokenizer loaded its tokenizer), their output in one log
    assert "to instantiate a model of type" not in mxfp4.log_tail(chars=1 << 24)


def test_long_prompt_selection_drops_blocks(mxfp4):
    prompt = long_prompt(seed=11)
    body, recs = _new_records(mxfp4, lambda: mxfp4.generate(prompt, max_new_tokens=3))
    rows = _rows(recs)
    sparse_rows = [v for v in rows.values() if v["n_visible"] > TOPK]
    assert sparse_rows, "no row saw more than topk blocks"
    for v in sparse_rows:
        for sel in v["selected"]:
            assert len(sel) == TOPK and -1 not in sel
            assert sel[-1] == v["n_visible"] - 1  # own block last
            assert len(set(sel)) == TOPK and max(sel) < v["n_visible"]
    # Decode rows too: the generated tokens scored the whole context.
    assert any(k[0] == "decode" and v["n_visible"] == (len(prompt) // BLOCK) + 1 for k, v in rows.items())


def test_prefix_cache_hit_matches_cold_run(mxfp4):
    prompt = long_prompt(seed=12)
    cold, cold_recs = _new_records(mxfp4, lambda: mxfp4.generate(prompt, max_new_tokens=4))
    warm, warm_recs = _new_records(mxfp4, lambda: mxfp4.generate(prompt, max_new_tokens=4))
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] >= (len(prompt) // BLOCK) * BLOCK - BLOCK
    assert warm["output_ids"] == cold["output_ids"]
    cold_rows, warm_rows = _rows(cold_recs), _rows(warm_recs)
    warm_extend = [k for k in warm_rows if k[0] == "extend"]
    assert warm_extend and min(k[2] for k in warm_extend) >= warm["meta_info"]["cached_tokens"]
    compared = 0
    for key, row in warm_rows.items():
        if key in cold_rows:
            assert row["selected"] == cold_rows[key]["selected"], key
            compared += 1
    assert compared >= len(warm_extend)


def test_concurrent_requests_complete(mxfp4):
    def one(i):
        if i % 2:
            return mxfp4.post("/v1/completions", {"model": "default", "prompt": f"request {i}", "max_tokens": 8})
        return mxfp4.post("/generate", {"input_ids": long_prompt(seed=100 + i, length=300),
                                        "sampling_params": {"max_new_tokens": 8}})

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(one, range(8)))
    assert all(status == 200 for status, _ in results), results


def test_pool_exhaustion_queues_and_keeps_serving(mxfp4):
    # Four requests need more slots than the pool holds: SGLang queues (or retracts) and finishes all.
    new_tokens = 16
    prompts = [long_prompt(seed=200 + i, length=1100) for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda p: mxfp4.post("/generate", {"input_ids": p, "sampling_params": {
            "max_new_tokens": new_tokens, "ignore_eos": True}}), prompts))
    assert sum(len(p) + new_tokens for p in prompts) > POOL_TOKENS
    for status, body in results:
        assert status == 200 and body["meta_info"]["completion_tokens"] == new_tokens, body
    # One request larger than the whole pool is refused, not fatal.
    status, body = mxfp4.post("/generate", {"input_ids": long_prompt(seed=300, length=POOL_TOKENS + 500),
                                            "sampling_params": {"max_new_tokens": 4}})
    assert status != 200 or body["meta_info"]["finish_reason"]["type"] == "abort", body
    assert mxfp4.healthy()
    assert mxfp4.generate(long_prompt(seed=301, length=200), max_new_tokens=2)["meta_info"]["completion_tokens"] == 2


def test_abort_mid_decode_keeps_serving(mxfp4):
    rid = "abort-me"
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(mxfp4.post, "/generate", {
            "rid": rid, "input_ids": long_prompt(seed=400, length=600),
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}})
        status, body = 0, None
        for _ in range(600):  # abort once the request is running
            status, _ = mxfp4.post("/abort_request", {"rid": rid})
            if pending.done():
                break
            concurrent.futures.wait([pending], timeout=1)
        status, body = pending.result(timeout=600)
    assert status != 200 or body["meta_info"]["finish_reason"]["type"] == "abort", body
    assert mxfp4.healthy()
    assert mxfp4.generate(long_prompt(seed=401, length=300), max_new_tokens=2)["meta_info"]["completion_tokens"] == 2


def test_out_of_vocabulary_ids_get_400(mxfp4):
    status, body = mxfp4.post("/generate", {"input_ids": [1000000000, -1], "sampling_params": {"max_new_tokens": 2}})
    assert status == 400, body
    message = body["error"]["message"]
    assert "1000000000" in message and "-1" in message
    status, body = mxfp4.post("/v1/completions", {"model": "default", "prompt": [5, 2048], "max_tokens": 2})
    assert status == 400 and "2048" in str(body), body
    assert mxfp4.generate([5, 6, 7], max_new_tokens=2)["meta_info"]["completion_tokens"] == 2


def _format_rows(server, prompt):
    _, recs = _new_records(server, lambda: server.generate(prompt, max_new_tokens=1))
    return _rows(recs, mode="extend", layer=FIRST_SPARSE_LAYER)


def test_formats_pick_the_same_blocks_outside_their_error(server_factory, mxfp4):
    """Layer 1 sees identical index keys before quantization under every format (layer 0 is
    dense), so its block choices may differ from bf16's only between blocks whose bf16 scores
    lie within twice the format's score error on that row."""
    prompt = long_prompt(seed=13)
    rows = {"mxfp4": _format_rows(mxfp4, prompt)}
    mxfp4.stop()  # last user of the shared server: free the cores for the others
    # The three start together (their start-ups are mostly single-threaded imports: they overlap on two cores).
    servers = {fmt: server_factory(fmt, "--index-k-format", fmt, record=True) for fmt in ("bf16", "fp8", "mxfp4_rot")}
    for fmt, server in servers.items():
        try:
            rows[fmt] = _format_rows(server.wait_ready(), prompt)
        finally:
            server.stop()
    ref = rows["bf16"]
    for fmt in ("fp8", "mxfp4", "mxfp4_rot"):
        assert rows[fmt].keys() == ref.keys()
        worst, differing = 0.0, 0
        for key, row in rows[fmt].items():
            if row["n_visible"] <= TOPK:
                assert row["selected"] == ref[key]["selected"]
                continue
            for h, (sel, sel_ref) in enumerate(zip(row["selected"], ref[key]["selected"])):
                n = row["n_visible"]  # every visible block holds a visible token: finite scores
                s, s_ref = row["scores"][h][:n], ref[key]["scores"][h][:n]
                err = max(abs(a - b) for a, b in zip(s, s_ref))
                worst = max(worst, err)
                differing += sorted(sel) != sorted(sel_ref)
                for a in set(sel) - set(sel_ref):
                    for b in set(sel_ref) - set(sel):
                        assert abs(s_ref[a] - s_ref[b]) <= 2 * err * (1 + 1e-6), (fmt, key, h, a, b)
        print(f"{fmt}: {len(ref)} rows x {len(row['selected'])} heads, {differing} (row, head) selections differ "
              f"from bf16's, worst score error {worst:.3g}")
        assert worst > 0, f"{fmt} scores equal bf16's exactly: is the format engaged?"


def _run_launcher(argv, tmp_path) -> tuple[int, str]:
    """Exit code and output of a launch that is expected to stop by itself (through the prewarmed launcher when
    the session has one, as the test servers)."""
    log_path = tmp_path / "launch.log"
    with open(log_path, "w") as log:
        proc = prewarm.start(argv, env=cpu_env(), cwd=REPO, log=log)
        code = proc.wait(timeout=600)
    return code, log_path.read_text()


def _refused_in_one_line(code: int, out: str) -> str:
    """The one ``sglang-m3: error:`` line of a launch refused as a usage error (exit 2, no traceback)."""
    assert code == 2 and "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("sglang-m3: error: "), out[-3000:]
    return errors[0]


def _model_folder(folder: Path, **changes) -> Path:
    """The tiny config's files in ``folder``, its config.json with ``changes`` (None: the key dropped)."""
    import json
    import shutil

    shutil.copytree(TINY_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        config.pop(key, None) if value is None else config.__setitem__(key, value)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _launch(model: Path, *extra: str, dummy: bool = True) -> list[str]:
    load = ["--load-format", "dummy"] if dummy else []
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), *load, *cpu_args(4096),
            *extra, "--host", "127.0.0.1", "--port", str(free_port())]


@pytest.mark.parametrize("case, said", [
    ("bad format override", "index_k_format must be one of [bf16, fp8, mxfp4, mxfp4_rot], got 'mxfp3'"),
    ("bad scale rule override", "index_k_scale_rule"),
    ("no format", "names no index_k_format: choose the index-K cache format"),
    ("format flag on llama", "--index-k-format fp8: the flag is for MiniMax-M3.1 configs"),
    ("no weights", "holds no weights (*.safetensors, *.bin, *.pt) for --load-format auto: add --load-format dummy"),
    ("float16", "dtype torch.float16: the MiniMax-M3.1 index-K cache takes bfloat16"),  # check_launch (and the config)
    ("hicache on a cpu", "--enable-hierarchical-cache with --device cpu: SGLang's HiCache K/V host pool needs CUDA"),
    ("hisparse", "enable_hisparse: the MiniMax-M3.1 index-K cache has no hierarchical sparse"),
    ("speculative", "--speculative-algorithm EAGLE: speculative decoding is not supported"),
])
def test_a_bad_launch_is_refused_in_one_line_before_any_process_starts(tmp_path, case, said):
    argv = {
        "bad format override": lambda: _launch(TINY_MODEL, "--json-model-override-args", '{"index_k_format": "mxfp3"}'),
        "bad scale rule override": lambda: _launch(TINY_MODEL, "--json-model-override-args",
                                                   '{"index_k_scale_rule": "up"}'),
        "no format": lambda: _launch(_model_folder(tmp_path / "m", index_k_format=None)),
        "format flag on llama": lambda: _launch(_model_folder(tmp_path / "m", model_type="llama",
                                                              architectures=["LlamaForCausalLM"]),
                                                "--index-k-format", "fp8"),
        "no weights": lambda: _launch(TINY_MODEL, dummy=False),
        "float16": lambda: _launch(TINY_MODEL, "--dtype", "float16"),
        "hicache on a cpu": lambda: _launch(TINY_MODEL, "--enable-hierarchical-cache"),
        "hisparse": lambda: _launch(TINY_MODEL, "--enable-hisparse"),
        "speculative": lambda: _launch(TINY_MODEL, "--speculative-algorithm", "EAGLE"),
    }[case]()
    code, out = _run_launcher(argv, tmp_path)
    line = _refused_in_one_line(code, out)
    assert said in line, line
    assert "Scheduler" not in out and "Cannot find any model weights" not in out


def test_unknown_format_flag_names_the_choices(launch_command, tmp_path):
    code, out = _run_launcher(launch_command(free_port(), "--index-k-format", "int4"), tmp_path)
    assert code == 2
    assert "bf16" in out and "mxfp4_rot" in out and "int4" in out, out[-2000:]
