"""lm-eval hooks of the sglang-m3 accuracy tasks (referenced by ``!function utils.<name>`` in the YAMLs).

The long-context tasks (``m3_niah_single``, ``m3_niah_multikey``, ``m3_kv``, ``m3_vt``, ``m3_kv_64``,
``m3_vt_value``) build their data at load time (``accuracy.retrieval.docs``) from the metadata the runner
passes (``--metadata`` on the lm_eval command line): ``max_seq_lengths`` (list of token lengths),
``num_samples`` (per length: samples ``0 .. num_samples - 1``) or ``sample_ids`` (the sample indices to
generate), ``num_depths`` (needle depth grid), ``seed``, ``questions`` (questions per context, for the
tasks that take several: ``retrieval.max_questions``), and the tokenizer of the served model under
``tokenizer`` (or ``pretrained`` / ``model``, which lm-eval copies from ``--model_args``).
"""

import re
from decimal import Decimal
from pathlib import Path

import datasets

from accuracy import needle, retrieval

DEFAULTS = {"max_seq_lengths": [4096], "num_samples": 20, "num_depths": 10, "seed": 0, "sample_ids": None,
            "questions": 1}
MULTIKEY_KEYS = retrieval.NEEDLE_KEYS["m3_niah_multikey"]  # needles in a multi-key sample: one asked for


def _tokenizer_name(kwargs) -> str:
    for key in ("tokenizer", "pretrained", "model"):
        if isinstance(kwargs.get(key), str) and kwargs[key]:
            return kwargs[key]
    refuse("the long-context tasks need the served model's tokenizer: pass --model_args tokenizer=<path or name>")


API_MAX_LENGTH = 2048  # lm-eval's default max_length for local-completions / local-chat-completions


def _flag(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes")


def needed_max_length(lengths, add_bos_token: bool = False) -> int:
    """The smallest ``--model_args max_length`` that sends every prompt of ``lengths`` whole: lm-eval's API
    models keep the last ``max_length - 1 - max_gen_toks`` prompt tokens, and a prompt of length ``L`` has at
    most ``L - max_gen_toks`` tokens (with the task's own ``max_gen_toks``), plus a BOS token if one is added."""
    return max(int(n) for n in lengths) + 1 + int(add_bos_token)


def check_max_length(task: str, lengths, kwargs) -> None:
    """ValueError naming ``max_length`` when lm-eval would cut this task's prompts.

    lm-eval 0.4.13's API models left-truncate a tokenized prompt to ``max_length - 1 - max_gen_toks`` tokens
    with no warning (the one they have tests the length after cutting) and ignore ``truncate``; they send text
    whole with ``tokenized_requests=False``. The lm_eval command line hands ``--model_args`` to the task too,
    which is where this check reads ``max_length`` (lm-eval's default 2048 when absent), ``tokenized_requests``
    and ``add_bos_token``."""
    if "tokenized_requests" in kwargs and not _flag(kwargs["tokenized_requests"]):
        return
    max_length = int(kwargs.get("max_length") or API_MAX_LENGTH)
    need = needed_max_length(lengths, _flag(kwargs.get("add_bos_token", False)))
    if max_length < need:
        given = "given" if kwargs.get("max_length") else "lm-eval's default"
        refuse(f"{task}: max_length {max_length} ({given}) would cut the {max(map(int, lengths))}-token prompts "
               f"from the left; pass --model_args max_length={need} (max_seq_lengths + 1) or more")


def _under_lm_eval_cli() -> bool:
    """Whether this process is the ``lm_eval`` command line (``lm_eval`` / ``lm-eval`` or ``python -m lm_eval``)."""
    import os
    import sys

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (spec is not None and spec.name in ("lm_eval", "lm_eval.__main__")) or \
        os.path.basename(sys.argv[0] if sys.argv else "") in ("lm_eval", "lm-eval")


def refuse(message: str) -> None:
    """A caller's mistake: under the ``lm_eval`` command line one ``lm_eval: error:`` line and exit status 2 (lm-eval
    would print its whole traceback around a ValueError); a ValueError for any other caller."""
    if _under_lm_eval_cli():
        import sys

        print(f"lm_eval: error: {message}", file=sys.stderr)
        raise SystemExit(2)
    raise ValueError(message)


def _long_dataset(task: str, kwargs) -> dict:
    opts = {k: kwargs.get(k, v) for k, v in DEFAULTS.items()}
    lengths = opts["max_seq_lengths"]
    if isinstance(lengths, (int, str)):
        lengths = [lengths]
    check_max_length(task, lengths, kwargs)
    ids = range(int(opts["num_samples"])) if opts["sample_ids"] is None else opts["sample_ids"]
    questions = retrieval.questions_for(task, opts["questions"])  # up to that many where the task can
    docs = retrieval.docs(task, _tokenizer_name(kwargs), [int(n) for n in lengths], ids, int(opts["seed"]),
                          int(opts["num_depths"]), questions)
    return {"test": datasets.Dataset.from_list(docs)}


def niah_single(**kwargs):
    """One needle per sample."""
    return _long_dataset("m3_niah_single", kwargs)


def niah_multikey(**kwargs):
    """``MULTIKEY_KEYS`` needles with distinct keys per sample; one is asked for."""
    return _long_dataset("m3_niah_multikey", kwargs)


def kv_retrieval(**kwargs):
    """``"key": value`` lines in the chronicle, one key asked (``training.data`` ``kv`` format)."""
    return _long_dataset("m3_kv", kwargs)


def variable_tracking(**kwargs):
    """Chains of ``VAR X = ...`` assignments, one chain asked (``training.data`` ``vt`` format)."""
    return _long_dataset("m3_vt", kwargs)


def kv_retrieval_64(**kwargs):
    """``kv_retrieval`` with ``retrieval.KV_FIXED_PAIRS`` pairs at every length."""
    return _long_dataset("m3_kv_64", kwargs)


def variable_tracking_value(**kwargs):
    """``variable_tracking`` asking the value of the chain's last variable, never its member list."""
    return _long_dataset("m3_vt_value", kwargs)


def exact_results(doc, results):
    """1.0 when the response begins with the trained answer, final period included (``retrieval.exact``)."""
    return {"acc": retrieval.exact(results[0], doc["answer"])}


def needle_results(doc, results):
    return {"acc": needle.score(results[0], doc["target"])}


def first_number(text: str) -> str | None:
    """The first number in ``text`` (thousands commas dropped, a decimal part kept so that "3.5" is
    not read as 3; a sentence-ending period is not a decimal part), or None."""
    m = re.search(r"-?\d[\d,]*(?:\.\d+)?", text)
    return m.group(0).replace(",", "") if m else None


def arith_results(doc, results):
    """1.0 when the response's first number equals the whole-number answer as a value ("42.0" counts)."""
    number = first_number(results[0])
    return {"acc": 1.0 if number is not None and Decimal(number) == Decimal(doc["answer"]) else 0.0}


SHORT_ARITH = Path(__file__).parent / "data" / "short_arith.jsonl"


def short_arith(**kwargs):
    """The bundled arithmetic word problems (``make_short_arith.py``)."""
    return {"test": datasets.Dataset.from_json(str(SHORT_ARITH))}
