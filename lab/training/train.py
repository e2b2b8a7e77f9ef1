"""Train a small model with MiniMax-M3's sparse-attention geometry on long-context retrieval.

    python -m training.train --config lab/training/configs/msa-small.json --out build/msa-train --budget-s 540
    python -m training.train --config lab/training/configs/msa-small.json --out build/msa-train --resume build/msa-train

Model: ``training.model.MSAForCausalLM`` (M3's attention: 128-token blocks, top-16 with the local
block forced, 4 KV heads x 128, one index-query head per KV head and one shared index key of dim 128,
per-head Gemma RMSNorm and partial NeoX RoPE). Data: ``training.data`` (needle, multi-key needle,
key-value and variable-tracking samples, generated on the fly, one per sequence).

Recipe (MSA paper, arXiv:2606.13392, Lai et al. 2026, as summarised in the team's research notes:
"a KL loss aligns the index distribution with the group-averaged main distribution on the selected
blocks", with gradient detach, indexer warm-up and the forced local block; the two-stage schedule
follows DeepSeek-V3.2's lightning-indexer training, whose report describes a dense warm-up, where
only the indexer learns, by KL against the main attention summed over heads and L1-normalised,
then sparse training of all parameters with the KL restricted to the selected tokens and the
indexer's input detached so that it learns only from the KL):

1. dense stage, steps ``[0, dense_steps)``: every layer attends densely. Loss = answer CE (every
   answer of the sample's ``queries`` questions) + ``query_weight`` x CE of the question rows after
   the context + ``lm_weight`` x context CE (sampled rows) + ``kl_weight`` x index KL, where the KL is
   ``KL(p || softmax(index block scores))`` over all visible blocks, ``p`` the main attention of the
   KV group (averaged over its query heads, summed per block, detached). Unlike DeepSeek-V3.2's
   warm-up the main model is not frozen: it starts from random weights and must learn the tasks.
2. sparse stage, steps ``[dense_steps, steps)``: sparse layers attend to the top-16 blocks the
   indexer selects; the same losses, the KL now over the selected blocks only (``p`` renormalised
   over them).

In both stages the index branch reads a detached copy of its input (inside the model): the LM loss
trains the main model, the KL trains only the indexer, so the terms are simply added. KL rows:
the answer rows plus ``kl_rows`` random rows per sample. Lengths: ``short_lengths`` for steps
``[0, short_steps)``, then ``long_lengths`` (each step draws one length from the list, then
``token_budget // length`` samples); or ``curriculum``, any number of phases each with its own
length list, starting at given fractions of the plan (``curriculum()``). AdamW (no decay on norms),
linear warm-up then cosine decay to ``min_lr_frac`` x ``lr``, gradient clipping, bf16 autocast on CUDA.

Checkpoints: ``<out>/ckpt/state.pt`` (model, optimizer, next step, plan, RNG; batches are a pure
function of the step, so that is the data state) every ``ckpt_every_s`` seconds and when the call
ends; the call ends ``reserve_s`` before ``budget_s`` (or at ``stop_at_step``, or after ``steps``).
``--resume <dir>`` continues exactly from ``<dir>/ckpt/state.pt``; given only an export
(``<dir>/export`` or ``<dir>`` holding ``trainer_state.json``) it continues the plan from the
exported bf16 weights with a fresh optimizer, which is not exact and says so. With ``--portable``
each checkpoint also writes ``<out>/portable.pt`` (``save_portable``: fp32 weights, Adam moments in
bf16 or partly dropped, step, plan, RNG; 4-8 bytes per parameter against the exact state's 12, to
carry between machines); ``--resume`` of a directory holding it, or its parts ``portable.pt.part-*``,
continues the plan with the weights exact and says what was not. ``--init-from <export>``
instead starts a new plan (step 0, fresh optimizer) from an export's weights: fine-tuning, e.g. more
multi-key training from ``configs/msa-small``. Each call ends with the
checkpoint, an export (``training.export.export_checkpoint``) into ``<out>/export`` plus
``trainer_state.json``, then the held-out evaluation (last: in sparse mode it may compile attention
kernels for new shapes).

Log: one line every ``log_every`` steps (step, stage, seq len x batch, loss, answer loss, answer-token
accuracy, LM loss, index KL, attention mass kept by the selection, lr, tokens/s, elapsed) to stdout
and ``<out>/train.log``; metrics as JSON lines in ``<out>/metrics.jsonl``. Every ``eval_every``
steps and at the end of each call: held-out samples (``training.data.HELDOUT_HAYSTACK_SEED``) at
``eval_lengths``, teacher-forced greedy exact match of the answer in dense and in sparse mode, and
per sparse layer the indexer's recall of the evidence blocks (the needle's value, ...) in the
top-16 of the first answer row (mean over KV heads).
"""

