"""Training batches of long-context retrieval samples, as token ids, for ``training.train``.

The samples themselves (tasks, haystack streams, the prompt formats the served evaluation also asks)
come from the product's ``accuracy.prompts``; this module adds the training tokenizer and the batches.

Tokenizer: ``lab/training/tokenizer`` (built by ``lab/scripts/build_msa_tokenizer.py``), byte-level BPE with
2048 tokens whose pre-tokenizer puts every digit, every whitespace character and every word (with
its one leading space) in its own piece, so a 7-digit answer is always ``" "`` + seven one-digit
tokens and the haystack's words are whole tokens. The tiny serving config's tokenizer was not
reused: trained on Python sources, it merges digit pairs irregularly ("12", "25", "00"; "8" and
"9" have no space-prefixed form) and splits the haystack's words (2.4 characters per token).

Batches (``make_batch``): one sample per sequence, all samples of a batch filled to one length ``T``
(drawn from a short list of multiples of ``BLOCK``), right-padded with ``PAD_ID`` (a sample ends at a
sentence boundary, a few tokens short of ``T``); the batch size is ``token_budget // T``.
A batch is a pure function of ``(seed, step, length range)``, so resuming needs only the step.
"""

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from accuracy.prompts import (  # noqa: F401  (the trainer, the probes and their tests read them as data.*)
    BLOCK, COPY_MAX_NUMBERS, DEFAULT_TASK_WEIGHTS, EVAL_HAYSTACK_SEED, EVAL_TASKS, HELDOUT_HAYSTACK_SEED, KV_LINE_KEY,
    KV_PROMPT, MAX_KV_PAIRS, MULTIKEY_RANGE, QUERY_TOKENS, TASKS, TRAIN_HAYSTACK_SEED, VT_ASK_LAST, VT_ASK_MEMBERS,
    VT_PROMPT, COPY_PROMPT, KV_FIRST_WORDS, KV_SECOND_WORDS, Haystack, Piece, Sample, TaskGenerator, asked_keys,
)

TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"
PAD_ID = 0


def load_tokenizer(path: str | Path = TOKENIZER_DIR) -> Tokenizer:
    """The training tokenizer (``tokenizer.json`` in ``path``); ``PAD_ID`` is its ``<pad>``."""
    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    if tok.token_to_id("<pad>") != PAD_ID:
        raise ValueError(f"tokenizer at {path}: <pad> must have id {PAD_ID}, has {tok.token_to_id('<pad>')}")
    return tok


@dataclass
class Batch:
    """A padded batch. Rows index positions of ``input_ids``; row r predicts ``input_ids[:, r+1]``.

    ``input_ids`` int64 [B, T]; ``loss_rows`` / ``loss_targets`` int64 [B, R]; ``answer_mask``,
    ``query_mask`` and ``lm_mask`` bool [B, R] (answer rows, then the question rows after the context
    (``Sample.query_rows``; none unless ``query_rows``), then sampled context rows for the light LM
    loss; padding rows have all three False); ``kl_rows`` int64 [B, K] (answer rows, then random rows); ``first_answer_row``
    int64 [B]; ``evidence_blocks`` list of B lists; ``lengths`` int64 [B] (tokens before padding);
    ``tasks`` list of B names."""
    input_ids: torch.Tensor
    loss_rows: torch.Tensor
    loss_targets: torch.Tensor
    answer_mask: torch.Tensor
    lm_mask: torch.Tensor
    query_mask: torch.Tensor
    kl_rows: torch.Tensor
    first_answer_row: torch.Tensor
    evidence_blocks: list[list[int]]
    lengths: torch.Tensor
    tasks: list[str]

    def to(self, device) -> "Batch":
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in self.__dict__.items()}
        return Batch(**moved)


