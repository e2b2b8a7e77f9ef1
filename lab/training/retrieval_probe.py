"""Retrieval accuracy of a trained MSA checkpoint in plain torch, per task, length and index-K format.

    python -m training.retrieval_probe <export dir | run dir> --lengths 8192,32768,65536,131072 \\
        --tasks single,multikey,kv,vt --samples 24 --modes dense,fp8,mxfp4 --budget-s 120 --out out/probe

No server: ``training.model.MSAForCausalLM`` scores the prompts itself. Modes: ``dense`` (full causal
attention, the control), ``sparse`` (top-16 blocks from the model's own fp32 index scores, as in
training), and an index-K format ``bf16 | fp8 | mxfp4 | mxfp4_rot`` (top-16 blocks selected as a
server with that cache would: q rounded to bf16, k through the format; ``index_k_format`` of the model).

Samples: held-out (``training.data.HELDOUT_HAYSTACK_SEED``, a haystack stream never trained on), one
question each, drawn by ``training.data.TaskGenerator.sample`` (queried fact at a uniform random depth)
from a generator seeded by ``(seed, task, length, index)``: every mode scores the same prompts, so
modes pair sample by sample, and a later checkpoint is probed on the same prompts. A sample counts as
correct when every answer token is the argmax at its row given the true prefix (teacher forcing),
which holds exactly when greedy decoding emits the whole answer first.

Budget: cells are filled in rounds of ``--round`` samples, each round over every (length, task) from
the shortest length up, all modes of a batch together; a batch whose predicted time (its length's last
batch time) would pass ``--budget-s`` is skipped, and the cell keeps the samples it has. So an early
stop leaves every cell with about the same ``n``, and ``n`` is reported per cell. On CUDA every batch
holds ``--batch-tokens // length`` sequences (a short batch is padded with copies of its last prompt,
whose results are dropped): the training batch shapes, so the compiled flex-attention kernels of
training (and their inductor cache) serve the probe too. Elsewhere batches are not padded.

Intervals: Wilson score 95% per proportion (``scipy.stats.binomtest(...).proportion_ci``); for each pair
of modes given by ``--pairs`` the discordant counts (first right / second right) and the exact
McNemar p-value (``accuracy.stats.mcnemar_exact``).

On CUDA the model runs under bf16 autocast (as in training) with TF32 matmuls: for the format modes the
index scores' inputs (bf16 q, dequantized k) are exact in TF32, so their products are exact and only
the fp32 summation order differs from a server; ``sparse`` mode's fp32 scores are rounded to TF32.
"""

import argparse
import json
import random
import time
from pathlib import Path

import torch

from accuracy.stats import mcnemar_exact
from training import data

MODES = ("dense", "sparse", "bf16", "fp8", "mxfp4", "mxfp4_rot")
DEFAULT_LENGTHS = "8192,32768,65536,131072"


def load_model(path: str | Path):
    """``(model, step)`` from an export (``config.json`` + safetensors, ``trainer_state.json`` if any) or a
    run directory / ``state.pt`` (``training.probe.load``); ``step`` is None when unknown."""
    path = Path(path)
    if (path / "config.json").is_file():
        from training.export import load_checkpoint

        state = path / "trainer_state.json"
        step = json.loads(state.read_text())["step"] if state.is_file() else None
        return load_checkpoint(path).eval(), step
    if (path / "export" / "config.json").is_file() and not (path / "ckpt").is_dir():
        return load_model(path / "export")
    from training.probe import load

    return load(path)


def wilson(correct: int, n: int) -> tuple[float, float]:
    """Wilson score 95% interval of ``correct / n`` (``(0, 1)`` for ``n = 0``)."""
    if n == 0:
        return 0.0, 1.0
    from scipy.stats import binomtest

    ci = binomtest(correct, n).proportion_ci(confidence_level=0.95, method="wilson")
    return float(ci.low), float(ci.high)