import argparse
import io
import json
import math
import os
import queue
import random
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from training import data

# Arguments that define the run; a resumed run must keep them (``_check_plan``).
PLAN_DEFAULTS = {
    "config": None,
    # The H200 plan (docs/accuracy.md section 4): configs/msa-small came from --train-s 900 over two
    # calls of ~400 trained seconds each, the second resumed exactly (740 s reached). A time
    # plan runs stages, curriculum and cosine on trained seconds / train_s (dense_steps / steps and
    # short_steps / steps are fractions; steps is a cap), so a call of unknown speed still reaches the
    # sparse stage; resume continues from the saved trained seconds, and where a phase switch falls then
    # depends on timing, so it is not bitwise exact. train_s 0 = a step plan: 4000 steps of 64k tokens.
    "steps": 4000,
    "train_s": 0.0,
    # Short lengths (512-2048, where top-16 keeps every block) for the first 45%: retrieval must emerge
    # there; then 4k-32k. Dense until 75% (the indexer warms up on KL against dense attention, at the
    # long lengths too), sparse after.
    "dense_steps": 3000,
    "short_steps": 1800,
    "short_lengths": "512,1024,2048",
    "long_lengths": "4096,8192,16384,32768",
    # "" = the two phases above; else phases "START:LENGTHS;START:LENGTHS;..." with START the fraction of
    # the plan where the phase begins (the first 0, increasing), e.g. "0:512,1024;0.4:4096,8192;0.7:131072".
    # It replaces short_lengths, long_lengths and short_steps.
    "curriculum": "",
    "token_budget": 65536,
    "task_weights": "single=0.1,multikey=0.3,kv=0.3,vt=0.1,copy=0.2",
    "lr": 2e-3,
    "min_lr_frac": 0.1,
    "warmup_steps": 50,
    "weight_decay": 0.1,
    "beta2": 0.95,
    "grad_clip": 1.0,
    "lm_weight": 0.05,
    "kl_weight": 1.0,
    "lm_rows": 256,
    "kl_rows": 256,
    # several questions per kv / multikey sample (up to T // 128 keys, half asked twice) and a loss on
    # the question rows (the asked key can be copied from the context): the retrieval signal per
    # sequence is ~10x denser than one 7-digit answer, and copying is rewarded from the first steps.
    "queries": 8,
    "query_weight": 1.0,
    "seed": 0,
    "tokenizer": "",  # "" = lab/training/tokenizer
    # an export (``training.export``) whose weights start this plan at step 0 with a fresh optimizer
    # (fine-tuning, e.g. from configs/msa-small); "" = random initialisation
    "init_from": "",
}
STATE_FILE = "state.pt"
PORTABLE_FILE = "portable.pt"  # split into PORTABLE_FILE + ".part-*" to travel; find_resume joins them
PORTABLE_MOMENTS = ("both", "second", "none")
TRAINER_STATE = "trainer_state.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="run directory: ckpt/, export/, train.log, metrics.jsonl")
    p.add_argument("--resume", help="run directory (or export) to continue from")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall seconds this call may take")
    p.add_argument("--reserve-s", type=float, default=60.0, help="seconds kept for the last checkpoint, eval, export")
    p.add_argument("--ckpt-every-s", type=float, default=120.0)
    p.add_argument("--stop-at-step", type=int, help="end this call once this step is reached")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-lengths", default="4096,16384,32768")
    p.add_argument("--eval-samples", type=int, default=2,
                   help="held-out samples per task and length (at least; rounded up to whole batches)")
    p.add_argument("--eval-tasks", default=",".join(data.EVAL_TASKS))
    p.add_argument("--no-final-eval", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (off by default)")
    p.add_argument("--prefetch", type=int, default=4, help="batches generated ahead by a background thread")
    p.add_argument("--no-export", action="store_true")
    p.add_argument("--portable", action="store_true",
                   help=f"also write <out>/{PORTABLE_FILE} at every checkpoint: fp32 weights, Adam moments in bf16 "
                        "(--portable-moments), step, RNG; a smaller file to carry between machines")
    p.add_argument("--portable-moments", choices=PORTABLE_MOMENTS, default="both",
                   help="Adam moments kept in the portable state: both (8 B/param in all), second (6 B/param; "
                        "first moments restart at 0 on resume), none (4 B/param; fresh optimizer)")
    p.add_argument("--tf32", action="store_true",
                   help="allow TF32 for fp32 matmuls on CUDA (index block scores, KL targets): faster, "
                        "selection from scores rounded to 10-bit mantissas; off by default")
    for name, default in PLAN_DEFAULTS.items():
        kind = type(default) if default is not None else str
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help=f"plan (default {default}; a resumed run keeps its own)")
    return p.parse_args(argv)


