"""Build the small MSA model's byte-level BPE tokenizer (vocab 2048) into lab/training/tokenizer.

    .venv/bin/python lab/scripts/build_msa_tokenizer.py [out_dir]

Why not the tiny serving config's tokenizer (configs/minimax-m3.1-tiny, trained on Python sources):
it merges digit pairs irregularly ("12", "25", "00"), has no space-prefixed "8"/"9", and cuts the
haystack's words into pieces (2.4 characters per token). Here the pre-tokenizer isolates every
digit and every whitespace character and keeps a word with its one leading space, so a 7-digit
number is always seven one-digit tokens (after a lone space token), newlines never merge, and
token ids of text pieces joined by a space or a newline are the concatenation of the pieces' ids.
The BPE is trained on the haystack's prose (a seed used by neither training nor evaluation), the
task frames with random keys, and a few Python standard-library modules (so the vocabulary fills
up with general pieces). The files are committed; training never runs this.
"""

import json
import random
import sys
import sysconfig
from itertools import islice
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from accuracy import needle  # noqa: E402
from accuracy.haystack import sentences  # noqa: E402
from training import data  # noqa: E402

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
# A word with one optional leading space | one digit | punctuation run with one optional leading
# space | one whitespace character.
PRE_TOKEN_PATTERN = r" ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s"
CORPUS_SEED = 7
STDLIB_MODULES = ["argparse", "textwrap", "calendar", "random", "statistics"]


def corpus() -> list[str]:
    rng = random.Random(CORPUS_SEED)
    prose = list(islice(sentences(CORPUS_SEED), 40000))
    texts = [" ".join(prose[i:i + 40]) for i in range(0, len(prose), 40)]
    for _ in range(2000):
        key = f"{rng.choice(needle.KEY_FIRST_WORDS)}-{rng.choice(needle.KEY_SECOND_WORDS)}"
        kv_key = f"{rng.choice(data._KV_A)}-{rng.choice(data._KV_B)}"
        value = str(rng.randrange(10**6, 10**7))
        ctx = " ".join(rng.sample(prose, 3))
        texts.append(needle.PROMPT.format(context=ctx + " " + needle.NEEDLE.format(key=key, value=value), key=key)
                     + f" {value}.")
        texts.append(data.KV_PROMPT.format(context=data.KV_LINE_KEY.format(key=kv_key) + f" {value}\n" + ctx,
                                           key=kv_key) + f" {value}.")
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(2)]
        small = str(rng.randrange(10**4, 10**5))
        question, lead = (s.format(value=small, name=names[1]) for s in (data.VT_ASK_MEMBERS[0], data.VT_ASK_LAST[1]))
        texts.append(data.VT_PROMPT.format(context=f"VAR {names[0]} = {small}. {ctx} VAR {names[1]} = VAR {names[0]}.",
                                           question=question, lead=lead) + f" {names[0]}, {names[1]}.")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_MODULES:
        path = stdlib / f"{name}.py"
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8"))
    return texts


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocabulary has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return tok


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build().save(str(out / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 65536, "add_bos_token": False,
         "add_eos_token": False, "clean_up_tokenization_spaces": False, **specials}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "lab" / "training" / "tokenizer"))
