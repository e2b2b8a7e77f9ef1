"""The trained models' chat template (configs/msa-small, configs/msa-medium): they are completion models trained
on raw text, so a chat prompt is its messages' contents in order with nothing added, and ``/v1/chat/completions``
sends the model exactly what ``/v1/completions`` sends for that text (``m3-accuracy --api chat`` and lm-eval's
``local-chat-completions`` then score the same prompts)."""

import json
import shlex
import urllib.request
from pathlib import Path

import pytest

from sglang_m3.server import LAUNCHER, Server

ROOT = Path(__file__).resolve().parents[2]
TRAINED = [ROOT / "configs" / "msa-small", ROOT / "configs" / "msa-medium"]
# README.md's CPU launch line, served below as written (tests/test_docs.py checks that the README shows this line).
README_CPU_LAUNCH = ("python -m sglang.launch_server --model-path configs/msa-small --device cpu "
                     "--attention-backend torch_native --max-total-tokens 16384")
PROMPT = ("The special number for \"copper kettle\" is 4817.\n\nQuestion: what is the special number for "
          "\"copper kettle\" in the chronicle above?\nAnswer:")


@pytest.mark.parametrize("model", TRAINED, ids=lambda p: p.name)
def test_a_chat_prompt_is_its_messages_text(model):
    from transformers import AutoTokenizer

    from accuracy import retrieval

    retrieval.register_m3_config()
    tok = AutoTokenizer.from_pretrained(str(model))
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(ids) == tok(PROMPT).input_ids
    two = [{"role": "system", "content": "A: "}, {"role": "user", "content": PROMPT}]
    assert tok.apply_chat_template(two, tokenize=False, add_generation_prompt=True) == "A: " + PROMPT


def _post(url: str, path: str, payload: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chat_completions_serve_the_completion_prompt(tmp_path):
    python, m, launcher, model_flag, model, *args = shlex.split(README_CPU_LAUNCH)
    assert (python, m, launcher, model_flag) == ("python", "-m", LAUNCHER, "--model-path")
    with Server(model, args, tmp_path / "server.log", cwd=ROOT) as s:  # the README's line, from the repository root
        greedy = {"model": "default", "max_tokens": 8, "temperature": 0}
        chat = _post(s.url, "/v1/chat/completions", {**greedy, "messages": [{"role": "user", "content": PROMPT}]})
        plain = _post(s.url, "/v1/completions", {**greedy, "prompt": PROMPT})
    assert chat["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