def _plan_from(args) -> dict:
    return {k: getattr(args, k) for k in PLAN_DEFAULTS}


def _check_plan(given: dict, saved: dict) -> dict:
    """The saved plan, after checking that every plan argument given on the command line equals it."""
    diff = {k: (v, saved.get(k)) for k, v in given.items() if v is not None and v != saved.get(k)}
    if diff:
        raise ValueError("a resumed run keeps its plan; these arguments differ from it (given, saved): "
                         + ", ".join(f"--{k.replace('_', '-')} {a!r} vs {b!r}" for k, (a, b) in diff.items())
                         + ". Leave them out or start a new --out.")
    return dict(saved)


def _complete_plan(given: dict) -> dict:
    plan = {k: (PLAN_DEFAULTS[k] if v is None else v) for k, v in given.items()}
    if plan["config"] is None:
        raise ValueError("--config is required for a new run")
    plan["config"] = str(plan["config"])
    _validate_plan(plan)
    return plan


def _lengths(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name}: comma-separated token counts expected, got {text!r}") from None
    bad = [v for v in values if v < data.BLOCK or v % data.BLOCK]
    if not values or bad:
        raise ValueError(f"--{name}: lengths must be multiples of {data.BLOCK} (>= {data.BLOCK}), got {text!r}")
    return values


