"""The task folder through the stock ``lm_eval`` command line (accuracy/tasks/README.md's command) against a
CPU SGLang server of the tiny MiniMax-M3.1 config: lm-eval's default ``max_length`` (2048) would cut a 4k
prompt from the left; the task refuses that loudly, and with the ``max_length`` the README gives the server
receives every prompt token."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from accuracy import retrieval
from sglang_m3.server import Server, cpu_args

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "minimax-m3.1-tiny"
LENGTH = 4096
TASK = "m3_niah_single"


def _lm_eval(url: str, *model_args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    args = ",".join([f"base_url={url}/v1/completions", f"model={TINY}", f"tokenizer={TINY}",
                     "tokenizer_backend=huggingface", *model_args])
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
           "--tasks", TASK, "--include_path", str(ROOT / "accuracy" / "tasks"), "--limit", "1",
           "--metadata", json.dumps({"max_seq_lengths": [LENGTH], "num_samples": 1, "num_depths": 1})]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _prompt_tokens(log: str) -> int | None:
    """Tokens of the first prompt the server prefilled: its first ``Prefill batch`` line's new, cached and pending
    tokens (a long prompt is prefilled in chunks; the first line counts what the later ones will take as pending);
    None before any."""
    m = re.search(r"Prefill batch.*?#new-token: (\d+), #cached-token: (\d+),.*?#pending-token: (\d+)", log)
    return None if m is None else sum(map(int, m.groups()))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stock_lm_eval_never_sends_a_cut_prompt(tmp_path):
    from transformers import AutoTokenizer

    retrieval.register_m3_config()
    doc = retrieval.docs(TASK, str(TINY), [LENGTH], [0], 0, 1, 1)[0]
    tokens = len(AutoTokenizer.from_pretrained(str(TINY))(doc["input"], add_special_tokens=False).input_ids)
    assert 2048 < tokens <= LENGTH

    args = ["--load-format", "dummy", *cpu_args(16384), "--log-level", "info"]
    with Server(TINY, args, tmp_path / "server.log", timeout_s=600) as server:
        cut = _lm_eval(server.url)  # lm-eval's default max_length: 2048
        assert cut.returncode == 2, cut.stderr[-3000:]  # a usage error, in one line: no lm-eval traceback
        assert "Traceback" not in cut.stderr, cut.stderr[-3000:]
        last = cut.stderr.strip().splitlines()[-1]
        assert last.startswith("lm_eval: error: ") and f"max_length={LENGTH + 1}" in last and "cut" in last, last
        assert _prompt_tokens(server.log_tail(1 << 24)) is None  # refused before any request

        whole = _lm_eval(server.url, f"max_length={LENGTH + 1}")
        assert whole.returncode == 0, whole.stderr[-3000:]
        assert _prompt_tokens(server.log_tail(1 << 24)) == tokens  # every prompt token reached the server