@dataclass(frozen=True)
class BatchSpec:
    """What a batch is drawn from: a sequence length uniformly from ``lengths`` (multiples of
    ``BLOCK``; few distinct shapes keep compiled attention kernels few), ``token_budget // length``
    samples, tasks by ``task_weights``, up to ``lm_rows`` prompt rows per sample for the LM loss and
    ``kl_random_rows`` random rows per sample (besides the answer rows) for the index KL; ``multikey``
    and ``kv`` samples ask up to ``queries`` of their keys (each answer supervised); ``query_rows``:
    supervise the question rows after the context too (``Batch.query_mask``)."""
    lengths: tuple[int, ...]
    token_budget: int
    task_weights: tuple[tuple[str, float], ...] = tuple(DEFAULT_TASK_WEIGHTS.items())
    lm_rows: int = 256
    kl_random_rows: int = 256
    queries: int = 1
    query_rows: bool = False

    def __post_init__(self):
        bad = [n for n in self.lengths if n < BLOCK or n % BLOCK]
        if not self.lengths or bad:
            raise ValueError(f"lengths must be multiples of {BLOCK} (>= {BLOCK}), got {self.lengths}")
        if self.token_budget < max(self.lengths):
            raise ValueError(f"token_budget ({self.token_budget}) must hold one sequence of the longest length "
                             f"({max(self.lengths)})")
        for name, w in self.task_weights:
            if name not in TASKS or w < 0:
                raise ValueError(f"task_weights: {name!r}={w}: names must be in {TASKS}, weights >= 0")
        if sum(w for _, w in self.task_weights) <= 0:
            raise ValueError("task_weights: at least one weight must be > 0")
        if self.queries < 1:
            raise ValueError(f"queries must be >= 1, got {self.queries}")
        if self.lm_rows < 0 or self.kl_random_rows < 0:
            raise ValueError(f"lm_rows and kl_random_rows must be >= 0, got {self.lm_rows}, {self.kl_random_rows}")


def collate(samples: list[Sample], seq_len: int, rng: random.Random, lm_rows: int, kl_random_rows: int,
            query_rows: bool = False) -> Batch:
    """Pads ``samples`` (each at most ``seq_len`` tokens) into a ``Batch`` (see its doc)."""
    b = len(samples)
    ids = torch.full((b, seq_len), PAD_ID, dtype=torch.long)
    rows_l, targets_l, answer_l, lm_l, query_l, kl_l = [], [], [], [], [], []
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        if n > seq_len:
            raise ValueError(f"sample {i} has {n} tokens, more than seq_len {seq_len}")
        ids[i, :n] = torch.tensor(s.input_ids)
        ans = s.answer_rows()
        qr = s.query_rows() if query_rows else []
        prompt_rows = range(0, qr[0] if qr else s.answer_start - 1)
        lm = sorted(rng.sample(prompt_rows, min(lm_rows, len(prompt_rows))))
        rows = ans + qr + lm
        rows_l.append(rows)
        targets_l.append([s.input_ids[r + 1] for r in rows])
        answer_l.append([True] * len(ans) + [False] * (len(qr) + len(lm)))
        query_l.append([False] * len(ans) + [True] * len(qr) + [False] * len(lm))
        lm_l.append([False] * (len(ans) + len(qr)) + [True] * len(lm))
        others = [r for r in rng.sample(range(n), min(kl_random_rows + len(ans), n)) if r not in set(ans)]
        kl_l.append(ans + sorted(others[:kl_random_rows]))
    width = max(len(r) for r in rows_l)
    kl_width = max(len(r) for r in kl_l)

    def pad(rows, fill, w):
        return [r + [fill] * (w - len(r)) for r in rows]

    # KL padding repeats the sample's own rows (a padded row would be a pad token, not context).
    kl_padded = [(r * (kl_width // len(r) + 1))[:kl_width] for r in kl_l]
    return Batch(
        input_ids=ids,
        loss_rows=torch.tensor(pad(rows_l, 0, width)),
        loss_targets=torch.tensor(pad(targets_l, PAD_ID, width)),
        answer_mask=torch.tensor(pad(answer_l, False, width)),
        lm_mask=torch.tensor(pad(lm_l, False, width)),
        query_mask=torch.tensor(pad(query_l, False, width)),
        kl_rows=torch.tensor(kl_padded),
        first_answer_row=torch.tensor([s.answer_start - 1 for s in samples]),
        evidence_blocks=[s.evidence_blocks() for s in samples],
        lengths=torch.tensor([len(s.input_ids) for s in samples]),
        tasks=[s.task for s in samples],
    )


def make_batch(gen: TaskGenerator, spec: BatchSpec, seed: int, step: int) -> Batch:
    """Batch number ``step`` of the stream ``seed``: a pure function of its arguments."""
    rng = random.Random(f"{seed}-{step}")
    seq_len = rng.choice(spec.lengths)
    names = [n for n, _ in spec.task_weights]
    weights = [w for _, w in spec.task_weights]
    samples = [gen.sample(rng.choices(names, weights)[0], rng, seq_len, spec.queries)
               for _ in range(max(1, spec.token_budget // seq_len))]
    return collate(samples, seq_len, rng, spec.lm_rows, spec.kl_random_rows, spec.query_rows)
