"""Build the tiny model's byte-level BPE tokenizer from local text (Python's standard library sources).

    .venv/bin/python lab/scripts/build_tiny_tokenizer.py configs/minimax-m3.1-tiny

Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json. The vocabulary size
(incl. special tokens) equals the tiny config's ``vocab_size``; the files are committed, so
serving never runs this.
"""

import json
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
CORPUS_MODULES = ["argparse", "textwrap", "json/__init__", "logging/__init__", "pathlib/__init__", "collections/__init__",
                  "dataclasses", "enum", "functools", "inspect", "string/__init__", "random", "statistics", "calendar"]


def corpus_files() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for name in CORPUS_MODULES:
        for candidate in (stdlib / f"{name}.py", stdlib / name / "__init__.py"):
            if candidate.is_file():
                files.append(str(candidate))
                break
    if not files:
        raise RuntimeError("no standard-library sources found to train on")
    return files


def main(out_dir: str) -> None:
    out = Path(out_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(corpus_files(), trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocabulary has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192, "add_bos_token": False,
         "clean_up_tokenization_spaces": False, **specials}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "configs/minimax-m3.1-tiny")
