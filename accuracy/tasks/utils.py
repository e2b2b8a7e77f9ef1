"""lm-eval hooks of the sglang-m3 accuracy tasks (referenced by ``!function utils.<name>`` in the YAMLs).

The needle tasks build their data at load time from the metadata the runner passes
(``--metadata`` on the lm_eval command line): ``max_seq_lengths`` (list of token lengths),
``num_samples`` (per length), ``num_depths``, ``seed``, and the tokenizer of the served model under
``tokenizer`` (or ``pretrained`` / ``model``, which lm-eval copies from ``--model_args``).
"""

import functools
import re
from decimal import Decimal
from pathlib import Path

import datasets

from accuracy import needle

DEFAULTS = {"max_seq_lengths": [4096], "num_samples": 20, "num_depths": 10, "seed": 0}
MULTIKEY_KEYS = 4  # needles in a multi-key sample: one asked for, three distractors


@functools.cache
def _tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, trust_remote_code=True)


def _tokenizer_from(kwargs):
    for key in ("tokenizer", "pretrained", "model"):
        if isinstance(kwargs.get(key), str) and kwargs[key]:
            return _tokenizer(kwargs[key])
    raise ValueError("needle tasks need the served model's tokenizer: pass --model_args tokenizer=<path or name>")


def _needle_dataset(n_keys: int, kwargs) -> dict:
    opts = {k: kwargs.get(k, v) for k, v in DEFAULTS.items()}
    lengths = opts["max_seq_lengths"]
    if isinstance(lengths, (int, str)):
        lengths = [lengths]
    docs = needle.generate(_tokenizer_from(kwargs), [int(n) for n in lengths], int(opts["num_samples"]),
                           int(opts["num_depths"]), n_keys, int(opts["seed"]))
    return {"test": datasets.Dataset.from_list(docs)}


def niah_single(**kwargs):
    """One needle per sample."""
    return _needle_dataset(1, kwargs)


def niah_multikey(**kwargs):
    """``MULTIKEY_KEYS`` needles with distinct keys per sample; one is asked for."""
    return _needle_dataset(MULTIKEY_KEYS, kwargs)


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