def _check(args) -> tuple[list[int], list[str], list[str], list[tuple[str, str]]]:
    lengths = [int(x) for x in args.lengths.split(",") if x]
    bad = [n for n in lengths if n < data.BLOCK or n % data.BLOCK]
    if not lengths or bad:
        raise ValueError(f"--lengths: multiples of {data.BLOCK} expected, got {args.lengths!r}")
    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks or any(t not in data.EVAL_TASKS for t in tasks):
        raise ValueError(f"--tasks must be among {data.EVAL_TASKS}, got {args.tasks!r}")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"--modes must be distinct names among {MODES}, got {args.modes!r}")
    pairs = []
    text = args.pairs if args.pairs is not None else ("fp8:mxfp4" if {"fp8", "mxfp4"} <= set(modes) else "")
    for item in [x for x in text.split(",") if x]:
        a, _, b = item.partition(":")
        if a not in modes or b not in modes or a == b:
            raise ValueError(f"--pairs: 'A:B' with A != B among --modes {modes}, got {item!r}")
        pairs.append((a, b))
    if args.samples < 1 or args.round < 1 or args.batch_tokens < 1:
        raise ValueError("--samples, --round and --batch-tokens must be >= 1")
    return lengths, tasks, modes, pairs


@torch.no_grad()
def score_batch(model, samples: list, T: int, modes: list[str], device, autocast_dtype) -> dict:
    """``{mode: [0/1 per sample]}``: teacher-forced exact match of each sample's answer in each mode."""
    batch = data.collate(samples, T, random.Random(0), 0, 0).to(device)
    out = {}
    for mode in modes:
        attention = "dense" if mode == "dense" else "sparse"
        fmt = None if mode in ("dense", "sparse") else mode
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits, _ = model(batch.input_ids, attention=attention, logit_rows=batch.loss_rows, index_k_format=fmt)
        correct = (logits.argmax(-1) == batch.loss_targets) | ~batch.answer_mask
        out[mode] = [int(x) for x in correct.all(-1).tolist()]
    return out