def _task_weights(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for item in str(text).split(","):
        name, _, w = item.partition("=")
        try:
            out.append((name.strip(), float(w)))
        except ValueError:
            raise ValueError(f"--task-weights: name=weight pairs expected, got {text!r}") from None
    return tuple(out)


def _validate_plan(plan: dict) -> None:
    if plan["steps"] < 1:  # stages and curriculum are fractions of steps, a time plan's too
        raise ValueError(f"--steps must be >= 1, got {plan['steps']}")
    if not 0 <= plan["dense_steps"] <= plan["steps"]:
        raise ValueError(f"--dense-steps must be in [0, --steps={plan['steps']}], got {plan['dense_steps']}")
    if plan.get("train_s", 0) < 0:
        raise ValueError(f"--train-s must be >= 0 (0 = a step plan), got {plan['train_s']}")
    if plan["short_steps"] < 0:
        raise ValueError(f"--short-steps must be >= 0, got {plan['short_steps']}")
    for name in () if plan.get("curriculum") else ("short_lengths", "long_lengths"):
        for n in _lengths(plan[name], name.replace("_", "-")):
            if n > plan["token_budget"]:
                raise ValueError(f"--{name.replace('_', '-')}: {n} exceeds --token-budget {plan['token_budget']}")
    for n in plan_lengths(plan):
        if n > plan["token_budget"]:
            raise ValueError(f"--curriculum: {n} exceeds --token-budget {plan['token_budget']}")
    _spec(plan, 0)  # task weights and row counts


def progress(plan: dict, step: int, trained_s: float = 0.0) -> float:
    """Fraction of the plan done: ``trained_s / train_s`` for a time plan, else ``step / steps``."""
    if plan.get("train_s", 0) > 0:
        return trained_s / plan["train_s"]
    return step / plan["steps"]


def curriculum(plan: dict) -> list[tuple[float, str, str]]:
    """Phases ``(start fraction, name, lengths text)`` in order: ``plan["curriculum"]`` (names ``c0``, ``c1``,
    ...) or, without one, ``short`` from 0 and ``long`` from ``short_steps / steps``."""
    text = plan.get("curriculum") or ""
    if not text:
        return [(0.0, "short", plan.get("short_lengths")),
                (plan["short_steps"] / plan["steps"], "long", plan.get("long_lengths"))]
    phases = []
    for i, item in enumerate(text.split(";")):
        start, sep, lengths = item.partition(":")
        try:
            frac = float(start)
        except ValueError:
            frac = float("nan")
        if not sep or not 0.0 <= frac < 1.0 or (phases and frac <= phases[-1][0]) or (not phases and frac != 0.0):
            raise ValueError(f"--curriculum: phases 'START:LENGTHS' separated by ';', starts increasing in [0, 1) "
                             f"from 0, got {text!r}")
        _lengths(lengths, "curriculum")
        phases.append((frac, f"c{i}", lengths))
    return phases


def phase(plan: dict, step: int, trained_s: float = 0.0) -> str:
    """Curriculum phase of ``step``: the last phase of ``curriculum(plan)`` that has begun."""
    done = progress(plan, step, trained_s)
    return [name for start, name, _ in curriculum(plan) if done >= start][-1]


def plan_lengths(plan: dict) -> list[int]:
    """Every sequence length the plan trains on."""
    return sorted({n for _, _, lengths in curriculum(plan) for n in _lengths(lengths, "lengths")})


def _spec(plan: dict, step: int, trained_s: float = 0.0, which: str | None = None) -> data.BatchSpec:
    """The batch spec of ``step``: the length list of its curriculum phase (or of phase ``which``)."""
    which = which or phase(plan, step, trained_s)
    lengths = _lengths({name: lengths for _, name, lengths in curriculum(plan)}[which], "lengths")
    return data.BatchSpec(tuple(lengths), plan["token_budget"], _task_weights(plan["task_weights"]),
                          plan["lm_rows"], plan["kl_rows"], plan.get("queries", 1),
                          plan.get("query_weight", 0.0) > 0)


def stage(plan: dict, step: int, trained_s: float = 0.0) -> str:
    return "dense" if progress(plan, step, trained_s) < plan["dense_steps"] / plan["steps"] else "sparse"


def learning_rate(plan: dict, step: int, trained_s: float = 0.0) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine to ``min_lr_frac * lr`` at the
    end of the plan (``steps``, or ``train_s`` seconds for a time plan)."""
    lr, warm, total = plan["lr"], plan["warmup_steps"], plan["steps"]
    if step < warm:
        return lr * (step + 1) / warm
    if plan.get("train_s", 0) > 0:
        t = min(1.0, progress(plan, step, trained_s))
    else:
        t = min(1.0, (step - warm) / max(1, total - warm))
    floor = plan["min_lr_frac"] * lr
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


# -- model, optimizer, checkpoints ---------------------------------------------------------------------
def build_model(plan: dict, device) -> tuple:
    from training.model import MSAConfig, MSAForCausalLM

    config_dict = json.loads(Path(plan["config"]).read_text())
    cfg = MSAConfig.from_dict(config_dict)
    tok = data.load_tokenizer(plan["tokenizer"] or data.TOKENIZER_DIR)
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens, config vocab_size is {cfg.vocab_size}")
    if cfg.block_size != data.BLOCK:
        raise ValueError(f"config block size {cfg.block_size} != the data's block {data.BLOCK}")
    model = MSAForCausalLM(cfg)
    model.init_weights(plan["seed"])
    return model.to(device), cfg, config_dict, tok


def build_optimizer(model, plan: dict) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": plan["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=plan["lr"], betas=(0.9, plan["beta2"]), eps=1e-8)


def save_state(path: Path, model, opt, plan: dict, step: int, trained_s: float) -> None:
    """Atomically writes the exact-resume state (``step`` = the next step to run)."""
    path.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(), "optimizer": opt.state_dict(), "plan": plan, "step": step,
        "trained_s": trained_s, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    tmp = path / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path / STATE_FILE)


def save_portable(path: Path, model, opt, plan: dict, step: int, trained_s: float, moments: str) -> None:
    """Atomically writes ``path`` (a file): the portable resume state.

    fp32 weights (exact), Adam's per-parameter step count, its moments rounded to bf16 (``moments``:
    ``both``, ``second`` = second moments only, ``none``), the plan, the next step, trained seconds and
    the RNG states. About 8, 6 or 4 bytes per parameter instead of the exact state's 12.
    """
    if moments not in PORTABLE_MOMENTS:
        raise ValueError(f"moments must be one of {PORTABLE_MOMENTS}, got {moments!r}")
    names = {id(p): n for n, p in model.named_parameters()}
    keep = {"both": ("exp_avg", "exp_avg_sq"), "second": ("exp_avg_sq",), "none": ()}[moments]
    state = {
        "kind": "msa-portable-1", "moments": moments,
        "model": {n: t.detach().to("cpu", torch.float32) for n, t in model.state_dict().items()},
        "adam_step": {}, "exp_avg": {}, "exp_avg_sq": {},
        "plan": plan, "step": step, "trained_s": trained_s, "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    for p, st in opt.state.items():
        name = names[id(p)]
        if keep and "step" in st:
            state["adam_step"][name] = float(st["step"])
        for key in keep:
            state[key][name] = st[key].detach().to("cpu", torch.bfloat16)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_portable(path: Path) -> dict:
    """The portable state at ``path``: the file itself or, when absent, its parts ``path.part-*`` joined in order."""
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=False)
    parts = sorted(path.parent.glob(path.name + ".part-*"))
    if not parts:
        raise ValueError(f"{path}: neither the file nor parts {path.name}.part-* exist")
    return torch.load(io.BytesIO(b"".join(part.read_bytes() for part in parts)), map_location="cpu",
                      weights_only=False)


def restore_portable(saved: dict, model, opt) -> str:
    """Loads a portable state into ``model`` and ``opt`` (built from its plan); returns what was not exact."""
    if saved.get("kind") != "msa-portable-1":
        raise ValueError(f"not a portable training state (kind {saved.get('kind')!r})")
    model.load_state_dict(saved["model"])
    for name, p in model.named_parameters():
        if name not in saved["adam_step"]:
            continue
        second = saved["exp_avg_sq"][name].to(p.device, torch.float32)
        first = saved["exp_avg"][name].to(p.device, torch.float32) if name in saved["exp_avg"] else torch.zeros_like(p)
        opt.state[p] = {"step": torch.tensor(saved["adam_step"][name], dtype=torch.float32),
                        "exp_avg": first, "exp_avg_sq": second}
    return {"both": "Adam moments rounded to bf16",
            "second": "second moments rounded to bf16, first moments restarted at 0",
            "none": "fresh optimizer"}[saved["moments"]]


def find_resume(resume: str) -> tuple[str, Path]:
    """``("exact", state.pt)``, ``("portable", portable.pt)`` (the file or its parts) or ``("weights", export
    dir)`` for ``--resume``."""
    root = Path(resume)
    for cand in (root / "ckpt" / STATE_FILE, root / STATE_FILE):
        if cand.is_file():
            return "exact", cand
    for cand in (root / PORTABLE_FILE, root / "portable" / PORTABLE_FILE):
        if cand.is_file() or list(cand.parent.glob(cand.name + ".part-*")):
            return "portable", cand
    for cand in (root / "export", root):
        if (cand / TRAINER_STATE).is_file() and (cand / "config.json").is_file():
            return "weights", cand
    raise ValueError(f"--resume {resume}: no ckpt/{STATE_FILE}, {STATE_FILE}, {PORTABLE_FILE}(.part-*), "
                     f"or export with {TRAINER_STATE} there")


# -- metrics -------------------------------------------------------------------------------------------
def batch_losses(logits: torch.Tensor, batch: data.Batch) -> dict:
    """Per-batch answer CE (mean over answer tokens), LM CE (mean over sampled prompt rows) and
    answer-token accuracy; tensors, no host sync."""
    targets = batch.loss_targets
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    ans = batch.answer_mask.float()
    lm = batch.lm_mask.float()
    query = batch.query_mask.float()
    correct = (logits.argmax(-1) == batch.loss_targets).float()
    return {
        "answer_loss": (ce * ans).sum() / ans.sum().clamp_min(1.0),
        "lm_loss": (ce * lm).sum() / lm.sum().clamp_min(1.0),
        "query_loss": (ce * query).sum() / query.sum().clamp_min(1.0),
        "answer_acc": (correct * ans).sum() / ans.sum().clamp_min(1.0),
    }


@torch.no_grad()
def evaluate(model, batches: list[data.Batch], device, autocast_dtype) -> dict:
    """Teacher-forced greedy exact match per (mode, task, length) and, in sparse mode, the recall of
    each sample's evidence blocks in the first answer row's selection, per sparse layer."""
    was_training = model.training
    model.eval()
    out: dict = {}
    for mode in ("dense", "sparse"):
        for cpu_batch in batches:
            batch = cpu_batch.to(device)
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                logits, aux = model(batch.input_ids, attention=mode, logit_rows=batch.loss_rows,
                                    return_selection=mode == "sparse")
            correct = (logits.argmax(-1) == batch.loss_targets) | ~batch.answer_mask
            exact = correct.all(-1).float().cpu()
            T = batch.input_ids.shape[1]
            for i, task in enumerate(cpu_batch.tasks):
                key = f"{mode}/{task}/{T}"
                out.setdefault(key, []).append(float(exact[i]))
                if mode == "sparse":
                    for layer, sel in aux["selected"].items():
                        row = sel[i, :, int(cpu_batch.first_answer_row[i])].cpu()  # [Hkv, topk]
                        want = cpu_batch.evidence_blocks[i]
                        hits = [sum(b in set(h.tolist()) for b in want) / max(1, len(want)) for h in row]
                        out.setdefault(f"recall/L{layer}/{task}/{T}", []).append(sum(hits) / len(hits))
    model.train(was_training)
    return {k: sum(v) / len(v) for k, v in sorted(out.items())}


def summarize_eval(result: dict) -> list[str]:
    """Log lines: exact match per mode and length (over tasks), recall per layer and length."""
    lines = []
    groups: dict = {}
    for k, v in result.items():
        head, task, T = k.rsplit("/", 2)
        groups.setdefault((head, T), []).append(f"{task}={v:.2f}")
    for (head, T), items in sorted(groups.items(), key=lambda x: (x[0][0], int(x[0][1]))):
        lines.append(f"eval {head:<10} T={T:>6} " + " ".join(items))
    return lines


def heldout_batches(plan: dict, tok, lengths: list[int], tasks: list[str], per: int) -> list[data.Batch]:
    """Fixed held-out samples (``HELDOUT_HAYSTACK_SEED``): per length ``T``, at least ``per`` samples
    of each task (cycling over ``tasks``), in batches of the training batch size ``token_budget // T``
    (the same shapes as training, so no new compiled attention kernels)."""
    gen = data.TaskGenerator(tok, data.HELDOUT_HAYSTACK_SEED, num_sentences=_pool_sentences(max(lengths)))
    batches = []
    for T in lengths:
        size = max(1, plan["token_budget"] // T)
        n = -(-len(tasks) * per // size) * size
        rng = random.Random(f"heldout-{plan['seed']}-{T}")
        samples = [gen.sample(tasks[i % len(tasks)], rng, T) for i in range(n)]
        batches += [data.collate(samples[i:i + size], T, rng, 0, 0) for i in range(0, n, size)]
    return batches


def _pool_sentences(max_len: int) -> int:
    """Haystack sentences for windows of ``max_len`` tokens (~17 tokens per sentence, 8 windows' worth)."""
    return max(4096, 8 * max_len // 16)


# -- data prefetch -------------------------------------------------------------------------------------
class Prefetcher:
    """Generates ``make_batch(step)`` for the coming steps in a background thread (batches are pure
    functions of the step and curriculum phase, so the order of generation cannot change them).
    The thread draws for ``self.phase``; ``get`` remakes a batch drawn for a stale phase (a time
    plan's switch to long lengths wastes at most ``depth`` batches)."""

    def __init__(self, gen, plan: dict, start: int, stop: int, depth: int, phase_now: str):
        self.gen, self.plan, self.depth = gen, plan, max(1, depth)
        self.phase = phase_now
        self.q: queue.Queue = queue.Queue(maxsize=self.depth)
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(start, stop), daemon=True)
        self.thread.start()

    def _run(self, start, stop):
        try:
            for step in range(start, stop):
                which = self.phase
                spec = _spec(self.plan, step, which=which)
                self.q.put((step, which, data.make_batch(self.gen, spec, self.plan["seed"], step)))
        except BaseException as e:  # surfaced in get()
            self.error = e
            self.q.put((None, None, None))

    def get(self, step: int, which: str) -> data.Batch:
        self.phase = which
        got, got_phase, batch = self.q.get()
        if got is None:
            raise RuntimeError("batch generation failed") from self.error
        if got != step:
            raise RuntimeError(f"prefetcher out of order: expected step {step}, got {got}")
        if got_phase != which:
            batch = data.make_batch(self.gen, _spec(self.plan, step, which=which), self.plan["seed"], step)
        return batch


# -- main ----------------------------------------------------------------------------------------------
class Logger:
    def __init__(self, out: Path):
        self.log = open(out / "train.log", "a")
        self.metrics = open(out / "metrics.jsonl", "a")

    def line(self, text: str):
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def record(self, rec: dict):
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()


def main(argv=None) -> dict:
    """Runs one call of the plan; returns a summary (last step, losses of every step run)."""
    t_start = time.time()
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Logger(out)
    device = torch.device(args.device)
    given = _plan_from(args)

    resume_kind, resume_path, saved = None, None, None
    if args.resume:
        resume_kind, resume_path = find_resume(args.resume)
        if resume_kind == "exact":
            saved = torch.load(resume_path, map_location="cpu", weights_only=False)
            plan = _check_plan(given, saved["plan"])
        elif resume_kind == "portable":
            saved = load_portable(resume_path)
            plan = _check_plan(given, saved["plan"])
        else:
            saved = json.loads((resume_path / TRAINER_STATE).read_text())
            plan = _check_plan(given, saved["plan"])
    else:
        plan = _complete_plan(given)

    if args.tf32 and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model, cfg, config_dict, tok = build_model(plan, device)
    opt = build_optimizer(model, plan)
    start_step, trained_s = 0, 0.0
    if resume_kind in ("exact", "portable"):
        if resume_kind == "exact":
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        else:
            inexact = restore_portable(saved, model, opt)
        start_step, trained_s = saved["step"], saved["trained_s"]
        torch.set_rng_state(saved["torch_rng"])
        random.setstate(saved["python_rng"])
        if saved.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda_rng"])
        if resume_kind == "exact":
            log.line(f"resume exact from {resume_path} at step {start_step}")
        else:
            log.line(f"resume from portable state {resume_path} at step {start_step}: fp32 weights exact, {inexact}")
    elif resume_kind is None and plan.get("init_from"):
        from training.export import load_checkpoint

        model.load_state_dict(load_checkpoint(plan["init_from"], device="cpu").state_dict())
        log.line(f"new plan from the weights of {plan['init_from']} (fresh optimizer, step 0)")
    elif resume_kind == "weights":
        from training.export import load_checkpoint

        model.load_state_dict(load_checkpoint(resume_path, device="cpu").state_dict())
        start_step, trained_s = saved["step"], saved.get("trained_s", 0.0)
        log.line(f"resume NOT exact from export {resume_path} at step {start_step}: bf16 weights, fresh optimizer")
    raw_model = model  # checkpoints and exports take the uncompiled module's names
    if args.compile:
        model = torch.compile(model)
    # flex_attention compiles once per sequence shape; the length lists keep the shapes few.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    model.train()

    gen = data.TaskGenerator(tok, data.TRAIN_HAYSTACK_SEED, num_sentences=_pool_sentences(max(plan_lengths(plan))))
    eval_lengths = _lengths(args.eval_lengths, "eval-lengths")
    eval_tasks = [t for t in args.eval_tasks.split(",") if t]
    heldout = heldout_batches(plan, tok, eval_lengths, eval_tasks, args.eval_samples) if args.eval_samples > 0 else []
    stop = plan["steps"] if args.stop_at_step is None else min(plan["steps"], args.stop_at_step)
    prefetch = Prefetcher(gen, plan, start_step, stop, args.prefetch, phase(plan, start_step, trained_s))
    n_params = sum(p.numel() for p in model.parameters())
    log.line(f"plan {json.dumps(plan)}")
    log.line(f"model {n_params / 1e6:.2f}M params on {device}; steps {start_step}->{stop} of {plan['steps']}; "
             f"setup {time.time() - t_start:.1f}s")

    deadline = t_start + args.budget_s - args.reserve_s
    last_ckpt = time.time()
    step = start_step
    losses: list[float] = []
    window: dict = {}
    window_tokens, window_t0, step_ends = 0, time.time(), []

    def checkpoint():
        nonlocal last_ckpt
        save_state(out / "ckpt", raw_model, opt, plan, step, trained_s)
        if args.portable:
            save_portable(out / PORTABLE_FILE, raw_model, opt, plan, step, trained_s, args.portable_moments)
        last_ckpt = time.time()

    def flush(mode, batch):
        """One log line and metrics record for the steps since the last one."""
        nonlocal window, window_tokens, window_t0
        vals = {k: float(torch.stack(v).float().mean()) for k, v in window.items()}
        tps = window_tokens / max(1e-9, time.time() - window_t0)
        T, B = batch.input_ids.shape[1], batch.input_ids.shape[0]
        log.line(f"step {step:>6} {mode:<6} T={T:>6}x{B:<3} loss {vals['loss']:.4f} ans {vals['answer_loss']:.4f} "
                 f"acc {vals['answer_acc']:.3f} lm {vals['lm_loss']:.3f} q {vals['query_loss']:.3f} kl {vals['index_kl']:.4f} "
                 f"kept {vals.get('attn_kept', float('nan')):.3f} gnorm {vals['grad_norm']:.2f} "
                 f"lr {learning_rate(plan, step - 1, trained_s):.2e} tok/s {tps:,.0f} elapsed {time.time() - t_start:.0f}s")
        log.record({"step": step, "stage": mode, "T": T, "B": B, "tok_s": tps,
                    "elapsed_s": time.time() - t_start, **vals})
        window, window_tokens, window_t0 = {}, 0, time.time()

    while step < stop and not (plan.get("train_s", 0) > 0 and trained_s >= plan["train_s"]):
        # wall time per step over the last steps (GPU work is asynchronous; timestamps average it out)
        recent = step_ends[-21:]
        est = (recent[-1] - recent[0]) / (len(recent) - 1) if len(recent) > 1 else 0.0
        if time.time() + 1.5 * est > deadline:
            log.line(f"budget: stopping after step {step} ({time.time() - t_start:.0f}s of {args.budget_s:.0f}s used)")
            break
        t0 = time.time()
        batch = prefetch.get(step, phase(plan, step, trained_s)).to(device)
        mode = stage(plan, step, trained_s)
        for g in opt.param_groups:
            g["lr"] = learning_rate(plan, step, trained_s)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits, aux = model(batch.input_ids, attention=mode, kl_rows=batch.kl_rows, logit_rows=batch.loss_rows)
        m = batch_losses(logits, batch)
        kl = aux["index_kl"] if aux["index_kl"] is not None else torch.zeros((), device=device)
        loss = (m["answer_loss"] + plan["lm_weight"] * m["lm_loss"] + plan.get("query_weight", 0.0) * m["query_loss"]
                + plan["kl_weight"] * kl)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), plan["grad_clip"])
        opt.step()
        m.update(loss=loss.detach(), index_kl=kl.detach(), grad_norm=grad_norm.detach())
        if aux.get("recall") is not None:
            m["attn_kept"] = aux["recall"].detach()
        losses.append(loss.detach())
        for k, v in m.items():
            window.setdefault(k, []).append(v.detach())
        window_tokens += int(batch.lengths.sum())
        step += 1
        if device.type == "cuda" and (step % args.log_every == 0 or step == stop):
            torch.cuda.synchronize()
        trained_s += time.time() - t0
        step_ends.append(time.time())
        if step % args.log_every == 0 or step == stop:
            flush(mode, batch)
        if heldout and args.eval_every > 0 and step % args.eval_every == 0 and step < stop:
            result = evaluate(model, heldout, device, autocast_dtype)
            for line in summarize_eval(result):
                log.line(f"step {step:>6} " + line)
            log.record({"step": step, "eval": result})
            window_t0 = time.time()
        if time.time() - last_ckpt > args.ckpt_every_s:
            checkpoint()
            log.line(f"checkpoint at step {step}")
            window_t0 = time.time()

    if window:
        flush(mode, batch)
    checkpoint()
    log.line(f"checkpoint at step {step} -> {out / 'ckpt' / STATE_FILE}")
    if not args.no_export:
        from training.export import export_checkpoint

        export_dir = export_checkpoint(raw_model, config_dict, plan["tokenizer"] or data.TOKENIZER_DIR,
                                       out / "export")
        trainer_state = {"step": step, "trained_s": trained_s, "plan": plan, "stage": stage(plan, max(0, step - 1), trained_s)}
        (export_dir / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2) + "\n")
        log.line(f"exported step {step} to {export_dir}")
    if heldout and not args.no_final_eval:
        result = evaluate(model, heldout, device, autocast_dtype)
        for line in summarize_eval(result):
            log.line(f"step {step:>6} " + line)
        log.record({"step": step, "eval": result, "final": True})
    log.line(f"done: step {step} of {plan['steps']}, {time.time() - t_start:.0f}s this call")
    return {"step": step, "losses": [float(x) for x in losses], "plan": plan}


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
