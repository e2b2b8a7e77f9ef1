"""Helpers of the accuracy tests: an oracle that answers a long-context prompt by reading it, and a
stand-in OpenAI-completions server that answers with that oracle (for runner tests without SGLang)."""

import json
import re
from pathlib import Path
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class NoAnswer(ValueError):
    """The prompt does not determine one answer."""


def _context_and_question(prompt: str) -> tuple[str, str]:
    head, sep, rest = prompt.partition("\n\n")
    context, sep2, question = rest.rpartition("\n\nQuestion: ")
    if not sep or not sep2:
        raise NoAnswer("not a long-context prompt (no context or question)")
    return context, question


def _one(found: list, what: str):
    if len(found) != 1:
        raise NoAnswer(f"{len(found)} candidates for {what}")
    return found[0]


def oracle(prompt: str) -> str:
    """The answer a reader of ``prompt`` gives, as the task's ``target`` (digits, or names joined by
    ", "), found from the prompt's text alone; NoAnswer when the prompt does not determine one."""
    context, question = _context_and_question(prompt)
    m = re.match(r'what is the special number for "([^"]+)" in the chronicle above\?', question)
    if m:
        key = re.escape(m.group(1))
        return _one(re.findall(rf'The special number for "{key}" is (\d+)\.', context), f"needle {m.group(1)}")
    m = re.match(r'what is the value of "([^"]+)" in the chronicle above\?', question)
    if m:
        key = re.escape(m.group(1))
        return _one(re.findall(rf'(?m)^"{key}": (\d+)$', context), f"key {m.group(1)}")
    values = dict(re.findall(r"\bVAR ([A-Z]+) = (\d+)\.", context))
    refs = dict(re.findall(r"\bVAR ([A-Z]+) = VAR ([A-Z]+)\.", context))
    if set(values) & set(refs):
        raise NoAnswer("a variable is assigned twice")

    def resolve(name, seen=()):
        if name in values:
            return values[name]
        if name not in refs or name in seen:
            raise NoAnswer(f"VAR {name} has no value")
        return resolve(refs[name], (*seen, name))

    m = re.match(r"what is the value of VAR ([A-Z]+) in the chronicle above\?", question)
    if m:
        return resolve(m.group(1))
    m = re.match(r"which variables are assigned the value (\d+) in the chronicle above\?", question)
    if m:
        first = _one([n for n, v in values.items() if v == m.group(1)], f"value {m.group(1)}")
        chain, nxt = [first], {ref: name for name, ref in refs.items()}
        while chain[-1] in nxt:
            chain.append(nxt[chain[-1]])
        if len([n for n in refs if resolve(n) == m.group(1)]) != len(chain) - 1:
            raise NoAnswer("the chain branches")
        return ", ".join(chain)
    raise NoAnswer(f"unknown question {question[:80]!r}")


@pytest.fixture
def read_answer():
    return oracle


INFO_PATHS = ("/server_info", "/get_server_info", "/model_info", "/get_model_info")
SERVED_MODEL = str(Path(__file__).resolve().parents[2] / "configs" / "msa-small")  # what the stand-ins serve
UPSTREAM_INFO = Path(__file__).parent / "data" / "upstream_m3_info_0.5.16.json"


class FakeCompletions:
    """An OpenAI-style completions server on a loopback port that answers every prompt with
    ``oracle``'s answer (as the trained answer text, " <answer>."), except where ``wrong(prompt)`` is
    true (then a 0 is put in front of it), each request after ``delay_s``. Keeps the prompts it was sent."""

    def __init__(self, wrong=lambda prompt: False, max_model_len: int = 200000, delay_s: float = 0.0,
                 serves: str | None = "fp8", model_path: str = SERVED_MODEL, max_req_input_len: int | None = None,
                 info_paths=INFO_PATHS, **server_info):
        """``serves``: the label whose server this stands in for (``m3_index_k`` in the server and model info: that
        format with sparse layers, ``"dense"`` bf16 with none; None no key: a server of another model;
        ``"upstream"``: SGLang's own MiniMax-M3 path, its recorded info, ``UPSTREAM_INFO``). ``info_paths``: the
        info endpoints it answers (SGLang 0.5.16-0.5.23 answer all four; the others get HTTP 404);
        ``server_info``: keys of its server info (``version``, ``kv_cache_dtype``, ...). ``model_path``: what it
        says it serves (by default configs/msa-small, whose tokenizer the runner tests load)."""
        self.prompts: list[str] = []
        outer = self
        recorded = json.loads(UPSTREAM_INFO.read_text()) if serves == "upstream" else None
        info = {**(recorded["server_info"] if recorded else {"version": "0.0-fake"}), "model_path": model_path,
                "max_req_input_len": max_req_input_len, **server_info}
        arch = "LlamaForCausalLM" if serves is None else "MiniMaxM3SparseForCausalLM"  # None: another model
        model_info = {**(recorded["model_info"] if recorded else {"architectures": [arch]}), "model_path": model_path}
        if serves not in (None, "upstream"):
            fmt = serves.partition("@")[0]
            info["m3_index_k"] = model_info["m3_index_k"] = {
                "format": "bf16" if fmt == "dense" else fmt, "scale_rule": "rceil", "sign_seed": None,
                "sparse_layers": 0 if fmt == "dense" else 3, "sparse_topk_blocks": 16, "sglang_m3_version": "0.0-fake"}
        answers = {"/server_info": info, "/get_server_info": info, "/model_info": model_info,
                   "/get_model_info": model_info}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, obj, code=200):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.startswith("/v1/models"):
                    self._send({"data": [{"id": "fake", "max_model_len": max_model_len}]})
                elif self.path in answers:
                    self._send(answers[self.path] if self.path in info_paths else {"detail": "Not Found"},
                               200 if self.path in info_paths else 404)
                else:
                    self._send({})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                time.sleep(delay_s)
                prompts = req["prompt"] if isinstance(req["prompt"], list) else [req["prompt"]]
                choices = []
                for i, prompt in enumerate(prompts):
                    outer.prompts.append(prompt)
                    try:
                        answer = oracle(prompt)
                    except NoAnswer:
                        answer = "none"
                    if wrong(prompt):
                        answer = "0" + answer  # no longer the number (or chain) asked for
                    choices.append({"index": i, "text": f" {answer}.\nQuestion:", "finish_reason": "length"})
                self._send({"id": "x", "object": "text_completion", "model": "fake", "choices": choices})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def wrong_every(k: int):
    """A deterministic ``wrong`` rule: about one prompt in ``k`` (by a checksum of its text)."""
    return lambda prompt: zlib.crc32(prompt.encode()) % k == 0


@pytest.fixture
def fake_completions():
    return FakeCompletions


@pytest.fixture
def wrong_rule():
    return wrong_every