def run(model, lengths, tasks, modes, samples: int, budget_s: float, device, round_size: int = 8,
        batch_tokens: int = 131072, seed: int = 0, log=print) -> list[dict]:
    """Per-sample results ``{task, length, index, <mode>: 0/1}`` (see the module doc for order and budget)."""
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    deadline = time.time() + budget_s
    gen = data.TaskGenerator(data.load_tokenizer(), data.HELDOUT_HAYSTACK_SEED,
                             num_sentences=max(512, max(lengths) // 2))
    last_batch_s: dict = {}
    results: list[dict] = []
    skipped = 0
    for r0 in range(0, samples, round_size):
        for T in lengths:
            for task in tasks:
                idx = list(range(r0, min(samples, r0 + round_size)))
                size = max(1, batch_tokens // T)
                for b0 in range(0, len(idx), size):
                    chunk = idx[b0:b0 + size]
                    predicted = last_batch_s.get(T, 0.0) * (1 if device.type == "cuda" else len(chunk) / size)
                    if time.time() + predicted > deadline:
                        skipped += len(chunk)
                        continue
                    t0 = time.time()
                    prompts = [gen.sample(task, random.Random(f"probe-{seed}-{task}-{T}-{i}"), T) for i in chunk]
                    pad = prompts[-1:] * (size - len(chunk)) if device.type == "cuda" else []
                    got = score_batch(model, prompts + pad, T, modes, device, autocast_dtype)
                    last_batch_s[T] = (time.time() - t0) * (1 if device.type == "cuda" else size / len(chunk))
                    results += [{"task": task, "length": T, "index": i, **{m: got[m][j] for m in modes}}
                                for j, i in enumerate(chunk)]
        spent = time.time() - deadline + budget_s
        log(f"probe: round {r0 // round_size + 1} done, {len(results)} samples, {spent:.0f}s")
    if skipped:
        log(f"probe: budget reached, {skipped} samples not scored (cells report their n)")
    return results


def summarize(results: list[dict], lengths, tasks, modes, pairs) -> dict:
    """``{"task/length": {"n", <mode>: {"correct", "acc", "ci95"}, "pairs": {"A:B": {...}}}}``."""
    cells = {}
    for task in tasks:
        for T in lengths:
            rows = [r for r in results if r["task"] == task and r["length"] == T]
            cell = {"n": len(rows)}
            for m in modes:
                c = sum(r[m] for r in rows)
                cell[m] = {"correct": c, "acc": c / len(rows) if rows else None, "ci95": wilson(c, len(rows))}
            cell["pairs"] = {}
            for a, b in pairs:
                n10 = sum(1 for r in rows if r[a] and not r[b])
                n01 = sum(1 for r in rows if r[b] and not r[a])
                cell["pairs"][f"{a}:{b}"] = {"a_only": n10, "b_only": n01, "mcnemar_p": mcnemar_exact(n10, n01)}
            cells[f"{task}/{T}"] = cell
    return cells


def markdown(cells: dict, lengths, tasks, modes, pairs) -> str:
    head = ["task", "length", "n"] + [f"{m} % [95% CI]" for m in modes] + [f"{a} only / {b} only (p)" for a, b in pairs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task in tasks:
        for T in lengths:
            c = cells[f"{task}/{T}"]
            row = [task, str(T), str(c["n"])]
            for m in modes:
                lo, hi = c[m]["ci95"]
                row.append("-" if not c["n"] else f"{100 * c[m]['acc']:.0f} [{100 * lo:.0f}, {100 * hi:.0f}]")
            for a, b in pairs:
                p = c["pairs"][f"{a}:{b}"]
                row.append(f"{p['a_only']} / {p['b_only']} ({p['mcnemar_p']:.2g})")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="export directory (config.json + safetensors) or run directory / state.pt")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS)
    p.add_argument("--tasks", default=",".join(data.EVAL_TASKS))
    p.add_argument("--modes", default="dense,fp8,mxfp4")
    p.add_argument("--pairs", default=None,
                   help="comma-separated A:B mode pairs reported paired (default fp8:mxfp4 when both are modes)")
    p.add_argument("--samples", type=int, default=24, help="samples per (task, length), at most")
    p.add_argument("--round", type=int, default=8, help="samples per cell per round")
    p.add_argument("--batch-tokens", type=int, default=131072, help="tokens per forward (batch = this // length)")
    p.add_argument("--budget-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sparse-backend", choices=("auto", "flex", "masked"), default="auto",
                   help="sparse attention kernel (training.model.sparse_attention); auto = flex on CUDA")
    p.add_argument("--out", type=Path, help="folder for probe.json and probe.md")
    args = p.parse_args(argv)
    lengths, tasks, modes, pairs = _check(args)
    t0 = time.time()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model, step = load_model(args.checkpoint)
    model = model.to(device)
    model.sparse_backend = args.sparse_backend
    results = run(model, lengths, tasks, modes, args.samples, args.budget_s - (time.time() - t0), device,
                  args.round, args.batch_tokens, args.seed)
    cells = summarize(results, lengths, tasks, modes, pairs)
    table = markdown(cells, lengths, tasks, modes, pairs)
    header = (f"retrieval probe: {args.checkpoint} (step {step}), {device}, {time.time() - t0:.0f} s; "
              f"teacher-forced exact match, held-out prompts, Wilson 95% intervals\n\n")
    print(header + table, flush=True)
    summary = {"checkpoint": str(args.checkpoint), "step": step, "device": str(device), "args": vars(args) | {
        "out": str(args.out)}, "cells": cells, "samples": results, "seconds": time.time() - t0}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe.json").write_text(json.dumps(summary, indent=1) + "\n")
        (args.out / "probe.md").write_text(header + table)
    return summary


if __name__ == "__main__":
    main()
